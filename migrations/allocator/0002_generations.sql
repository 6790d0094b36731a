-- One row per allocator open of this store (issue 10). The generation is the
-- fencing token carried by every reply that names a txg: txg numbers that
-- never synced are reused after a crash, so a txg only means something with
-- its generation. `synced_txg_at_open` is the last txg synced by all earlier
-- generations: a txg T of generation G synced iff
-- T <= synced_txg_at_open of generation G + 1 (or of the current state when
-- G is the newest).
CREATE TABLE generations (
    generation          INTEGER PRIMARY KEY CHECK (generation > 0),
    synced_txg_at_open  INTEGER NOT NULL,
    opened_ms           INTEGER NOT NULL,
    -- Who opened it: "pid N on HOST".
    opened_by           TEXT    NOT NULL
);
