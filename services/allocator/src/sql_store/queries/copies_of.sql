SELECT c.vdev, c.start FROM block_copies c
JOIN block_copies me ON me.pool = c.pool AND me.block = c.block
WHERE me.pool = $1 AND me.vdev = $2 AND me.start = $3
    AND NOT (c.vdev = $2 AND c.start = $3)
ORDER BY c.vdev, c.start
