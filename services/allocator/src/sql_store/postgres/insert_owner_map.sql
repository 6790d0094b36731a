INSERT INTO owner_maps (pool, vdev, start, data)
SELECT $1, $2, * FROM UNNEST($3::BIGINT[], $4::BYTEA[])
