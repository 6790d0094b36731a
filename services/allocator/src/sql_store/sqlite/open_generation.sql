-- The bump (the data dir's lock makes this the only writer).
UPDATE leaders SET generation = generation + 1 WHERE pool = $1 RETURNING generation
