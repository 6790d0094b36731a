-- A vdev removal that moves the vdev's blocks (the allocator's mover):
-- one row from the RemoveVdev that started it until the vdev is gone (its
-- blocks copied and every mapping entry of its old addresses dropped).
-- What is left to move is not kept here: it is every extent still
-- allocated on the vdev without a mapping entry, so a leader that takes
-- over resumes exactly where the synced txgs leave it. Row meaning:
-- services/allocator/src/mover.rs.
CREATE TABLE vdev_evacuations (
    pool        INTEGER NOT NULL REFERENCES pools (id),
    vdev        INTEGER NOT NULL,
    bytes       INTEGER NOT NULL, -- allocated on the vdev when it started
    extents     INTEGER NOT NULL,
    started_ms  INTEGER NOT NULL,
    PRIMARY KEY (pool, vdev)
);
