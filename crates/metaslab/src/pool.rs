//! The pool: vdevs with their metaslab groups, the three classes, the
//! throttle (unified, legacy or off), tickets and in-flight allocations,
//! and the open txg. This is where the spec's pieces meet: admission
//! (§3.7–3.8, §4.4), DVA placement over the ring (§2.11), rotation (§3.5,
//! §4.2), queue depth (§3.6, §4.3), embedded log metaslabs (§5.2–5.3),
//! slop (§5.6) and the txg pipeline (§6.2).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::class::Class;
use crate::group::{Activation, AllocCtx, Group};
use crate::metaslab::{Metaslab, Role};
use crate::throttle::{legacy, unified};
use crate::txg::{TxgLog, sync_done};
use crate::vdev::{data_children, metaslab_count, metaslab_shift, psize_to_asize};
use crate::{
    AllocKind, AllocRequest, Allocation, AllocationId, ClassKind, Error, Extent, Health, LogTier,
    NoSpaceReason, Result, SPA_MAXBLOCKSIZE, SPA_MINBLOCKSIZE, SpaceChange, SpaceChangeKind,
    Submitted, TXG_DEFER_SIZE, TXG_INITIAL, ThrottlePolicy, Ticket, Tunables, Txg, TxgSync, VdevId,
    VdevRole, VdevSpec,
};

pub(crate) const NORMAL: usize = 0;
pub(crate) const LOG: usize = 1;
pub(crate) const ELOG: usize = 2;

/// The largest vdev: 2^17 metaslabs (`zfs_vdev_ms_count_limit`) of 2^40.
pub const MAX_VDEV_CAPACITY: u64 = 1 << 57;

/// Most metaslabs one vdev may have (memory bound on caller input).
const MAX_METASLABS: u64 = 1 << 20;

pub(crate) fn class_index(k: ClassKind) -> usize {
    match k {
        ClassKind::Normal => NORMAL,
        ClassKind::Log => LOG,
        ClassKind::EmbeddedLog => ELOG,
    }
}

/// What a ticket or allocation holds in the throttle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reservation {
    None,
    /// Unified: `copies × size` bytes in the normal class.
    Bytes(u64),
    /// Legacy: `copies` slots (and the bytes, for stats).
    Slots(u64, u64),
}

#[derive(Clone, Debug)]
pub(crate) struct TicketState {
    pub req: AllocRequest,
    /// Which of the class's allocators places it.
    pub allocator: usize,
    pub queued: bool,
    pub res: Reservation,
}

#[derive(Clone, Debug)]
pub(crate) struct Inflight {
    pub extents: [Extent; 3],
    pub n: u8,
    pub psize: u64,
    pub res: Reservation,
}

impl Inflight {
    fn extents(&self) -> &[Extent] {
        &self.extents[..self.n as usize]
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Vdev {
    pub id: VdevId,
    pub spec: VdevSpec,
    pub shift: u8,
    pub ms: Vec<Metaslab>,
    pub mg: Group,
    pub log_mg: Option<Group>,
    pub health: Health,
    pub online: bool,
    pub elog: Option<u32>,
    pub data_children: u64,
    /// In-flight (placed, not committed) extents: offset → (size, id).
    pub inflight: BTreeMap<u64, (u64, AllocationId)>,
    /// Removed from the pool (`Pool::remove_vdev`): a tombstone keeping the
    /// id, with no metaslabs, never in a ring, absent from `stats`.
    pub removed: bool,
}

impl Vdev {
    /// Faulted, unavailable and offline vdevs are never allocatable.
    pub fn allocatable(&self) -> bool {
        self.online && matches!(self.health, Health::Healthy | Health::Degraded)
    }

    pub fn vs_space(&self) -> u64 {
        self.mg.space + self.log_mg.as_ref().map_or(0, |g| g.space)
    }

    pub fn vs_alloc(&self) -> u64 {
        self.mg.alloc + self.log_mg.as_ref().map_or(0, |g| g.alloc)
    }

    pub fn main_class(&self) -> usize {
        match self.spec.role {
            VdevRole::Normal => NORMAL,
            VdevRole::Log => LOG,
        }
    }

    pub fn group(&self, ci: usize) -> Option<&Group> {
        if ci == ELOG {
            self.log_mg.as_ref()
        } else if ci == self.main_class() {
            Some(&self.mg)
        } else {
            None
        }
    }

    /// Metaslab `m` and the group of class `ci` at once (disjoint fields).
    fn ms_and_group(&mut self, m: u32, ci: usize) -> (&mut Metaslab, Option<&mut Group>) {
        let g = if ci == ELOG {
            self.log_mg.as_mut()
        } else if ci == self.main_class() {
            Some(&mut self.mg)
        } else {
            None
        };
        (&mut self.ms[m as usize], g)
    }

    fn group_mut(&mut self, ci: usize) -> Option<&mut Group> {
        if ci == ELOG {
            self.log_mg.as_mut()
        } else if ci == self.main_class() {
            Some(&mut self.mg)
        } else {
            None
        }
    }

    /// Class of the group holding metaslab `m`.
    fn class_of(&self, m: u32) -> usize {
        if self.elog == Some(m) {
            ELOG
        } else {
            self.main_class()
        }
    }

    pub fn end(&self) -> u64 {
        (self.ms.len() as u64) << self.shift
    }

    fn min_alloc(&self) -> u64 {
        1 << self.spec.ashift
    }

    /// The in-flight extent overlapping `[off, off+size)`, if any.
    fn inflight_overlap(&self, off: u64, size: u64) -> Option<Extent> {
        let (&s, &(len, _)) = self.inflight.range(..off + size).next_back()?;
        (s + len > off).then_some(Extent {
            vdev: self.id,
            offset: s,
            size: len,
        })
    }
}

/// Pieces of an extent per metaslab: (metaslab id, offset, size).
fn pieces(shift: u8, e: &Extent) -> impl Iterator<Item = (u32, u64, u64)> {
    let end = e.offset + e.size;
    let mut pos = e.offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let id = pos >> shift;
        let piece_end = ((id + 1) << shift).min(end);
        let out = (id as u32, pos, piece_end - pos);
        pos = piece_end;
        Some(out)
    })
}

/// The pool: vdevs, their metaslab groups, the classes and the throttle.
pub struct Pool {
    pub(crate) tun: Tunables,
    pub(crate) vdevs: Vec<Vdev>,
    pub(crate) classes: [Class; 3],
    pub(crate) open_txg: Txg,
    next_ticket: Ticket,
    next_alloc: AllocationId,
    pub(crate) tickets: HashMap<Ticket, TicketState>,
    pub(crate) inflight: HashMap<AllocationId, Inflight>,
    admitted: Vec<Ticket>,
    pub(crate) txg: TxgLog,
    /// Loaded metaslabs by last selection: (selected txg, vdev, metaslab).
    pub(crate) lru: BTreeSet<(Txg, VdevId, u32)>,
    /// Vdevs the allocation being placed must not use (a relocation's
    /// source and its block's other copies); empty otherwise.
    avoid: Vec<VdevId>,
    /// The caller's clock at the last sync, ms (never read here).
    now_ms: u64,
    /// `spa_alloc_count`, and the allocator the next request uses.
    alloc_count: usize,
    next_allocator: usize,
}

/// Placement result of one allocation.
struct Placed {
    extents: [Extent; 3],
    n: usize,
    loads: u32,
}

const NO_EXTENT: Extent = Extent {
    vdev: 0,
    offset: 0,
    size: 0,
};

impl Default for Placed {
    fn default() -> Self {
        Placed {
            extents: [NO_EXTENT; 3],
            n: 0,
            loads: 0,
        }
    }
}

impl Placed {
    /// Metaslabs of vdev `v` (shift `shift`) holding a DVA of this block.
    fn holding(&self, v: VdevId, shift: u8) -> ([u32; 3], usize) {
        let mut out = [0u32; 3];
        let mut n = 0;
        for e in self.extents[..self.n].iter().filter(|e| e.vdev == v) {
            out[n] = (e.offset >> shift) as u32;
            n += 1;
        }
        (out, n)
    }
}

