SELECT vdev, start, width, data FROM spacemaps WHERE pool = $1 AND vdev = $2 ORDER BY start
