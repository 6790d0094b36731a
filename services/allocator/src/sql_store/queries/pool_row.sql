SELECT guid, synced_txg, state_digest FROM pools WHERE id = $1