impl Pool {
    pub fn new(tunables: Tunables) -> Pool {
        Pool {
            tun: tunables,
            vdevs: Vec::new(),
            classes: [
                Class::new(ClassKind::Normal),
                Class::new(ClassKind::Log),
                Class::new(ClassKind::EmbeddedLog),
            ],
            open_txg: TXG_INITIAL,
            next_ticket: 1,
            next_alloc: 1,
            tickets: HashMap::new(),
            inflight: HashMap::new(),
            admitted: Vec::new(),
            txg: TxgLog::default(),
            lru: BTreeSet::new(),
            now_ms: 0,
            alloc_count: 1,
            next_allocator: 0,
            avoid: Vec::new(),
        }
    }

    /// Rebuild a pool from the store: vdevs with their persisted ids and
    /// metaslab shifts, the durable allocated extents, the last synced txg.
    /// Re-selects the embedded log metaslabs. Overlaps or extents outside
    /// their vdev give `Error::Inconsistent` naming the first one.
    pub fn restore(
        tunables: Tunables,
        vdevs: Vec<(VdevId, VdevSpec)>,
        allocated: &[Extent],
        synced_txg: Txg,
    ) -> Result<Pool> {
        let mut sorted: Vec<Extent> = allocated.to_vec();
        sorted.sort();
        Pool::restore_sorted(tunables, vdevs, sorted, synced_txg)
    }

    /// [`Pool::restore`] from extents already in `(vdev, offset)` order, as
    /// a store lists them: one pass, nothing materialised, and each
    /// metaslab's free tree cut in bulk (`RangeTree::remove_sorted`), so a
    /// restart at ten million extents is not ten million tree splits.
    /// Extents out of order are refused as inconsistent.
    pub fn restore_sorted<I>(
        tunables: Tunables,
        vdevs: Vec<(VdevId, VdevSpec)>,
        allocated: I,
        synced_txg: Txg,
    ) -> Result<Pool>
    where
        I: IntoIterator<Item = Extent>,
    {
        let mut pool = Pool::new(tunables);
        pool.open_txg = synced_txg.max(TXG_INITIAL - 1) + 1;
        let mut vdevs = vdevs;
        vdevs.sort_by_key(|(id, _)| *id);
        for (i, (id, _)) in vdevs.iter().enumerate() {
            if *id as usize != i {
                return Err(Error::Inconsistent(format!(
                    "vdev ids must be 0..{} without gaps; found {id} at position {i}",
                    vdevs.len()
                )));
            }
        }
        let mut built = Vec::with_capacity(vdevs.len());
        for (id, spec) in vdevs {
            let v = pool
                .build_vdev(id, spec, false)
                .map_err(|e| Error::Inconsistent(format!("vdev {id}: {e}")))?;
            built.push(v);
        }
        // The pieces of the current metaslab, cut from its free tree when
        // the next extent lies in another one.
        let mut batch: Vec<(u64, u64)> = Vec::new();
        let mut batch_ms: Option<(VdevId, u32)> = None;
        let flush =
            |built: &mut Vec<Vdev>, at: Option<(VdevId, u32)>, batch: &mut Vec<(u64, u64)>| {
                if let Some((v, m)) = at {
                    let ms = &mut built[v as usize].ms[m as usize];
                    let ok = ms.allocatable.remove_sorted(batch);
                    debug_assert!(ok, "checked disjoint and inside the vdev");
                    ms.has_space_map = true;
                }
                batch.clear();
            };
        let mut prev: Option<Extent> = None;
        for e in allocated {
            let Some(v) = built.get(e.vdev as usize) else {
                return Err(Error::Inconsistent(format!(
                    "extent {e}: no vdev {}",
                    e.vdev
                )));
            };
            let mask = v.min_alloc() - 1;
            if e.size == 0 || e.offset & mask != 0 || e.size & mask != 0 {
                return Err(Error::Inconsistent(format!(
                    "extent {e} is empty or misaligned"
                )));
            }
            if e.offset.checked_add(e.size).is_none_or(|end| end > v.end()) {
                return Err(Error::Inconsistent(format!(
                    "extent {e} lies outside its vdev"
                )));
            }
            if let Some(p) = prev {
                if (p.vdev, p.offset) > (e.vdev, e.offset) {
                    return Err(Error::Inconsistent(format!(
                        "extent {e} is listed after extent {p}: not in offset order"
                    )));
                }
                if p.vdev == e.vdev && p.offset + p.size > e.offset {
                    return Err(Error::Inconsistent(format!(
                        "extent {e} overlaps extent {p}"
                    )));
                }
            }
            prev = Some(e);
            let shift = v.shift;
            for (m, off, len) in pieces(shift, &e) {
                if batch_ms != Some((e.vdev, m)) {
                    flush(&mut built, batch_ms, &mut batch);
                    batch_ms = Some((e.vdev, m));
                }
                batch.push((off, len));
            }
        }
        flush(&mut built, batch_ms, &mut batch);
        for v in built {
            pool.install_vdev(v);
        }
        for ci in 0..3 {
            pool.recount(ci);
            pool.balance(ci, false);
        }
        Ok(pool)
    }

    /// Validate a spec and build a vdev (metaslabs `new` or ready), not yet
    /// in any class.
    fn build_vdev(&self, id: VdevId, mut spec: VdevSpec, new: bool) -> Result<Vdev> {
        if !(9..=16).contains(&spec.ashift) {
            return Err(Error::BadVdev(format!(
                "ashift {} is outside 9..=16",
                spec.ashift
            )));
        }
        if spec.children == 0 {
            return Err(Error::BadVdev("children must be at least 1".into()));
        }
        if spec.parity >= spec.children {
            return Err(Error::BadVdev(format!(
                "parity {} leaves no data children of {}",
                spec.parity, spec.children
            )));
        }
        let shift = spec
            .metaslab_shift
            .unwrap_or_else(|| metaslab_shift(spec.capacity, &self.tun));
        // The same bound for a new vdev as for one restored from the store:
        // anything accepted here must come back after a restart.
        if shift < spec.ashift.max(24) || shift > 40 {
            return Err(Error::BadVdev(match spec.metaslab_shift {
                Some(s) => format!("metaslab shift {s} is outside {}..=40", spec.ashift.max(24)),
                None => format!(
                    "capacity {} bytes needs metaslabs of 2^{shift} bytes, outside 2^{}..=2^40 \
                     (at most {} bytes per vdev)",
                    spec.capacity,
                    spec.ashift.max(24),
                    MAX_VDEV_CAPACITY
                ),
            }));
        }
        let count = metaslab_count(spec.capacity, shift);
        if count == 0 {
            return Err(Error::BadVdev(format!(
                "capacity {} is smaller than one metaslab ({} bytes)",
                spec.capacity,
                1u64 << shift
            )));
        }
        if count > MAX_METASLABS {
            return Err(Error::BadVdev(format!("{count} metaslabs is too many")));
        }
        spec.metaslab_shift = Some(shift);
        let ms = (0..count as u32)
            .map(|i| Metaslab::new(i, shift, spec.ashift, new))
            .collect();
        let log_mg =
            (spec.role == VdevRole::Normal).then(|| Group::new(id, ClassKind::EmbeddedLog));
        let main = match spec.role {
            VdevRole::Normal => ClassKind::Normal,
            VdevRole::Log => ClassKind::Log,
        };
        Ok(Vdev {
            id,
            data_children: data_children(&spec),
            spec,
            shift,
            ms,
            mg: Group::new(id, main),
            log_mg,
            health: Health::Healthy,
            online: true,
            elog: None,
            inflight: BTreeMap::new(),
            removed: false,
        })
    }

