-- A flushed metaslab's log rows: its chunks hold them now.
DELETE FROM spacemap_log WHERE pool = $1 AND vdev = $2 AND metaslab = $3 AND txg <= $4
