//! Agent certificates bound to devices: the first Register of an agent
//! certificate binds its name to that device guid; afterwards that
//! certificate may register and report only that device, and no other
//! agent certificate may register it. Plaintext (`--insecure`) servers have
//! no identities and bind nothing. In memory: after a restart the agents'
//! next registrations bind again.

use std::collections::HashMap;
use std::sync::Mutex;

use aliquot_auth::{Identity, Role};
use tonic::Status;

#[derive(Debug, Default)]
pub struct AgentBindings {
    by_name: Mutex<HashMap<String, u64>>,
}

impl AgentBindings {
    /// Bind (or check) `id` to `device_guid` at Register.
    pub fn bind(&self, id: Option<&Identity>, device_guid: u64) -> Result<(), Status> {
        let Some(id) = id.filter(|i| i.role == Role::Agent) else {
            return Ok(());
        };
        let mut m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&bound) = m.get(&id.name) {
            if bound != device_guid {
                return Err(Status::permission_denied(format!(
                    "agent certificate {} is bound to device {bound:#x}; it cannot register device {device_guid:#x}",
                    id.name
                )));
            }
            return Ok(());
        }
        if let Some((other, _)) = m.iter().find(|(_, g)| **g == device_guid) {
            return Err(Status::permission_denied(format!(
                "device {device_guid:#x} is bound to agent certificate {other}, not {}",
                id.name
            )));
        }
        m.insert(id.name.clone(), device_guid);
        Ok(())
    }

    /// The device `id` registered (None: not an agent identity, or plaintext).
    pub fn device_of(&self, id: Option<&Identity>) -> Option<Option<u64>> {
        let id = id.filter(|i| i.role == Role::Agent)?;
        let m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        Some(m.get(&id.name).copied())
    }
}
