SELECT id, synced_txg FROM pools WHERE name = $1
