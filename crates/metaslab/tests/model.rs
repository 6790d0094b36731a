//! Model-based test: random sequences of allocate (data and log, copies
//! 1–3, through the throttle with queueing, admission and cancel), commit,
//! abort, free, claim, sync, vdev add and growth, checked step by step
//! against a reference interval model: no two live extents overlap, none
//! leaves its vdev or misses its alignment, data never lands in an embedded
//! log metaslab, allocated bytes match exactly, freed space is not handed
//! out before its deferral ends, and each sync returns exactly the changes
//! of its txg and the bytes whose deferral ended.

use std::collections::{BTreeMap, VecDeque};

use metaslab::*;
use proptest::prelude::*;

/// xorshift64*: the test's own deterministic randomness per seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

#[derive(Clone, Copy)]
struct VdevModel {
    end: u64,
    ashift: u8,
    role: VdevRole,
    /// Embedded log metaslab range.
    elog: Option<(u64, u64)>,
}

type Map = BTreeMap<(VdevId, u64), u64>;

fn overlaps(map: &Map, e: &Extent) -> bool {
    map.range(..(e.vdev, e.offset + e.size))
        .next_back()
        .is_some_and(|(&(v, off), &size)| v == e.vdev && off + size > e.offset)
}

/// Bytes of `e` covered by entries of `map`.
fn covered(map: &Map, e: &Extent) -> u64 {
    let end = e.offset + e.size;
    let start = map
        .range(..(e.vdev, e.offset))
        .next_back()
        .filter(|&(&(v, off), &size)| v == e.vdev && off + size > e.offset)
        .map_or(e.offset, |(&(_, off), _)| off);
    map.range((e.vdev, start)..(e.vdev, end))
        .map(|(&(_, off), &size)| (off + size).min(end) - off.max(e.offset))
        .sum()
}

struct Model {
    rng: Rng,
    pool: Pool,
    vdevs: Vec<VdevModel>,
    /// Committed + in-flight extents.
    live: Map,
    /// In-flight extents (subset of live).
    inflight_map: Map,
    /// Freed, not yet reusable: size, txg of the free.
    deferred: BTreeMap<(VdevId, u64), (u64, Txg)>,
    inflight: Vec<(AllocationId, Vec<Extent>)>,
    committed: Vec<Vec<Extent>>,
    /// Queued tickets, one FIFO per allocator (each has its own budget).
    queued: Vec<VecDeque<Ticket>>,
    /// Requests submitted so far: the allocator of the next is this
    /// modulo `allocator_count()` (requests take allocators in turn).
    submitted: u64,
    ready: Vec<Ticket>,
    changes: Vec<SpaceChange>,
    ops: u64,
    /// ok data, ok log (log, elog, normal), nospace, txgwait, queued, nodefer syncs.
    counts: [u64; 8],
}

impl Model {
    fn new(seed: u64, policy: &str) -> Model {
        let mut t = Tunables::default();
        t.set("zfs_embedded_slog_min_ms", "4").unwrap();
        t.set("throttle_policy", policy).unwrap();
        let mut m = Model {
            rng: Rng(seed | 1),
            pool: Pool::new(t),
            vdevs: vec![],
            live: Map::new(),
            inflight_map: Map::new(),
            deferred: BTreeMap::new(),
            inflight: vec![],
            committed: vec![],
            queued: vec![VecDeque::new(); 4],
            submitted: 0,
            ready: vec![],
            changes: vec![],
            ops: 0,
            counts: [0; 8],
        };
        // 1 to 4 allocators (spa_alloc_count from 1..=16 CPUs).
        let cpus = 1 + m.rng.below(16);
        m.pool.set_cpus(cpus);
        let n = 2 + m.rng.below(2);
        for _ in 0..n {
            m.add_vdev();
        }
        m.sync();
        m
    }

    fn refresh_vdevs(&mut self) {
        self.vdevs = self
            .pool
            .stats()
            .vdevs
            .iter()
            .map(|v| {
                let ms = 1u64 << v.metaslab_shift;
                VdevModel {
                    end: v.metaslab_count as u64 * ms,
                    ashift: v.spec.ashift,
                    role: v.spec.role,
                    elog: v.embedded_log_metaslab.map(|i| (i as u64 * ms, ms)),
                }
            })
            .collect();
    }

