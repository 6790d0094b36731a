SELECT vdev, start, width, data FROM spacemaps WHERE pool = $1 ORDER BY vdev, start
