-- A pool moved in from another store (`migrate-store`) takes over its
-- generation and clean-handover mark, only if nobody led it here since the
-- row was read ($5).
UPDATE leaders SET generation = $2, leader_id = $3, last_txg = $4
WHERE pool = $1 AND generation = $5
