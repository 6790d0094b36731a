SELECT plan_id, from_vdev, from_offset, from_size, to_vdev, to_offset, to_size, txg
FROM relocations WHERE pool = $1 AND allocation_id = $2
