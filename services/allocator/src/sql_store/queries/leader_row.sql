SELECT generation, leader_id FROM leaders WHERE pool = $1
