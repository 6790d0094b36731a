SELECT name, device_guid FROM agent_bindings WHERE pool = $1
