//! The `AgentRegistry` service: agents register their device (a new device
//! becomes a vdev; a known device guid gets its vdev id back) and keep a
//! report stream open. Reports carry health and capacity; a vdev whose agent
//! stays silent for `MISSED_REPORTS` intervals is made unavailable
//! (allocation goes on elsewhere) until its reports resume.

use std::sync::Arc;
use std::time::Instant;

use aliquot_proto::v1 as pb;
use aliquot_proto::v1::agent_registry_server::AgentRegistry;
use metaslab::{Health, VdevId, VdevRole, VdevSpec};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::convert;
use crate::error::{Error, Result};
use crate::state::{Inner, MISSED_REPORTS, RolledBack, Shared, VdevInfo};
use crate::store::VdevRecord;

/// How long a Register waits for a txg being persisted before its label is
/// checked (the agent retries).
const LABEL_CHECK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Clone)]
pub struct RegistryService {
    pub shared: Arc<Shared>,
    pub bindings: Arc<crate::binding::AgentBindings>,
    /// Agent certificates admitted ahead to add their device (`--admit-agent`).
    pub admit: Arc<crate::admission::AdmitList>,
}

/// Grow vdev `vdev` to `capacity` (ExpandVdev): refused beyond what the
/// store reopens or below the current capacity; the new record goes out with
/// the open txg, which is returned (the caller waits for it to sync).
pub fn expand(g: &mut Inner, vdev: VdevId, capacity: u64) -> Result<Option<metaslab::Txg>> {
    let current = vdev_capacity(g, vdev).ok_or(metaslab::Error::UnknownVdev(vdev))?;
    if capacity >= metaslab::pool::MAX_VDEV_CAPACITY {
        return Err(Error::InvalidArgument(capacity_limit(capacity)));
    }
    if capacity < current {
        return Err(Error::VdevConflict(format!(
            "vdev {vdev} cannot shrink from {current} to {capacity} bytes"
        )));
    }
    if capacity == current {
        return Ok(None);
    }
    // Confirmed with the vdev's agent (its last registration or report):
    // space past the device's end would take allocations whose writes fail.
    let device = g.vdevs.get(&vdev).map_or(0, |v| v.device_capacity);
    if capacity > device {
        return Err(Error::VdevConflict(format!(
            "vdev {vdev}'s agent says its device holds {device} bytes; it cannot grow to \
             {capacity}: grow the device first (restart its agent with a larger --capacity, or \
             on a larger block device), then expand the vdev to at most what the agent reports"
        )));
    }
    g.pool.grow_vdev(vdev, capacity)?;
    if let Some(rec) = record_of(g, vdev) {
        g.pending_vdevs.push(rec);
    }
    g.wake_admitted();
    g.event(
        "vdev_expand",
        vdev,
        format!("{current} -> {capacity} bytes (administrative)"),
    );
    Ok(Some(g.pool.open_txg()))
}

fn record_of(g: &Inner, id: VdevId) -> Option<VdevRecord> {
    let info = g.vdevs.get(&id)?;
    let stats = g.pool.stats();
    let v = stats.vdevs.iter().find(|v| v.id == id)?;
    let mut spec = v.spec.clone();
    spec.metaslab_shift = Some(v.metaslab_shift);
    Some(VdevRecord {
        id,
        guid: info.guid,
        name: info.name.clone(),
        endpoint: info.endpoint.clone(),
        spec,
    })
}

fn vdev_capacity(g: &Inner, id: VdevId) -> Option<u64> {
    vdev_spec(g, id).map(|s| s.capacity)
}

fn vdev_spec(g: &Inner, id: VdevId) -> Option<VdevSpec> {
    g.pool
        .stats()
        .vdevs
        .into_iter()
        .find(|v| v.id == id)
        .map(|v| v.spec)
}

/// Is `endpoint` served by a live vdev other than `me`?
fn endpoint_owner(g: &Inner, endpoint: &str, me: Option<VdevId>) -> Option<VdevId> {
    g.vdevs
        .iter()
        .find(|(id, v)| Some(**id) != me && v.endpoint == endpoint && !v.silent)
        .map(|(id, _)| *id)
}

