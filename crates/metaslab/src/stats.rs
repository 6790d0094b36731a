//! Introspection (`Pool::stats`): per class and per group exactly what the
//! services' status views and metrics are built from, and `Pool::verify`,
//! the invariant check used by tests and after restore.

use crate::pool::{ELOG, LOG, NORMAL, Pool, Reservation};
use crate::{ClassKind, Error, Health, Result, ThrottlePolicy, Txg, VdevId, VdevSpec};

#[derive(Clone, Debug, PartialEq)]
pub struct GroupStats {
    pub vdev: VdevId,
    /// Bytes (vs_space of the top-level vdev).
    pub capacity: u64,
    /// Bytes, deferred frees included (as OpenZFS counts them).
    pub alloc: u64,
    pub children: u32,
    pub parity: u32,
    pub aliquot: u64,
    pub queue_target: u64,
    /// Bytes placed and not yet committed.
    pub queue_depth: u64,
    /// Percent; `None` when not known.
    pub fragmentation: Option<u32>,
    pub health: Health,
    pub online: bool,
    pub free_fraction: f64,
    pub allocatable: bool,
    pub embedded_log_metaslab: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClassStats {
    pub kind: ClassKind,
    pub space: u64,
    pub alloc: u64,
    pub deferred: u64,
    pub reserved: u64,
    pub alloc_max: u64,
    pub alloc_io_size: u64,
    pub waiting: u32,
    pub waiting_bytes: u64,
    pub throttle_enabled: bool,
    pub fragmentation: Option<u32>,
    pub groups: Vec<GroupStats>,
}

impl ClassStats {
    /// Each group's capacity and allocation, in `groups` order.
    pub fn fills(&self) -> Vec<crate::balance_score::VdevFill> {
        self.groups
            .iter()
            .map(|g| crate::balance_score::VdevFill {
                capacity: g.capacity,
                alloc: g.alloc,
            })
            .collect()
    }

