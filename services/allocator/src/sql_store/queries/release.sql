UPDATE leaders SET lease_until = '-infinity',
    leader_id = CASE WHEN $4 = 1 THEN $5 ELSE leader_id END
WHERE pool = $1 AND generation = $2 AND leader_id = $3
