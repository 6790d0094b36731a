-- The columns of store::VdevRow, in its order.
SELECT id, guid, name, endpoint, capacity, ashift, metaslab_shift, metaslab_size, children,
    parity, rotational, class, allocated, admin_state
FROM vdevs WHERE pool = $1 ORDER BY id