    /// The class's balance score (`crate::balance_score::score`).
    pub fn balance_score(&self) -> f64 {
        crate::balance_score::score(&self.fills())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct VdevStats {
    pub id: VdevId,
    pub spec: VdevSpec,
    pub metaslab_shift: u8,
    pub metaslab_count: u32,
    pub health: Health,
    pub online: bool,
    pub alloc: u64,
    pub embedded_log_metaslab: Option<u32>,
    /// Metaslabs loaded (in memory, selectable without a load stall).
    pub loaded_metaslabs: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    pub open_txg: Txg,
    pub policy: ThrottlePolicy,
    /// Bytes kept back from data (`spa_misc.c:spa_get_slop_space@zfs-2.4.0`).
    pub slop: u64,
    pub classes: Vec<ClassStats>,
    pub vdevs: Vec<VdevStats>,
}

fn class_stats(pool: &Pool, ci: usize) -> ClassStats {
    let c = &pool.classes[ci];
    let mut groups = Vec::new();
    let mut deferred = 0;
    let mut frag_weighted: u128 = 0;
    let mut frag_space: u128 = 0;
    let mut frag_valid = true;
    for v in pool.vdevs.iter().filter(|v| !v.removed) {
        let Some(g) = v.group(ci) else { continue };
        for id in g.members() {
            deferred += v.ms[id as usize].deferred();
        }
        let (vs_space, vs_alloc) = (v.vs_space(), v.vs_alloc());
        let in_ring = c.in_ring(v.id);
        let (aliquot, queue_target) =
            if pool.tun.throttle_policy == ThrottlePolicy::Legacy && ci == NORMAL {
                (
                    (g.legacy_aliquot as i64 + g.legacy_bias).max(0) as u64,
                    g.legacy_cur_max(),
                )
            } else {
                (g.aliquot, g.queue_target)
            };
        match g.fragmentation {
            Some(f) => {
                frag_weighted += f as u128 * g.space as u128;
                frag_space += g.space as u128;
            }
            None => frag_valid = false,
        }
        groups.push(GroupStats {
            vdev: v.id,
            capacity: vs_space,
            alloc: vs_alloc,
            children: v.spec.children,
            parity: v.spec.parity,
            aliquot: if in_ring { aliquot } else { 0 },
            queue_target: if in_ring { queue_target } else { 0 },
            queue_depth: g.queue_depth(),
            fragmentation: g.fragmentation.map(|f| f as u32),
            health: v.health,
            online: v.online,
            free_fraction: if vs_space == 0 {
                0.0
            } else {
                vs_space.saturating_sub(vs_alloc) as f64 / vs_space as f64
            },
            allocatable: in_ring && g.allocatable && v.vdev_allocatable(),
            embedded_log_metaslab: v.elog,
        });
    }
    let fragmentation = if frag_valid && frag_space > 0 {
        Some((frag_weighted / frag_space) as u32)
    } else if frag_valid {
        Some(0)
    } else {
        None
    };
    let policy = pool.tun.throttle_policy;
    ClassStats {
        kind: c.kind,
        space: c.space,
        alloc: c.alloc,
        deferred,
        reserved: c.reserved + c.legacy_bytes,
        alloc_max: c.alloc_max,
        alloc_io_size: c.alloc_io_size,
        waiting: c.waiting() as u32,
        waiting_bytes: c.waiting_bytes,
        throttle_enabled: c.throttle_enabled && policy != ThrottlePolicy::Off,
        fragmentation,
        groups,
    }
}

pub(crate) fn pool_stats(pool: &Pool) -> PoolStats {
    PoolStats {
        open_txg: pool.open_txg,
        policy: pool.tun.throttle_policy,
        slop: pool.spa_get_slop_space(),
        classes: [NORMAL, LOG, ELOG]
            .into_iter()
            .map(|ci| class_stats(pool, ci))
            .collect(),
        // Removed vdevs are forgotten: only their ids stay taken.
        vdevs: pool
            .vdevs
            .iter()
            .filter(|v| !v.removed)
            .map(|v| VdevStats {
                id: v.id,
                spec: v.spec.clone(),
                metaslab_shift: v.shift,
                metaslab_count: v.ms.len() as u32,
                health: v.health,
                online: v.online,
                alloc: v.vs_alloc(),
                embedded_log_metaslab: v.elog,
                loaded_metaslabs: v.ms.iter().filter(|m| m.loaded).count() as u32,
            })
            .collect(),
    }
}

fn broken(msg: String) -> Result<()> {
    Err(Error::Inconsistent(msg))
}

pub(crate) fn verify(pool: &Pool) -> Result<()> {
    let mut class_space = [0u64; 3];
    let mut class_alloc = [0u64; 3];
    let mut depth = vec![0u64; pool.vdevs.len()];
    // (vdev, allocator) -> bytes.
    let mut depth_by: std::collections::BTreeMap<(VdevId, usize), u64> = Default::default();
    let mut requests = vec![0u64; pool.vdevs.len()];
    let mut reserved = 0u64;
    let mut slots = 0u64;
    for a in pool.inflight.values() {
        for e in &a.extents[..a.n as usize] {
            let v = &pool.vdevs[e.vdev as usize];
            match v.inflight.get(&e.offset) {
                Some(&(len, _)) if len == e.size => {}
                _ => return broken(format!("in-flight extent {e} is not indexed")),
            }
            let m = (e.offset >> v.shift) as usize;
            if v.ms[m].free_overlap(e.offset, e.size) != 0 {
                return broken(format!("in-flight extent {e} overlaps free space"));
            }
            match a.res {
                Reservation::Bytes(_) => {
                    depth[e.vdev as usize] += a.psize;
                    *depth_by.entry((e.vdev, a.allocator)).or_default() += a.psize;
                }
                Reservation::Slots(..) => requests[e.vdev as usize] += 1,
                Reservation::None => {}
            }
        }
    }
    for r in pool
        .inflight
        .values()
        .map(|a| a.res)
        .chain(pool.tickets.values().map(|t| t.res))
    {
        match r {
            Reservation::Bytes(b) => reserved += b,
            Reservation::Slots(s, _) => slots += s,
            Reservation::None => {}
        }
    }
    let n_inflight: usize = pool.inflight.values().map(|a| a.n as usize).sum();
    let n_indexed: usize = pool.vdevs.iter().map(|v| v.inflight.len()).sum();
    if n_inflight != n_indexed {
        return broken(format!(
            "{n_indexed} in-flight extents indexed, {n_inflight} in flight"
        ));
    }
    for v in &pool.vdevs {
        let (mut g_alloc, mut g_space, mut l_alloc, mut l_space) = (0, 0, 0, 0);
        for ms in &v.ms {
            let trees = [&ms.allocatable, &ms.freeing, &ms.defer[0], &ms.defer[1]];
            for (i, t) in trees.iter().enumerate() {
                for (s, e) in t.iter() {
                    if s < ms.start || e > ms.end() {
                        return broken(format!(
                            "vdev {} metaslab {}: segment {s:#x}..{e:#x} outside it",
                            v.id, ms.id
                        ));
                    }
                    for (j, o) in trees.iter().enumerate() {
                        if i != j && o.overlap_bytes(s, e - s) != 0 {
                            return broken(format!(
                                "vdev {} metaslab {}: free segment {s:#x}..{e:#x} is in two trees",
                                v.id, ms.id
                            ));
                        }
                    }
                }
            }
            if (ms.deferred() > 0 || ms.new) && !ms.dirty {
                return broken(format!(
                    "vdev {} metaslab {}: deferred or new but not dirty",
                    v.id, ms.id
                ));
            }
            if ms.dirty != pool.txg_dirty(v.id, ms.id) {
                return broken(format!(
                    "vdev {} metaslab {}: dirty flag drifted",
                    v.id, ms.id
                ));
            }
            let space: u64 = ms.allocatable.iter().map(|(s, e)| e - s).sum();
            if space != ms.allocatable.space() {
                return broken(format!(
                    "vdev {} metaslab {}: space total drifted",
                    v.id, ms.id
                ));
            }
            if ms.embedded_log {
                l_alloc += ms.alloc();
                if !ms.new {
                    l_space += ms.size;
                }
            } else {
                g_alloc += ms.alloc();
                if !ms.new {
                    g_space += ms.size;
                }
            }
        }
        if g_alloc != v.mg.alloc || g_space != v.mg.space {
            return broken(format!(
                "vdev {}: group alloc/space {}/{} but metaslabs sum to {g_alloc}/{g_space}",
                v.id, v.mg.alloc, v.mg.space
            ));
        }
        if let Some(g) = &v.log_mg
            && (l_alloc != g.alloc || l_space != g.space)
        {
            return broken(format!("vdev {}: embedded log group sums differ", v.id));
        }
        let ci = v.main_class();
        class_alloc[ci] += g_alloc;
        class_space[ci] += g_space;
        class_alloc[ELOG] += l_alloc;
        class_space[ELOG] += l_space;
        if v.mg.queue_depth() != depth[v.id as usize] {
            return broken(format!(
                "vdev {}: queue depth {} but in-flight allocations hold {}",
                v.id,
                v.mg.queue_depth(),
                depth[v.id as usize]
            ));
        }
        for k in 0..pool.alloc_count.max(1) {
            let held = depth_by.get(&(v.id, k)).copied().unwrap_or(0);
            if v.mg.queue_depth_of(k) != held {
                return broken(format!(
                    "vdev {}: allocator {k}'s queue depth {} but its allocations hold {held}",
                    v.id,
                    v.mg.queue_depth_of(k)
                ));
            }
        }
        if v.mg.legacy_requests() != requests[v.id as usize] {
            return broken(format!("vdev {}: legacy queue depth drifted", v.id));
        }
    }
    for ci in 0..3 {
        let c = &pool.classes[ci];
        if c.space != class_space[ci] || c.alloc != class_alloc[ci] {
            return broken(format!(
                "class {:?}: space/alloc {}/{} but groups sum to {}/{}",
                c.kind, c.space, c.alloc, class_space[ci], class_alloc[ci]
            ));
        }
    }
    let c = &pool.classes[NORMAL];
    if c.reserved != reserved || c.slots_reserved != slots {
        return broken(format!(
            "normal class reserved {} bytes / {} slots but tickets hold {reserved} / {slots}",
            c.reserved, c.slots_reserved
        ));
    }
    if c.reserved_by.iter().sum::<u64>() != c.reserved
        || c.slots_by.iter().sum::<u64>() != c.slots_reserved
    {
        return broken("per-allocator reservations do not add up to the class's".into());
    }
    // Each ticket and allocation is in its own allocator's budget and queue.
    let lanes = c.reserved_by.len();
    let mut by_lane = vec![(0u64, 0u64); lanes];
    for (res, k) in pool
        .inflight
        .values()
        .map(|a| (a.res, a.allocator))
        .chain(pool.tickets.values().map(|t| (t.res, t.allocator)))
    {
        match res {
            Reservation::Bytes(b) => by_lane[c.lane(k)].0 += b,
            Reservation::Slots(s, _) => by_lane[c.lane(k)].1 += s,
            Reservation::None => {}
        }
    }
    for (k, &(b, s)) in by_lane.iter().enumerate() {
        if b != c.reserved_by[k] || s != c.slots_by[k] {
            return broken(format!(
                "allocator {k} reserved {} bytes / {} slots but its tickets hold {b} / {s}",
                c.reserved_by[k], c.slots_by[k]
            ));
        }
    }
    for (k, q) in c.waiters.iter().enumerate() {
        if q.iter()
            .filter_map(|t| pool.tickets.get(t))
            .any(|t| c.lane(t.allocator) != k)
        {
            return broken(format!("allocator {k}'s queue holds another's ticket"));
        }
    }
    let waiting: u64 = c
        .waiters
        .iter()
        .flatten()
        .filter_map(|t| pool.tickets.get(t))
        .map(|t| t.req.copies as u64 * t.req.size)
        .sum();
    if waiting != c.waiting_bytes {
        return broken("waiting bytes drifted".into());
    }
    let _ = (Health::Healthy, ClassKind::Normal);
    Ok(())
}

/// Unused type parameters kept nameable for docs.
#[allow(dead_code)]
type _Names = (Txg, VdevId, VdevSpec);
