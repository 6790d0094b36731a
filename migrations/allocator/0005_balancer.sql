-- The balancer (issue 16). A vdev's administrative state survives a
-- restart: `offline` (no new allocations, e.g. while it is drained) and
-- `removed` (RemoveVdev: the pool forgot it; the row keeps its id and
-- guid so the id is never reused and the device cannot rejoin unnoticed).
ALTER TABLE vdevs ADD COLUMN admin_state TEXT NOT NULL DEFAULT 'online'
    CHECK (admin_state IN ('online', 'offline', 'removed'));
ALTER TABLE vdevs ADD COLUMN removed_txg INTEGER;

-- Relocations (a Relocate's allocation committed): the move of a block
-- copy from `from_*` to `to_*`, written in the same transaction as the
-- txg that allocated the new extent and freed the old one, so a mover
-- that crashed can ask whether its commit took effect.
CREATE TABLE relocations (
    allocation_id  INTEGER PRIMARY KEY,
    plan_id        INTEGER NOT NULL,
    from_vdev      INTEGER NOT NULL,
    from_offset    INTEGER NOT NULL,
    from_size      INTEGER NOT NULL,
    to_vdev        INTEGER NOT NULL,
    to_offset      INTEGER NOT NULL,
    to_size        INTEGER NOT NULL,
    txg            INTEGER NOT NULL,
    committed_ms   INTEGER NOT NULL
);
