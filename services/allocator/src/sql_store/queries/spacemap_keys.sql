SELECT start FROM spacemaps WHERE pool = $1 AND vdev = $2 ORDER BY start
