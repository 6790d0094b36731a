//! The allocator's shared state: the `metaslab::Pool` behind one
//! `std::sync::Mutex` (short critical sections, never held across an
//! `.await`), the tickets parked in the throttle, the leases of in-flight
//! allocations, and what the registry knows about each vdev. The policy is
//! asked, never second-guessed: this module only waits, wakes and times.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use metaslab::{
    AllocRequest, Allocation, AllocationId, Extent, Pool, Submitted, Ticket, Txg, VdevId,
};
use tokio::sync::{oneshot, watch};

use crate::error::{Error, Result};
use crate::indirect::Mapping;
use crate::relocation::{RelocateIntent, Relocations};
use crate::store::MappingChange;
use crate::store::{AdminState, Store, VdevRecord};

/// Revocations queued for one vdev's agent at most (see `Inner::revoke`).
const REVOKED_QUEUE_MAX: usize = 1 << 20;

/// How many report intervals a vdev may stay silent before it is unavailable.
pub const MISSED_REPORTS: u32 = 3;

/// What the registry knows about one vdev besides the pool's view.
#[derive(Clone, Debug)]
pub struct VdevInfo {
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    pub backend: String,
    pub last_report: Option<pb::AgentReport>,
    /// Time of the last report (or of registration).
    pub last_seen: Instant,
    /// The report before `last_report`, for throughput deltas.
    pub prev_report: Option<(Instant, pb::AgentReport)>,
    pub last_report_at: Option<Instant>,
    /// Silent for `MISSED_REPORTS` intervals: health forced to Unavailable.
    pub silent: bool,
    /// The agent has reported in this generation (so it knows it and
    /// refuses older tokens). Until then the vdev stays silent: a
    /// re-registration alone does not make it allocatable.
    pub generation_acked: bool,
    /// The health the agent itself reported last.
    pub reported_health: metaslab::Health,
    /// Reports in a row with writes queued and none completing.
    pub stalled_reports: u32,
    /// Made unavailable because its queue does not drain.
    pub stalled: bool,
    /// The device's size as its agent last said it (registration or
    /// report): ExpandVdev grows the vdev no further.
    pub device_capacity: u64,
    /// Kept out of allocation until the claim window ends: its agent could
    /// not name every write of the older generation (`crate::takeover`).
    pub window_out: bool,
}

impl VdevInfo {
    /// Why the registry keeps this vdev unavailable, in an operator's words
    /// (the events that mark it and PlanRebalance's refusal say the same);
    /// None: the registry does not.
    pub fn unavailable_reason(&self) -> Option<String> {
        if self.silent {
            return Some(if self.last_report.is_none() || !self.generation_acked {
                "its agent has not reported to this allocator yet".into()
            } else if self.window_out {
                "its agent cannot name what older generations wrote there: it waits for the \
                 claim window to end"
                    .into()
            } else {
                format!("no report for {} ms", self.last_seen.elapsed().as_millis())
            });
        }
        if !self.stalled {
            return None;
        }
        let last = self.last_report.as_ref();
        Some(if last.is_some_and(|r| r.out_of_space) {
            "its device's file system is full (ENOSPC)".into()
        } else {
            format!(
                "{} I/Os queued at its device, none completing (no write, no read) for {} reports (hung)",
                last.map_or(0, |r| r.queue_depth_ios),
                self.stalled_reports
            )
        })
    }
}

pub struct Inner {
    pub pool: Pool,
    /// Tickets queued in the throttle → the parked request.
    waiters: HashMap<Ticket, oneshot::Sender<()>>,
    /// In-flight allocations → lease deadline.
    inflight: HashMap<AllocationId, Instant>,
    /// When each in-flight allocation was placed: renewals end at
    /// `--max-lease-lifetime` after it.
    born: HashMap<AllocationId, Instant>,
    leases: BinaryHeap<Reverse<(Instant, AllocationId)>>,
    pub vdevs: BTreeMap<VdevId, VdevInfo>,
    pub by_guid: HashMap<u64, VdevId>,
    /// Vdev records to persist with the next txg.
    pub pending_vdevs: Vec<VdevRecord>,
    /// New devices waiting for an operator to admit them, by device guid.
    pub awaiting_admission: BTreeMap<u64, crate::admission::Waiting>,
    /// Administrative state changes to persist with the next txg.
    pub pending_vdev_states: Vec<(VdevId, AdminState)>,
    /// The balancer's moves (Relocate) and plan progress.
    pub relocations: Relocations,
    /// Relocate tickets waiting in the throttle → what they move.
    reloc_tickets: HashMap<Ticket, RelocateIntent>,
    /// Events since the last metrics snapshot.
    pub events: Vec<pb::PoolEvent>,
    /// The server's metrics, for the per-vdev space counters (none in
    /// tests that build the state alone).
    pub rpc: Option<std::sync::Arc<telemetry::rpc_metrics::RpcMetrics>>,
    /// Committed ids → their txg, kept until that txg synced plus
    /// `COMMIT_MEMORY_TXGS` and at least `COMMIT_MEMORY` ago, so a repeated
    /// Commit gets the first answer.
    committed: HashMap<AllocationId, Txg>,
    /// The same ids by txg, so each sync forgets the oldest txgs' ids
    /// without walking the whole memory (a minute of commits).
    committed_by_txg: BTreeMap<Txg, Vec<AllocationId>>,
    /// Txgs synced within `COMMIT_MEMORY`, oldest first, with when.
    recent_syncs: VecDeque<(Txg, Instant)>,
    /// The last txg that synced `COMMIT_MEMORY` ago or more.
    synced_long_ago: Txg,
    /// Ids whose lease expired → when, so a late Commit is told so.
    expired: HashMap<AllocationId, Instant>,
    /// Extents freed in txgs not yet synced → the txg, so a repeated Free
    /// gets the first answer (after the sync, a repeat is a double free).
    pub recent_frees: HashMap<Extent, Txg>,
    /// Extents committed or claimed in txgs not yet persisted → (size,
    /// txg, claimed): the store does not have them yet; Claim's exact check
    /// looks here too, and refuses to take an extent an Allocate of this
    /// generation committed for the lost block of an older one.
    pub recent_allocs: BTreeMap<(VdevId, u64), (u64, Txg, bool)>,
    /// The largest size in `recent_allocs` (at least; exact after each
    /// sync): an entry overlapping an offset starts at most this far below
    /// it, so an overlap lookup reads that window, not the vdev from 0.
    pub recent_alloc_max: u64,
    /// Space committed in this generation (by Allocate+Commit or a move),
    /// freed since or not. A block of an older generation whose txg was lost
    /// may have been written over there: its late Claim must be refused even
    /// when the store holds the new block in exactly the same shape, for the
    /// same client.
    pub gen_committed: crate::gen_space::GenSpace,
    /// Ranges the agents named as written under older generations' tokens
    /// (`crate::takeover`), (vdev, offset) → (end, the allocation id that
    /// wrote it last), for this generation: a claim by another allocation
    /// is refused (`claim::check_allocation`).
    pub older_writers: BTreeMap<(VdevId, u64), (u64, u64)>,
    /// Extents claimed in this generation → the allocation id they were
    /// claimed for (0: unknown): a claim of the same extent for another
    /// allocation is refused, a repeat for the same one is a retry.
    pub gen_claims: HashMap<Extent, u64>,
    /// Bytes of the txg being persisted (dirty until the store has them).
    pub syncing_bytes: u64,
    /// `--txg-dirty-max`: plays `zfs_dirty_data_max` for the busy rule.
    pub dirty_max: u64,
    /// Who owns each committed extent (mutual TLS only).
    pub extent_owners: crate::extent_owners::ExtentOwners,
    /// Allocations whose write tokens must die, per vdev, until the vdev's
    /// next ReportAck carries them to its agent: `(allocation id, expiry of
    /// its newest token, unix ms)`. Only when tokens are signed.
    pub revoked: HashMap<u32, Vec<(AllocationId, u64)>>,
    pub revoke_tokens: bool,
    /// Moved blocks whose old address still answers (`crate::indirect`).
    pub indirect: crate::indirect::IndirectMap,
    /// Mapping changes with their txg, until that txg's record takes them.
    pending_mappings: Vec<(Txg, MappingChange)>,
    /// Blocks of several copies committed, until their txg's record.
    pub pending_copies: crate::block_copies::PendingCopies,
}

