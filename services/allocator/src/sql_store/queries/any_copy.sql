SELECT 1 FROM block_copies WHERE pool = $1 LIMIT 1
