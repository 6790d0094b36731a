-- The chunk rows any extent in [$3, $4) of vdev $2 can be in: the one
-- starting last at or before $3, then those starting inside (see spacemap.rs),
-- at most $5.
SELECT start, width, data FROM spacemaps
WHERE pool = $1 AND vdev = $2 AND start < $4 AND start >= COALESCE(
    (SELECT MAX(start) FROM spacemaps WHERE pool = $1 AND vdev = $2 AND start <= $3), $3)
ORDER BY start
LIMIT $5
