-- Take the leadership by compare-and-swap when its lease expired (or nobody
-- held it), with the next generation.
UPDATE leaders SET generation = generation + 1, leader_id = $2, leader_address = $3,
    lease_until = clock_timestamp() + $4 * interval '1 millisecond'
WHERE pool = $1 AND lease_until < clock_timestamp()
RETURNING generation
