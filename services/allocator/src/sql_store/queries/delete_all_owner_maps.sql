DELETE FROM owner_maps WHERE pool = $1
