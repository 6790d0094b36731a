SELECT vdev, bytes, extents, started_ms FROM vdev_evacuations WHERE pool = $1 ORDER BY vdev
