INSERT INTO owner_maps (pool, vdev, start, data) VALUES ($1, $2, $3, $4)
