-- Owner maps of pool $1: $2 a JSON array of [vdev, start, offset, length],
-- each row's data the bytes of $3 at that 1-based offset. One statement for
-- many rows (a txg rewrites a window per spread free); SQLite's JSON has no
-- blobs, so the data travels as one blob and is cut here.
INSERT INTO owner_maps (pool, vdev, start, data)
SELECT $1, w.value ->> 0, w.value ->> 1, substr($3, w.value ->> 2, w.value ->> 3)
FROM json_each($2) w
