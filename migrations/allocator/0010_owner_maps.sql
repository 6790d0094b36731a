-- Owners of committed extents, compactly (issue 25): one row per vdev and
-- 16 MiB window holding, as varints, every owner run that starts in it,
-- instead of one row per run (10^7 rows when two clients' blocks alternate:
-- 10 s of a restart). Row layout: services/allocator/src/owner_map.rs.
-- Rows left in `owner_runs` by an older binary are moved here when the store
-- is opened for writing, in one transaction; that table stays (empty) so
-- older files still read.
CREATE TABLE owner_maps (
    vdev    INTEGER NOT NULL,
    -- The window's first byte (a multiple of 16 MiB): its key.
    start   INTEGER NOT NULL,
    data    BLOB    NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (vdev, start)
) WITHOUT ROWID;