    fn add_vdev(&mut self) {
        let r = &mut self.rng;
        let raidz = r.chance(30);
        let spec = VdevSpec {
            capacity: (256 + r.below(384)) << 20,
            ashift: if r.chance(50) { 9 } else { 12 },
            children: if raidz { 5 } else { 1 },
            parity: if raidz { 1 } else { 0 },
            rotational: r.chance(50),
            role: if r.chance(15) {
                VdevRole::Log
            } else {
                VdevRole::Normal
            },
            metaslab_shift: None,
        };
        let id = self.pool.add_vdev(spec).unwrap();
        assert_eq!(id as usize, self.vdevs.len());
        self.refresh_vdevs();
    }

    fn alloc_bytes(&self) -> u64 {
        self.pool.stats().classes.iter().map(|c| c.alloc).sum()
    }

    fn check_bytes(&self) {
        let live: u64 = self.live.values().sum();
        let deferred: u64 = self.deferred.values().map(|d| d.0).sum();
        assert_eq!(
            self.alloc_bytes(),
            live + deferred,
            "allocated bytes after {} ops",
            self.ops
        );
    }

    fn take_admitted(&mut self) {
        for t in self.pool.take_admitted() {
            // FIFO per allocator: admitted tickets leave from their queue's head.
            let lane = self
                .queued
                .iter()
                .position(|q| q.front() == Some(&t))
                .expect("admission out of order: not at the head of any allocator's queue");
            self.queued[lane].pop_front();
            self.ready.push(t);
        }
    }

    fn check_placement(&self, req: &AllocRequest, a: &Allocation) {
        assert_eq!(a.extents.len(), req.copies as usize);
        for (i, e) in a.extents.iter().enumerate() {
            let v = &self.vdevs[e.vdev as usize];
            let mask = (1u64 << v.ashift) - 1;
            assert_eq!(e.offset & mask, 0, "{e} misaligned");
            assert!(e.size >= req.size && e.size & mask == 0, "{e} size");
            assert!(e.offset + e.size <= v.end, "{e} outside vdev");
            assert!(!overlaps(&self.live, e), "{e} overlaps a live extent");
            assert!(
                !overlaps_deferred(&self.deferred, e),
                "{e} reuses deferred space"
            );
            // Copies may share a vdev, and even a metaslab once no inactive
            // one can take the copy (`metaslab.c:find_valid_metaslab@zfs-2.4.0`
            // skips the uniqueness check for an active candidate), but never
            // a byte.
            assert!(
                a.extents[..i].iter().all(|o| o.vdev != e.vdev
                    || o.offset + o.size <= e.offset
                    || e.offset + e.size <= o.offset),
                "copies {:?} overlap",
                a.extents
            );
            let in_elog = v
                .elog
                .is_some_and(|(s, l)| e.offset < s + l && e.offset + e.size > s);
            match (req.kind, a.tier) {
                (AllocKind::Data, None) => {
                    assert!(!in_elog, "data in the embedded log metaslab: {e}");
                    assert_eq!(v.role, VdevRole::Normal);
                }
                (AllocKind::Log, Some(LogTier::Log)) => assert_eq!(v.role, VdevRole::Log),
                (AllocKind::Log, Some(LogTier::EmbeddedLog)) => assert!(in_elog, "{e}"),
                (AllocKind::Log, Some(LogTier::Normal)) => {
                    assert!(!in_elog && v.role == VdevRole::Normal, "{e}")
                }
                other => panic!("tier {other:?}"),
            }
        }
    }

    fn allocate(&mut self, t: Ticket, req: AllocRequest) {
        let busy = self.rng.chance(50);
        match self.pool.allocate(t, busy) {
            Ok(a) => {
                self.counts[match a.tier {
                    None => 0,
                    Some(LogTier::Log) => 1,
                    Some(LogTier::EmbeddedLog) => 2,
                    Some(LogTier::Normal) => 3,
                }] += 1;
                self.check_placement(&req, &a);
                for e in &a.extents {
                    self.live.insert((e.vdev, e.offset), e.size);
                    self.inflight_map.insert((e.vdev, e.offset), e.size);
                }
                self.inflight.push((a.id, a.extents));
            }
            Err(Error::NoSpace { .. }) => {
                self.counts[4] += 1;
                // A log block waits for a sync only while one can help.
                assert!(
                    req.kind == AllocKind::Data || self.deferred.is_empty(),
                    "log NoSpace with frees pending"
                );
            }
            Err(Error::TxgWaitRequired { until }) => {
                self.counts[5] += 1;
                assert!(!self.deferred.is_empty(), "txg wait with nothing deferred");
                assert_eq!(req.kind, AllocKind::Log);
                assert_eq!(until, self.pool.open_txg() + TXG_DEFER_SIZE);
            }
            Err(e) => panic!("allocate: {e}"),
        }
    }