/// Txgs after its sync that a committed id is still remembered.
const COMMIT_MEMORY_TXGS: Txg = 4;
/// And how long at least: a client repeats a Commit whose reply it missed
/// (its deadline passed while the store was away) a client timeout and a
/// back-off later, while txgs may sync many a second once the store is
/// back; forgotten by then, the repeat would hear "unknown allocation"
/// for a block that is durable.
const COMMIT_MEMORY: Duration = Duration::from_secs(60);
/// How long an expired lease is remembered (and at most how many).
const EXPIRED_MEMORY: Duration = Duration::from_secs(600);
const EXPIRED_MEMORY_MAX: usize = 1 << 20;

impl Inner {
    pub fn new(pool: Pool) -> Inner {
        Inner {
            pool,
            waiters: HashMap::new(),
            inflight: HashMap::new(),
            born: HashMap::new(),
            leases: BinaryHeap::new(),
            vdevs: BTreeMap::new(),
            by_guid: HashMap::new(),
            pending_vdevs: Vec::new(),
            awaiting_admission: BTreeMap::new(),
            pending_vdev_states: Vec::new(),
            relocations: Relocations::default(),
            rpc: None,
            reloc_tickets: HashMap::new(),
            events: Vec::new(),
            committed: HashMap::new(),
            committed_by_txg: BTreeMap::new(),
            recent_syncs: VecDeque::new(),
            synced_long_ago: 0,
            expired: HashMap::new(),
            recent_frees: HashMap::new(),
            recent_allocs: BTreeMap::new(),
            recent_alloc_max: 0,
            gen_committed: Default::default(),
            older_writers: BTreeMap::new(),
            gen_claims: HashMap::new(),
            syncing_bytes: 0,
            dirty_max: u64::MAX,
            extent_owners: Default::default(),
            revoked: HashMap::new(),
            revoke_tokens: false,
            indirect: Default::default(),
            pending_mappings: Vec::new(),
            pending_copies: Default::default(),
        }
    }

    /// After anything that can release throttle bytes: wake the tickets the
    /// throttle admitted, in FIFO order. A ticket whose request went away is
    /// cancelled (the waiter's guard also cancels; either way it is once).
    pub fn wake_admitted(&mut self) {
        loop {
            let admitted = self.pool.take_admitted();
            if admitted.is_empty() {
                return;
            }
            for t in admitted {
                match self.waiters.remove(&t) {
                    Some(tx) => {
                        if tx.send(()).is_err() {
                            let _ = self.pool.cancel(t);
                        }
                    }
                    // Nobody waits for it any more: give its bytes back.
                    None => {
                        let _ = self.pool.cancel(t);
                    }
                }
            }
        }
    }

    /// Busy for `metaslab_perf_bias`, the answer placement uses and
    /// GetPool reports: OpenZFS's dirty-data rule on the bytes of the open
    /// and syncing txgs against `--txg-dirty-max`.
    pub fn busy(&self) -> bool {
        let dirty = self.pool.dirty_bytes().saturating_add(self.syncing_bytes);
        self.pool.busy_with_dirty(dirty, self.dirty_max)
    }

    /// Place an admitted ticket and start its lease.
    fn place(&mut self, ticket: Ticket, lease: Duration) -> Result<(Allocation, Instant)> {
        let busy = self.busy();
        let reloc = self.reloc_tickets.remove(&ticket);
        if let Some(r) = &reloc
            && let Some(other) = self.relocations.moving(&r.from)
        {
            // Another Relocate of the same extent was placed while this one
            // waited in the throttle.
            let _ = self.pool.cancel(ticket);
            self.wake_admitted();
            return Err(Error::RelocationConflict {
                extent: r.from,
                allocation: other,
            });
        }
        let avoid = reloc.as_ref().map_or(&[][..], |r| r.avoid.as_slice());
        match self.pool.allocate_avoiding(ticket, busy, avoid) {
            Ok(a) => {
                let deadline = Instant::now() + lease;
                self.inflight.insert(a.id, deadline);
                self.born.insert(a.id, Instant::now());
                self.leases.push(Reverse((deadline, a.id)));
                if let Some(r) = &reloc {
                    self.relocations.start(a.id, r, a.extents[0]);
                }
                Ok((a, deadline))
            }
            Err(e) => {
                // The failed allocate released its reservation.
                self.wake_admitted();
                Err(self.no_vdevs_or(e))
            }
        }
    }