/// A vdev heard from again: its reported health applies once more.
pub(crate) fn mark_alive(g: &mut Inner, id: VdevId, now: Instant, why: &str) {
    let Some(info) = g.vdevs.get_mut(&id) else {
        return;
    };
    info.last_seen = now;
    if info.silent {
        info.silent = false;
        let health = info.reported_health;
        let _ = g.pool.set_health(id, health);
        g.wake_admitted();
        g.event("vdev_online", id, why.to_string());
        tracing::info!(vdev = id, ?health, "vdev available again");
    }
}

/// The refusal of a vdev too large: 2^17 metaslabs of at most 2^40 bytes
/// each means a vdev of 2^57 bytes exactly would need a 2^41 metaslab, so
/// the bound named is one that is itself accepted.
fn capacity_limit(capacity: u64) -> String {
    format!(
        "capacity {capacity} bytes is too large: a vdev holds at most {} bytes (just under \
         128 PiB: 2^17 metaslabs of 2^40 bytes)",
        metaslab::pool::MAX_VDEV_CAPACITY - 1
    )
}

/// Longest vdev name (the store and every table must hold it).
pub const MAX_NAME_LEN: usize = 128;

/// Check a registration by the store's own rules before anything is
/// persisted (the pool's `add_vdev` then checks the metaslab sizing).
fn validate_registration(r: &pb::RegisterRequest) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    if r.capacity == 0 {
        return bad("capacity must be above 0 bytes".into());
    }
    if r.capacity >= metaslab::pool::MAX_VDEV_CAPACITY {
        return bad(capacity_limit(r.capacity));
    }
    if !(9..=16).contains(&r.ashift) {
        return bad(format!("ashift {} is out of range (9 ..= 16)", r.ashift));
    }
    if r.children > 255 {
        return bad(format!(
            "children {} is out of range (1 ..= 255)",
            r.children
        ));
    }
    if r.parity > 3 || r.parity >= r.children.max(1) {
        return bad(format!(
            "parity {} must be at most 3 and leave a data child of {}",
            r.parity,
            r.children.max(1)
        ));
    }
    if r.name.is_empty() || r.name.len() > MAX_NAME_LEN {
        return bad(format!(
            "name must be 1 ..= {MAX_NAME_LEN} bytes (got {})",
            r.name.len()
        ));
    }
    if let Some(c) = r
        .name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-_.:/@+".contains(*c)))
    {
        return bad(format!(
            "name {:?} has the character {c:?}; use letters, digits and - _ . : / @ +",
            r.name.chars().take(40).collect::<String>()
        ));
    }
    if !matches!(r.backend.as_str(), "" | "file" | "sim") {
        return bad(format!("backend {:?} is not file or sim", r.backend));
    }
    Ok(())
}

/// Reports that show I/Os queued at the device but none completing (no
/// write, no read, not even a failed one) for `STALLED_REPORTS` reports in
/// a row: the agent's device is hung. The vdev stops taking allocations
/// (health Unavailable) until it drains. A device serving reads is not
/// hung, even while no write arrives (a read-back, a verify).
pub const STALLED_REPORTS: u32 = 2;

