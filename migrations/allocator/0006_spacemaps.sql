-- The durable extents as space maps (issue 14): one row per chunk of up to
-- 4096 extents of one vdev in offset order, instead of one row per extent,
-- so a restart decodes a few thousand BLOBs rather than millions of rows
-- and a txg rewrites only the chunks it touched. Entry layout and the chunk
-- rules: services/allocator/src/spacemap.rs. Rows left in `extents` by an
-- older binary are moved into chunks when the store is opened for writing,
-- in one transaction; the table stays (empty) so older files still read.
CREATE TABLE spacemaps (
    vdev    INTEGER NOT NULL REFERENCES vdevs (id),
    -- Offset of the chunk's first extent: its key.
    start   INTEGER NOT NULL,
    -- Bytes per entry: 8 (u32 offset from `start` and u32 size, in 512-byte
    -- units) or 16 (u64 offset and u64 size, in bytes); little-endian.
    width   INTEGER NOT NULL CHECK (width IN (8, 16)),
    data    BLOB    NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (vdev, start)
);