    /// A pool with no vdev at all is not "full": say what it lacks; a full
    /// one says how much is free and how much of that is slop.
    fn no_vdevs_or(&self, e: metaslab::Error) -> Error {
        if let metaslab::Error::NoSpace {
            size,
            copies,
            reason,
        } = e
        {
            let st = self.pool.stats();
            if st.vdevs.is_empty() {
                return Error::NoVdevs;
            }
            if reason == metaslab::NoSpaceReason::Full
                && let Some(c) = st
                    .classes
                    .iter()
                    .find(|c| c.kind == metaslab::ClassKind::Normal)
            {
                return Error::PoolFull {
                    size,
                    copies,
                    space: c.space,
                    alloc: c.alloc,
                    slop: st.slop,
                    deferred: c.deferred,
                };
            }
        }
        e.into()
    }

    pub fn endpoints(&self, a: &Allocation) -> Vec<String> {
        a.extents
            .iter()
            .map(|e| {
                self.vdevs
                    .get(&e.vdev)
                    .map(|v| v.endpoint.clone())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Commit in-flight allocations, all or nothing; returns the txg that
    /// makes them durable. Ids committed already (a retry) answer their
    /// first txg; ids whose lease expired fail with LeaseExpired.
    pub fn commit(&mut self, ids: &[AllocationId]) -> Result<Txg> {
        self.commit_as(ids, None)
    }

    /// Commit, recording `owner` (the committing identity) as the owner of
    /// the extents; a relocation's new extent keeps its source's owner.
    /// Per-vdev counters of `extents` committed or freed.
    fn count_space(&self, extents: &[Extent], freed: bool) {
        let Some(rpc) = &self.rpc else { return };
        let mut per: BTreeMap<VdevId, (u64, u64)> = BTreeMap::new();
        for e in extents {
            let x = per.entry(e.vdev).or_default();
            x.0 += e.size;
            x.1 += 1;
        }
        for (v, (bytes, n)) in per {
            let name = self.vdevs.get(&v).map_or("", |i| i.name.as_str());
            rpc.vdev_space(v, name, bytes, n, freed);
        }
    }

    pub fn commit_as(&mut self, ids: &[AllocationId], owner: Option<&str>) -> Result<Txg> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("no allocation ids given".into()));
        }
        let mut txg = 0;
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(Error::InvalidArgument(format!(
                    "allocation {id} is listed twice"
                )));
            }
            if let Some(&t) = self.committed.get(id) {
                txg = txg.max(t);
            } else if !self.inflight.contains_key(id) {
                return Err(self.not_inflight(*id));
            }
        }
        let open = self.pool.open_txg();
        // A relocation's commit frees its source in the same (open) txg:
        // first, so that if the source cannot be freed nothing changes.
        let all_sources: Vec<(AllocationId, Extent, bool)> = ids
            .iter()
            .filter(|id| !self.committed.contains_key(id))
            .filter_map(|id| self.relocations.source(*id).map(|(e, k)| (*id, e, k)))
            .collect();
        // A move that keeps its old address leaves the source allocated
        // (the mapping entry holds it); the others free it. A move of a
        // moved block's new home (a removal of the vdev it was moved to)
        // points the block's entry at the newest home and frees the one it
        // leaves: the old address stays one hop from the data.
        let mut kept: HashMap<AllocationId, Mapping> = HashMap::new();
        let mut rehomed: HashMap<AllocationId, Extent> = HashMap::new();
        for &(id, from, keep) in &all_sources {
            if !keep {
                continue;
            }
            let to = self.pool.extents_of(id)?[0];
            if to.size != from.size {
                return Err(Error::InvalidArgument(format!(
                    "move of {from} to {to}: a move that keeps its address needs a new \
                     extent of the same size"
                )));
            }
            if self.indirect.get(&from).is_some() {
                return Err(Error::MappedExtent(from));
            }
            let old = self.indirect.source_of(&from);
            let m = Mapping {
                from: old.unwrap_or(from),
                to,
                txg: open,
            };
            crate::indirect::IndirectMap::check(&m)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            if old.is_some() {
                rehomed.insert(id, from);
            }
            kept.insert(id, m);
        }
        let sources: Vec<(AllocationId, Extent)> = all_sources
            .iter()
            .filter(|&&(id, _, keep)| !keep || rehomed.contains_key(&id))
            .map(|&(id, e, _)| (id, e))
            .collect();
        if !sources.is_empty() {
            let extents: Vec<Extent> = sources.iter().map(|(_, e)| *e).collect();
            let t = self.pool.free(&extents)?;
            self.count_space(&extents, true);
            for e in extents {
                self.recent_frees.insert(e, t);
            }
        }
        let moved: HashMap<AllocationId, Extent> = sources.iter().copied().collect();
        let mut fresh = false;
        for id in ids {
            if self.committed.contains_key(id) {
                continue;
            }
            let extents = self.pool.extents_of(*id)?;
            let t = self.pool.commit(*id)?;
            self.count_space(&extents, false);
            if let Some(m) = kept.get(id) {
                let m = Mapping { txg: t, ..*m };
                if rehomed.contains_key(id) && self.indirect.remove(&m.from).is_some() {
                    self.pending_mappings.push((t, MappingChange::Drop(m.from)));
                }
                // Checked above; the new extent was just placed, so it is
                // no other entry's target.
                if let Err(e) = self.indirect.insert(m) {
                    tracing::error!(error = %e, "mapping entry not recorded");
                } else {
                    self.pending_mappings.push((t, MappingChange::Add(m)));
                }
                if !rehomed.contains_key(id) {
                    self.extent_owners.copied(&m.from, &extents);
                }
            }
            if !moved.contains_key(id) && !kept.contains_key(id) {
                self.pending_copies.committed(t, *id, &extents);
            }
            match (moved.get(id), owner) {
                (Some(from), _) => self.extent_owners.moved(from, &extents),
                (None, _) if kept.contains_key(id) => {}
                (None, Some(o)) => self.extent_owners.committed(o, &extents),
                (None, None) => {}
            }
            txg = txg.max(t);
            fresh = true;
            self.born.remove(id);
            if let Some(d) = self.inflight.remove(id) {
                self.revoke(*id, &extents, d);
            }
            self.committed.insert(*id, t);
            self.committed_by_txg.entry(t).or_default().push(*id);
            self.relocations.committed(*id, t);
            self.gen_committed.committed(&extents);
            for e in extents {
                self.recent_allocs
                    .insert((e.vdev, e.offset), (e.size, t, false));
                self.recent_alloc_max = self.recent_alloc_max.max(e.size);
            }
        }
        if fresh {
            self.wake_admitted();
        }
        Ok(if txg == 0 { open } else { txg })
    }

    /// The allocation is over (committed, aborted or expired): its tokens
    /// must not write again; the agents of its vdevs are told.
    fn revoke(&mut self, id: AllocationId, extents: &[Extent], deadline: Instant) {
        if !self.revoke_tokens {
            return;
        }
        let expires_ms = crate::convert::deadline_unix_ms(deadline);
        for e in extents {
            let q = self.revoked.entry(e.vdev).or_default();
            if q.last().map(|l| l.0) != Some(id) {
                q.push((id, expires_ms));
            }
            // An agent that stopped reporting is re-fenced by its restart
            // (it then honours no older token at all): keep the queue bounded.
            if q.len() > REVOKED_QUEUE_MAX {
                q.drain(..q.len() - REVOKED_QUEUE_MAX);
            }
        }
    }

    /// What to tell `vdev`'s agent in its next ReportAck.
    pub fn take_revoked(&mut self, vdev: u32) -> Vec<(AllocationId, u64)> {
        self.revoked.remove(&vdev).unwrap_or_default()
    }

    /// Allocated and neither committed, aborted nor expired.
    pub fn is_inflight(&self, id: AllocationId) -> bool {
        self.inflight.contains_key(&id)
    }

    /// Why `id` is not in flight: committed, expired, or never seen.
    fn not_inflight(&self, id: AllocationId) -> Error {
        if self.expired.contains_key(&id) {
            Error::LeaseExpired(id)
        } else {
            metaslab::Error::UnknownAllocation(id).into()
        }
    }

    /// Extend the leases of in-flight allocations, all or nothing; returns
    /// the new deadline. Committed ids are left as they are (nothing to
    /// renew), expired ones fail.
    /// Renew the leases of `ids` by `lease`, but never past `lifetime`
    /// after an allocation was placed (renewals without
    /// end let one client hold space for ever). Returns the earliest new
    /// deadline (what the tokens carry).
    pub fn renew(
        &mut self,
        ids: &[AllocationId],
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Instant> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("no allocation ids given".into()));
        }
        let now = Instant::now();
        for id in ids {
            if !self.inflight.contains_key(id) && !self.committed.contains_key(id) {
                return Err(self.not_inflight(*id));
            }
            if let Some(born) = self.born.get(id)
                && now >= *born + lifetime
            {
                return Err(Error::LeaseLifetime {
                    id: *id,
                    lifetime_ms: lifetime.as_millis() as u64,
                });
            }
        }
        let mut earliest = now + lease;
        for id in ids {
            let end = self
                .born
                .get(id)
                .map_or(now + lease, |b| (*b + lifetime).min(now + lease));
            if let Some(d) = self.inflight.get_mut(id) {
                *d = end;
                self.leases.push(Reverse((end, *id)));
                earliest = earliest.min(end);
            }
        }
        Ok(earliest)
    }

    /// The mapping changes of txgs up to `txg`, for its record.
    pub fn take_mappings(&mut self, txg: Txg) -> Vec<MappingChange> {
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending_mappings)
            .into_iter()
            .partition(|(t, _)| *t <= txg);
        self.pending_mappings = later;
        now.into_iter().map(|(_, c)| c).collect()
    }

    /// Refuse to move a moved block's old address, or its new home unless
    /// the move keeps the address (the commit then repoints the entry).
    pub fn check_movable(&self, e: &Extent, keep_address: bool) -> Result<()> {
        if self.indirect.get(e).is_some() || (!keep_address && self.indirect.is_target(e)) {
            return Err(Error::MappedExtent(*e));
        }
        Ok(())
    }

    /// What a Free of `extents` frees: each moved block's old extent also
    /// frees its new one (or, freed at its new home, its held old one),
    /// with the entries dropped. Returns the extents to free and the old
    /// extents whose entries go.
    pub fn resolve_free(&self, extents: &[Extent]) -> (Vec<Extent>, Vec<Extent>) {
        let mut out = Vec::with_capacity(extents.len());
        let mut dropped = Vec::new();
        for e in extents {
            out.push(*e);
            if let Some(to) = self.indirect.get(e) {
                out.push(to);
                dropped.push(*e);
            } else if let Some(from) = self.indirect.source_of(e) {
                out.push(from);
                dropped.push(from);
            }
        }
        (out, dropped)
    }

    /// Free what [`Self::resolve_free`] resolved `asked` to, if the mapping
    /// has not changed since; the entries are dropped in the same txg.
    pub fn free_resolved(
        &mut self,
        asked: &[Extent],
        resolved: &(Vec<Extent>, Vec<Extent>),
    ) -> Result<Txg> {
        if self.resolve_free(asked) != *resolved {
            return Err(Error::InvalidArgument(
                "the blocks were moved or remapped during this Free: send it again".into(),
            ));
        }
        let txg = self.free(&resolved.0)?;
        self.drop_mappings(&resolved.1, txg);
        Ok(txg)
    }

    fn drop_mappings(&mut self, from: &[Extent], txg: Txg) {
        for e in from {
            if self.indirect.remove(e).is_some() {
                self.pending_mappings.push((txg, MappingChange::Drop(*e)));
            }
        }
    }

    /// Remap: drop the entries of old extents `from` (each mapped), freeing
    /// them; returns their new extents and the txg.
    pub fn remap(&mut self, from: &[Extent]) -> Result<(Vec<Extent>, Txg)> {
        let mut to = Vec::with_capacity(from.len());
        for (i, e) in from.iter().enumerate() {
            if from[..i].contains(e) {
                return Err(Error::InvalidArgument(format!(
                    "extent {e} is listed twice"
                )));
            }
            to.push(self.indirect.get(e).ok_or(Error::NotMapped(*e))?);
        }
        let txg = self.free(from)?;
        self.drop_mappings(from, txg);
        Ok((to, txg))
    }

    /// Free committed extents; a retry of a Free whose txg has not synced
    /// answers that txg.
    pub fn free(&mut self, extents: &[Extent]) -> Result<Txg> {
        for e in extents {
            if let Some(allocation) = self.relocations.moving(e) {
                return Err(Error::RelocationConflict {
                    extent: *e,
                    allocation,
                });
            }
        }
        match self.pool.free(extents) {
            Ok(txg) => {
                self.count_space(extents, true);
                self.extent_owners.freed(extents);
                self.pending_copies.freed(extents);
                for e in extents {
                    self.recent_frees.insert(*e, txg);
                }
                Ok(txg)
            }
            Err(err @ (metaslab::Error::NotAllocated(_) | metaslab::Error::PartlyAllocated(_))) => {
                let again: Option<Txg> = extents
                    .iter()
                    .map(|e| self.recent_frees.get(e).copied())
                    .try_fold(0, |m, t| t.map(|t| m.max(t)));
                again.ok_or(err.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Claim extents (after `claim::check_exact`); remembered until their
    /// txg is persisted.
    /// With an identity, the claimant becomes the owner of what had none
    /// (free space claimed, or a block committed without identities).
    pub fn claim(&mut self, extents: &[Extent], claimant: Option<&str>) -> Result<Txg> {
        let txg = self.pool.claim(extents)?;
        if let Some(c) = claimant {
            let unowned: Vec<Extent> = extents
                .iter()
                .filter(|e| self.extent_owners.unowned(e))
                .copied()
                .collect();
            self.extent_owners.committed(c, &unowned);
        }
        for e in extents {
            self.recent_allocs
                .insert((e.vdev, e.offset), (e.size, txg, true));
            self.recent_alloc_max = self.recent_alloc_max.max(e.size);
        }
        Ok(txg)
    }

    /// Claim one extent that passed `claim::check_each`, for allocation
    /// `allocation_id` (0: unknown) of a client that saw generation
    /// `previous` at the latest: refused when the allocation may not claim
    /// it (`claim::check_allocation`), when anything committed in this
    /// generation overlaps it (its bytes were given out again after its txg
    /// was lost), or when it is exactly an extent another identity owns (a
    /// claim says "this block is mine", not an override: admins too).
    pub fn claim_one(
        &mut self,
        e: Extent,
        claimant: Option<&str>,
        allocation_id: u64,
        previous: u64,
    ) -> Result<Txg> {
        crate::claim::check_allocation(self, previous, &e, allocation_id)?;
        if let Some(committed) = self.gen_committed.overlapping(&e) {
            return Err(Error::ClaimOverwritten {
                requested: e,
                committed,
            });
        }
        if let Some(c) = claimant
            && let Some((extent, _)) = self.extent_owners.foreign(c, &[e])
        {
            return Err(Error::ClaimGivenOut(extent));
        }
        let txg = self.claim(&[e], claimant)?;
        self.gen_claims.entry(e).or_insert(allocation_id);
        Ok(txg)
    }

    /// After txg `synced` persisted: forget what retries no longer need.
    pub fn synced(&mut self, synced: Txg, now: Instant) {
        self.relocations.persisted(synced);
        self.recent_syncs.push_back((synced, now));
        while let Some(&(t, at)) = self.recent_syncs.front() {
            if now.duration_since(at) < COMMIT_MEMORY {
                break;
            }
            self.synced_long_ago = self.synced_long_ago.max(t);
            self.recent_syncs.pop_front();
        }
        // Forgotten: txgs `COMMIT_MEMORY_TXGS` behind this sync that also
        // synced `COMMIT_MEMORY` ago.
        let forget_to = synced
            .checked_sub(COMMIT_MEMORY_TXGS)
            .map(|t| t.min(self.synced_long_ago));
        while let Some(e) = self.committed_by_txg.first_entry() {
            if forget_to.is_none_or(|to| *e.key() > to) {
                break;
            }
            for id in e.remove() {
                self.committed.remove(&id);
            }
        }
        self.recent_frees.retain(|_, t| *t > synced);
        self.recent_allocs.retain(|_, (_, t, _)| *t > synced);
        self.recent_alloc_max = self.recent_allocs.values().map(|v| v.0).max().unwrap_or(0);
        if self.expired.len() > EXPIRED_MEMORY_MAX {
            self.expired.clear();
        }
        self.expired
            .retain(|_, at| now.duration_since(*at) < EXPIRED_MEMORY);
    }

    pub fn abort(&mut self, ids: &[AllocationId]) -> Result<()> {
        self.check_inflight(ids)?;
        for id in ids {
            let extents = self.pool.extents_of(*id)?;
            self.pool.abort(*id)?;
            self.born.remove(id);
            if let Some(d) = self.inflight.remove(id) {
                self.revoke(*id, &extents, d);
            }
            self.relocations.forget(*id);
        }
        self.wake_admitted();
        Ok(())
    }

    /// Every copy of `ids` is written: end their throttle reservations
    /// and queue depth now (the space stays in flight until commit, abort
    /// or expiry) and admit whom that lets in. All or nothing; committed
    /// ids, and ids reported before, are a no-op.
    pub fn written(&mut self, ids: &[AllocationId]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("no allocation ids given".into()));
        }
        for id in ids {
            if !self.inflight.contains_key(id) && !self.committed.contains_key(id) {
                return Err(self.not_inflight(*id));
            }
        }
        for id in ids {
            if self.inflight.contains_key(id) {
                self.pool.written(*id)?;
            }
        }
        self.wake_admitted();
        Ok(())
    }

    fn check_inflight(&self, ids: &[AllocationId]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("no allocation ids given".into()));
        }
        for (i, id) in ids.iter().enumerate() {
            if !self.inflight.contains_key(id) {
                return Err(self.not_inflight(*id));
            }
            if ids[..i].contains(id) {
                return Err(Error::InvalidArgument(format!(
                    "allocation {id} is listed twice"
                )));
            }
        }
        Ok(())
    }

    /// Abort the allocations whose lease ended by `now`; returns them.
    /// Their space is deferred like a free (`Pool::expire`): a late writer
    /// cannot land on a block that another client was given meanwhile.
    pub fn expire_leases(&mut self, now: Instant) -> Vec<AllocationId> {
        let mut expired = Vec::new();
        while let Some(Reverse((deadline, id))) = self.leases.peek().copied() {
            if deadline > now {
                break;
            }
            self.leases.pop();
            // Stale heap entries (committed or aborted since) are skipped.
            if self.inflight.get(&id) == Some(&deadline) {
                self.inflight.remove(&id);
                self.born.remove(&id);
                self.relocations.forget(id);
                if let Ok(extents) = self.pool.extents_of(id) {
                    self.revoke(id, &extents, deadline);
                }
                if self.pool.expire(id).is_ok() {
                    self.expired.insert(id, now);
                    expired.push(id);
                }
            }
        }
        if !expired.is_empty() {
            self.wake_admitted();
        }
        expired
    }

    pub fn inflight_count(&self) -> usize {
        self.inflight.len()
    }

    /// Shutting down: every parked request is told so (its sender drops).
    pub fn drop_waiters(&mut self) {
        self.waiters.clear();
    }

    pub fn event(&mut self, kind: &str, vdev: VdevId, detail: String) {
        self.events.push(pb::PoolEvent {
            time_ms: crate::convert::unix_ms() as i64,
            kind: kind.to_string(),
            vdev,
            detail,
        });
        // Bounded: without a metrics sink nobody drains them.
        if self.events.len() > 1024 {
            self.events.drain(..512);
        }
    }
}

