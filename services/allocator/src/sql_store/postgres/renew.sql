UPDATE leaders SET lease_until = clock_timestamp() + $3 * interval '1 millisecond'
WHERE pool = $1 AND generation = $2 AND leader_id = $4