    fn submit(&mut self) {
        let r = &mut self.rng;
        let kind = if r.chance(15) {
            AllocKind::Log
        } else {
            AllocKind::Data
        };
        let size = match r.below(10) {
            0..=3 => 512 * (1 + r.below(256)),
            4..=7 => 1 + r.below(1 << 20),
            _ => 1 + r.below(8 << 20),
        };
        let copies = 1 + r.below(3) as u8;
        // Half the requests name an allocator by an affinity key; the rest
        // take the allocators in turn.
        let affinity = (r.below(2) == 0).then(|| r.below(8));
        let req = AllocRequest {
            kind,
            size,
            copies,
            max_size: None,
            affinity,
        };
        let lane = match affinity {
            Some(key) => self.pool.allocator_for(key),
            None => {
                let k = (self.submitted % self.pool.allocator_count() as u64) as usize;
                self.submitted += 1;
                k
            }
        };
        match self.pool.submit(req).unwrap() {
            Submitted::Ready(t) => self.allocate(t, req),
            Submitted::Queued(t) => {
                assert_eq!(kind, AllocKind::Data);
                self.counts[6] += 1;
                self.queued[lane].push_back(t);
            }
        }
    }

    fn pick<T>(rng: &mut Rng, v: &mut Vec<T>) -> Option<T> {
        if v.is_empty() {
            return None;
        }
        let i = rng.below(v.len() as u64) as usize;
        Some(v.swap_remove(i))
    }

    fn commit(&mut self) {
        let Some((id, extents)) = Self::pick(&mut self.rng, &mut self.inflight) else {
            return;
        };
        let txg = self.pool.commit(id).unwrap();
        assert_eq!(txg, self.pool.open_txg());
        for e in &extents {
            self.inflight_map.remove(&(e.vdev, e.offset));
            self.changes.push(SpaceChange {
                kind: SpaceChangeKind::Alloc,
                extent: *e,
            });
        }
        self.committed.push(extents);
    }

    fn abort(&mut self) {
        let Some((id, extents)) = Self::pick(&mut self.rng, &mut self.inflight) else {
            return;
        };
        self.pool.abort(id).unwrap();
        for e in &extents {
            self.inflight_map.remove(&(e.vdev, e.offset));
            self.live.remove(&(e.vdev, e.offset));
        }
    }

    fn free(&mut self) {
        let Some(extents) = Self::pick(&mut self.rng, &mut self.committed) else {
            return;
        };
        let before = self.alloc_bytes();
        // An in-flight extent or a double free in the slice: refused, nothing changes.
        if let Some((_, bad)) = self.inflight.first()
            && self.rng.chance(20)
        {
            let mut slice = extents.clone();
            slice.push(bad[0]);
            assert!(self.pool.free(&slice).is_err());
            assert_eq!(self.alloc_bytes(), before);
        }
        let txg = self.pool.free(&extents).unwrap();
        for e in &extents {
            self.live.remove(&(e.vdev, e.offset));
            self.deferred.insert((e.vdev, e.offset), (e.size, txg));
            self.changes.push(SpaceChange {
                kind: SpaceChangeKind::Free,
                extent: *e,
            });
        }
        assert_eq!(
            self.pool.free(&extents[..1]),
            Err(Error::NotAllocated(extents[0]))
        );
    }

