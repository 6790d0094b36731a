-- Every chunk of a run in one statement (one round trip): UNNEST of the columns.
INSERT INTO spacemaps (pool, vdev, start, width, data)
SELECT $1, $2, * FROM UNNEST($3::BIGINT[], $4::BIGINT[], $5::BYTEA[])
