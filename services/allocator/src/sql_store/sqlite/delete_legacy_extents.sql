DELETE FROM extents WHERE pool = $1