/// Service settings that are not policy (the tunables the service owns).
pub struct ServiceSettings {
    pub pool_name: String,
    pub default_lease: Duration,
    pub report_interval: Duration,
    /// `zfs_txg_timeout`, in microseconds (settable at run time).
    pub txg_timeout_us: AtomicU64,
    /// The open txg closes early once it changed this many bytes.
    pub txg_dirty_max: u64,
    /// The longest lease an Allocate or RenewLease may ask for.
    pub max_lease: Duration,
    /// The longest an allocation may stay in flight, renewals included.
    pub max_lease_lifetime: Duration,
    /// Bytes one client identity may hold in flight (0: no limit).
    pub max_leased_per_client: u64,
    /// Signs a write token per extent of each allocation (None: no tokens).
    pub token_signer: Option<aliquot_auth::TokenSigner>,
}

/// This start of the allocator, as fencing sees it.
#[derive(Clone, Debug)]
pub struct Fencing {
    /// Bumped in the store at every start.
    pub generation: u64,
    /// The last synced txg when this generation opened: txgs above it that a
    /// client saw in an older generation never synced.
    pub synced_at_open: Txg,
    /// After a restart, Allocate waits until then (Claim is served).
    pub claim_window_until: Option<Instant>,
    /// Generation -> synced txg when it opened (`Store::generation_history`):
    /// generation G's last synced txg is the entry of G + 1.
    pub history: BTreeMap<u64, Txg>,
    /// Labels written before this generation are not held against the
    /// store (an operator accepted a rollback with `--rewind-to`).
    pub rewind_generation: u64,
}

