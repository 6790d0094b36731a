-- A vdev added, or its endpoint or capacity changed, in a txg.
INSERT INTO vdevs (pool, id, guid, name, endpoint, capacity, ashift, metaslab_shift,
    metaslab_size, children, parity, rotational, class, allocated, added_txg)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 0, $14)
ON CONFLICT (pool, id) DO UPDATE SET guid = excluded.guid, name = excluded.name,
    endpoint = excluded.endpoint, capacity = excluded.capacity,
    ashift = excluded.ashift, metaslab_shift = excluded.metaslab_shift,
    metaslab_size = excluded.metaslab_size, children = excluded.children,
    parity = excluded.parity, rotational = excluded.rotational,
    class = excluded.class
