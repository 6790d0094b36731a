DELETE FROM block_copies WHERE pool = $1 AND vdev = $2 AND start >= $3 AND start < $4
