-- The copies of one block: a block committed with several copies (one
-- allocation, one extent per copy) has a row per copy, all with the same
-- `block` (the allocation id that committed it, unique in the pool), so
-- a move of one copy can keep off the vdevs of the others. A row follows
-- its copy: moved in the txg that commits the copy's relocation, deleted
-- in the txg that frees it. Blocks of one copy have no rows, nor have
-- blocks committed before this table existed (they are moved as unlinked).
-- Row meaning: services/allocator/src/block_copies.rs.
CREATE TABLE block_copies (
    pool   BIGINT NOT NULL REFERENCES pools (id),
    vdev   BIGINT NOT NULL,
    start  BIGINT NOT NULL, -- the copy's extent's first byte on the vdev
    block  BIGINT NOT NULL,
    PRIMARY KEY (pool, vdev, start)
);
CREATE INDEX block_copies_of_block ON block_copies (pool, block);