fn stall_check(g: &mut Inner, id: VdevId) {
    let Some(info) = g.vdevs.get_mut(&id) else {
        return;
    };
    let (Some(last), Some((_, prev))) = (&info.last_report, &info.prev_report) else {
        return;
    };
    let stuck = last.queue_depth_ios > 0
        && last.writes == prev.writes
        && last.bytes_written == prev.bytes_written
        && last.bytes_read == prev.bytes_read
        && last.write_errors == prev.write_errors
        && last.read_errors == prev.read_errors;
    if stuck {
        info.stalled_reports += 1;
    } else {
        info.stalled_reports = 0;
    }
    let hung = info.stalled_reports >= STALLED_REPORTS;
    // An agent whose device met ENOSPC: every write
    // placed there fails until its file system has room again.
    let full = last.out_of_space;
    let stalled = hung || full;
    let health = info.reported_health;
    let depth = last.queue_depth_ios;
    // Logs name the vdev as operators see it: `file2 (2)`.
    let label = format!("{} ({id})", info.name);
    if stalled && !info.stalled {
        info.stalled = true;
        let why = info.unavailable_reason().unwrap_or_default();
        let _ = g.pool.set_health(id, Health::Unavailable);
        if full {
            g.event("vdev_full", id, why);
            tracing::warn!(
                "vdev {label} out of space: a write met ENOSPC; not allocating there until the agent has room"
            );
        } else {
            g.event("vdev_stalled", id, why);
            tracing::warn!(
                queued = depth,
                "vdev {label} stalled: {depth} I/Os queued at its device, none completing; not allocating there"
            );
        }
    } else if !stalled && info.stalled {
        info.stalled = false;
        let _ = g.pool.set_health(id, health);
        g.wake_admitted();
        g.event(
            "vdev_online",
            id,
            "queue draining again, with room on its device".into(),
        );
        tracing::info!("vdev {label} writable again");
    }
}

/// A new device where a known vdev (live or silent, e.g. just recovered
/// from the store) was last seen is refused: its extents would be read from
/// the wrong device. The known device frees the endpoint by re-registering
/// from elsewhere.
pub(crate) fn endpoint_free(g: &Inner, endpoint: &str, device_guid: u64) -> Result<()> {
    if let Some((&owner, v)) = g.vdevs.iter().find(|(_, v)| v.endpoint == endpoint) {
        let state = if v.silent { "silent" } else { "live" };
        return Err(Error::VdevConflict(format!(
            "endpoint {endpoint} belongs to {state} vdev {owner} (device guid {:#x}); a different device (guid {:#x}) cannot take it over",
            v.guid, device_guid
        )));
    }
    Ok(())
}

/// Add device `r` to the pool as a new vdev (admitted: by an operator, or
/// registered where admission is not needed); returns the txg its record
/// joins (usable once that txg synced).
pub(crate) fn add_device(
    g: &mut Inner,
    r: &pb::RegisterRequest,
    endpoint: &str,
    now: Instant,
) -> Result<(VdevId, metaslab::Txg)> {
    let spec = VdevSpec {
        capacity: r.capacity,
        ashift: r.ashift as u8,
        children: r.children.max(1),
        parity: r.parity,
        rotational: r.rotational,
        role: if r.log {
            VdevRole::Log
        } else {
            VdevRole::Normal
        },
        metaslab_shift: None,
    };
    let id = g.pool.add_vdev(spec)?;
    g.vdevs.insert(
        id,
        VdevInfo {
            guid: r.device_guid,
            name: r.name.clone(),
            endpoint: endpoint.to_string(),
            backend: r.backend.clone(),
            last_report: None,
            last_seen: now,
            prev_report: None,
            last_report_at: None,
            silent: false,
            // A device new to the pool has no token of an older
            // generation to fear.
            generation_acked: true,
            reported_health: Health::Healthy,
            stalled_reports: 0,
            stalled: false,
            device_capacity: r.capacity,
            window_out: false,
        },
    );
    g.by_guid.insert(r.device_guid, id);
    if let Some(rec) = record_of(g, id) {
        g.pending_vdevs.push(rec);
    }
    g.event(
        "vdev_add",
        id,
        format!(
            "{} {} at {endpoint}",
            r.name,
            units::format_bytes(r.capacity)
        ),
    );
    let txg = g.pool.open_txg();
    tracing::info!(vdev = id, name = %r.name, endpoint = %endpoint, capacity = r.capacity,
        guid = r.device_guid, "vdev added");
    Ok((id, txg))
}

impl RegistryService {
    /// `may_grow`: a re-registration with a larger capacity grows the vdev
    /// (plaintext pools). Under mutual TLS an agent certificate cannot grow
    /// its vdev: an admin does (`ExpandVdev`), so a stolen agent key cannot
    /// pull the pool's writes to itself.
    async fn register_inner(
        &self,
        r: pb::RegisterRequest,
        may_grow: bool,
        needs_admission: Option<String>,
    ) -> Result<pb::RegisterReply> {
        let (reply, wait_for) = self.register_locked(r, may_grow, needs_admission)?;
        if let Some(txg) = wait_for {
            // Its metaslabs are usable once the txg it joined in has synced.
            self.shared.wait_synced(txg).await?;
        }
        Ok(reply)
    }

