SELECT allocation_id, plan_id, from_vdev, from_offset, from_size, to_vdev, to_offset, to_size,
    txg, committed_ms
FROM relocations WHERE pool = $1 ORDER BY allocation_id
