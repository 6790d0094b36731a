-- One schema for every SQL store: the table names, columns and keys of the
-- PostgreSQL store (migrations/allocator-postgres/), so both run the same
-- statements (services/allocator/src/sql_store/queries/). Every row is
-- copied into the new tables and the old ones dropped, in this migration's
-- one transaction: a crash leaves the file at 0010 or at 0011, never between.
-- Differences that remain: `extents` (rows of files from before space maps,
-- moved into `spacemaps` at open) exists here only; `standbys` (advisory,
-- several allocators per database) on PostgreSQL only; `leaders` holds the
-- generation but no lease is ever taken (one writer by the data dir's lock).

CREATE TABLE leaders (
    pool            TEXT    PRIMARY KEY,
    generation      INTEGER NOT NULL DEFAULT 0,
    leader_id       TEXT    NOT NULL DEFAULT '',
    leader_address  TEXT    NOT NULL DEFAULT '',
    lease_until     TEXT    NOT NULL DEFAULT '-infinity',
    last_txg        INTEGER NOT NULL DEFAULT 0
);
INSERT INTO leaders (pool, generation) SELECT name, generation FROM pool;

CREATE TABLE pools (
    id                 INTEGER PRIMARY KEY,
    name               TEXT    NOT NULL UNIQUE REFERENCES leaders (pool),
    guid               INTEGER NOT NULL,
    synced_txg         INTEGER NOT NULL DEFAULT 0,
    state_digest       INTEGER NOT NULL DEFAULT 0,
    rewind_generation  INTEGER NOT NULL DEFAULT 0,
    created_ms         INTEGER NOT NULL
);
INSERT INTO pools (id, name, guid, synced_txg, state_digest, rewind_generation, created_ms)
    SELECT id, name, guid, synced_txg, state_digest, rewind_generation, created_ms FROM pool;

CREATE TABLE new_generations (
    pool                TEXT    NOT NULL REFERENCES leaders (pool),
    generation          INTEGER NOT NULL CHECK (generation > 0),
    synced_txg_at_open  INTEGER NOT NULL,
    opened_ms           INTEGER NOT NULL,
    leader_id           TEXT    NOT NULL,
    leader_address      TEXT    NOT NULL,
    PRIMARY KEY (pool, generation)
);
INSERT INTO new_generations
    SELECT (SELECT name FROM pool), generation, synced_txg_at_open, opened_ms, '', ''
    FROM generations;

CREATE TABLE new_vdevs (
    pool            INTEGER NOT NULL REFERENCES pools (id),
    id              INTEGER NOT NULL,
    guid            INTEGER NOT NULL,
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
    allocated       INTEGER NOT NULL DEFAULT 0,
    added_txg       INTEGER NOT NULL,
    admin_state     TEXT    NOT NULL DEFAULT 'online'
        CHECK (admin_state IN ('online', 'offline', 'removed')),
    removed_txg     INTEGER,
    PRIMARY KEY (pool, id),
    UNIQUE (pool, guid)
);
INSERT INTO new_vdevs
    SELECT 1, id, guid, name, endpoint, capacity, ashift, metaslab_shift, metaslab_size,
        children, parity, rotational, class, allocated, added_txg, admin_state, removed_txg
    FROM vdevs;

CREATE TABLE new_spacemaps (
    pool   INTEGER NOT NULL REFERENCES pools (id),
    vdev   INTEGER NOT NULL,
    start  INTEGER NOT NULL,
    width  INTEGER NOT NULL CHECK (width IN (8, 16)),
    data   BLOB    NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (pool, vdev, start)
);
INSERT INTO new_spacemaps SELECT 1, vdev, start, width, data FROM spacemaps;

CREATE TABLE new_extents (
    pool    INTEGER NOT NULL REFERENCES pools (id),
    vdev    INTEGER NOT NULL,
    offset  INTEGER NOT NULL,
    size    INTEGER NOT NULL CHECK (size > 0),
    txg     INTEGER NOT NULL,
    PRIMARY KEY (pool, vdev, offset)
) WITHOUT ROWID;
INSERT INTO new_extents SELECT 1, vdev, offset, size, txg FROM extents;

CREATE TABLE new_tunables (
    pool    INTEGER NOT NULL REFERENCES pools (id),
    name    TEXT    NOT NULL,
    value   TEXT    NOT NULL,
    set_ms  INTEGER NOT NULL,
    PRIMARY KEY (pool, name)
);
INSERT INTO new_tunables SELECT 1, name, value, set_ms FROM tunables;

CREATE TABLE new_agent_bindings (
    pool         INTEGER NOT NULL REFERENCES pools (id),
    name         TEXT    NOT NULL,
    device_guid  INTEGER NOT NULL,
    bound_ms     INTEGER NOT NULL,
    PRIMARY KEY (pool, name),
    UNIQUE (pool, device_guid)
);
INSERT INTO new_agent_bindings SELECT 1, name, device_guid, bound_ms FROM agent_bindings;

CREATE TABLE new_relocations (
    pool           INTEGER NOT NULL REFERENCES pools (id),
    allocation_id  INTEGER NOT NULL,
    plan_id        INTEGER NOT NULL,
    from_vdev      INTEGER NOT NULL,
    from_offset    INTEGER NOT NULL,
    from_size      INTEGER NOT NULL,
    to_vdev        INTEGER NOT NULL,
    to_offset      INTEGER NOT NULL,
    to_size        INTEGER NOT NULL,
    txg            INTEGER NOT NULL,
    committed_ms   INTEGER NOT NULL,
    PRIMARY KEY (pool, allocation_id)
);
INSERT INTO new_relocations
    SELECT 1, allocation_id, plan_id, from_vdev, from_offset, from_size, to_vdev, to_offset,
        to_size, txg, committed_ms
    FROM relocations;

CREATE TABLE new_owners (
    pool      INTEGER NOT NULL REFERENCES pools (id),
    idx       INTEGER NOT NULL,
    identity  TEXT    NOT NULL,
    PRIMARY KEY (pool, idx),
    UNIQUE (pool, identity)
);
INSERT INTO new_owners SELECT 1, idx, identity FROM owners;

CREATE TABLE new_owner_runs (
    pool   INTEGER NOT NULL REFERENCES pools (id),
    vdev   INTEGER NOT NULL,
    start  INTEGER NOT NULL,
    stop   INTEGER NOT NULL CHECK (stop > start),
    owner  INTEGER NOT NULL,
    PRIMARY KEY (pool, vdev, start)
) WITHOUT ROWID;
INSERT INTO new_owner_runs SELECT 1, vdev, start, stop, owner FROM owner_runs;

CREATE TABLE new_owner_maps (
    pool   INTEGER NOT NULL REFERENCES pools (id),
    vdev   INTEGER NOT NULL,
    start  INTEGER NOT NULL,
    data   BLOB    NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (pool, vdev, start)
) WITHOUT ROWID;
INSERT INTO new_owner_maps SELECT 1, vdev, start, data FROM owner_maps;

-- Children before parents: the old foreign keys never dangle.
DROP TABLE extents;
DROP TABLE spacemaps;
DROP TABLE owner_runs;
DROP TABLE owner_maps;
DROP TABLE owners;
DROP TABLE vdevs;
DROP TABLE generations;
DROP TABLE tunables;
DROP TABLE agent_bindings;
DROP TABLE relocations;
DROP TABLE pool;

ALTER TABLE new_generations RENAME TO generations;
ALTER TABLE new_vdevs RENAME TO vdevs;
ALTER TABLE new_spacemaps RENAME TO spacemaps;
ALTER TABLE new_extents RENAME TO extents;
ALTER TABLE new_tunables RENAME TO tunables;
ALTER TABLE new_agent_bindings RENAME TO agent_bindings;
ALTER TABLE new_relocations RENAME TO relocations;
ALTER TABLE new_owners RENAME TO owners;
ALTER TABLE new_owner_runs RENAME TO owner_runs;
ALTER TABLE new_owner_maps RENAME TO owner_maps;
