SELECT generation, leader_id, leader_address,
    GREATEST(0, EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::float8
FROM leaders WHERE pool = $1
