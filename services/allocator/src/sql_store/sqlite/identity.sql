-- Who the file belongs to (it holds one pool).
SELECT guid, name, synced_txg FROM pools ORDER BY id LIMIT 1
