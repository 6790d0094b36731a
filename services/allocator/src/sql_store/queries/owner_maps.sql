SELECT vdev, start, data FROM owner_maps WHERE pool = $1 ORDER BY vdev, start
