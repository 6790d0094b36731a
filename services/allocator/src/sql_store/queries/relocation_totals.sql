SELECT COUNT(*), CAST(COALESCE(SUM(from_size), 0) AS BIGINT) FROM relocations WHERE pool = $1
