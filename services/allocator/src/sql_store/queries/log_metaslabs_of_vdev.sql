-- The metaslabs of one vdev with log rows (the primary key's prefix).
SELECT DISTINCT metaslab FROM spacemap_log WHERE pool = $1 AND vdev = $2