    /// Embedded log selection (spec §5.2) among metaslabs `from..`: the
    /// least-allocated one, lowest index on ties, when the vdev has more
    /// than `zfs_embedded_slog_min_ms` metaslabs and none yet.
    fn select_elog(&self, v: &mut Vdev, from: usize) {
        if v.spec.role != VdevRole::Normal
            || v.elog.is_some()
            || (v.ms.len() as u64) <= self.tun.zfs_embedded_slog_min_ms
            || from >= v.ms.len()
        {
            return;
        }
        let m = (from..v.ms.len())
            .min_by_key(|&i| (v.ms[i].alloc(), i))
            .expect("non-empty range");
        v.ms[m].embedded_log = true;
        v.elog = Some(m as u32);
    }

    /// Weigh the metaslabs `from..`, put them in their groups, account them
    /// and dirty the new ones.
    fn adopt_metaslabs(&mut self, v: &mut Vdev, from: usize) {
        let count = v.ms.len() as u64;
        let main = v.main_class();
        for i in from..v.ms.len() {
            let ms = &mut v.ms[i];
            ms.compute_weight(v.spec.rotational, count, &self.tun);
            let ci = if ms.embedded_log { ELOG } else { main };
            let g = if ci == ELOG {
                v.log_mg.as_mut().expect("normal vdev has a log group")
            } else {
                &mut v.mg
            };
            g.insert(ms);
            g.dirty = true;
            let c = &mut self.classes[ci];
            c.alloc += ms.alloc();
            if !ms.new {
                c.space += ms.size;
            }
            if ms.new {
                self.txg.mark_dirty(v.id, ms);
            }
        }
    }

    fn install_vdev(&mut self, mut v: Vdev) {
        self.select_elog(&mut v, 0);
        self.adopt_metaslabs(&mut v, 0);
        let id = v.id;
        refresh_groups(&mut v, &self.tun);
        self.vdevs.push(v);
        self.update_membership(id);
    }

    /// Put the vdev's groups in or out of their class rings per its state.
    /// Ring membership follows the administrative state only (OpenZFS's
    /// `noalloc`/removal passivate a group). A faulted, degraded or silent
    /// vdev stays in the ring and in the class balance, keeping its aliquot,
    /// and is skipped at each allocation (`eligible`).
    pub(crate) fn update_membership(&mut self, id: VdevId) {
        let v = &self.vdevs[id as usize];
        let want = v.online;
        let main = v.main_class();
        let has_log = v.log_mg.is_some();
        for (ci, present) in [(main, true), (ELOG, has_log)] {
            if !present {
                continue;
            }
            let c = &mut self.classes[ci];
            if want && !c.in_ring(id) {
                c.insert(id);
            } else if !want && c.in_ring(id) {
                c.remove(id);
            }
            self.recount(ci);
            self.balance(ci, false);
        }
    }

    /// Online vdev add; ids are assigned in order from 0. Its metaslabs are
    /// usable after the next sync (OpenZFS's ms_new).
    pub fn add_vdev(&mut self, spec: VdevSpec) -> Result<VdevId> {
        let id = self.vdevs.len() as VdevId;
        let v = self.build_vdev(id, spec, true)?;
        self.install_vdev(v);
        self.dispatch();
        Ok(id)
    }

    /// Capacity growth: appends metaslabs of the same size.
    pub fn grow_vdev(&mut self, vdev: VdevId, capacity: u64) -> Result<()> {
        self.check_present(vdev)?;
        let v = self
            .vdevs
            .get(vdev as usize)
            .ok_or(Error::UnknownVdev(vdev))?;
        if capacity < v.spec.capacity {
            return Err(Error::BadVdev(format!(
                "vdev {vdev} cannot shrink from {} to {capacity} bytes",
                v.spec.capacity
            )));
        }
        let old = v.ms.len();
        let new_count = metaslab_count(capacity, v.shift);
        if new_count > MAX_METASLABS {
            return Err(Error::BadVdev(format!("{new_count} metaslabs is too many")));
        }
        // Take the vdev out while its metaslabs are adopted; put back below.
        let placeholder = self.vdevs[vdev as usize].clone_empty();
        let mut v = std::mem::replace(&mut self.vdevs[vdev as usize], placeholder);
        v.spec.capacity = capacity;
        let (shift, ashift) = (v.shift, v.spec.ashift);
        for i in old as u32..new_count as u32 {
            v.ms.push(Metaslab::new(i, shift, ashift, true));
        }
        self.select_elog(&mut v, old);
        self.adopt_metaslabs(&mut v, old);
        refresh_groups(&mut v, &self.tun);
        self.vdevs[vdev as usize] = v;
        for ci in 0..3 {
            self.recount(ci);
            self.balance(ci, false);
        }
        self.dispatch();
        Ok(())
    }

    pub fn set_health(&mut self, vdev: VdevId, health: Health) -> Result<()> {
        self.check_present(vdev)?;
        let v = self
            .vdevs
            .get_mut(vdev as usize)
            .ok_or(Error::UnknownVdev(vdev))?;
        if v.health != health {
            v.health = health;
            self.update_membership(vdev);
            self.dispatch();
        }
        Ok(())
    }

    /// Administrative online/offline; offline vdevs are not allocatable.
    pub fn set_online(&mut self, vdev: VdevId, online: bool) -> Result<()> {
        self.check_present(vdev)?;
        let v = self
            .vdevs
            .get_mut(vdev as usize)
            .ok_or(Error::UnknownVdev(vdev))?;
        if v.online != online {
            v.online = online;
            self.update_membership(vdev);
            self.dispatch();
        }
        Ok(())
    }

    pub fn tunables(&self) -> &Tunables {
        &self.tun
    }

    /// Validated; rebalances the classes.
    pub fn set_tunable(&mut self, name: &str, value: &str) -> Result<()> {
        let mut t = self.tun.clone();
        t.set(name, value)?;
        let policy_changed = t.throttle_policy != self.tun.throttle_policy;
        self.tun = t;
        if policy_changed && self.tun.throttle_policy == ThrottlePolicy::Legacy {
            self.legacy_reset();
        }
        for ci in 0..3 {
            self.recount(ci);
            self.balance(ci, false);
        }
        self.dispatch();
        Ok(())
    }

    pub fn open_txg(&self) -> Txg {
        self.open_txg
    }

    /// Bytes the open txg has changed so far (committed allocations, claims
    /// and frees): the service closes a txg early past a bound.
    pub fn dirty_bytes(&self) -> u64 {
        self.txg.bytes
    }