    /// An agent certificate (so: over mutual TLS, bound to this device) gets
    /// its vdev's MAC token key of this generation; from then on its tokens
    /// are MACs under that key. Nobody else gets a key.
    fn hand_token_key(
        &self,
        id: Option<&aliquot_auth::Identity>,
        device_guid: u64,
        reply: &mut pb::RegisterReply,
    ) {
        let (Some(signer), Some(_)) = (
            &self.shared.settings.token_signer,
            id.filter(|i| i.role == aliquot_auth::Role::Agent),
        ) else {
            return;
        };
        let key = signer.vdev_key(self.shared.pool_guid, device_guid, reply.generation);
        reply.token_key = key.bytes().to_vec();
        self.shared
            .mac_keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(reply.vdev, key);
    }

    /// What the label's generation proves against the store's history of
    /// generations, if anything: a generation the store never opened, a
    /// txg that generation never synced here, or this very generation on a
    /// device this allocator never acknowledged. A store restored from an
    /// older copy reopens generation numbers the devices already saw, and
    /// its synced txg can pass the labels' txg while it runs, so the txg
    /// alone cannot tell its history from the devices'.
    fn label_generation_problem(&self, r: &pb::RegisterRequest, vdev: u32) -> Option<String> {
        let seen = r.label_generation;
        let f = &self.shared.fencing;
        let (first, _) = f.history.first_key_value()?;
        if seen == 0 || seen < *first {
            return None; // a label or a store from before generations were recorded
        }
        if seen > f.generation {
            return Some(format!(
                "was last told of generation {seen} (txg {}), which this store never opened \
                 (it opened generation {} now)",
                r.label_txg, f.generation
            ));
        }
        if seen == f.generation {
            let acked = self
                .shared
                .lock()
                .vdevs
                .get(&vdev)
                .is_some_and(|v| v.generation_acked);
            return (!acked).then(|| {
                format!(
                    "says txg {} synced in generation {seen}, this allocator's own, which never \
                     acknowledged that device",
                    r.label_txg
                )
            });
        }
        let Some(&opened_at) = f.history.get(&seen) else {
            return Some(format!(
                "was last told of generation {seen} (txg {}), which this store never opened",
                r.label_txg
            ));
        };
        let last = f.synced_by(seen);
        (r.label_txg < opened_at || r.label_txg > last).then(|| {
            format!(
                "says txg {} synced in generation {seen}, which synced only txgs {opened_at}..={last} \
                 in this store",
                r.label_txg
            )
        })
    }

