-- The indirect mapping: a block the allocator's mover copied to a new
-- extent keeps answering at its old one (reads, frees) until its owner
-- acknowledges the new address or frees it (OpenZFS's indirect vdevs,
-- module/zfs/vdev_indirect_mapping.c, kept per block). One row per live
-- entry, written in the txg that committed the move, deleted in the txg
-- that dropped it. Row meaning: services/allocator/src/indirect.rs.
CREATE TABLE indirect_mappings (
    pool         BIGINT  NOT NULL REFERENCES pools (id),
    from_vdev    BIGINT  NOT NULL,
    from_offset  BIGINT  NOT NULL,
    from_size    BIGINT  NOT NULL,
    to_vdev      BIGINT  NOT NULL,
    to_offset    BIGINT  NOT NULL,
    to_size      BIGINT  NOT NULL,
    txg          BIGINT  NOT NULL,
    PRIMARY KEY (pool, from_vdev, from_offset)
);
