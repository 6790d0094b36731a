SELECT vdev, start, block FROM block_copies WHERE pool = $1 ORDER BY vdev, start