impl Fencing {
    /// The last txg generation `seen` synced: exact when the store recorded
    /// the next generation's open; else (generations from before the
    /// history) the synced txg when this generation opened.
    pub fn synced_by(&self, seen: u64) -> Txg {
        self.history
            .get(&(seen + 1))
            .copied()
            .unwrap_or(self.synced_at_open)
    }
}

pub struct Shared {
    inner: Mutex<Inner>,
    pub settings: ServiceSettings,
    pub pool_guid: u64,
    pub fencing: Fencing,
    pub store: Arc<dyn Store>,
    /// The last txg whose sync was persisted.
    pub synced: watch::Sender<Txg>,
    /// The highest txg somebody waits for; the txg clock syncs up to it.
    pub wanted: watch::Sender<Txg>,
    pub shutting_down: AtomicBool,
    /// Wakes the txg clock when `zfs_txg_timeout` changed.
    pub txg_timeout_changed: tokio::sync::Notify,
    /// Wakes the claims that wait for a vdev's first report of this
    /// generation (`VdevInfo::generation_acked`), when one arrives or a vdev
    /// is forgotten.
    pub vdev_acked: tokio::sync::Notify,
    /// Turns true when shutdown starts: streams end, the txg clock does
    /// its last sync.
    pub stop: watch::Sender<bool>,
    /// Turns true after the last sync: nothing more will become durable.
    pub closed: watch::Sender<bool>,
    /// Who made each in-flight allocation (mutual TLS only).
    pub owners: crate::ownership::Owners,
    /// Vdevs whose agent holds its MAC token key of this generation
    /// (handed over in its RegisterReply): their tokens are MACs, the
    /// others' Ed25519 signatures.
    pub mac_keys: std::sync::RwLock<HashMap<u32, aliquot_auth::VdevKey>>,
    /// Set when a device's label proved the store older than the pool:
    /// from then on nothing is served (see `refuse_rolled_back`).
    rolled_back: Mutex<Option<RolledBack>>,
    /// The last synced txg and the store's state digest at it, as one pair
    /// (what ReportAck tells the agents to write to their labels).
    pub synced_state: Mutex<(Txg, u64)>,
    /// One gate for a txg's persist and a device's label check: a txg in
    /// flight when a label proves the store old is either counted by the
    /// check or never lands, and none closes after the refusal.
    pub sync_gate: tokio::sync::Mutex<()>,
    /// Whether a device's label has vouched for the store (passed the label
    /// check) in this generation. A restarted pool syncs no txg before:
    /// txgs synced while no device could object would move a store restored
    /// from an older copy past the labels' txg (`lib.rs` sets it for a new
    /// pool).
    pub labels_vouched: watch::Sender<bool>,
    /// Leadership among allocators sharing a store (`--store postgres://`);
    /// `None` for a store with one writer by construction (SQLite).
    pub lease: std::sync::OnceLock<Arc<crate::leadership::Lease>>,
    /// Set while the store refuses a txg (GetPool, health, metrics).
    pub persist_failure: watch::Sender<Option<crate::txg::PersistFailure>>,
    /// The allocator's own mover (vdev removal).
    pub mover: crate::mover::Mover,
}

