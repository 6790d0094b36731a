INSERT INTO tunables (pool, name, value, set_ms) VALUES ($1, $2, $3, $4)
ON CONFLICT (pool, name) DO UPDATE SET value = excluded.value, set_ms = excluded.set_ms