    /// Compare what the device's label says of its pool with this pool and
    /// store (OpenZFS compares the labels' uberblocks at import,
    /// `spa.c:spa_load_impl@zfs-2.4.0`, and refuses a pool whose devices
    /// say another guid, `vdev_label.c:vdev_validate@zfs-2.4.0`).
    fn check_label(&self, r: &pb::RegisterRequest) -> Result<()> {
        if r.label_pool_guid == 0 {
            return Ok(()); // a new device, or one from before labels had marks
        }
        let pool = self.shared.pool_guid;
        let device = format!(
            "device {:#x} ({:?} at {})",
            r.device_guid, r.name, r.endpoint
        );
        if r.label_pool_guid != pool {
            return Err(Error::PoolMismatch {
                label_pool_guid: r.label_pool_guid,
                pool_guid: pool,
                message: format!(
                    "{device} is labelled for pool {:#x} (synced txg {} in generation {}), not \
                     this pool {pool:#x}; nothing was written to it. If it belongs to another \
                     pool, point its agent at that pool's allocator. If this allocator lost its \
                     store (a deleted data dir or WAL makes it start a new, empty pool), stop it \
                     and restore the store. To reuse the device here, give the agent a fresh \
                     device (or zero its first MiB).",
                    r.label_pool_guid, r.label_txg, r.label_generation
                ),
            });
        }
        let (store_txg, store_digest) = *self
            .shared
            .synced_state
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // At the same txg the digests must agree (0: not known on a side):
        // otherwise the store is of another history (a copy that went its
        // own way), and what the device holds is not what it says.
        let diverged = r.label_txg == store_txg
            && r.label_state_digest != 0
            && store_digest != 0
            && r.label_state_digest != store_digest;
        let vdev = self
            .shared
            .lock()
            .by_guid
            .get(&r.device_guid)
            .copied()
            .unwrap_or(u32::MAX);
        let generation_problem = self.label_generation_problem(r, vdev);
        let txg_ahead = !(r.label_txg < store_txg || (r.label_txg == store_txg && !diverged));
        if generation_problem.is_none() && !txg_ahead {
            return Ok(());
        }
        if r.label_generation < self.shared.fencing.rewind_generation {
            tracing::warn!(
                vdev,
                label_txg = r.label_txg,
                label_generation = r.label_generation,
                store_txg,
                "{device}: rollback accepted by --rewind-to: what it saw after txg {store_txg} is lost",
            );
            return Ok(());
        }
        if let Some(why) = generation_problem {
            return Err(self.shared.refuse_rolled_back(RolledBack {
                vdev,
                label_txg: r.label_txg,
                store_txg,
                message: format!(
                    "the store is older than the pool: {device} {why}. Its label was written \
                     by a history this store does not hold (an older copy of the data dir or \
                     of the database restored); blocks committed there would be handed out \
                     again, so this allocator serves nothing and syncs no txg. Restore the \
                     newest store and restart, or accept losing that history: restart the \
                     allocator with --rewind-to {store_txg} (as `zpool import -F`)."
                ),
            }));
        }
        if diverged {
            return Err(self.shared.refuse_rolled_back(RolledBack {
                vdev,
                label_txg: r.label_txg,
                store_txg,
                message: format!(
                    "the store is not the pool's: {device} saw txg {store_txg} sync with state \
                     digest {:#x}, this store's txg {store_txg} has digest {store_digest:#x} (a \
                     copy of the store that went its own way). Restore the store the devices \
                     were written with, or accept this one: restart the allocator with \
                     --rewind-to {store_txg}.",
                    r.label_state_digest
                ),
            }));
        }
        Err(self.shared.refuse_rolled_back(RolledBack {
            vdev,
            label_txg: r.label_txg,
            store_txg,
            message: format!(
                "the store is older than the pool: {device} says txg {} synced (generation {}), \
                 the store holds only up to txg {store_txg}. Txgs {}..={} are missing (a \
                 deleted or truncated WAL, or an older copy of the data dir restored); blocks \
                 committed in them would be handed out again, so this allocator serves \
                 nothing. Restore the newest store and restart, or accept losing those txgs: \
                 restart the allocator with --rewind-to {store_txg} (as `zpool import -F`).",
                r.label_txg,
                r.label_generation,
                store_txg + 1,
                r.label_txg
            ),
        }))
    }

