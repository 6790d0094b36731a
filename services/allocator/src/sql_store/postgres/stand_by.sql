-- A standby's poll: record that it polls and read who leads, in one statement.
WITH seen AS (
    INSERT INTO standbys (pool, id, address, seen)
    VALUES ($1, $2, $3, clock_timestamp())
    ON CONFLICT (pool, id) DO UPDATE SET address = excluded.address, seen = excluded.seen)
SELECT generation, leader_id, leader_address,
    GREATEST(0, EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::float8
FROM leaders WHERE pool = $1
