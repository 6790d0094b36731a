INSERT INTO indirect_mappings (pool, from_vdev, from_offset, from_size, to_vdev, to_offset,
    to_size, txg)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
