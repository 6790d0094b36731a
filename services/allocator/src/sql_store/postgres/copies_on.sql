-- The copies of the blocks with a copy on vdev $2 starting at one of $3 (a
-- JSON array of starts), grouped by that copy's start.
SELECT me.start, o.vdev, o.start FROM block_copies me
JOIN block_copies o ON o.pool = me.pool AND o.block = me.block
WHERE me.pool = $1 AND me.vdev = $2
    AND me.start IN (SELECT jsonb_array_elements_text($3::jsonb)::BIGINT)
ORDER BY me.start, o.vdev, o.start
