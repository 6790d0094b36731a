UPDATE block_copies SET vdev = $4, start = $5 WHERE pool = $1 AND vdev = $2 AND start = $3
