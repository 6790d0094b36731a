-- The bump (the data dir's lock makes this the only writer); it clears a
-- clean-shutdown mark, which speaks only of the generation before.
UPDATE leaders SET generation = generation + 1, leader_id = '' WHERE pool = $1
RETURNING generation
