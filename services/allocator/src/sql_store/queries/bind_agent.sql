INSERT INTO agent_bindings (pool, name, device_guid, bound_ms) VALUES ($1, $2, $3, $4)
