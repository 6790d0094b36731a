-- First in every txg's transaction, holding the leadership row until commit:
-- a deposed leader (another generation took the pool) updates nothing.
UPDATE leaders SET last_txg = $3 WHERE pool = $1 AND generation = $2 AND leader_id = $4
