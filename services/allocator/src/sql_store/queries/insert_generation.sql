INSERT INTO generations (pool, generation, synced_txg_at_open, opened_ms, leader_id,
    leader_address) VALUES ($1, $2, $3, $4, $5, $6)
