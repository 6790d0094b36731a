INSERT INTO relocations (pool, allocation_id, plan_id, from_vdev, from_offset,
    from_size, to_vdev, to_offset, to_size, txg, committed_ms)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