    /// The synchronous part of Register; a new vdev also returns the txg
    /// to wait for.
    fn register_locked(
        &self,
        r: pb::RegisterRequest,
        may_grow: bool,
        needs_admission: Option<String>,
    ) -> Result<(pb::RegisterReply, Option<metaslab::Txg>)> {
        self.shared.check_serving()?;
        if r.device_guid == 0 {
            return Err(Error::InvalidArgument(
                "device_guid must be set (the device's stable identity)".into(),
            ));
        }
        let endpoint = r.endpoint.trim().to_string();
        if endpoint.parse::<tonic::transport::Uri>().is_err() || !endpoint.contains("://") {
            return Err(Error::InvalidArgument(format!(
                "endpoint {endpoint:?} is not a URL such as http://127.0.0.1:7001"
            )));
        }
        validate_registration(&r)?;
        let now = Instant::now();
        let mut g = self.shared.lock();
        let next_allocation_id = g.pool.next_allocation_id();
        let reply = |vdev| pb::RegisterReply {
            vdev,
            pool_guid: self.shared.pool_guid,
            report_interval_ms: self.shared.settings.report_interval.as_millis() as u32,
            generation: self.shared.fencing.generation,
            next_allocation_id,
            max_lease_ms: self.shared.settings.max_lease.as_millis() as u64,
            // Filled by `hand_token_key` once the registration succeeded.
            token_key: Vec::new(),
        };
        if let Some(&id) = g.by_guid.get(&r.device_guid) {
            if g.pool.is_removed(id) {
                return Err(Error::VdevConflict(format!(
                    "device {:#x} was vdev {id}, removed from the pool (RemoveVdev); give the \
                     agent a new device (a fresh file or a wiped label) to add it again",
                    r.device_guid
                )));
            }
            if let Some(owner) = endpoint_owner(&g, &endpoint, Some(id)) {
                return Err(Error::VdevConflict(format!(
                    "endpoint {endpoint} belongs to live vdev {owner}; a different device cannot take it over"
                )));
            }
            // While the device's agent reports from its endpoint, nobody
            // moves the device elsewhere (that would redirect its writes).
            if let Some(info) = g.vdevs.get(&id)
                && !info.silent
                && info.last_report.is_some()
                && info.endpoint != endpoint
            {
                return Err(Error::VdevConflict(format!(
                    "device {:#x} is vdev {id}, live at {}; it cannot move to {endpoint} while \
                     its agent there keeps reporting (stop that agent first)",
                    r.device_guid, info.endpoint
                )));
            }
            // The device's size as its agent says it, even when refused
            // below: what `vdev expand` may then grow the vdev to.
            if let Some(info) = g.vdevs.get_mut(&id) {
                info.device_capacity = r.capacity;
            }
            // What the pool knows of the device wins over what a
            // re-Register says; a difference is refused, not ignored.
            if let Some(spec) = vdev_spec(&g, id) {
                let role_now = if r.log {
                    VdevRole::Log
                } else {
                    VdevRole::Normal
                };
                if role_now != spec.role {
                    return Err(Error::VdevConflict(format!(
                        "device {:#x} is vdev {id}, a {:?} vdev; it cannot register again as a \
                         {role_now:?} vdev (a vdev's role is fixed when it joins the pool)",
                        r.device_guid, spec.role
                    )));
                }
                if r.capacity > spec.capacity && !may_grow {
                    return Err(Error::VdevConflict(format!(
                        "device {:#x} is vdev {id} of {} bytes; it registered again with {} \
                         bytes, and an agent certificate cannot grow its vdev: an admin grows \
                         it with `aliquotctl vdev expand {id} --capacity {}`",
                        r.device_guid, spec.capacity, r.capacity, r.capacity
                    )));
                }
            }
            let mut changed = false;
            if let Some(info) = g.vdevs.get_mut(&id) {
                changed |= info.endpoint != endpoint || info.name != r.name;
                info.endpoint = endpoint.clone();
                info.name = r.name.clone();
                info.backend = r.backend.clone();
            }
            if may_grow && vdev_capacity(&g, id).is_some_and(|c| r.capacity > c) {
                g.pool.grow_vdev(id, r.capacity)?;
                changed = true;
            }
            // A vdev whose agent has not yet reported in this generation
            // waits for that report (it follows the RegisterReply that
            // teaches the agent the generation); see `report_one`.
            let window_open = !self.shared.claim_window_remaining().is_zero();
            if g.vdevs
                .get(&id)
                .is_some_and(|v| v.generation_acked && !(v.window_out && window_open))
            {
                mark_alive(&mut g, id, now, "agent registered again");
            } else if let Some(info) = g.vdevs.get_mut(&id) {
                info.last_seen = now;
            }
            if changed && let Some(rec) = record_of(&g, id) {
                g.pending_vdevs.push(rec);
            }
            drop(g);
            tracing::info!(vdev = id, endpoint = %endpoint, guid = r.device_guid, "vdev re-registered");
            return Ok((reply(id), None));
        }
        endpoint_free(&g, &endpoint, r.device_guid)?;
        // A device new to the pool joins only when an operator said so.
        if let Some(agent) = needs_admission {
            return Err(crate::admission::hold(&mut g, &agent, &r, &self.admit));
        }
        g.awaiting_admission.remove(&r.device_guid);
        let (id, txg) = add_device(&mut g, &r, &endpoint, now)?;
        drop(g);
        Ok((reply(id), Some(txg)))
    }

