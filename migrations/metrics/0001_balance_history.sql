-- aliquot-metrics: balance history of Aliquot pools.
-- Raw samples are kept for --retention, then only their 1-minute aggregates.

-- One row per pool, with the running figures Summary reports.
CREATE TABLE pools (
    id                  INTEGER PRIMARY KEY,
    name                TEXT    NOT NULL UNIQUE,
    first_ms            INTEGER NOT NULL,
    last_ms             INTEGER NOT NULL,
    last_spread         REAL    NOT NULL DEFAULT 0,
    worst_spread        REAL    NOT NULL DEFAULT 0,
    last_vdev_add_ms    INTEGER,
    rebalanced_ms       INTEGER,            -- first time spread < 5 % after the last vdev add
    total_written_bytes REAL    NOT NULL DEFAULT 0,
    samples             INTEGER NOT NULL DEFAULT 0,
    snapshots           INTEGER NOT NULL DEFAULT 0,
    dropped_snapshots   INTEGER NOT NULL DEFAULT 0,  -- the sender's cumulative count
    aggregated_until_ms INTEGER NOT NULL DEFAULT 0,  -- minutes below are in vdev_minutes
    pruned_until_ms     INTEGER NOT NULL DEFAULT 0   -- raw rows below were deleted
);

CREATE TABLE vdevs (
    pool_id  INTEGER NOT NULL REFERENCES pools (id),
    vdev     INTEGER NOT NULL,
    name     TEXT    NOT NULL,
    first_ms INTEGER NOT NULL,
    last_ms  INTEGER NOT NULL,
    PRIMARY KEY (pool_id, vdev)
) WITHOUT ROWID;

CREATE TABLE snapshots (
    pool_id INTEGER NOT NULL,
    time_ms INTEGER NOT NULL,
    txg     INTEGER NOT NULL,
    spread  REAL    NOT NULL,   -- max - min used fraction across the snapshot's vdevs
    dropped INTEGER NOT NULL
);
CREATE INDEX snapshots_pool_time ON snapshots (pool_id, time_ms);

CREATE TABLE vdev_samples (
    pool_id        INTEGER NOT NULL,
    time_ms        INTEGER NOT NULL,
    vdev           INTEGER NOT NULL,
    txg            INTEGER NOT NULL,
    capacity       INTEGER NOT NULL,  -- bytes
    allocated      INTEGER NOT NULL,  -- bytes
    free_fraction  REAL    NOT NULL,
    fragmentation  INTEGER NOT NULL,  -- percent, -1 unknown
    aliquot        INTEGER NOT NULL,  -- bytes
    queue_target   INTEGER NOT NULL,  -- bytes
    queue_depth    INTEGER NOT NULL,  -- bytes
    write_bps      REAL    NOT NULL,
    read_bps       REAL    NOT NULL,
    latency_p50_us INTEGER NOT NULL,
    latency_p99_us INTEGER NOT NULL,
    health         INTEGER NOT NULL
);
CREATE INDEX vdev_samples_pool_time ON vdev_samples (pool_id, time_ms);

-- Sums per vdev per minute (averages are sum / n), so buckets of any width
-- can be averaged exactly from them.
CREATE TABLE vdev_minutes (
    pool_id            INTEGER NOT NULL,
    minute_ms          INTEGER NOT NULL,
    vdev               INTEGER NOT NULL,
    n                  INTEGER NOT NULL,
    sum_time_ms        INTEGER NOT NULL,
    sum_used           REAL    NOT NULL,
    sum_allocated      REAL    NOT NULL,
    sum_capacity       REAL    NOT NULL,
    sum_write_bps      REAL    NOT NULL,
    sum_read_bps       REAL    NOT NULL,
    sum_queue_depth    REAL    NOT NULL,
    sum_queue_target   REAL    NOT NULL,
    sum_aliquot        REAL    NOT NULL,
    sum_fragmentation  REAL    NOT NULL,
    n_fragmentation    INTEGER NOT NULL,  -- samples with a known fragmentation
    max_latency_p99_us INTEGER NOT NULL,
    PRIMARY KEY (pool_id, minute_ms, vdev)
) WITHOUT ROWID;

CREATE TABLE class_samples (
    pool_id   INTEGER NOT NULL,
    time_ms   INTEGER NOT NULL,
    class     TEXT    NOT NULL,
    alloc_max INTEGER NOT NULL,  -- bytes
    reserved  INTEGER NOT NULL,  -- bytes
    busy      INTEGER NOT NULL
);
CREATE INDEX class_samples_pool_time ON class_samples (pool_id, time_ms);

CREATE TABLE events (
    pool_id INTEGER NOT NULL,
    time_ms INTEGER NOT NULL,
    kind    TEXT    NOT NULL,
    vdev    INTEGER NOT NULL,
    detail  TEXT    NOT NULL
);
CREATE INDEX events_pool_time ON events (pool_id, time_ms);
