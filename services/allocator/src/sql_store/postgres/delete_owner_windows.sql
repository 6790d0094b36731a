-- The owner-map rows of pool $1 in any of the spans of $2, a JSON array of
-- [vdev, start, end]: a txg's rewritten windows in one statement, not one each.
DELETE FROM owner_maps o USING jsonb_array_elements($2::jsonb) w
WHERE o.pool = $1 AND o.vdev = (w ->> 0)::BIGINT
    AND o.start >= (w ->> 1)::BIGINT AND o.start < (w ->> 2)::BIGINT
