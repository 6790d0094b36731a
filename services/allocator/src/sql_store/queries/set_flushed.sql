INSERT INTO metaslab_flushes (pool, vdev, metaslab, flushed_txg) VALUES ($1, $2, $3, $4)
ON CONFLICT (pool, vdev, metaslab) DO UPDATE SET flushed_txg = excluded.flushed_txg
