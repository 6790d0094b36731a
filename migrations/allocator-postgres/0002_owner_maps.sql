-- Owners of committed extents, compactly (issue 25): one row per vdev and
-- 16 MiB window holding, as varints, every owner run that starts in it,
-- instead of one row per run. Row layout: services/allocator/src/owner_map.rs.
-- Rows left in `owner_runs` by an older binary are moved here when the store
-- is opened, in one transaction.
CREATE TABLE owner_maps (
    pool   BIGINT NOT NULL REFERENCES pools (id),
    vdev   BIGINT NOT NULL,
    start  BIGINT NOT NULL,
    data   BYTEA  NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (pool, vdev, start)
);
