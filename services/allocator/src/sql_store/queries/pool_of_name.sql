SELECT id, guid FROM pools WHERE name = $1
