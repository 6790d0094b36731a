-- One chunk a statement: SQLite has no arrays, and a statement is a call,
-- not a round trip.
INSERT INTO spacemaps (pool, vdev, start, width, data) VALUES ($1, $2, $3, $4, $5)
