//! The pool: vdevs with their metaslab groups, the three classes, the
//! throttle (unified, legacy or off), tickets and in-flight allocations,
//! and the open txg. This file holds the state and the vdevs' lifecycle
//! (add, restore, grow, health, online; embedded log metaslabs,
//! `vdev_metaslab_init`); the rest of `impl Pool` is one concern per module:
//! `admission` (throttle reservations, busy, rdspace and slop),
//! `placement` (DVA placement over the ring, rotation, queue depth),
//! `class_balance` (`metaslab_class_balance`), `space` (commit, abort, expire, free, claim), `txg_sync`
//! (deferred frees, unload/preload) and `removal` (vdev removal).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::class::Class;
use crate::group::Group;
use crate::metaslab::Metaslab;
use crate::txg::TxgLog;
use crate::vdev::{data_children, metaslab_count, metaslab_shift};
use crate::{
    AllocKind, AllocationId, ClassKind, Error, Extent, Health, Result, TXG_INITIAL, ThrottlePolicy,
    Ticket, Tunables, Txg, VdevId, VdevRole, VdevSpec,
};

pub(crate) const NORMAL: usize = 0;
pub(crate) const LOG: usize = 1;
pub(crate) const ELOG: usize = 2;

/// The largest vdev: 2^17 metaslabs (`zfs_vdev_ms_count_limit`) of 2^40.
pub const MAX_VDEV_CAPACITY: u64 = 1 << 57;

/// Most metaslabs one vdev may have (memory bound on caller input).
pub(crate) const MAX_METASLABS: u64 = 1 << 20;

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
    pub req: TicketReq,
    /// Which of the class's allocators places it.
    pub allocator: usize,
    pub queued: bool,
    pub res: Reservation,
}

/// A map keyed by the pool's own sequential ids (tickets, allocations):
/// never a caller's choice, so no flooding to resist. With std's SipHash
/// these maps' inserts and removes were 12 % of the 4 KiB allocation
/// path's profile (`benches/alloc.rs`); foldhash's fixed seed also keeps
/// the crate deterministic (std's is random per process).
pub(crate) type IdMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// What a ticket keeps of its request: what placement reads, with the
/// size range resolved once (`max_size` is `size` for a fixed block). The
/// affinity key is spent at submit, when it picks the allocator. (Copying the
/// whole request was thought to make the path ~5 % slower; a profile put that
/// on SipHash and the `rdspace` scan instead.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct TicketReq {
    pub kind: AllocKind,
    pub copies: u8,
    pub size: u64,
    /// `size` unless the request gave a range.
    pub max_size: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Inflight {
    pub extents: [Extent; 3],
    pub n: u8,
    pub psize: u64,
    pub res: Reservation,
    /// The allocator whose budget `res` is in.
    pub allocator: usize,
}

impl Inflight {
    pub(crate) fn extents(&self) -> &[Extent] {
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
    /// Free space kept out of allocation (`Pool::hold`): offset → size,
    /// each piece inside one metaslab. Never persisted.
    pub held: BTreeMap<u64, u64>,
    /// Removed from the pool (`Pool::remove_vdev`): a tombstone keeping the
    /// id, with no metaslabs, never in a ring, absent from `stats`.
    pub removed: bool,
}

impl Vdev {
    /// Faulted, unavailable and offline vdevs are never allocatable.
    pub fn vdev_allocatable(&self) -> bool {
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
    pub(crate) fn ms_and_group(
        &mut self,
        m: u32,
        ci: usize,
    ) -> (&mut Metaslab, Option<&mut Group>) {
        let g = if ci == ELOG {
            self.log_mg.as_mut()
        } else if ci == self.main_class() {
            Some(&mut self.mg)
        } else {
            None
        };
        (&mut self.ms[m as usize], g)
    }

    pub(crate) fn group_mut(&mut self, ci: usize) -> Option<&mut Group> {
        if ci == ELOG {
            self.log_mg.as_mut()
        } else if ci == self.main_class() {
            Some(&mut self.mg)
        } else {
            None
        }
    }

    /// Class of the group holding metaslab `m`.
    pub(crate) fn class_of(&self, m: u32) -> usize {
        if self.elog == Some(m) {
            ELOG
        } else {
            self.main_class()
        }
    }

    pub fn end(&self) -> u64 {
        (self.ms.len() as u64) << self.shift
    }

    pub(crate) fn min_alloc(&self) -> u64 {
        1 << self.spec.ashift
    }

    /// The in-flight extent overlapping `[off, off+size)`, if any.
    pub(crate) fn inflight_overlap(&self, off: u64, size: u64) -> Option<Extent> {
        let (&s, &(len, _)) = self.inflight.range(..off + size).next_back()?;
        (s + len > off).then_some(Extent {
            vdev: self.id,
            offset: s,
            size: len,
        })
    }
}

/// Pieces of an extent per metaslab: (metaslab id, offset, size).
pub(crate) fn pieces(shift: u8, e: &Extent) -> impl Iterator<Item = (u32, u64, u64)> {
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
/// `Clone` gives an independent copy (a bench or a what-if starts from one
/// built state).
#[derive(Clone)]
pub struct Pool {
    pub(crate) tun: Tunables,
    pub(crate) vdevs: Vec<Vdev>,
    pub(crate) classes: [Class; 3],
    pub(crate) open_txg: Txg,
    pub(crate) next_ticket: Ticket,
    pub(crate) next_alloc: AllocationId,
    pub(crate) tickets: IdMap<Ticket, TicketState>,
    pub(crate) inflight: IdMap<AllocationId, Inflight>,
    pub(crate) admitted: Vec<Ticket>,
    pub(crate) txg: TxgLog,
    /// Loaded metaslabs by last selection: (selected txg, vdev, metaslab).
    pub(crate) lru: BTreeSet<(Txg, VdevId, u32)>,
    /// The caller's clock at the last sync, ms (never read here).
    pub(crate) now_ms: u64,
    /// `spa_alloc_count`, and the allocator the next request uses.
    pub(crate) alloc_count: usize,
    pub(crate) next_allocator: usize,
    /// The normal vdevs that are offline (not removed): what
    /// [`Self::rdspace`] takes from the class's space. Kept by
    /// `update_membership` and removal, so the allocation path reads a
    /// short list instead of every vdev (usually empty).
    pub(crate) offline_normal: Vec<VdevId>,
}

/// Placement result of one allocation.
pub(crate) struct Placed {
    pub(crate) extents: [Extent; 3],
    pub(crate) n: usize,
    pub(crate) loads: u32,
    /// Bytes of the block every copy holds (see `Allocation::psize`).
    pub(crate) psize: u64,
}

pub(crate) const NO_EXTENT: Extent = Extent {
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
            psize: 0,
        }
    }
}

impl Placed {
    /// Metaslabs of vdev `v` (shift `shift`) holding a DVA of this block.
    pub(crate) fn holding(&self, v: VdevId, shift: u8) -> ([u32; 3], usize) {
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
            tickets: IdMap::default(),
            inflight: IdMap::default(),
            admitted: Vec::new(),
            txg: TxgLog::default(),
            lru: BTreeSet::new(),
            now_ms: 0,
            alloc_count: 1,
            next_allocator: 0,
            offline_normal: Vec::new(),
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
            pool.metaslab_class_balance(ci, false);
        }
        Ok(pool)
    }

