//! Which new devices may join the pool. Adding a vdev adds capacity that
//! every client's writes then land on, so it is an operator's act (as `zpool
//! add` is): an agent certificate alone only makes its device wait as a
//! pending vdev, shown in `PoolStatus.pending_vdevs`, until an admin admits
//! it (`AdmitVdev`, `aliquotctl vdev add NAME`). The allocator's
//! `--admit-agent NAME[:SIZE]` is the operator's standing admission of the
//! device an agent certificate registers first (at most SIZE bytes), which
//! `aliquotctl up` and the compose stack give for the agents they start. A
//! plaintext (`--insecure`) pool has no identities: there, as before, any
//! agent adds its device. Pending devices live in the leader's memory only:
//! their agents keep registering, so a new leader sees them again.

use std::collections::HashMap;

use aliquot_auth::{Identity, Role};
use aliquot_proto::v1 as pb;

use crate::convert::unix_ms;
use crate::error::{Error, Result};
use crate::state::Inner;

/// Pending devices kept at most (oldest dropped first): each is one agent
/// certificate's Register, but a bound keeps a leaked one from growing it.
pub const MAX_PENDING: usize = 256;

/// A device waiting for an operator: as shown, and as its agent registered it.
#[derive(Clone, Debug)]
pub struct Waiting {
    pub shown: pb::PendingVdev,
    pub request: pb::RegisterRequest,
}

/// `--admit-agent NAME[:SIZE]`: agent certificate names whose first device
/// joins without a further step, each up to SIZE bytes when given.
#[derive(Clone, Debug, Default)]
pub struct AdmitList(HashMap<String, Option<u64>>);

/// One `--admit-agent` value: `NAME` or `NAME:SIZE` (e.g. `file3:4GiB`).
pub fn parse_admit(s: &str) -> std::result::Result<(String, Option<u64>), String> {
    let (name, size) = match s.split_once(':') {
        Some((n, sz)) => (n.trim(), Some(units::size_arg(sz.trim())?)),
        None => (s.trim(), None),
    };
    if !aliquot_auth::role::valid_name(name) {
        return Err(format!(
            "{s:?}: expected an agent certificate's name, optionally :SIZE (e.g. file3:4GiB)"
        ));
    }
    Ok((name.to_owned(), size))
}

impl AdmitList {
    pub fn new(entries: impl IntoIterator<Item = (String, Option<u64>)>) -> AdmitList {
        AdmitList(entries.into_iter().collect())
    }

    /// Must a Register of a device new to the pool by `id` wait for an
    /// operator? Some(certificate name) when it must.
    pub fn needs_admission(
        &self,
        id: Option<&Identity>,
        r: &pb::RegisterRequest,
    ) -> Option<String> {
        // No identity (plaintext) or an operator's own certificate: admitted.
        let id = id.filter(|i| i.role == Role::Agent)?;
        match self.0.get(&id.name) {
            Some(None) => None,
            Some(Some(max)) if r.capacity <= *max => None,
            _ => Some(id.name.clone()),
        }
    }
}

/// Keep `r` as a pending device of agent certificate `agent`, and say why
/// its Register is refused.
pub fn hold(g: &mut Inner, agent: &str, r: &pb::RegisterRequest, admit_list: &AdmitList) -> Error {
    let now = unix_ms();
    let w = g
        .awaiting_admission
        .entry(r.device_guid)
        .or_insert_with(|| Waiting {
            shown: pb::PendingVdev {
                since_ms: now,
                ..Default::default()
            },
            request: r.clone(),
        });
    w.request = r.clone();
    let p = &mut w.shown;
    let first = p.last_ms == 0;
    p.name = r.name.clone();
    p.device_guid = r.device_guid;
    p.capacity = r.capacity;
    p.log = r.log;
    p.endpoint = r.endpoint.trim().to_string();
    p.agent = agent.to_owned();
    p.last_ms = now;
    if first {
        tracing::warn!(name = %r.name, agent, guid = format_args!("{:#x}", r.device_guid),
            capacity = r.capacity, "a new device waits for an operator: `aliquotctl vdev add {}` admits it", r.name);
    }
    if g.awaiting_admission.len() > MAX_PENDING
        && let Some((&oldest, _)) = g
            .awaiting_admission
            .iter()
            .min_by_key(|(_, w)| w.shown.last_ms)
    {
        g.awaiting_admission.remove(&oldest);
    }
    let over = match admit_list.0.get(agent) {
        Some(Some(max)) => format!(
            " (--admit-agent admits at most {} for this certificate)",
            units::format_bytes(*max)
        ),
        _ => String::new(),
    };
    Error::VdevPending {
        device: r.device_guid,
        name: r.name.clone(),
        message: format!(
            "device {:#x} ({:?}, {}{}) is new to the pool and agent certificate {agent} was not \
             admitted to add capacity{over}: it waits as a pending vdev until an operator runs \
             `aliquotctl vdev add {}` (this agent keeps registering; it joins at its next try)",
            r.device_guid,
            r.name,
            units::format_bytes(r.capacity),
            if r.log { ", log" } else { "" },
            r.name
        ),
    }
}

/// Take the pending device named `name` (its registered name or its
/// agent certificate's) or with guid `guid` out of the waiting list.
pub fn take(g: &mut Inner, name: &str, guid: u64) -> Result<Waiting> {
    let found: Vec<u64> = g
        .awaiting_admission
        .values()
        .map(|w| &w.shown)
        .filter(|p| {
            (guid != 0 && p.device_guid == guid)
                || (guid == 0 && !name.is_empty() && (p.name == name || p.agent == name))
        })
        .map(|p| p.device_guid)
        .collect();
    match found.as_slice() {
        [one] => Ok(g.awaiting_admission.remove(one).expect("present")),
        [] => {
            let names: Vec<String> = g
                .awaiting_admission
                .values()
                .map(|w| format!("{} ({:#x})", w.shown.name, w.shown.device_guid))
                .collect();
            Err(Error::NotFound(format!(
                "no pending device {}; {}",
                if guid != 0 {
                    format!("{guid:#x}")
                } else {
                    format!("{name:?}")
                },
                if names.is_empty() {
                    "none waits (a device waits once its agent registered)".to_string()
                } else {
                    format!("pending: {}", names.join(", "))
                }
            )))
        }
        many => Err(Error::InvalidArgument(format!(
            "{} pending devices are named {name:?} (guids {}): give the device guid",
            many.len(),
            many.iter()
                .map(|g| format!("{g:#x}"))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