/// What proved the store older than the pool.
#[derive(Clone, Debug)]
pub struct RolledBack {
    pub vdev: u32,
    pub label_txg: Txg,
    pub store_txg: Txg,
    pub message: String,
}

impl RolledBack {
    fn error(&self) -> Error {
        Error::StoreRolledBack {
            vdev: self.vdev,
            label_txg: self.label_txg,
            store_txg: self.store_txg,
            message: self.message.clone(),
        }
    }
}

/// How a `begin_allocate` ended.
pub enum Begun {
    Placed(Allocation, Vec<String>, Instant),
    Queued(Ticket, oneshot::Receiver<()>),
}

impl Shared {
    pub fn new(
        mut pool: Pool,
        settings: ServiceSettings,
        pool_guid: u64,
        fencing: Fencing,
        store: Arc<dyn Store>,
        synced_txg: Txg,
    ) -> Arc<Shared> {
        // Each generation numbers its allocations in its own range, so an id
        // from before a restart never names a newer allocation.
        pool.start_allocation_ids_at((fencing.generation << 40) | 1);
        // spa_alloc_count from this machine's CPUs (OpenZFS: at import).
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let allocators = pool.set_cpus(cpus);
        tracing::debug!(cpus, allocators, "spa_alloc_count");
        let mut inner = Inner::new(pool);
        inner.dirty_max = settings.txg_dirty_max;
        Arc::new(Shared {
            inner: Mutex::new(inner),
            settings,
            pool_guid,
            fencing,
            store,
            synced: watch::Sender::new(synced_txg),
            wanted: watch::Sender::new(synced_txg),
            shutting_down: AtomicBool::new(false),
            txg_timeout_changed: tokio::sync::Notify::new(),
            vdev_acked: tokio::sync::Notify::new(),
            stop: watch::Sender::new(false),
            closed: watch::Sender::new(false),
            owners: Default::default(),
            mac_keys: Default::default(),
            rolled_back: Mutex::new(None),
            synced_state: Mutex::new((synced_txg, 0)),
            sync_gate: tokio::sync::Mutex::new(()),
            labels_vouched: watch::Sender::new(false),
            lease: std::sync::OnceLock::new(),
            persist_failure: watch::Sender::new(None),
            mover: Default::default(),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in the policy; keep
        // serving what state there is rather than poisoning every RPC.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Past the dirty bound, ask the txg clock to close the open txg now
    /// (without waiting for it). Called after commits, frees and claims.
    pub fn kick_if_dirty(&self, g: &Inner) {
        if g.pool.dirty_bytes() >= self.settings.txg_dirty_max {
            let open = g.pool.open_txg();
            self.wanted.send_if_modified(|w| {
                if *w < open {
                    *w = open;
                    true
                } else {
                    false
                }
            });
        }
    }

    /// Time left in the claim window (zero once it closed).
    pub fn claim_window_remaining(&self) -> Duration {
        self.fencing.claim_window_until.map_or(Duration::ZERO, |u| {
            u.saturating_duration_since(Instant::now())
        })
    }

    /// Nothing committed, claimed or freed waits for a txg to persist
    /// (after the last sync of a shutdown: whether it landed).
    pub fn nothing_unsynced(&self) -> bool {
        let g = self.lock();
        g.recent_allocs.is_empty() && g.recent_frees.is_empty() && g.pool.dirty_bytes() == 0
    }

    /// During the claim window, while no vdev serves yet (their agents
    /// have not reported in this generation, or are kept out for the
    /// window): an Allocate would only fail.
    pub fn waits_for_a_vdev(&self) -> bool {
        !self.claim_window_remaining().is_zero()
            && !self
                .lock()
                .vdevs
                .values()
                .any(|v| !v.silent && !v.window_out)
    }

    /// Right after a takeover, wait until a vdev serves or the claim window
    /// ends (new allocations do not wait for the window itself: what a
    /// claim may still take is held, `crate::takeover`).
    pub async fn nothing_serves_yet(&self) -> Result<()> {
        while self.waits_for_a_vdev() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                _ = self.stopping() => return Err(Error::ShuttingDown),
            }
        }
        // The window may have closed a moment before housekeeping noticed:
        // let the vdevs kept out for it serve before this placement.
        crate::takeover::check_window(self, Instant::now());
        Ok(())
    }

    /// A txg a client saw in generation `seen`: refuse it if it belongs to
    /// an older generation and never synced there. `seen` is required: with
    /// 0 ("whatever generation this is") a txg lost in a restart and reused
    /// by the new generation would be reported synced to a client that never
    /// had it durable.
    pub fn check_generation(&self, seen: u64, txg: Txg) -> Result<()> {
        let current = self.fencing.generation;
        if seen == 0 {
            return Err(Error::InvalidArgument(format!(
                "generation is required: pass the generation of the reply that named the \
                 allocation or txg (this allocator is at generation {current}; GetPool tells it)"
            )));
        }
        if seen == current {
            return Ok(());
        }
        if seen > current {
            return Err(Error::GenerationAhead { seen, current });
        }
        // Not the current generation's synced txg at open: after two
        // restarts it may cover a txg number the newer generation reused.
        let synced = self.fencing.synced_by(seen);
        if txg == 0 || txg > synced {
            return Err(Error::AllocatorRestarted {
                seen,
                current,
                txg,
                synced,
                window_ms: self.claim_window_remaining().as_millis() as u64,
            });
        }
        Ok(())
    }

    /// A requested lease (0: the default), bounded by `--max-lease`.
    pub fn lease(&self, lease_ms: u32) -> Result<Duration> {
        if lease_ms == 0 {
            return Ok(self.settings.default_lease);
        }
        let d = Duration::from_millis(lease_ms as u64);
        if d > self.settings.max_lease {
            return Err(Error::InvalidArgument(format!(
                "lease_ms {lease_ms} is above the allocator's --max-lease of {} ms; ask for less \
                 and renew it with RenewLease",
                self.settings.max_lease.as_millis()
            )));
        }
        Ok(d)
    }

    pub fn txg_timeout(&self) -> Duration {
        Duration::from_micros(self.settings.txg_timeout_us.load(Ordering::Relaxed))
    }

    /// Refuse (NOT_LEADER) unless this allocator leads under a live lease;
    /// the calls that still answer while the store is refused (GetPool,
    /// Report) check only this.
    pub fn check_lease(&self) -> Result<()> {
        if let Some(l) = self.lease.get() {
            l.check()?;
        }
        Ok(())
    }

    /// Resolves, with the refusal to send, once the lease ran out or was
    /// taken (never for a store with one writer): streams end with it, so
    /// agents and watchers move to whoever leads instead of waiting on an
    /// allocator that no longer does.
    pub async fn lease_lost(&self) -> Error {
        let Some(l) = self.lease.get() else {
            return std::future::pending().await;
        };
        loop {
            if let Err(e) = l.check() {
                return e;
            }
            tokio::select! {
                _ = tokio::time::sleep(l.left() + Duration::from_millis(10)) => {}
                _ = l.deposed() => {}
            }
        }
    }

    pub fn check_serving(&self) -> Result<()> {
        if let Some(l) = self.lease.get() {
            l.check()?;
        }
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        if let Some(r) = self
            .rolled_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(r.error());
        }
        Ok(())
    }

