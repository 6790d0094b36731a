-- The allocator's durable state: one pool per database file. A txg sync
-- writes its changes to `extents` and `vdevs`, and moves pool.synced_txg,
-- in ONE transaction; what is here is exactly the pool as of synced_txg.
-- u64 values (guids, offsets) are stored as their i64 bit patterns.

CREATE TABLE pool (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    guid        INTEGER NOT NULL,
    name        TEXT    NOT NULL,
    synced_txg  INTEGER NOT NULL,
    created_ms  INTEGER NOT NULL
);

CREATE TABLE vdevs (
    id              INTEGER PRIMARY KEY,
    guid            INTEGER NOT NULL UNIQUE,
    name            TEXT    NOT NULL,
    endpoint        TEXT    NOT NULL,
    capacity        INTEGER NOT NULL,
    ashift          INTEGER NOT NULL,
    metaslab_shift  INTEGER NOT NULL,
    metaslab_size   INTEGER NOT NULL,
    children        INTEGER NOT NULL,
    parity          INTEGER NOT NULL,
    rotational      INTEGER NOT NULL,
    class           TEXT    NOT NULL CHECK (class IN ('normal', 'log')),
    -- Sum of this vdev's extents: checked against `extents` at every open.
    allocated       INTEGER NOT NULL DEFAULT 0,
    added_txg       INTEGER NOT NULL
);

-- Durable allocated extents (committed allocations and claims, minus frees).
CREATE TABLE extents (
    vdev    INTEGER NOT NULL REFERENCES vdevs (id),
    offset  INTEGER NOT NULL,
    size    INTEGER NOT NULL CHECK (size > 0),
    -- The txg that made it durable.
    txg     INTEGER NOT NULL,
    PRIMARY KEY (vdev, offset)
) WITHOUT ROWID;

-- Tunables set at run time (SetTunable): they survive restarts.
CREATE TABLE tunables (
    name    TEXT PRIMARY KEY,
    value   TEXT NOT NULL,
    set_ms  INTEGER NOT NULL
);
