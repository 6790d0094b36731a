-- Every log row newer than its metaslab's flush txg, in replay order (per
-- vdev, txg by txg).
SELECT l.vdev, l.metaslab, l.txg, l.data FROM spacemap_log l
LEFT JOIN metaslab_flushes f ON f.pool = l.pool AND f.vdev = l.vdev AND f.metaslab = l.metaslab
WHERE l.pool = $1 AND l.txg > COALESCE(f.flushed_txg, 0)
ORDER BY l.vdev, l.txg, l.metaslab
