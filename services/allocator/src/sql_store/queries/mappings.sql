SELECT from_vdev, from_offset, from_size, to_vdev, to_offset, to_size, txg
FROM indirect_mappings WHERE pool = $1 ORDER BY from_vdev, from_offset
