-- The chunks of one vdev with keys in $3 ..= $4.
SELECT vdev, start, width, data FROM spacemaps
WHERE pool = $1 AND vdev = $2 AND start >= $3 AND start <= $4 ORDER BY start
