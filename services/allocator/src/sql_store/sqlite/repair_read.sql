SELECT capacity, metaslab_shift, allocated FROM vdevs WHERE pool = $1 AND id = $2
