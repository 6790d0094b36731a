-- The owner-map rows of pool $1 in any of the spans of $2, a JSON array of
-- [vdev, start, end]: a txg's rewritten windows in one statement, not one
-- each. CROSS JOIN keeps the list outside, so each span is a range search of
-- the key rather than a scan of the vdev's rows per span.
DELETE FROM owner_maps WHERE pool = $1 AND (vdev, start) IN (
    SELECT o.vdev, o.start FROM json_each($2) w CROSS JOIN owner_maps o
    WHERE o.pool = $1 AND o.vdev = w.value ->> 0
        AND o.start >= w.value ->> 1 AND o.start < w.value ->> 2
)
