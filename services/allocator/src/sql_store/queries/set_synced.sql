UPDATE pools SET synced_txg = $1, state_digest = $2 WHERE id = $3
