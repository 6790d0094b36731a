-- Fencing: the allocator bumps `generation` at every open of the store (one
-- owner at a time, by the data dir's lock). Replies and write tokens carry
-- it; a txg is never reported synced to a client of an older generation
-- unless it synced then. `generation_synced_txg` is the synced txg at the
-- moment the current generation opened.
ALTER TABLE pool ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
