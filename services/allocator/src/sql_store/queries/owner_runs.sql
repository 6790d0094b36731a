-- Rows of the one-row-per-run layout an older binary wrote.
SELECT vdev, start, stop, owner FROM owner_runs WHERE pool = $1 ORDER BY vdev, start
