INSERT INTO pools (name, guid, created_ms) VALUES ($1, $2, $3) RETURNING id
