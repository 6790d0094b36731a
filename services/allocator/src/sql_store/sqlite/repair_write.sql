UPDATE vdevs SET capacity = $1, metaslab_shift = $2, metaslab_size = $3, allocated = $4
WHERE pool = $5 AND id = $6