    fn report_one(&self, mut r: pb::AgentReport) -> Result<pb::ReportAck> {
        self.shared.check_lease()?;
        let now = Instant::now();
        let mut g = self.shared.lock();
        let id = r.vdev;
        if g.pool.is_removed(id) {
            return Err(metaslab::Error::VdevRemoved(id).into());
        }
        // The first report in this generation, during the claim window:
        // what older generations wrote here is kept for their claims.
        let window_open = !self.shared.claim_window_remaining().is_zero();
        let first = g.vdevs.get(&id).is_some_and(|v| !v.generation_acked);
        let kept_out = first
            && window_open
            && !crate::takeover::first_report(&mut g, &self.shared.fencing, id, &r);
        r.older_writes = Vec::new();
        let Some(info) = g.vdevs.get_mut(&id) else {
            return Err(Error::NotFound(format!(
                "vdev {id} is not registered here; register first"
            )));
        };
        let health = convert::health_from_pb(r.health);
        let old_health = info.reported_health;
        info.reported_health = health;
        if let Some(prev) = info.last_report.take() {
            info.prev_report = Some((info.last_report_at.unwrap_or(now), prev));
        }
        let capacity = r.capacity;
        info.last_report = Some(r);
        info.last_report_at = Some(now);
        let was_silent = info.silent;
        info.generation_acked = true;
        if first {
            // Claims waiting for this vdev's older writes re-check now.
            self.shared.vdev_acked.notify_waiters();
        }
        info.window_out |= kept_out;
        if was_silent && info.window_out && window_open {
            // Heard from, but kept out until the claim window ends.
            info.last_seen = now;
        } else if was_silent {
            mark_alive(&mut g, id, now, "reports resumed");
        } else {
            let v = g.vdevs.get_mut(&id).expect("present");
            v.last_seen = now;
            // A stalled or full vdev stays unavailable whatever health its
            // agent reports; `stall_check` restores the reported one when
            // it drains or has room again.
            let held = v.stalled;
            if health != old_health && !held {
                g.pool.set_health(id, health)?;
                g.wake_admitted();
                tracing::info!(vdev = id, ?health, "vdev health changed");
            }
        }
        // A report never grows a vdev (growth is `vdev expand`, or a
        // plaintext re-registration); it tells how large the device is.
        if capacity > 0
            && let Some(v) = g.vdevs.get_mut(&id)
        {
            v.device_capacity = capacity;
        }
        stall_check(&mut g, id);
        let (revoked_allocations, revoked_expires_ms) = g.take_revoked(id).into_iter().unzip();
        let synced_state = *self
            .shared
            .synced_state
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let stats = g.pool.stats();
        let v = stats.vdevs.iter().find(|v| v.id == id);
        Ok(pb::ReportAck {
            health: convert::health_to_pb(v.map_or(Health::Unavailable, |v| v.health)) as i32,
            online: v.is_some_and(|v| v.online),
            generation: self.shared.fencing.generation,
            // What the agent writes to its label: only a txg already durable.
            pool_guid: self.shared.pool_guid,
            synced_txg: synced_state.0,
            state_digest: synced_state.1,
            revoked_allocations,
            revoked_expires_ms,
        })
    }
}

