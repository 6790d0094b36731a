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

/// What a Register's certificate holds on its device while it registers.
#[must_use]
#[derive(Debug)]
pub enum Claim {
    /// No identity, or a binding made before.
    None,
    /// Bound by this Register, not yet durable.
    New { name: String, device_guid: u64 },
}

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

    /// Check `id`'s claim on `device_guid` at Register and hold it (a
    /// concurrent Register of the same name or device sees it); a new one
    /// counts once [`Self::persist`]ed, and is dropped by [`Self::release`].
    /// Refusals are PERMISSION_DENIED, NOT_OWNER.
    pub fn claim(&self, id: Option<&Identity>, device_guid: u64) -> Result<Claim> {
        let Some(id) = id.filter(|i| i.role == Role::Agent) else {
            return Ok(Claim::None);
        };
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
            return Ok(Claim::None);
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
        m.insert(id.name.clone(), device_guid);
        Ok(Claim::New {
            name: id.name.clone(),
            device_guid,
        })
    }

    /// Make a new claim durable (before the Register is answered).
    pub async fn persist(&self, store: &dyn Store, claim: Claim) -> Result<()> {
        let Claim::New { name, device_guid } = claim else {
            return Ok(());
        };
        if let Err(e) = store.bind_agent(&name, device_guid).await {
            self.release(Claim::New {
                name: name.clone(),
                device_guid,
            });
            return Err(Error::Store(format!("binding agent {name}: {e}")));
        }
        tracing::info!(agent = %name, device = format_args!("{device_guid:#x}"), "agent certificate bound to its device");
        Ok(())
    }

    /// Drop a new claim whose Register failed.
    pub fn release(&self, claim: Claim) {
        if let Claim::New { name, device_guid } = claim {
            let mut m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
            if m.get(&name) == Some(&device_guid) {
                m.remove(&name);
            }
        }
    }

    /// The device `id` registered (None: not an agent identity, or plaintext).
    pub fn device_of(&self, id: Option<&Identity>) -> Option<Option<u64>> {
        let id = id.filter(|i| i.role == Role::Agent)?;
        let m = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        Some(m.get(&id.name).copied())
    }
}
