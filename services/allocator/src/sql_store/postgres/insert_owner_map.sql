-- Owner maps of pool $1: $2 a JSON array of [vdev, start, offset, length],
-- each row's data the bytes of $3 at that 1-based offset (the statement's
-- shape is SQLite's, whose JSON has no blobs).
INSERT INTO owner_maps (pool, vdev, start, data)
SELECT $1, (w ->> 0)::BIGINT, (w ->> 1)::BIGINT,
    substring($3::BYTEA FROM (w ->> 2)::INT FOR (w ->> 3)::INT)
FROM jsonb_array_elements($2::jsonb) w
