SELECT generation, synced_txg_at_open FROM generations WHERE pool = $1 ORDER BY generation
