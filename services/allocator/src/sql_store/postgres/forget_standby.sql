DELETE FROM standbys WHERE pool = $1 AND id = $2
