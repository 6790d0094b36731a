//! The allocator's mover: empties a vdev that is being removed, whoever
//! wrote its blocks (OpenZFS's device removal, `vdev_removal.c`). For each
//! block on the vdev it places a new extent by Relocate's rule (one rule
//! for where a move goes: off the vdevs of the block's other copies while
//! another vdev has room, `Pool::removal_avoid`), mints a read token for the old extent and a
//! write token for the new one, and asks the new extent's agent to copy the
//! bytes from the old one's agent (CopyFrom: the bytes never pass through
//! the allocator; the agent checks length and checksum). It then commits
//! the move like a Relocate that keeps its address: in one txg the new
//! extent is committed and an indirect mapping entry old -> new recorded,
//! so the old address keeps answering reads and frees. A block already
//! moved there (the new home of an earlier move) is moved again the same
//! way, and its entry repointed to the newest home: chains never grow.
//!
//! Nothing of the work list is kept apart: what is left to move is every
//! extent still allocated on the vdev without a mapping entry, and the
//! store's one row per removal (`Store::evacuations`) says which vdev. A
//! leader that takes over, or a restart, resumes exactly there; a move cut
//! short leaves its new extent uncommitted (the lease returns it) and its
//! old extent where it was. Once every block is copied the vdev is
//! indirect: offline, needing no agent, kept until its last entry is
//! dropped (Remap or Free of its old addresses), then forgotten: the
//! removal's row is deleted in the txg that records the vdev removed.
//!
//! Paced by `move_rate` (bytes/s, a run-time tunable; 0 pauses), and the
//! agents queue the copies behind client I/O.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use futures_util::StreamExt;
use metaslab::Extent;
use tonic::transport::Channel;

use crate::convert;
use crate::error::{Error, Result};
use crate::state::Shared;
use crate::store::{AdminState, Evacuation};

/// The tunable (GetTunables/SetTunable) and its default, bytes/s.
pub const MOVE_RATE: &str = "move_rate";
pub const DEFAULT_MOVE_RATE: u64 = 64 << 20;
/// Moves in flight at once (each one block, copied by one agent).
const CONCURRENT_MOVES: usize = 4;
/// The store is listed this much of the vdev at a time.
const LIST_WINDOW: u64 = 1 << 30;
/// How long a CopyFrom may take before the move is retried.
const COPY_WITHIN: Duration = Duration::from_secs(120);
/// The rate shown covers this much of the recent past.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Bytes the allocator keeps per mapping entry (`crate::indirect`).
const ENTRY_BYTES: u64 = 32;

/// Parse a `move_rate` value: a rate such as `64MiB/s` or plain bytes/s.
pub fn parse_rate(v: &str) -> Result<u64> {
    units::parse_rate(v).map(|r| r as u64).map_err(|e| {
        Error::Pool(metaslab::Error::BadTunableValue {
            name: MOVE_RATE.into(),
            value: v.into(),
            reason: e.to_string(),
        })
    })
}

pub fn format_rate(r: u64) -> String {
    units::format_rate(r as f64)
}

/// The mover's state in the leading allocator.
pub struct Mover {
    rate: AtomicU64,
    /// The store's removal row was read (at the first pass of this start).
    loaded: std::sync::atomic::AtomicBool,
    /// When the next move may start (the pace of `rate`).
    next_at: Mutex<Instant>,
    wake: tokio::sync::Notify,
    /// Every removal whose vdev is not forgotten, by vdev: at most one
    /// copying, the others done (indirect until their last entry goes).
    removals: Mutex<BTreeMap<u32, Progress>>,
    tls: Mutex<aliquot_auth::ClientTls>,
    channels: Mutex<HashMap<String, Channel>>,
}

/// The removal under way, as this leader knows it.
#[derive(Clone, Debug)]
struct Progress {
    ev: Evacuation,
    copied_bytes: u64,
    copied_extents: u64,
    done: bool,
    last_error: Option<String>,
    /// Recent moves (when, bytes), for the rate shown.
    recent: VecDeque<(Instant, u64)>,
}