    fn claim(&mut self) {
        if self.rng.chance(30)
            && let Some(x) = self.committed.first()
        {
            let x = x.clone();
            let n = self.changes.len();
            self.pool.claim(&x).unwrap();
            assert_eq!(n, self.changes.len());
            return;
        }
        let v = self.rng.below(self.vdevs.len() as u64) as VdevId;
        let vm = self.vdevs[v as usize];
        let sector = 1u64 << vm.ashift;
        let size = sector * (1 + self.rng.below(16));
        if vm.end < size {
            return;
        }
        let offset = self.rng.below((vm.end - size) / sector + 1) * sector;
        let e = Extent {
            vdev: v,
            offset,
            size,
        };
        let in_flight = overlaps(&self.inflight_map, &e);
        let deferred = overlaps_deferred(&self.deferred, &e);
        let cov = covered(&self.live, &e);
        let res = self.pool.claim(&[e]);
        if in_flight || deferred || (cov != 0 && cov != e.size) {
            assert!(
                matches!(res, Err(Error::ClaimConflict { .. })),
                "claim {e}: {res:?}"
            );
        } else {
            assert!(res.is_ok(), "claim {e}: {res:?}");
            if cov == 0 {
                self.live.insert((v, offset), size);
                self.committed.push(vec![e]);
                self.changes.push(SpaceChange {
                    kind: SpaceChangeKind::Alloc,
                    extent: e,
                });
            }
        }
    }

    fn cancel(&mut self) {
        if self.rng.chance(50) {
            if let Some(t) = Self::pick(&mut self.rng, &mut self.ready) {
                self.pool.cancel(t).unwrap();
            }
        } else {
            let lanes: Vec<usize> = (0..self.queued.len())
                .filter(|&k| !self.queued[k].is_empty())
                .collect();
            if lanes.is_empty() {
                return;
            }
            let k = lanes[self.rng.below(lanes.len() as u64) as usize];
            let i = self.rng.below(self.queued[k].len() as u64) as usize;
            let t = self.queued[k].remove(i).unwrap();
            self.pool.cancel(t).unwrap();
        }
    }

    fn sync(&mut self) {
        let st = self.pool.stats();
        let normal = &st.classes[0];
        let nodefer = normal.space.saturating_sub(normal.alloc) <= st.slop;
        let txg = self.pool.open_txg();
        self.counts[7] += nodefer as u64;
        let s = self.pool.sync();
        assert_eq!(s.txg, txg);
        // The pool's own txgs always fit its space maps: a store may take
        // them unchecked.
        assert!(s.checked, "txg {txg}'s changes do not fit the space maps");
        assert_eq!(
            s.changes,
            std::mem::take(&mut self.changes),
            "changes of txg {txg}"
        );
        // Frees of txg T return after T+2's sync; within the slop, after
        // T+1's (the sync of T itself runs before T is durable).
        let mut released = 0;
        self.deferred.retain(|_, d| {
            if nodefer && d.1 == txg {
                d.1 = txg - 1;
            }
            let done = d.1 + TXG_DEFER_SIZE == txg;
            if done {
                released += d.0;
            }
            !done
        });
        assert_eq!(s.undeferred_bytes, released, "undeferred at txg {txg}");
    }

