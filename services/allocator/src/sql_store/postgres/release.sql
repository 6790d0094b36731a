UPDATE leaders SET lease_until = '-infinity'
WHERE pool = $1 AND generation = $2 AND leader_id = $3
