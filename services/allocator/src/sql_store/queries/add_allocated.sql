UPDATE vdevs SET allocated = allocated + $1 WHERE pool = $2 AND id = $3