    fn step(&mut self) {
        self.ops += 1;
        // Alternate fill and drain phases so the pool reaches its slop.
        let fill = (self.ops / 2500).is_multiple_of(2);
        let op = self.rng.below(1000);
        let free_w = if fill { 30 } else { 300 };
        let submit_w = if fill { 400 } else { 150 };
        let bounds = [submit_w, 150, 200, 30, free_w, 40, 10, 60];
        let mut acc = 0;
        let mut which = bounds.len();
        let total: u64 = bounds.iter().sum();
        let op = op * total / 1000;
        for (i, w) in bounds.iter().enumerate() {
            acc += w;
            if op < acc {
                which = i;
                break;
            }
        }
        let extra = self.rng.below(1000);
        match (which, extra) {
            (_, 0) => {
                if self.vdevs.len() < 6 {
                    self.add_vdev();
                }
            }
            (_, 1) => {
                let v = self.rng.below(self.vdevs.len() as u64) as VdevId;
                let cap = self.pool.stats().vdevs[v as usize].spec.capacity;
                self.pool
                    .grow_vdev(v, cap + (self.rng.below(4) << 26))
                    .unwrap();
                self.refresh_vdevs();
            }
            (_, 2..=3) => {
                // Faults and repairs: degraded and faulted vdevs, offline.
                let v = self.rng.below(self.vdevs.len() as u64) as VdevId;
                let health = match self.rng.below(4) {
                    0 => Health::Degraded,
                    1 => Health::Faulted,
                    _ => Health::Healthy,
                };
                self.pool.set_health(v, health).unwrap();
                match self.pool.set_online(v, self.rng.chance(80)) {
                    Ok(()) => {}
                    // Only when no other normal vdev takes allocations
                    // (`vdev_passivate`): the rule, checked from the stats.
                    Err(Error::LastAllocatingVdev(x)) => {
                        assert_eq!(x, v);
                        let st = self.pool.stats();
                        assert!(
                            !st.vdevs.iter().any(|o| o.id != v
                                && o.online
                                && o.spec.role == VdevRole::Normal
                                && matches!(o.health, Health::Healthy | Health::Degraded)),
                            "offline of vdev {v} refused while another takes allocations"
                        );
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            (0, _) => self.submit(),
            (1, _) => {
                if let Some(t) = Self::pick(&mut self.rng, &mut self.ready) {
                    // Admitted tickets carry their request in the pool; the
                    // model re-derives the kind from the placement check.
                    let req = AllocRequest {
                        kind: AllocKind::Data,
                        size: 1,
                        copies: 1,
                        max_size: None,
                        affinity: None,
                    };
                    self.allocate_admitted(t, req);
                }
            }
            (2, _) => self.commit(),
            (3, _) => self.abort(),
            (4, _) => self.free(),
            (5, _) => self.claim(),
            (6, _) => self.cancel(),
            _ => self.sync(),
        }
        self.take_admitted();
        self.check_bytes();
        if self.ops.is_multiple_of(500) {
            self.pool.verify().unwrap();
        }
    }

    /// Allocate a ticket admitted from the queue (always data: log
    /// requests are never queued).
    fn allocate_admitted(&mut self, t: Ticket, _req: AllocRequest) {
        let busy = self.rng.chance(50);
        match self.pool.allocate(t, busy) {
            Ok(a) => {
                let req = AllocRequest {
                    kind: AllocKind::Data,
                    size: 1,
                    copies: a.extents.len() as u8,
                    max_size: None,
                    affinity: None,
                };
                self.check_placement(&req, &a);
                for e in &a.extents {
                    self.live.insert((e.vdev, e.offset), e.size);
                    self.inflight_map.insert((e.vdev, e.offset), e.size);
                }
                self.inflight.push((a.id, a.extents));
            }
            Err(Error::NoSpace { .. }) => {}
            Err(e) => panic!("allocate admitted: {e}"),
        }
    }
}

fn overlaps_deferred(map: &BTreeMap<(VdevId, u64), (u64, Txg)>, e: &Extent) -> bool {
    map.range(..(e.vdev, e.offset + e.size))
        .next_back()
        .is_some_and(|(&(v, off), &(size, _))| v == e.vdev && off + size > e.offset)
}

fn run(seed: u64, policy: &str, ops: u64) {
    let mut m = Model::new(seed, policy);
    for _ in 0..ops {
        m.step();
    }
    // Drain: commit everything, sync out the deferrals, check once more.
    while !m.inflight.is_empty() {
        m.commit();
    }
    for _ in 0..3 {
        m.sync();
    }
    assert!(m.deferred.is_empty());
    if std::env::var_os("MODEL_STATS").is_some() {
        let st = m.pool.stats();
        eprintln!(
            "{policy}: txg {} committed {} vdevs {} normal {}/{} elog {:?} admitted-queue {} stats {:?}",
            st.open_txg,
            m.committed.len(),
            m.vdevs.len(),
            st.classes[0].alloc,
            st.classes[0].space,
            st.vdevs
                .iter()
                .map(|v| v.embedded_log_metaslab)
                .collect::<Vec<_>>(),
            m.ready.len(),
            m.counts
        );
    }
    m.check_bytes();
    m.pool.verify().unwrap();
}

const POLICIES: [&str; 3] = ["unified", "legacy", "off"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// 24 cases × 5000 operations = 1.2 × 10^5 in the normal run.
    #[test]
    fn pool_matches_interval_model(seed in any::<u64>(), policy in 0usize..3) {
        run(seed, POLICIES[policy], 5000);
    }
}

/// 10^7 operations: `cargo test --release -p metaslab --test model -- --ignored`.
#[test]
#[ignore]
fn pool_matches_interval_model_10m() {
    for i in 0..100u64 {
        run(
            0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1),
            POLICIES[(i % 3) as usize],
            100_000,
        );
    }
}
