INSERT INTO block_copies (pool, vdev, start, block) VALUES ($1, $2, $3, $4)
ON CONFLICT (pool, vdev, start) DO UPDATE SET block = excluded.block
