DELETE FROM indirect_mappings WHERE pool = $1 AND from_vdev = $2 AND from_offset = $3
