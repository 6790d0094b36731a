-- The store's state digest at synced_txg (issue 25): chained per txg over
-- its space changes (store.rs `state_digest`). Devices' labels keep it beside
-- the txg; a store of another history at the same txg is refused. 0: not
-- known (a store written before digests).
ALTER TABLE pool ADD COLUMN state_digest INTEGER NOT NULL DEFAULT 0;