    /// Validate a spec and build a vdev (metaslabs `new` or ready), not yet
    /// in any class.
    pub(crate) fn build_vdev(&self, id: VdevId, mut spec: VdevSpec, new: bool) -> Result<Vdev> {
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
            held: BTreeMap::new(),
            removed: false,
        })
    }

    /// Embedded log selection (`vdev.c:vdev_metaslab_init@zfs-2.4.0`) among
    /// metaslabs `from..`: the least-allocated one, lowest index on ties, when
    /// the vdev has more than `zfs_embedded_slog_min_ms` metaslabs and none
    /// yet.
    pub(crate) fn select_elog(&self, v: &mut Vdev, from: usize) {
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
    pub(crate) fn adopt_metaslabs(&mut self, v: &mut Vdev, from: usize) {
        let count = v.ms.len() as u64;
        let main = v.main_class();
        for i in from..v.ms.len() {
            let ms = &mut v.ms[i];
            ms.metaslab_weight(v.spec.rotational, count, &self.tun);
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

    pub(crate) fn install_vdev(&mut self, mut v: Vdev) {
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
        self.refresh_offline_normal();
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
            self.metaslab_class_balance(ci, false);
        }
    }

    /// Recompute [`Self::offline_normal`] after a vdev's online state or
    /// presence changed (rare: not on the allocation path).
    pub(crate) fn refresh_offline_normal(&mut self) {
        self.offline_normal = self
            .vdevs
            .iter()
            .filter(|v| !v.removed && !v.online && v.main_class() == NORMAL)
            .map(|v| v.id)
            .collect();
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
            self.metaslab_class_balance(ci, false);
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

    /// Restore an offline state recorded before (a restart): no guard, the
    /// pool is being rebuilt as it was, whatever rules held when it was
    /// recorded.
    pub fn restore_offline(&mut self, vdev: VdevId) -> Result<()> {
        self.check_present(vdev)?;
        if let Some(v) = self.vdevs.get_mut(vdev as usize)
            && v.online
        {
            v.online = false;
            self.update_membership(vdev);
            self.dispatch();
        }
        Ok(())
    }

    /// Administrative online/offline; offline vdevs are not allocatable.
    /// The last normal vdev that still takes allocations cannot go offline:
    /// nothing could then be allocated at all (OpenZFS refuses the same,
    /// EINVAL: `vdev_removal.c:vdev_passivate@zfs-2.4.0`, which skips only
    /// the vdev itself, non-concrete and dead vdevs, and other classes).
    pub fn set_online(&mut self, vdev: VdevId, online: bool) -> Result<()> {
        self.check_present(vdev)?;
        if !online
            && let Some(v) = self.vdevs.get(vdev as usize)
            && v.online
            && v.spec.role == VdevRole::Normal
        {
            let another = self.vdevs.iter().any(|o| {
                o.id != vdev
                    && !o.removed
                    && o.spec.role == VdevRole::Normal
                    && o.online
                    && matches!(o.health, Health::Healthy | Health::Degraded)
            });
            if !another {
                return Err(Error::LastAllocatingVdev(vdev));
            }
        }
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
            self.metaslab_class_balance(ci, false);
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
pub(crate) fn refresh_groups(v: &mut Vdev, t: &Tunables) {
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
            held: BTreeMap::new(),
            removed: self.removed,
        }
    }
}
