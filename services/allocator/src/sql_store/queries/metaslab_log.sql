-- The log rows of one metaslab not yet flushed, in txg order.
SELECT l.data FROM spacemap_log l
LEFT JOIN metaslab_flushes f ON f.pool = l.pool AND f.vdev = l.vdev AND f.metaslab = l.metaslab
WHERE l.pool = $1 AND l.vdev = $2 AND l.metaslab = $3 AND l.txg > COALESCE(f.flushed_txg, 0)
ORDER BY l.txg