    /// Has a device's label proved the store older than the pool?
    pub fn is_rolled_back(&self) -> bool {
        self.rolled_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// The store is older than a device's label: serve nothing more (no
    /// Allocate, Claim, Commit, Free, SyncTxg, Register) until an operator
    /// restores the store or accepts the loss (`--rewind-to`). The first
    /// proof is kept; it is what the operator is told.
    pub fn refuse_rolled_back(&self, r: RolledBack) -> Error {
        let mut g = self.rolled_back.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::error!(
                vdev = r.vdev,
                label_txg = r.label_txg,
                store_txg = r.store_txg,
                "{}",
                r.message
            );
        }
        g.get_or_insert(r).error()
    }

    /// Submit a request; place it at once when the throttle admits it,
    /// otherwise park it (FIFO) and return the receiver to wait on.
    pub fn begin_allocate(&self, req: AllocRequest, lease: Duration) -> Result<Begun> {
        let mut g = self.lock();
        // Checked under the lock: shutdown drops the waiters under it too.
        self.check_serving()?;
        let submitted = g.pool.submit(req).map_err(|e| g.no_vdevs_or(e))?;
        match submitted {
            Submitted::Ready(t) => {
                let (a, deadline) = g.place(t, lease)?;
                let eps = g.endpoints(&a);
                Ok(Begun::Placed(a, eps, deadline))
            }
            Submitted::Queued(t) => {
                let (tx, rx) = oneshot::channel();
                g.waiters.insert(t, tx);
                // It may have been admitted between submit and now by no
                // one else (we hold the lock), but a submit can itself move
                // the FIFO: wake whatever it admitted.
                g.wake_admitted();
                Ok(Begun::Queued(t, rx))
            }
        }
    }

