INSERT INTO vdev_evacuations (pool, vdev, bytes, extents, started_ms) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (pool, vdev) DO UPDATE SET bytes = excluded.bytes, extents = excluded.extents, started_ms = excluded.started_ms
