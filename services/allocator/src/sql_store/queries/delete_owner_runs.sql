DELETE FROM owner_runs WHERE pool = $1