    /// `begin_allocate` for a Relocate: the placement avoids `intent.avoid`
    /// and the allocation is tracked as the move of `intent.from`.
    pub fn begin_relocate(
        &self,
        req: AllocRequest,
        lease: Duration,
        intent: RelocateIntent,
    ) -> Result<Begun> {
        let mut g = self.lock();
        self.check_serving()?;
        if let Some(allocation) = g.relocations.moving(&intent.from) {
            return Err(Error::RelocationConflict {
                extent: intent.from,
                allocation,
            });
        }
        if g.recent_frees.contains_key(&intent.from) {
            return Err(metaslab::Error::NotAllocated(intent.from).into());
        }
        match g.pool.submit(req)? {
            Submitted::Ready(t) => {
                g.reloc_tickets.insert(t, intent);
                let (a, deadline) = g.place(t, lease)?;
                let eps = g.endpoints(&a);
                Ok(Begun::Placed(a, eps, deadline))
            }
            Submitted::Queued(t) => {
                g.reloc_tickets.insert(t, intent);
                let (tx, rx) = oneshot::channel();
                g.waiters.insert(t, tx);
                g.wake_admitted();
                Ok(Begun::Queued(t, rx))
            }
        }
    }

    /// Relocate: like `allocate` (throttle), for a move.
    pub async fn relocate(
        self: &Arc<Self>,
        req: AllocRequest,
        lease: Duration,
        intent: RelocateIntent,
    ) -> Result<(Allocation, Vec<String>, Instant, Duration)> {
        let start = Instant::now();
        self.nothing_serves_yet().await?;
        match self.begin_relocate(req, lease, intent)? {
            Begun::Placed(a, eps, deadline) => Ok((a, eps, deadline, start.elapsed())),
            Begun::Queued(t, rx) => {
                let (a, eps, deadline) = self.finish_allocate(t, rx, lease).await?;
                Ok((a, eps, deadline, start.elapsed()))
            }
        }
    }

    /// Wait for a parked ticket's admission, then place it. Dropping the
    /// future (client gone) cancels the ticket.
    pub async fn finish_allocate(
        self: &Arc<Self>,
        ticket: Ticket,
        rx: oneshot::Receiver<()>,
        lease: Duration,
    ) -> Result<(Allocation, Vec<String>, Instant)> {
        let mut guard = CancelOnDrop {
            shared: self,
            ticket,
            armed: true,
        };
        let woke = rx.await;
        guard.armed = false;
        if woke.is_err() {
            // The sender went away: shutdown.
            let mut g = self.lock();
            g.reloc_tickets.remove(&ticket);
            let _ = g.pool.cancel(ticket);
            g.wake_admitted();
            return Err(Error::ShuttingDown);
        }
        self.check_serving().inspect_err(|_| {
            let mut g = self.lock();
            g.reloc_tickets.remove(&ticket);
            let _ = g.pool.cancel(ticket);
            g.wake_admitted();
        })?;
        let mut g = self.lock();
        let (a, deadline) = g.place(ticket, lease)?;
        let eps = g.endpoints(&a);
        Ok((a, eps, deadline))
    }

    /// Allocate, waiting in the throttle if need be (and, right after a
    /// takeover, for a vdev to serve); returns the allocation, its endpoints, its lease deadline and the
    /// time waited.
    pub async fn allocate(
        self: &Arc<Self>,
        req: AllocRequest,
        lease: Duration,
    ) -> Result<(Allocation, Vec<String>, Instant, Duration)> {
        let start = Instant::now();
        self.nothing_serves_yet().await?;
        match self.begin_allocate(req, lease)? {
            Begun::Placed(a, eps, deadline) => Ok((a, eps, deadline, start.elapsed())),
            Begun::Queued(t, rx) => {
                let (a, eps, deadline) = self.finish_allocate(t, rx, lease).await?;
                Ok((a, eps, deadline, start.elapsed()))
            }
        }
    }

    /// Ask the txg clock to sync up to `txg` and wait until it is persisted.
    pub async fn wait_synced(&self, txg: Txg) -> Result<Txg> {
        let mut rx = self.synced.subscribe();
        if *rx.borrow() >= txg {
            return Ok(*rx.borrow());
        }
        self.wanted.send_if_modified(|w| {
            if *w < txg {
                *w = txg;
                true
            } else {
                false
            }
        });
        let mut closed = self.closed.subscribe();
        tokio::select! {
            r = rx.wait_for(|s| *s >= txg) => match r {
                Ok(s) => Ok(*s),
                Err(_) => Err(Error::ShuttingDown),
            },
            _ = closed.wait_for(|c| *c) => {
                // The last sync is done; it may have covered `txg`.
                let s = *self.synced.borrow();
                if s >= txg { Ok(s) } else { Err(Error::ShuttingDown) }
            }
        }
    }

    /// Resolves when shutdown starts.
    pub async fn stopping(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    pub fn synced_txg(&self) -> Txg {
        *self.synced.borrow()
    }
}

/// Cancels a parked ticket when the waiting request is dropped.
struct CancelOnDrop<'a> {
    shared: &'a Shared,
    ticket: Ticket,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut g = self.shared.lock();
            g.waiters.remove(&self.ticket);
            g.reloc_tickets.remove(&self.ticket);
            let _ = g.pool.cancel(self.ticket);
            g.wake_admitted();
            tracing::debug!(ticket = self.ticket, "throttled request went away");
        }
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
pub(crate) mod tests;
