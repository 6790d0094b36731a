-- What each generation left behind (issue 10 follow-up). A txg number is
-- reused after every crash, so "txg T of generation G synced" can only be
-- answered with G's own last synced txg, which is the synced txg at the open
-- of G + 1. Comparing with the current generation's synced txg at open is
-- wrong once two restarts happened: generation G + 1 may have synced its own
-- txg T, and a client of G would be told its lost txg T is durable.
-- Generations opened before this migration have no row.
CREATE TABLE generations (
    generation          INTEGER PRIMARY KEY CHECK (generation > 0),
    synced_txg_at_open  INTEGER NOT NULL,
    opened_ms           INTEGER NOT NULL
);
