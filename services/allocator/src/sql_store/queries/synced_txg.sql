SELECT synced_txg FROM pools WHERE id = $1