    /// Validate a request and pass it through the throttle. Log requests are
    /// always `Ready`.
    pub fn submit(&mut self, req: AllocRequest) -> Result<Submitted> {
        if req.size == 0 {
            return Err(Error::ZeroSize);
        }
        if req.size > SPA_MAXBLOCKSIZE {
            return Err(Error::TooLarge(req.size));
        }
        if !(1..=3).contains(&req.copies) {
            return Err(Error::BadCopies(req.copies));
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let allocator = self.next_allocator % self.alloc_count;
        self.next_allocator = self.next_allocator.wrapping_add(1);
        let mut st = TicketState {
            req,
            allocator,
            queued: false,
            res: Reservation::None,
        };
        if req.kind == AllocKind::Log {
            self.tickets.insert(ticket, st);
            return Ok(Submitted::Ready(ticket));
        }
        let bytes = req.copies as u64 * req.size;
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[NORMAL];
        if policy == ThrottlePolicy::Off || !c.throttle_enabled {
            self.tickets.insert(ticket, st);
            return Ok(Submitted::Ready(ticket));
        }
        if policy == ThrottlePolicy::Unified && req.size > c.alloc_io_size {
            // A larger block raises the estimate and rebalances now (§3.4).
            c.alloc_io_size = req.size;
            self.balance(NORMAL, false);
        }
        let c = &mut self.classes[NORMAL];
        if c.waiters.is_empty() {
            let granted = match policy {
                ThrottlePolicy::Unified => {
                    unified::reserve(&mut c.reserved, c.alloc_max, bytes, false).0 && {
                        st.res = Reservation::Bytes(bytes);
                        true
                    }
                }
                _ => {
                    legacy::reserve(&mut c.slots_reserved, c.max_slots, req.copies as u64) && {
                        c.legacy_bytes += bytes;
                        st.res = Reservation::Slots(req.copies as u64, bytes);
                        true
                    }
                }
            };
            if granted {
                self.tickets.insert(ticket, st);
                return Ok(Submitted::Ready(ticket));
            }
        }
        st.queued = true;
        c.waiters.push_back(ticket);
        c.waiting_bytes += bytes;
        self.tickets.insert(ticket, st);
        self.dispatch();
        Ok(Submitted::Queued(ticket))
    }

    /// Tickets admitted from the FIFO since the last call, in order.
    pub fn take_admitted(&mut self) -> Vec<Ticket> {
        std::mem::take(&mut self.admitted)
    }

    /// Admit waiters from the head while the throttle allows (§3.8).
    fn dispatch(&mut self) {
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[NORMAL];
        while let Some(&t) = c.waiters.front() {
            let Some(st) = self.tickets.get_mut(&t) else {
                c.waiters.pop_front();
                continue;
            };
            let bytes = st.req.copies as u64 * st.req.size;
            let mut more = true;
            let res = if policy == ThrottlePolicy::Off || !c.throttle_enabled {
                Reservation::None
            } else if policy == ThrottlePolicy::Unified {
                let (granted, m) = unified::reserve(&mut c.reserved, c.alloc_max, bytes, false);
                if !granted {
                    break;
                }
                more = m;
                Reservation::Bytes(bytes)
            } else {
                if !legacy::reserve(&mut c.slots_reserved, c.max_slots, st.req.copies as u64) {
                    break;
                }
                c.legacy_bytes += bytes;
                Reservation::Slots(st.req.copies as u64, bytes)
            };
            st.res = res;
            st.queued = false;
            c.waiters.pop_front();
            c.waiting_bytes -= bytes;
            self.admitted.push(t);
            if !more {
                break;
            }
        }
    }

    /// Release a reservation; wake waiters when the throttle says so.
    fn release(&mut self, res: Reservation) {
        let c = &mut self.classes[NORMAL];
        let wake = match res {
            Reservation::None => false,
            Reservation::Bytes(b) => unified::unreserve(&mut c.reserved, c.alloc_max, b),
            Reservation::Slots(s, b) => {
                c.slots_reserved = c.slots_reserved.saturating_sub(s);
                c.legacy_bytes = c.legacy_bytes.saturating_sub(b);
                true
            }
        };
        if wake && !c.waiters.is_empty() {
            self.dispatch();
        }
    }

    /// Drop a queued or admitted-but-not-placed ticket (the client went away).
    pub fn cancel(&mut self, ticket: Ticket) -> Result<()> {
        let st = self
            .tickets
            .remove(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        if st.queued {
            let c = &mut self.classes[NORMAL];
            if let Some(i) = c.waiters.iter().position(|&t| t == ticket) {
                c.waiters.remove(i);
            }
            c.waiting_bytes -= st.req.copies as u64 * st.req.size;
            self.dispatch();
        } else {
            self.release(st.res);
        }
        Ok(())
    }

    /// The spec's "busy" for a class (preface): reserved + waiting bytes over
    /// alloc_max × (min% + max%) / 200, or any request waiting.
    pub fn busy(&self, class: ClassKind) -> bool {
        let c = &self.classes[class_index(class)];
        if c.is_log {
            return false;
        }
        match self.tun.throttle_policy {
            ThrottlePolicy::Unified => unified::busy(
                c.reserved,
                c.waiting_bytes,
                c.waiters.len(),
                c.alloc_max,
                self.tun.busy_pct_sum(),
            ),
            ThrottlePolicy::Legacy => {
                !c.waiters.is_empty() || (c.max_slots > 0 && c.slots_reserved >= c.max_slots)
            }
            ThrottlePolicy::Off => false,
        }
    }

    /// OpenZFS's own busy rule, from the caller's dirty data: `dirty`
    /// bytes written and not yet synced, against its `dirty_max`
    /// (`zfs_dirty_data_max`), with the two percentages by their OpenZFS
    /// names; `sync_pending` as a pending sync task. The caller measures
    /// dirty data (the allocator: bytes in the open and syncing txgs and in
    /// flight; the simulator: its modelled dirty data).
    pub fn busy_dirty(&self, dirty: u64, dirty_max: u64, sync_pending: bool) -> bool {
        unified::busy_dirty(dirty, dirty_max, self.tun.busy_pct_sum(), sync_pending)
    }

    /// `spa_alloc_count` from the machine's CPU count (a fact the caller
    /// passes; OpenZFS fixes it at import): `max(1, min(spa_num_allocators,
    /// cpus / spa_cpus_per_allocator))`. Each allocator of a class has its
    /// own rotor position and aliquot counter; requests take them in turn
    /// (OpenZFS spreads blocks over them by object). Returns the count.
    pub fn set_cpus(&mut self, cpus: u64) -> usize {
        let t = &self.tun;
        let n = (cpus / t.spa_cpus_per_allocator.max(1))
            .min(t.spa_num_allocators)
            .max(1);
        self.alloc_count = n as usize;
        self.next_allocator = 0;
        for c in &mut self.classes {
            c.set_allocators(self.alloc_count);
        }
        self.alloc_count
    }

    /// The next request will be placed by allocator `k % spa_alloc_count`
    /// (a caller that knows which object a block belongs to keeps its
    /// blocks on one allocator, as OpenZFS does).
    pub fn prefer_allocator(&mut self, k: usize) {
        self.next_allocator = k;
    }

    pub fn allocator_count(&self) -> usize {
        self.alloc_count
    }

    /// Busy for a data allocation (`metaslab_perf_bias`): the throttle's
    /// own measure (`busy`, the spec preface's proxy, which moves first when
    /// clients write faster than the pool) or OpenZFS's dirty-data rule on
    /// the caller's `dirty` bytes against `dirty_max`. The one rule the
    /// allocator and the simulator both use.
    pub fn busy_with_dirty(&self, dirty: u64, dirty_max: u64) -> bool {
        self.busy(ClassKind::Normal) || self.busy_dirty(dirty, dirty_max, false)
    }

    /// Slop space (spec §5.6), raw bytes.
    pub(crate) fn slop(&self) -> u64 {
        let rd = self.classes[NORMAL].space;
        let elog = self.classes[ELOG].space;
        let mut slop = (rd >> self.tun.spa_slop_shift).min(128 << 30);
        slop -= elog.min(slop / 2);
        slop.max((rd / 2).min(128 << 20))
    }

    /// Place an admitted ticket. On failure the ticket is consumed and its
    /// reservation released.
    pub fn allocate(&mut self, ticket: Ticket, busy: bool) -> Result<Allocation> {
        self.allocate_avoiding(ticket, busy, &[])
    }

    /// `allocate`, never placing a copy on a vdev of `avoid`: a balancer
    /// move's new copy must leave its source vdev and the block's other
    /// copies' vdevs (the rotor still turns past them as past any vdev it
    /// cannot use). Only vdevs are avoided, so the class's slop and throttle
    /// rules are exactly those of any allocation.
    pub fn allocate_avoiding(
        &mut self,
        ticket: Ticket,
        busy: bool,
        avoid: &[VdevId],
    ) -> Result<Allocation> {
        self.avoid.clear();
        self.avoid.extend_from_slice(avoid);
        let r = self.allocate_inner(ticket, busy);
        self.avoid.clear();
        r
    }

    fn allocate_inner(&mut self, ticket: Ticket, busy: bool) -> Result<Allocation> {
        match self.tickets.get(&ticket) {
            None => return Err(Error::UnknownTicket(ticket)),
            Some(st) if st.queued => return Err(Error::NotAdmitted(ticket)),
            Some(_) => {}
        }
        let st = self.tickets.remove(&ticket).expect("checked");
        let req = st.req;
        for c in &mut self.classes {
            c.use_allocator(st.allocator);
        }
        let (placed, tier) = match req.kind {
            AllocKind::Data => {
                let c = &self.classes[NORMAL];
                let free = c.space.saturating_sub(c.alloc);
                let need = req.copies as u64 * req.size;
                let placed = if free < self.slop().saturating_add(need) {
                    Err(NoSpaceReason::Full)
                } else {
                    self.place(NORMAL, req.size, req.copies, busy, false)
                        .ok_or_else(|| self.no_space_reason(&[NORMAL]))
                };
                match placed {
                    Ok(p) => (p, None),
                    Err(reason) => {
                        self.release(st.res);
                        return Err(Error::NoSpace {
                            size: req.size,
                            copies: req.copies,
                            reason,
                        });
                    }
                }
            }
            AllocKind::Log => {
                let mut out = None;
                for (ci, tier) in [
                    (LOG, LogTier::Log),
                    (ELOG, LogTier::EmbeddedLog),
                    (NORMAL, LogTier::Normal),
                ] {
                    if self.classes[ci].ring.is_empty() {
                        continue;
                    }
                    if let Some(p) = self.place(ci, req.size, req.copies, busy, true) {
                        out = Some((p, Some(tier)));
                        break;
                    }
                }
                match out {
                    Some(o) => o,
                    // A sync helps only if it will make freed space
                    // allocatable; otherwise waiting never ends.
                    None if self.frees_pending() => {
                        return Err(Error::TxgWaitRequired {
                            until: self.open_txg + TXG_DEFER_SIZE,
                        });
                    }
                    None => {
                        return Err(Error::NoSpace {
                            size: req.size,
                            copies: req.copies,
                            reason: self.no_space_reason(&[LOG, ELOG, NORMAL]),
                        });
                    }
                }
            }
        };
        let id = self.next_alloc;
        self.next_alloc += 1;
        // Queue depth: counted exactly for allocations holding a
        // reservation, released by commit/abort on the same predicate.
        for e in &placed.extents[..placed.n] {
            let v = &mut self.vdevs[e.vdev as usize];
            match st.res {
                Reservation::Bytes(_) => v.mg.queue_depth += req.size,
                Reservation::Slots(..) => v.mg.queue_requests += 1,
                Reservation::None => {}
            }
            v.inflight.insert(e.offset, (e.size, id));
        }
        let extents = placed.extents[..placed.n].to_vec();
        self.inflight.insert(
            id,
            Inflight {
                extents: placed.extents,
                n: placed.n as u8,
                psize: req.size,
                res: st.res,
            },
        );
        Ok(Allocation {
            id,
            extents,
            txg: self.open_txg,
            tier,
            metaslab_loads: placed.loads,
        })
    }

    /// Place `copies` DVAs of `psize` in class `ci` (spec §2.11); on failure
    /// undo what was placed.
    fn place(
        &mut self,
        ci: usize,
        psize: u64,
        copies: u8,
        busy: bool,
        zil: bool,
    ) -> Option<Placed> {
        let mut placed = Placed::default();
        for d in 0..copies as usize {
            match self.place_one(ci, psize, d, &placed, busy, zil) {
                Some((e, loads)) => {
                    placed.extents[d] = e;
                    placed.n += 1;
                    placed.loads += loads;
                }
                None => {
                    for e in &placed.extents[..placed.n] {
                        self.unplace(e);
                    }
                    return None;
                }
            }
        }
        Some(placed)
    }

    /// `spa_min_alloc`: the smallest allocation any vdev can make.
    fn spa_min_alloc(&self) -> u64 {
        self.vdevs
            .iter()
            .filter(|v| v.vs_space() > 0)
            .map(|v| v.min_alloc())
            .min()
            .unwrap_or(SPA_MINBLOCKSIZE)
    }

    /// Whether some allocatable vdev of class `ci` has a free segment that
    /// holds `psize` in one piece (only asked after a failed first pass).
    fn fits_whole(&self, ci: usize, psize: u64) -> bool {
        self.classes[ci].ring.iter().any(|&v| {
            let vd = &self.vdevs[v as usize];
            let asize = psize_to_asize(&vd.spec, psize);
            vd.allocatable()
                && !self.avoid.contains(&v)
                && vd.group(ci).is_some_and(|g| {
                    g.members().any(|m| {
                        !vd.ms[m as usize].new && vd.ms[m as usize].allocatable.max_size() >= asize
                    })
                })
        })
    }

    /// Whether a txg sync would make freed space allocatable again.
    fn frees_pending(&self) -> bool {
        self.vdevs
            .iter()
            .any(|v| v.ms.iter().any(|m| m.deferred() > 0))
    }

    /// Why an allocation failed in classes `cis` (it was not
    /// the slop check): no allocatable vdev, or no free segment large
    /// enough (including where OpenZFS would gang), or simply full.
    fn no_space_reason(&self, cis: &[usize]) -> NoSpaceReason {
        let mut any = false;
        let mut largest_free = 0u64;
        for &ci in cis {
            for &v in &self.classes[ci].ring {
                let vd = &self.vdevs[v as usize];
                if !vd.allocatable() || self.avoid.contains(&v) {
                    continue;
                }
                any = true;
                if let Some(g) = vd.group(ci) {
                    for m in g.members() {
                        largest_free = largest_free.max(vd.ms[m as usize].allocatable.max_size());
                    }
                }
            }
        }
        if !any {
            NoSpaceReason::VdevsOffline
        } else if largest_free == 0 {
            NoSpaceReason::Full
        } else {
            // Space is free but the request did not fit: smaller blocks
            // (gang members, in OpenZFS) would.
            NoSpaceReason::Fragmented { largest_free }
        }
    }

    /// Return a placed-but-uncommitted extent to its metaslab.
    fn unplace(&mut self, e: &Extent) {
        let v = &mut self.vdevs[e.vdev as usize];
        let m = (e.offset >> v.shift) as u32;
        let ci = v.class_of(m);
        let (ms, g) = v.ms_and_group(m, ci);
        if ms.give_back(e.offset, e.size) {
            let g = g.expect("group of its class");
            g.alloc -= e.size;
            g.note_changed(ms);
            self.classes[ci].alloc -= e.size;
        }
    }

    fn place_one(
        &mut self,
        ci: usize,
        psize: u64,
        d: usize,
        placed: &Placed,
        busy: bool,
        zil: bool,
    ) -> Option<(Extent, u32)> {
        let n = self.classes[ci].ring.len();
        if n == 0 {
            return None;
        }
        for try_hard in [false, true] {
            // The try-hard pass (ignoring the group checks) is for blocks
            // OpenZFS cannot gang: intent-log blocks and blocks at the minimum
            // size, or every block with zfs_metaslab_try_hard_before_gang
            // (spec §2.11). Any other block OpenZFS writes as a gang block
            // whose members are placed trying hard: where one free segment
            // still holds the whole block, Aliquot (no gang blocks) places it
            // whole the same way; where none does, it fails as FRAGMENTED.
            if try_hard
                && !(zil
                    || self.tun.zfs_metaslab_try_hard_before_gang
                    || psize <= self.spa_min_alloc()
                    || self.fits_whole(ci, psize))
            {
                break;
            }
            let c = &self.classes[ci];
            let start = if d == 0 {
                c.rotor % n
            } else {
                let prev = placed.extents[d - 1].vdev;
                c.position(prev).map_or(c.rotor % n, |p| (p + 1) % n)
            };
            for k in 0..n {
                // A vdev holding a copy already is not skipped: the copy goes
                // to another of its metaslabs (spec §2.5, §2.6).
                let v = self.classes[ci].ring[(start + k) % n];
                if !self.eligible(ci, v, d, try_hard, zil) {
                    self.rotate(ci, v, psize, 0, false, busy, zil);
                    continue;
                }
                match self.group_alloc(ci, v, psize, placed, try_hard) {
                    Some((e, loads)) => {
                        self.rotate(ci, v, psize, e.size, true, busy, zil);
                        return Some((e, loads));
                    }
                    None => self.rotate(ci, v, psize, 0, false, busy, zil),
                }
            }
        }
        None
    }

    /// Group eligibility at allocation time (spec §2.7; legacy §4.5).
    fn eligible(&self, ci: usize, v: VdevId, d: usize, try_hard: bool, zil: bool) -> bool {
        let vd = &self.vdevs[v as usize];
        if !vd.allocatable() || self.avoid.contains(&v) {
            return false;
        }
        let Some(g) = vd.group(ci) else { return false };
        if try_hard {
            return true;
        }
        // Only a non-redundant (leaf) vdev below healthy is spared the first
        // copy; a degraded RAIDZ or mirror still takes its share (§2.7 rule 3).
        if d == 0 && vd.health == Health::Degraded && vd.spec.children <= 1 {
            return false;
        }
        let c = &self.classes[ci];
        if self.tun.throttle_policy == ThrottlePolicy::Legacy && ci == NORMAL {
            return self.legacy_eligible(c, g, d, zil);
        }
        !(g.no_free_space || (!g.allocatable && c.alloc_groups > 0))
    }

    /// LEGACY `metaslab_group_allocatable` (spec §4.5).
    fn legacy_eligible(&self, c: &Class, g: &Group, d: usize, zil: bool) -> bool {
        if c.groups <= 1 {
            return true;
        }
        if !g.allocatable {
            return c.alloc_groups == 0;
        }
        if !c.throttle_enabled {
            return true;
        }
        if g.no_free_space {
            return false;
        }
        if zil {
            return true;
        }
        if g.queue_requests < legacy::qmax(g.legacy_cur_max, d) || c.alloc_groups == 1 {
            return true;
        }
        let n = c.ring.len();
        let Some(pos) = c.position(g.vdev) else {
            return true;
        };
        let rotor = c.rotor % n;
        let mut i = (pos + 1) % n;
        while i != rotor && i != pos {
            let h = &self.vdevs[c.ring[i] as usize].mg;
            if h.queue_requests < legacy::qmax(h.legacy_cur_max, d) && !h.no_free_space {
                return false;
            }
            i = (i + 1) % n;
        }
        true
    }

    /// `metaslab_group_alloc` on vdev `v`'s group of class `ci`.
    fn group_alloc(
        &mut self,
        ci: usize,
        v: VdevId,
        psize: u64,
        placed: &Placed,
        try_hard: bool,
    ) -> Option<(Extent, u32)> {
        let Pool {
            vdevs,
            classes,
            tun,
            lru,
            now_ms,
            txg,
            open_txg,
            ..
        } = self;
        let vd = &mut vdevs[v as usize];
        let asize = psize_to_asize(&vd.spec, psize);
        let ctx = AllocCtx {
            t: tun,
            txg: *open_txg,
            now_ms: *now_ms,
            try_hard,
            rotational: vd.spec.rotational,
            ms_count: vd.ms.len() as u64,
            min_alloc: 1 << vd.spec.ashift,
        };
        let g = if ci == ELOG {
            vd.log_mg.as_mut()?
        } else {
            &mut vd.mg
        };
        let mut selected = |id: u32, old: Txg, was_loaded: bool| {
            if was_loaded {
                lru.remove(&(old, v, id));
            }
            lru.insert((*open_txg, v, id));
        };
        let (holding, n) = placed.holding(v, vd.shift);
        let activation = Activation::for_copies_on_vdev(n);
        let out = g.alloc(
            &mut vd.ms,
            asize,
            activation,
            &holding[..n],
            &ctx,
            &mut selected,
        );
        let (m, off) = out.offset?;
        g.alloc += asize;
        classes[ci].alloc += asize;
        txg.mark_dirty(v, &mut vd.ms[m as usize]);
        Some((
            Extent {
                vdev: v,
                offset: off,
                size: asize,
            },
            out.loads,
        ))
    }

    /// The rotor rules: unified (§3.5), legacy (§4.2) or off (strict quota).
    #[allow(clippy::too_many_arguments)]
    fn rotate(
        &mut self,
        ci: usize,
        v: VdevId,
        psize: u64,
        asize: u64,
        success: bool,
        busy: bool,
        zil: bool,
    ) {
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[ci];
        if c.ring.is_empty() {
            return;
        }
        if policy == ThrottlePolicy::Legacy {
            if !success {
                c.rotate_after(v);
                return;
            }
            let vd = &mut self.vdevs[v as usize];
            let bias_enabled = self.tun.metaslab_bias_enabled;
            let vs_free = vd.vs_space().saturating_sub(vd.vs_alloc());
            let mc_free = c.space.saturating_sub(c.alloc);
            let alloc_groups = c.alloc_groups;
            let Some(g) = vd.group_mut(ci) else { return };
            if c.visit_bytes == 0 && bias_enabled {
                g.legacy_bias =
                    legacy::space_bias(vs_free, mc_free, alloc_groups, g.legacy_aliquot);
            } else if !bias_enabled {
                g.legacy_bias = 0;
            }
            c.visit_bytes += asize;
            if legacy::should_rotate(zil, c.visit_bytes, g.legacy_aliquot, g.legacy_bias) {
                c.rotate_after(v);
            }
            return;
        }
        if c.groups < 2 || c.rotor_vdev() != Some(v) {
            return;
        }
        if success {
            c.visit_bytes += psize;
        }
        let Some(g) = self.vdevs[v as usize].group(ci) else {
            return;
        };
        let perf_bias = if policy == ThrottlePolicy::Off {
            0
        } else {
            self.tun.metaslab_perf_bias
        };
        let rotate = unified::should_rotate(&unified::RotateInput {
            success,
            is_log: c.is_log,
            psize,
            visit_bytes: c.visit_bytes,
            aliquot: g.aliquot,
            queue_target: g.queue_target,
            queue_depth: g.queue_depth,
            perf_bias,
            busy,
        });
        if rotate {
            c.rotate_after(v);
        }
    }

    /// Recount `mc_groups` and `mc_alloc_groups` over the ring.
    pub(crate) fn recount(&mut self, ci: usize) {
        let c = &mut self.classes[ci];
        let (mut groups, mut alloc_groups) = (0, 0);
        for &v in &c.ring {
            let vd = &self.vdevs[v as usize];
            if vd.vs_space() > 0 {
                groups += 1;
            }
            if vd.group(ci).is_some_and(|g| g.allocatable) {
                alloc_groups += 1;
            }
        }
        c.groups = groups;
        c.alloc_groups = alloc_groups;
    }

    /// `metaslab_class_balance` (spec §3.3) over the ring; onsync also moves
    /// `alloc_io_size` and refreshes the throttle flag.
    pub(crate) fn balance(&mut self, ci: usize, onsync: bool) {
        let t = &self.tun;
        let c = &mut self.classes[ci];
        if onsync || (!c.throttle_initialized && c.groups > 0) {
            if onsync {
                c.alloc_io_size = unified::io_size_onsync(c.alloc_io_size, t.aliquot());
            }
            c.throttle_enabled = !c.is_log && t.zio_dva_throttle_enabled && c.groups > 0;
            c.throttle_initialized = c.groups > 0;
        }
        let mut inputs = std::mem::take(&mut c.inputs);
        let mut quotas = std::mem::take(&mut c.quotas);
        inputs.clear();
        let (mut space, mut alloc) = (0u64, 0u64);
        for &v in &c.ring {
            let vd = &self.vdevs[v as usize];
            let vs_space = vd.vs_space();
            inputs.push(unified::GroupInput {
                data_children: vd.data_children,
                vs_space,
                vs_alloc: vd.vs_alloc(),
            });
            if let Some(g) = vd.group(ci)
                && vs_space > 0
            {
                space += g.space;
                alloc += g.alloc;
            }
        }
        let mc = unified::ClassInput {
            groups: c.groups,
            space,
            alloc,
            alloc_io_size: c.alloc_io_size,
            metaslab_aliquot: t.aliquot(),
            bias_enabled: t.metaslab_bias_enabled,
        };
        c.alloc_max = unified::balance(&mc, &inputs, &mut quotas);
        for (i, &v) in c.ring.iter().enumerate() {
            let vd = &mut self.vdevs[v as usize];
            let dc = vd.data_children;
            if let Some(g) = vd.group_mut(ci) {
                let q = quotas.get(i).copied().unwrap_or(unified::GroupQuota {
                    aliquot: 0,
                    queue_target: 0,
                });
                g.aliquot = q.aliquot;
                g.queue_target = q.queue_target;
                g.legacy_aliquot = legacy::group_aliquot(t.aliquot(), dc);
            }
        }
        c.inputs = inputs;
        c.quotas = quotas;
    }

    /// Legacy per-txg reset (spec §4.3): group limits back to the default
    /// queue depth, class slots = that × initialized groups.
    fn legacy_reset(&mut self) {
        let t = &self.tun;
        let gmax = t.zfs_vdev_async_write_max_active * t.zfs_vdev_queue_depth_pct / 100;
        let c = &mut self.classes[NORMAL];
        let mut groups = 0;
        for &v in &c.ring {
            let vd = &mut self.vdevs[v as usize];
            if vd.vs_space() == 0 {
                continue;
            }
            groups += 1;
            vd.mg.legacy_max = gmax;
            vd.mg.legacy_cur_max = t.zfs_vdev_def_queue_depth;
        }
        c.max_slots = t.zfs_vdev_def_queue_depth * groups;
    }

    /// Release the throttle and queue depth of a finished allocation.
    fn finish(&mut self, a: &Inflight) {
        for e in a.extents() {
            let v = &mut self.vdevs[e.vdev as usize];
            v.inflight.remove(&e.offset);
            match a.res {
                Reservation::Bytes(_) => {
                    v.mg.queue_depth = v.mg.queue_depth.saturating_sub(a.psize)
                }
                Reservation::Slots(..) => {
                    v.mg.queue_requests = v.mg.queue_requests.saturating_sub(1);
                }
                Reservation::None => {}
            }
        }
        self.release(a.res);
    }

    /// The writes finished: release throttle bytes and queue depth; the
    /// allocation becomes part of the open txg, which is returned.
    pub fn commit(&mut self, id: AllocationId) -> Result<Txg> {
        let a = self
            .inflight
            .remove(&id)
            .ok_or(Error::UnknownAllocation(id))?;
        if let Reservation::Slots(..) = a.res {
            // Legacy ramp-up: +1 per completed write up to the group max.
            for e in a.extents() {
                let g = &mut self.vdevs[e.vdev as usize].mg;
                if g.legacy_cur_max < g.legacy_max {
                    g.legacy_cur_max += 1;
                    self.classes[NORMAL].max_slots += 1;
                }
            }
        }
        for e in a.extents() {
            self.txg.push(SpaceChange {
                kind: SpaceChangeKind::Alloc,
                extent: *e,
            });
        }
        self.finish(&a);
        Ok(self.open_txg)
    }

    /// Never written: release and free the space at once.
    pub fn abort(&mut self, id: AllocationId) -> Result<()> {
        let a = self
            .inflight
            .remove(&id)
            .ok_or(Error::UnknownAllocation(id))?;
        for e in a.extents() {
            self.unplace(e);
        }
        self.finish(&a);
        Ok(())
    }

    /// The extents of an in-flight allocation.
    pub fn extents_of(&self, id: AllocationId) -> Result<Vec<Extent>> {
        self.inflight
            .get(&id)
            .map(|a| a.extents().to_vec())
            .ok_or(Error::UnknownAllocation(id))
    }

    /// Number allocations from `first` on (the allocator starts each
    /// generation in its own range, so an id never names two allocations).
    pub fn start_allocation_ids_at(&mut self, first: AllocationId) {
        self.next_alloc = self.next_alloc.max(first);
    }

    /// A lease ended before the commit: release the allocation like an
    /// abort, but defer its space like a free (`TXG_DEFER_SIZE` syncs), so
    /// a late writer still holding the extent cannot land on a block that a
    /// newer allocation placed there. Nothing is persisted: the extents
    /// were never durable.
    pub fn expire(&mut self, id: AllocationId) -> Result<()> {
        let a = self
            .inflight
            .remove(&id)
            .ok_or(Error::UnknownAllocation(id))?;
        for e in a.extents() {
            let v = &mut self.vdevs[e.vdev as usize];
            let m = (e.offset >> v.shift) as u32;
            let ms = &mut v.ms[m as usize];
            let ok = ms.freeing.add(e.offset, e.size).is_ok();
            debug_assert!(ok, "expired extent {e} already free");
            self.txg.mark_dirty(e.vdev, ms);
        }
        self.finish(&a);
        Ok(())
    }

    /// Basic checks of a caller's extent.
    fn check_extent(&self, e: &Extent) -> Result<&Vdev> {
        let v = self
            .vdevs
            .get(e.vdev as usize)
            .ok_or(Error::UnknownVdev(e.vdev))?;
        if e.size == 0 {
            return Err(Error::ZeroSize);
        }
        let mask = v.min_alloc() - 1;
        if e.offset & mask != 0 || e.size & mask != 0 {
            return Err(Error::Misaligned(*e));
        }
        if e.offset.checked_add(e.size).is_none_or(|end| end > v.end()) {
            return Err(Error::OutOfRange(*e));
        }
        Ok(v)
    }

    /// Sorted copy of a slice with the first overlapping pair, if any
    /// (exact duplicates are reported as overlaps too).
    fn first_overlap(extents: &[Extent]) -> Option<(Extent, Extent)> {
        if extents.len() < 2 {
            return None;
        }
        let mut sorted = extents.to_vec();
        sorted.sort();
        sorted
            .windows(2)
            .find(|w| w[0].vdev == w[1].vdev && w[0].offset + w[0].size > w[1].offset)
            .map(|w| (w[0], w[1]))
    }

    /// Free committed space; reusable after TXG_DEFER_SIZE more syncs.
    /// All-or-nothing over the slice.
    pub fn free(&mut self, extents: &[Extent]) -> Result<Txg> {
        for e in extents {
            let v = self.check_extent(e)?;
            let mut free = 0;
            for (m, off, len) in pieces(v.shift, e) {
                free += v.ms[m as usize].free_overlap(off, len);
            }
            if free == e.size {
                return Err(Error::NotAllocated(*e));
            }
            if free > 0 {
                return Err(Error::PartlyAllocated(*e));
            }
            if v.inflight_overlap(e.offset, e.size).is_some() {
                // Placed but never committed: abort it instead.
                return Err(Error::NotAllocated(*e));
            }
        }
        if let Some((_, later)) = Self::first_overlap(extents) {
            return Err(Error::NotAllocated(later));
        }
        for e in extents {
            let v = &mut self.vdevs[e.vdev as usize];
            let shift = v.shift;
            for (m, off, len) in pieces(shift, e) {
                let ms = &mut v.ms[m as usize];
                let ok = ms.freeing.add(off, len).is_ok();
                debug_assert!(ok);
                self.txg.mark_dirty(e.vdev, ms);
            }
            self.txg.push(SpaceChange {
                kind: SpaceChangeKind::Free,
                extent: *e,
            });
        }
        Ok(self.open_txg)
    }

    /// Re-assert extents after a restart: succeeds when free (allocates them
    /// as committed) or already allocated exactly so. All-or-nothing.
    pub fn claim(&mut self, extents: &[Extent]) -> Result<Txg> {
        let mut todo: Vec<Extent> = Vec::new();
        for e in extents {
            let v = self.check_extent(e)?;
            if let Some(x) = v.inflight_overlap(e.offset, e.size) {
                return Err(Error::ClaimConflict {
                    requested: *e,
                    conflicting: x,
                });
            }
            let (mut allocatable, mut free) = (0, 0);
            for (m, off, len) in pieces(v.shift, e) {
                let ms = &v.ms[m as usize];
                allocatable += ms.allocatable.overlap_bytes(off, len);
                free += ms.free_overlap(off, len);
            }
            if allocatable == e.size {
                todo.push(*e);
            } else if free != 0 {
                // Partly allocated, or (partly) freed and still deferred.
                let mut conflicting = None;
                for (m, off, len) in pieces(v.shift, e) {
                    if let Some((s, l)) = v.ms[m as usize].first_allocated_in(off, len) {
                        conflicting = Some((s, l));
                        break;
                    }
                }
                let (s, l) = conflicting.unwrap_or((e.offset, e.size));
                return Err(Error::ClaimConflict {
                    requested: *e,
                    conflicting: Extent {
                        vdev: e.vdev,
                        offset: s,
                        size: l,
                    },
                });
            }
        }
        todo.sort();
        todo.dedup();
        if let Some((a, b)) = Self::first_overlap(&todo) {
            return Err(Error::ClaimConflict {
                requested: b,
                conflicting: a,
            });
        }
        for e in &todo {
            let v = &mut self.vdevs[e.vdev as usize];
            let shift = v.shift;
            for (m, off, len) in pieces(shift, e) {
                let ci = v.class_of(m);
                let (ms, g) = v.ms_and_group(m, ci);
                let ok = ms.allocatable.remove(off, len);
                debug_assert!(ok);
                self.txg.mark_dirty(e.vdev, ms);
                let g = g.expect("group of its class");
                g.alloc += len;
                g.note_changed(ms);
                self.classes[ci].alloc += len;
            }
            self.txg.push(SpaceChange {
                kind: SpaceChangeKind::Alloc,
                extent: *e,
            });
        }
        Ok(self.open_txg)
    }

    /// `sync_at` the time of the previous sync: for callers without a clock
    /// (tests); metaslabs then never pass `metaslab_unload_delay_ms`.
    pub fn sync(&mut self) -> TxgSync {
        self.sync_at(self.now_ms)
    }

    /// Close the open txg at the caller's time `now_ms` (a clock of its own:
    /// wall time in the allocator, virtual time in the simulator; never
    /// read here): deferred frees move on, balance is recomputed, metaslabs
    /// unload after both delays and the best of each group are preloaded,
    /// and exactly what changed is returned.
    pub fn sync_at(&mut self, now_ms: u64) -> TxgSync {
        self.now_ms = self.now_ms.max(now_ms);
        let txg = self.open_txg;
        let changes = std::mem::take(&mut self.txg.changes);
        self.txg.bytes = 0;
        let normal = &self.classes[NORMAL];
        let nodefer = normal.space.saturating_sub(normal.alloc) <= self.slop();
        let dirty = std::mem::take(&mut self.txg.dirty);
        let mut undeferred = 0;
        let mut touched: Vec<VdevId> = Vec::new();
        for (v, m) in dirty {
            let vd = &mut self.vdevs[v as usize];
            let ci = vd.class_of(m);
            let count = vd.ms.len() as u64;
            let rotational = vd.spec.rotational;
            let ms = &mut vd.ms[m as usize];
            ms.dirty = false;
            let moved = sync_done(ms, txg, nodefer);
            undeferred += moved;
            let became_ready = std::mem::replace(&mut ms.new, false);
            let size = ms.size;
            let still_deferred = ms.deferred() > 0;
            let g = if ci == ELOG {
                vd.log_mg.as_mut().expect("log group")
            } else {
                &mut vd.mg
            };
            g.alloc -= moved;
            if became_ready {
                g.space += size;
                g.ready += 1;
                self.classes[ci].space += size;
            }
            self.classes[ci].alloc -= moved;
            g.reweigh(&mut vd.ms[m as usize], rotational, count, &self.tun);
            g.dirty = true;
            if still_deferred {
                self.txg.mark_dirty(v, &mut vd.ms[m as usize]);
            }
            if touched.last() != Some(&v) {
                touched.push(v);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for v in touched {
            refresh_groups(&mut self.vdevs[v as usize], &self.tun);
        }
        self.unload(txg);
        self.preload();
        self.open_txg += 1;
        for ci in 0..3 {
            self.recount(ci);
        }
        if self.tun.throttle_policy == ThrottlePolicy::Legacy {
            self.legacy_reset();
        }
        // Log classes are never balanced onsync (spec §9.20).
        self.balance(NORMAL, true);
        self.dispatch();
        TxgSync {
            txg,
            changes,
            undeferred_bytes: undeferred,
        }
    }

    /// Unload metaslabs not selected for `metaslab_unload_delay` txgs *and*
    /// `metaslab_unload_delay_ms` (spec §2.10; `metaslab_evict`); active
    /// and embedded-log metaslabs stay loaded. The LRU is in selection
    /// order, so the walk stops at the first one too young.
    fn unload(&mut self, txg: Txg) {
        let delay = self.tun.metaslab_unload_delay;
        let delay_ms = self.tun.metaslab_unload_delay_ms;
        let mut keep = Vec::new();
        while let Some(&(sel, v, m)) = self.lru.first() {
            if txg <= sel.saturating_add(delay) {
                break;
            }
            let sel_ms = self.vdevs[v as usize].ms[m as usize].selected_ms;
            if self.now_ms < sel_ms.saturating_add(delay_ms) {
                break;
            }
            self.lru.pop_first();
            let ms = &mut self.vdevs[v as usize].ms[m as usize];
            if ms.role != Role::Inactive || ms.embedded_log {
                keep.push((txg, v, m));
                ms.selected_txg = txg;
            } else {
                ms.loaded = false;
            }
        }
        self.lru.extend(keep);
    }

    /// `metaslab_group_preload` (spec §2.10): after a sync, the first
    /// `metaslab_preload_limit` metaslabs of each group in tree order are
    /// loaded off the allocation path, so a data allocation rarely pays a
    /// load. They join the LRU as selected now.
    fn preload(&mut self) {
        if !self.tun.metaslab_preload_enabled || self.tun.metaslab_preload_limit == 0 {
            return;
        }
        let limit = self.tun.metaslab_preload_limit as usize;
        let (txg, now_ms) = (self.open_txg, self.now_ms);
        for vd in &mut self.vdevs {
            let v = vd.id;
            let groups: Vec<Vec<u32>> = [Some(&vd.mg), vd.log_mg.as_ref()]
                .into_iter()
                .flatten()
                .map(|g| g.members().take(limit).collect())
                .collect();
            for id in groups.into_iter().flatten() {
                let ms = &mut vd.ms[id as usize];
                if ms.loaded || ms.new {
                    continue;
                }
                ms.loaded = true;
                if ms.selected_txg != 0 {
                    self.lru.remove(&(ms.selected_txg, v, id));
                }
                ms.selected_txg = txg;
                ms.selected_ms = now_ms;
                self.lru.insert((txg, v, id));
            }
        }
    }

    pub(crate) fn txg_dirty(&self, v: VdevId, m: u32) -> bool {
        self.txg.dirty.contains(&(v, m))
    }

    pub fn stats(&self) -> crate::PoolStats {
        crate::stats::pool_stats(self)
    }

    /// Check invariants (no overlaps, per-vdev sums match); the first broken
    /// one is named.
    pub fn verify(&self) -> Result<()> {
        crate::stats::verify(self)
    }
}

/// Refresh both groups of a vdev (fragmentation, allocatable). Only the
/// metaslabs noted as changed since the last refresh are visited (the
/// group's running sums), so a sync costs its dirty metaslabs, not the
/// vdev's metaslab count.
fn refresh_groups(v: &mut Vdev, t: &Tunables) {
    let (vs_space, vs_alloc) = (v.vs_space(), v.vs_alloc());
    v.mg.refresh(&mut v.ms, vs_space, vs_alloc, t);
    v.mg.dirty = false;
    if let Some(g) = v.log_mg.as_mut() {
        g.refresh(&mut v.ms, vs_space, vs_alloc, t);
        g.dirty = false;
    }
}

impl Vdev {
    /// A cheap stand-in used while a vdev is temporarily taken out.
    pub(crate) fn clone_empty(&self) -> Vdev {
        Vdev {
            id: self.id,
            spec: self.spec.clone(),
            shift: self.shift,
            ms: Vec::new(),
            mg: Group::new(self.id, self.mg.class),
            log_mg: None,
            health: self.health,
            online: self.online,
            elog: self.elog,
            data_children: self.data_children,
            inflight: BTreeMap::new(),
            removed: self.removed,
        }
    }
}