impl Default for Mover {
    fn default() -> Mover {
        Mover {
            rate: AtomicU64::new(DEFAULT_MOVE_RATE),
            loaded: Default::default(),
            next_at: Mutex::new(Instant::now()),
            wake: tokio::sync::Notify::new(),
            removals: Mutex::new(BTreeMap::new()),
            tls: Mutex::new(aliquot_auth::ClientTls::Insecure),
            channels: Default::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Mover {
    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }

    pub fn set_rate(&self, r: u64) {
        self.rate.store(r, Ordering::Relaxed);
        *lock(&self.next_at) = Instant::now();
        self.wake.notify_one();
    }

    /// How the mover reaches agents: its certificate as the allocator.
    pub fn set_tls(&self, tls: aliquot_auth::ClientTls) {
        *lock(&self.tls) = tls;
    }

    /// A removal was started or changed: look again now.
    pub fn kick(&self) {
        self.wake.notify_one();
    }

    /// The vdev whose blocks are being copied, if any (a removal whose
    /// copying is done does not hold another back).
    pub fn evacuating(&self) -> Option<u32> {
        lock(&self.removals)
            .values()
            .find(|p| !p.done)
            .map(|p| p.ev.vdev)
    }

    /// `vdev` is forgotten (under the pool lock, with `Pool::remove_vdev`):
    /// its removal is over. Its store row goes in the txg that records the
    /// vdev removed (`Store::persist`), so neither outlives the other.
    pub fn forgotten(&self, vdev: u32) {
        lock(&self.removals).remove(&vdev);
    }

    /// Wait for the pace: a move of `bytes` starts when the ones before it
    /// have had their share of the rate. False when the mover is paused
    /// (rate 0): the move is left for a later pass.
    async fn pace(&self, bytes: u64) -> bool {
        let rate = self.rate();
        if rate == 0 {
            return false;
        }
        let start = {
            let mut next = lock(&self.next_at);
            let now = Instant::now();
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(bytes as f64 / rate as f64);
            start
        };
        tokio::time::sleep_until(start.into()).await;
        true
    }

    fn agent(&self, endpoint: &str) -> std::result::Result<VdevAgentClient<Channel>, String> {
        let mut ch = lock(&self.channels);
        let channel = match ch.get(endpoint) {
            Some(c) => c.clone(),
            None => {
                let c = lock(&self.tls)
                    .endpoint(endpoint, aliquot_auth::Role::Agent)
                    .map_err(|e| format!("agent endpoint {endpoint}: {e}"))?
                    .connect_timeout(Duration::from_secs(5))
                    .tcp_nodelay(true)
                    .connect_lazy();
                ch.insert(endpoint.to_string(), c.clone());
                c
            }
        };
        Ok(VdevAgentClient::new(channel))
    }

    fn moved(&self, vdev: u32, bytes: u64) {
        if let Some(p) = lock(&self.removals).get_mut(&vdev) {
            p.copied_bytes += bytes;
            p.copied_extents += 1;
            p.last_error = None;
            let now = Instant::now();
            p.recent.push_back((now, bytes));
            while p
                .recent
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
            {
                p.recent.pop_front();
            }
        }
    }

    fn failed(&self, vdev: u32, why: String) {
        if let Some(p) = lock(&self.removals).get_mut(&vdev) {
            p.last_error = Some(why);
        }
    }

    /// PoolStatus.evacuation, with the mapping's figures from `g`: the
    /// removal copying, else the last one started of those done (indirect).
    pub fn status(&self, g: &crate::state::Inner) -> Option<pb::Evacuation> {
        let p = {
            let r = lock(&self.removals);
            r.values()
                .find(|p| !p.done)
                .or_else(|| r.values().max_by_key(|p| p.ev.started_ms))
                .cloned()?
        };
        let now = Instant::now();
        let recent: u64 = p
            .recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW)
            .map(|(_, b)| b)
            .sum();
        let entries = g.indirect.entries_on(p.ev.vdev) as u64;
        Some(pb::Evacuation {
            vdev: p.ev.vdev,
            name: g
                .vdevs
                .get(&p.ev.vdev)
                .map(|i| i.name.clone())
                .unwrap_or_default(),
            total_bytes: p.ev.bytes,
            total_extents: p.ev.extents,
            // u64::MAX: not counted yet (the first pass after a start).
            copied_bytes: (p.copied_bytes % u64::MAX).min(p.ev.bytes),
            copied_extents: (p.copied_extents % u64::MAX).min(p.ev.extents),
            rate: recent as f64 / RATE_WINDOW.as_secs_f64(),
            move_rate: self.rate(),
            done: p.done,
            mapping_entries: entries,
            mapping_bytes: entries * ENTRY_BYTES,
            last_error: p.last_error.unwrap_or_default(),
            started_ms: p.ev.started_ms,
        })
    }
}

/// RemoveVdev of a vdev that holds blocks: check, take it offline, record
/// the removal, and let the mover start. Nothing moves when refused.
pub async fn start(shared: &Shared, vdev: u32) -> Result<pb::RemoveVdevReply> {
    let running = shared.store.evacuations().await.map_err(store_err)?;
    // Another removal holds this one back while it copies; one whose
    // copying this leader saw finish (its vdev indirect) does not.
    let done: Vec<u32> = lock(&shared.mover.removals)
        .values()
        .filter(|p| p.done)
        .map(|p| p.ev.vdev)
        .collect();
    if let Some(r) = running
        .iter()
        .find(|r| r.vdev != vdev && !done.contains(&r.vdev))
    {
        return Err(Error::EvacuationRunning {
            running: r.vdev,
            asked: vdev,
        });
    }
    if let Some(r) = running.iter().find(|r| r.vdev == vdev) {
        // Asked again: the same removal, still under way.
        return Ok(pb::RemoveVdevReply {
            vdev,
            name: vdev_name(shared, vdev),
            txg: shared.synced_txg(),
            generation: shared.fencing.generation,
            evacuating: true,
            bytes: r.bytes,
            extents: r.extents,
        });
    }
    let (name, txg, bytes) = {
        let mut g = shared.lock();
        let available = g.pool.evacuation_room(vdev)?;
        let alloc = g
            .pool
            .stats()
            .vdevs
            .iter()
            .find(|v| v.id == vdev)
            .map_or(0, |v| v.alloc);
        // Blocks moved before (a balancer move that kept its address) are
        // already elsewhere.
        let moved: u64 = g
            .indirect
            .iter()
            .filter(|m| m.from.vdev == vdev)
            .map(|m| m.from.size)
            .sum();
        let need = alloc.saturating_sub(moved);
        if need > available {
            return Err(Error::NoRoomToEvacuate {
                vdev,
                need,
                available,
            });
        }
        let was_online = g
            .pool
            .stats()
            .vdevs
            .iter()
            .any(|v| v.id == vdev && v.online);
        if was_online {
            g.pool.set_online(vdev, false)?;
            g.pending_vdev_states.push((vdev, AdminState::Offline));
            g.wake_admitted();
        }
        g.event("vdev_evacuating", vdev, "RemoveVdev".into());
        let name = g
            .vdevs
            .get(&vdev)
            .map(|i| i.name.clone())
            .unwrap_or_default();
        (name, g.pool.open_txg(), need)
    };
    // Offline durably first: after a crash the vdev still takes nothing.
    let synced = shared.wait_synced(txg).await?;
    // Counted from the store at that txg: every extent the mover will see.
    let extents = list_unmapped(shared, vdev).await?.len() as u64;
    let ev = Evacuation {
        vdev,
        bytes,
        extents,
        started_ms: convert::unix_ms(),
    };
    shared
        .store
        .set_evacuation(vdev, Some(ev))
        .await
        .map_err(store_err)?;
    adopt(shared, ev, 0, 0);
    shared.mover.kick();
    tracing::info!(vdev, name = %name, bytes, extents, "vdev evacuation started");
    Ok(pb::RemoveVdevReply {
        vdev,
        name,
        txg: synced,
        generation: shared.fencing.generation,
        evacuating: true,
        bytes,
        extents,
    })
}

fn store_err(e: crate::store::StoreError) -> Error {
    Error::Store(e.to_string())
}

fn vdev_name(shared: &Shared, vdev: u32) -> String {
    shared
        .lock()
        .vdevs
        .get(&vdev)
        .map(|i| i.name.clone())
        .unwrap_or_default()
}

/// Make `ev` the removal this leader follows.
fn adopt(shared: &Shared, ev: Evacuation, copied_bytes: u64, copied_extents: u64) {
    let mut r = lock(&shared.mover.removals);
    if r.get(&ev.vdev).is_some_and(|p| p.ev == ev) {
        return;
    }
    r.insert(
        ev.vdev,
        Progress {
            ev,
            copied_bytes,
            copied_extents,
            done: false,
            last_error: None,
            recent: VecDeque::new(),
        },
    );
}

/// The durable extents on `vdev` without a mapping entry (still to move),
/// in offset order. Blocks whose Free has not synced are left out.
async fn list_unmapped(shared: &Shared, vdev: u32) -> Result<Vec<Extent>> {
    let capacity = shared
        .lock()
        .pool
        .stats()
        .vdevs
        .iter()
        .find(|v| v.id == vdev)
        .map_or(0, |v| v.spec.capacity);
    let mut out = Vec::new();
    let mut at = 0;
    while at < capacity {
        let window = Extent {
            vdev,
            offset: at,
            size: LIST_WINDOW.min(capacity - at),
        };
        let found = shared
            .store
            .allocated_overlapping(window)
            .await
            .map_err(store_err)?;
        let g = shared.lock();
        out.extend(found.into_iter().filter(|e| {
            // One that straddles the window's start was listed before.
            e.offset >= at
                && g.indirect.get(e).is_none()
                && !g.recent_frees.contains_key(e)
                && g.relocations.moving(e).is_none()
        }));
        at += window.size;
    }
    Ok(out)
}

/// The mover's task: follows the store's removal, moves, finishes.
pub async fn run(shared: Arc<Shared>) {
    loop {
        if shared.shutting_down.load(Ordering::Relaxed) {
            return;
        }
        // Shutdown does not wait for a pass: a move cut short leaves its
        // new extent uncommitted and the block where it was.
        let pass = tokio::select! {
            r = step(&shared) => r,
            _ = shared.stopping() => return,
        };
        let idle = match pass {
            Ok(moved) => moved == 0,
            Err(e) => {
                tracing::warn!(error = %e, "mover: will retry");
                if let Some(v) = shared.mover.evacuating() {
                    shared.mover.failed(v, e.to_string());
                }
                true
            }
        };
        if idle {
            tokio::select! {
                _ = shared.mover.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shared.stopping() => return,
            }
        }
    }
}

/// One pass over the removals: the one copying moves blocks, the done
/// ones are forgotten once empty; returns the blocks moved.
async fn step(shared: &Arc<Shared>) -> Result<u64> {
    // Only the serving leader moves (a standby, a closed claim window or a
    // failing store wait quietly).
    if shared.check_serving().is_err() {
        return Ok(0);
    }
    // The store's rows once per start (this leader writes them from then
    // on). Each is counted from what is left at its first pass below.
    if !shared.mover.loaded.load(Ordering::Relaxed) {
        for ev in shared.store.evacuations().await.map_err(store_err)? {
            adopt(shared, ev, u64::MAX, u64::MAX);
        }
        shared.mover.loaded.store(true, Ordering::Relaxed);
    }
    let removals: Vec<(Evacuation, bool)> = lock(&shared.mover.removals)
        .values()
        .map(|p| (p.ev, p.done))
        .collect();
    if removals.is_empty() {
        return Ok(0);
    }
    for &(ev, _) in &removals {
        // A row left by a binary that deleted it apart from the vdev's
        // removal.
        if shared.lock().pool.is_removed(ev.vdev) {
            shared
                .store
                .set_evacuation(ev.vdev, None)
                .await
                .map_err(store_err)?;
            shared.mover.forgotten(ev.vdev);
        }
    }
    // Everything committed so far in the store: the listing is complete
    // but for allocations still in flight on the vdev.
    let open = shared.lock().pool.open_txg();
    shared.wait_synced(open).await?;
    for &(ev, done) in &removals {
        if done && let Err(e) = finish(shared, ev.vdev).await {
            // It does not hold the removal copying back.
            tracing::warn!(vdev = ev.vdev, error = %e, "indirect vdev not forgotten yet");
        }
    }
    // The one copying (after a restart, each row in turn until one has
    // blocks left).
    let Some(&(ev, _)) = removals
        .iter()
        .find(|(ev, done)| !done && !shared.lock().pool.is_removed(ev.vdev))
    else {
        return Ok(0);
    };
    let vdev = ev.vdev;
    let todo = list_unmapped(shared, vdev).await?;
    let left: u64 = todo.iter().map(|e| e.size).sum();
    // A leader that took over counts what earlier ones copied.
    if let Some(p) = lock(&shared.mover.removals)
        .get_mut(&vdev)
        .filter(|p| p.copied_bytes == u64::MAX)
    {
        p.copied_bytes = ev.bytes.saturating_sub(left);
        p.copied_extents = ev.extents.saturating_sub(todo.len() as u64);
    }
    if todo.is_empty() {
        return finish(shared, vdev).await.map(|()| 0);
    }
    if shared.mover.rate() == 0 {
        return Ok(0);
    }
    let moved = futures_util::stream::iter(todo)
        .map(|from| {
            let shared = shared.clone();
            async move {
                if !shared.mover.pace(from.size).await {
                    return 0;
                }
                match move_one(&shared, from).await {
                    Ok(()) => {
                        shared.mover.moved(vdev, from.size);
                        1
                    }
                    Err(why) => {
                        tracing::warn!(extent = %from, error = %why, "move failed; retried on the next pass");
                        shared.mover.failed(vdev, format!("{from}: {why}"));
                        0
                    }
                }
            }
        })
        .buffer_unordered(CONCURRENT_MOVES)
        .fold(0u64, |n, m| async move { n + m })
        .await;
    Ok(moved)
}

/// Every block is copied: the vdev is indirect. Forget it once it holds
/// nothing (its last entry dropped, nothing in flight).
async fn finish(shared: &Shared, vdev: u32) -> Result<()> {
    let empty = {
        let g = shared.lock();
        if g.pool.inflight_on(vdev) > 0 {
            // A late allocation's commit would add a block: look again.
            return Ok(());
        }
        let alloc = g
            .pool
            .stats()
            .vdevs
            .iter()
            .find(|v| v.id == vdev)
            .map_or(0, |v| v.alloc);
        alloc == 0 && g.indirect.entries_on(vdev) == 0
    };
    let newly_done = lock(&shared.mover.removals)
        .get_mut(&vdev)
        .map(|p| !std::mem::replace(&mut p.done, true))
        .unwrap_or(false);
    if newly_done {
        shared
            .lock()
            .event("vdev_indirect", vdev, "every block copied".into());
        tracing::info!(
            vdev,
            "vdev evacuated: indirect until its last mapping entry is dropped"
        );
    }
    if !empty {
        return Ok(());
    }
    match crate::balancer::forget_vdev(shared, vdev).await {
        // The progress and the store row went with the vdev.
        Ok(_) => Ok(()),
        // Frees of its last blocks not synced yet: the next pass.
        Err(Error::Pool(metaslab::Error::VdevNotEmpty { .. })) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Move one block: place, copy agent to agent, commit with its entry.
async fn move_one(shared: &Arc<Shared>, from: Extent) -> std::result::Result<(), String> {
    let req = pb::RelocateRequest {
        extent: Some(convert::extent_to_pb(&from)),
        keep_address: true,
        ..Default::default()
    };
    let (a, eps, deadline, _) = crate::balancer::relocate_as(shared, &req, true)
        .await
        .map_err(|e| e.to_string())?;
    let abort = |why: String| {
        let _ = shared.lock().abort(&[a.id]);
        why
    };
    let to = a.extents[0];
    let source = shared
        .lock()
        .vdevs
        .get(&from.vdev)
        .map(|i| i.endpoint.clone())
        .filter(|e| !e.is_empty())
        .ok_or_else(|| abort(format!("vdev {} has no agent endpoint", from.vdev)))?;
    let target = eps.first().cloned().unwrap_or_default();
    let expires_ms = convert::deadline_unix_ms(deadline);
    // The read token's floor: an allocation at or above it that wrote the
    // old extent (it cannot: the extent stays allocated) would kill it.
    let floor = crate::read_grant::watermark(shared);
    let read = crate::service::mint_tokens(shared, floor, &[from], expires_ms, true);
    let write = crate::service::mint_tokens(shared, a.id, &[to], expires_ms, false);
    let mut client = shared.mover.agent(&target).map_err(&abort)?;
    let copied = tokio::time::timeout(
        COPY_WITHIN,
        client.copy_from(pb::CopyFromRequest {
            source_endpoint: source,
            source_offset: from.offset,
            source_token: read.into_iter().next().unwrap_or_default(),
            offset: to.offset,
            size: to.size,
            token: write.into_iter().next().unwrap_or_default(),
        }),
    )
    .await
    .map_err(|_| abort(format!("no copy within {COPY_WITHIN:?}")))?
    .map_err(|s| abort(format!("copy to {target}: {}: {}", s.code(), s.message())))?
    .into_inner();
    if copied.bytes != to.size {
        return Err(abort(format!(
            "the agent copied {} bytes of {}",
            copied.bytes, to.size
        )));
    }
    let txg = crate::service::commit_locked(shared, &[a.id], None).map_err(|e| e.to_string())?;
    tracing::debug!(from = %from, to = %to, txg, "block moved");
    Ok(())
}
