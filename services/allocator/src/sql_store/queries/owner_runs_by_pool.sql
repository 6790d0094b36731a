SELECT pool, count(*) FROM owner_runs GROUP BY pool ORDER BY pool
