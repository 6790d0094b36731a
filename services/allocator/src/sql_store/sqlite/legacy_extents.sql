-- Rows of the one-row-per-extent layout (files from before space maps).
SELECT vdev, offset, size FROM extents WHERE pool = $1 ORDER BY vdev, offset
