SELECT me.start, o.vdev, o.start FROM block_copies me
JOIN block_copies o ON o.pool = me.pool AND o.block = me.block
WHERE me.pool = $1 AND me.vdev = $2
ORDER BY me.start, o.vdev, o.start
