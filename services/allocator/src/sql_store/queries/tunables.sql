SELECT name, value FROM tunables WHERE pool = $1 ORDER BY set_ms, name
