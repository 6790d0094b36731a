DELETE FROM vdev_evacuations WHERE pool = $1 AND vdev = $2
