UPDATE vdevs SET admin_state = $1,
    removed_txg = CASE WHEN $1 = 'removed' THEN $2 ELSE removed_txg END
WHERE pool = $3 AND id = $4
