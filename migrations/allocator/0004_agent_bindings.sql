-- Agent certificates bound to devices (issue 11). The first Register of an
-- agent certificate binds its name to that device guid; afterwards the
-- certificate may register and report only that device and no other agent
-- certificate may register it. Kept across restarts, so a stolen agent
-- certificate cannot take over another vdev while its own agent is down.
CREATE TABLE agent_bindings (
    name         TEXT PRIMARY KEY,
    device_guid  INTEGER NOT NULL UNIQUE,
    bound_ms     INTEGER NOT NULL
);
