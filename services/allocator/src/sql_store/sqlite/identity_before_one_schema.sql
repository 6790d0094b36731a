-- Who the file belongs to, in the schema before migration 0011.
SELECT guid, name, synced_txg FROM pool WHERE id = 1
