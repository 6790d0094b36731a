-- Log rows at or before their metaslab's flush txg (a flush deletes them).
SELECT COUNT(*) FROM spacemap_log l
JOIN metaslab_flushes f ON f.pool = l.pool AND f.vdev = l.vdev AND f.metaslab = l.metaslab
WHERE l.pool = $1 AND l.txg <= f.flushed_txg
