INSERT INTO owners (pool, idx, identity) VALUES ($1, $2, $3)
