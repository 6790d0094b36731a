//! Agent certificates bound to devices: the first Register of an agent
//! certificate binds its name to that device guid; afterwards that
//! certificate may register and report only that device, and no other
//! agent certificate may register it. Bindings are persisted in the store
//! (`agent_bindings`, durable before the Register is answered) and loaded
//! at start, so they hold across restarts. Plaintext (`--insecure`) servers
//! have no identities and bind nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use aliquot_auth::{Identity, Role};

use crate::error::{Error, Result};
use crate::store::Store;

#[derive(Debug, Default)]
pub struct AgentBindings {
    by_name: Mutex<HashMap<String, u64>>,
}

impl AgentBindings {
    /// The bindings the store holds.
    pub fn from_store(m: BTreeMap<String, u64>) -> AgentBindings {
        AgentBindings {
            by_name: Mutex::new(m.into_iter().collect()),
        }
    }

    /// Bind (or check) `id` to `device_guid` at Register, persisting a new
    /// binding before it counts. Refusals are PERMISSION_DENIED, NOT_OWNER.
    pub async fn bind(
        &self,
        store: &dyn Store,
        id: Option<&Identity>,
        device_guid: u64,
    ) -> Result<()> {
        let Some(id) = id.filter(|i| i.role == Role::Agent) else {
            return Ok(());
        };
        {
            let mut m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(&bound) = m.get(&id.name) {
                if bound != device_guid {
                    return Err(Error::NotOwnerDevice {
                        device: device_guid,
                        message: format!(
                            "agent certificate {} is bound to device {bound:#x}; it cannot register device {device_guid:#x}",
                            id.name
                        ),
                    });
                }
                return Ok(());
            }
            if let Some((other, _)) = m.iter().find(|(_, g)| **g == device_guid) {
                return Err(Error::NotOwnerDevice {
                    device: device_guid,
                    message: format!(
                        "device {device_guid:#x} is bound to agent certificate {other}, not {}",
                        id.name
                    ),
                });
            }
            // Claimed now (a concurrent Register of the same name or device
            // sees it), undone below if the store refuses.
            m.insert(id.name.clone(), device_guid);
        }
        if let Err(e) = store.bind_agent(&id.name, device_guid).await {
            let mut m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
            m.remove(&id.name);
            return Err(Error::Store(format!("binding agent {}: {e}", id.name)));
        }
        tracing::info!(agent = %id.name, device = format_args!("{device_guid:#x}"), "agent certificate bound to its device");
        Ok(())
    }

    /// The device `id` registered (None: not an agent identity, or plaintext).
    pub fn device_of(&self, id: Option<&Identity>) -> Option<Option<u64>> {
        let id = id.filter(|i| i.role == Role::Agent)?;
        let m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        Some(m.get(&id.name).copied())
    }
}
