-- An accepted rollback (issue 25): the allocator started with --rewind-to at
-- this generation, accepting a store older than some devices' labels. Labels
-- written before it (their generation is lower) are not held against the
-- store; labels of it or later are (0: never rewound).
ALTER TABLE pool ADD COLUMN rewind_generation INTEGER NOT NULL DEFAULT 0;
