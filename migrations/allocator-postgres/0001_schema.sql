-- The allocator's durable state on PostgreSQL (issue 26): the same state
-- the SQLite store keeps (migrations/allocator/), for several pools per
-- database, each by its name, plus the leadership row of each pool. A txg
-- sync is ONE transaction that first updates the pool's leadership row
-- WHERE generation = the writer's: a deposed leader persists nothing.
-- u64 values (guids, offsets, digests) are stored as their i64 bit patterns.

-- Leadership of a pool among the allocators sharing this database: taken by
-- compare-and-swap when the lease (by the database's clock) has expired,
-- with the next generation; renewed by the leader; cleared on step-down.
CREATE TABLE leaders (
    pool            TEXT        PRIMARY KEY,
    generation      BIGINT      NOT NULL DEFAULT 0,
    leader_id       TEXT        NOT NULL DEFAULT '',
    leader_address  TEXT        NOT NULL DEFAULT '',
    lease_until     TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
    -- The last txg persisted under `generation` (what the txg's fencing
    -- update writes).
    last_txg        BIGINT      NOT NULL DEFAULT 0
);

CREATE TABLE pools (
    id                 BIGSERIAL PRIMARY KEY,
    name               TEXT   NOT NULL UNIQUE REFERENCES leaders (pool),
    guid               BIGINT NOT NULL,
    synced_txg         BIGINT NOT NULL DEFAULT 0,
    state_digest       BIGINT NOT NULL DEFAULT 0,
    rewind_generation  BIGINT NOT NULL DEFAULT 0,
    created_ms         BIGINT NOT NULL
);

-- What each generation left behind (see migrations/allocator/0003).
CREATE TABLE generations (
    pool                TEXT   NOT NULL REFERENCES leaders (pool),
    generation          BIGINT NOT NULL CHECK (generation > 0),
    synced_txg_at_open  BIGINT NOT NULL,
    opened_ms           BIGINT NOT NULL,
    leader_id           TEXT   NOT NULL,
    leader_address      TEXT   NOT NULL,
    PRIMARY KEY (pool, generation)
);

CREATE TABLE vdevs (
    pool            BIGINT NOT NULL REFERENCES pools (id),
    id              BIGINT NOT NULL,
    guid            BIGINT NOT NULL,
    name            TEXT   NOT NULL,
    endpoint        TEXT   NOT NULL,
    capacity        BIGINT NOT NULL,
    ashift          BIGINT NOT NULL,
    metaslab_shift  BIGINT NOT NULL,
    metaslab_size   BIGINT NOT NULL,
    children        BIGINT NOT NULL,
    parity          BIGINT NOT NULL,
    rotational      BIGINT NOT NULL,
    class           TEXT   NOT NULL CHECK (class IN ('normal', 'log')),
    allocated       BIGINT NOT NULL DEFAULT 0,
    added_txg       BIGINT NOT NULL,
    admin_state     TEXT   NOT NULL DEFAULT 'online'
        CHECK (admin_state IN ('online', 'offline', 'removed')),
    removed_txg     BIGINT,
    PRIMARY KEY (pool, id),
    UNIQUE (pool, guid)
);

-- Space-map chunks (layout: services/allocator/src/spacemap.rs).
CREATE TABLE spacemaps (
    pool   BIGINT NOT NULL REFERENCES pools (id),
    vdev   BIGINT NOT NULL,
    start  BIGINT NOT NULL,
    width  BIGINT NOT NULL CHECK (width IN (8, 16)),
    data   BYTEA  NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (pool, vdev, start)
);

CREATE TABLE tunables (
    pool    BIGINT NOT NULL REFERENCES pools (id),
    name    TEXT   NOT NULL,
    value   TEXT   NOT NULL,
    set_ms  BIGINT NOT NULL,
    PRIMARY KEY (pool, name)
);

CREATE TABLE agent_bindings (
    pool         BIGINT NOT NULL REFERENCES pools (id),
    name         TEXT   NOT NULL,
    device_guid  BIGINT NOT NULL,
    bound_ms     BIGINT NOT NULL,
    PRIMARY KEY (pool, name),
    UNIQUE (pool, device_guid)
);

CREATE TABLE relocations (
    pool           BIGINT NOT NULL REFERENCES pools (id),
    allocation_id  BIGINT NOT NULL,
    plan_id        BIGINT NOT NULL,
    from_vdev      BIGINT NOT NULL,
    from_offset    BIGINT NOT NULL,
    from_size      BIGINT NOT NULL,
    to_vdev        BIGINT NOT NULL,
    to_offset      BIGINT NOT NULL,
    to_size        BIGINT NOT NULL,
    txg            BIGINT NOT NULL,
    committed_ms   BIGINT NOT NULL,
    PRIMARY KEY (pool, allocation_id)
);

CREATE TABLE owners (
    pool      BIGINT NOT NULL REFERENCES pools (id),
    idx       BIGINT NOT NULL,
    identity  TEXT   NOT NULL,
    PRIMARY KEY (pool, idx),
    UNIQUE (pool, identity)
);

CREATE TABLE owner_runs (
    pool   BIGINT NOT NULL REFERENCES pools (id),
    vdev   BIGINT NOT NULL,
    start  BIGINT NOT NULL,
    stop   BIGINT NOT NULL CHECK (stop > start),
    owner  BIGINT NOT NULL,
    PRIMARY KEY (pool, vdev, start)
);

-- Standbys polling the leadership, for `aliquotctl status` (the leader lists
-- those seen in the last seconds). Advisory only: nothing depends on it.
CREATE TABLE standbys (
    pool     TEXT        NOT NULL,
    id       TEXT        NOT NULL,
    address  TEXT        NOT NULL,
    seen     TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (pool, id)
);