/// Called from housekeeping: vdevs silent for too long become unavailable.
pub fn check_liveness(shared: &Shared, now: Instant) {
    let limit = shared.settings.report_interval * MISSED_REPORTS;
    let mut g = shared.lock();
    let silent: Vec<VdevId> = g
        .vdevs
        .iter()
        .filter(|(_, v)| !v.silent && now.duration_since(v.last_seen) > limit)
        .map(|(id, _)| *id)
        .collect();
    for id in silent {
        let v = g.vdevs.get_mut(&id).expect("present");
        let age = now.duration_since(v.last_seen);
        v.silent = true;
        let why = v.unavailable_reason().unwrap_or_default();
        let _ = g.pool.set_health(id, Health::Unavailable);
        g.event("vdev_unavailable", id, why);
        tracing::warn!(
            vdev = id,
            silent_ms = age.as_millis() as u64,
            "vdev unavailable: agent stopped reporting"
        );
    }
}

#[tonic::async_trait]
impl AgentRegistry for RegistryService {
    #[tracing::instrument(skip_all, fields(endpoint = %req.get_ref().endpoint, guid = req.get_ref().device_guid, name = %req.get_ref().name))]
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterReply>, Status> {
        // Not the leader (its lease ran out): say so at once, before any
        // wait, so the agent tries the next allocator.
        self.shared.check_lease()?;
        let id = req.extensions().get::<aliquot_auth::Identity>().cloned();
        // The label first: a device of another pool, or one proving the store
        // lost txgs, is refused before anything (binding included) changes.
        // Under the sync gate: a txg persisting now is either counted here
        // or, after a refusal, never lands.
        {
            let _gate = tokio::time::timeout(LABEL_CHECK_WAIT, self.shared.sync_gate.lock())
                .await
                .map_err(|_| Error::SyncPending {
                    waited_ms: LABEL_CHECK_WAIT.as_millis() as u64,
                })?;
            self.check_label(req.get_ref())?;
            self.shared.labels_vouched.send_replace(true);
        }
        // The certificate's claim on the device is checked first and made
        // durable only once the registration succeeded: a refused first
        // Register binds nothing.
        let claim = self
            .bindings
            .claim(id.as_ref(), req.get_ref().device_guid)?;
        let device_guid = req.get_ref().device_guid;
        let needs_admission = self.admit.needs_admission(id.as_ref(), req.get_ref());
        match self
            .register_inner(req.into_inner(), id.is_none(), needs_admission)
            .await
        {
            Ok(mut reply) => {
                self.bindings
                    .persist(self.shared.store.as_ref(), claim)
                    .await?;
                self.hand_token_key(id.as_ref(), device_guid, &mut reply);
                Ok(Response::new(reply))
            }
            Err(e) => {
                self.bindings.release(claim);
                Err(e.into())
            }
        }
    }

    type ReportStream = ReceiverStream<Result<pb::ReportAck, Status>>;

    #[tracing::instrument(skip_all)]
    async fn report(
        &self,
        req: Request<Streaming<pb::AgentReport>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        // An agent certificate reports only the vdev of the device it registered.
        let bound = self
            .bindings
            .device_of(req.extensions().get::<aliquot_auth::Identity>());
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let svc = self.clone();
        tokio::spawn(
            async move {
                loop {
                    let msg = tokio::select! {
                        m = inbound.next() => m,
                        _ = svc.shared.stopping() => break,
                        // The stream ends with the lease: the agent then
                        // looks for the allocator that leads now.
                        e = svc.shared.lease_lost() => {
                            let _ = tx.send(Err(e.into())).await;
                            break;
                        }
                    };
                    let Some(msg) = msg else { break };
                    let reply = match msg {
                        Ok(r) => match bound {
                            Some(device) => {
                                let own = device.and_then(|g| svc.shared.lock().by_guid.get(&g).copied());
                                if own == Some(r.vdev) {
                                    svc.report_one(r).map_err(Status::from)
                                } else {
                                    Err(Status::from(Error::NotOwnerDevice {
                                        device: device.unwrap_or(0),
                                        message: format!(
                                            "this agent certificate may report only its own vdev ({own:?}), not vdev {}",
                                            r.vdev
                                        ),
                                    }))
                                }
                            }
                            None => svc.report_one(r).map_err(Status::from),
                        },
                        Err(status) => {
                            tracing::debug!(%status, "report stream ended");
                            break;
                        }
                    };
                    let fatal = reply.is_err();
                    if tx.send(reply).await.is_err() || fatal {
                        break;
                    }
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
