//! A metaslab class (`metaslab_class_t`, `metaslab_impl.h@zfs-2.4.0`): the ring
//! of groups with the allocator's rotor and visit counter, the unified
//! throttle's budget (`alloc_max`, `reserved`, `alloc_io_size`), the legacy
//! throttle's slots, and the FIFO of waiting tickets. Each of the class's
//! allocators (`spa_alloc_count`) has its own rotor position, visit counter,
//! reservation and queue (a "lane"); every call that turns a rotor names its
//! allocator.

use std::collections::VecDeque;

use crate::throttle::unified::{GroupInput, GroupQuota};
use crate::{ClassKind, Ticket, VdevId};

#[derive(Clone, Debug)]
pub struct Class {
    pub kind: ClassKind,
    pub is_log: bool,
    /// Activated groups in ring order (by vdev id).
    pub ring: Vec<VdevId>,
    /// Ring position by vdev id.
    pos: Vec<Option<usize>>,
    /// Every allocator's rotor (`mc_allocator[]`): an index into `ring`
    /// (`mca_rotor`) and the bytes given to that group during this visit
    /// (`mca_aliquot`).
    rotors: Vec<(usize, u64)>,
    /// Initialized ring groups (`mc_groups`).
    pub groups: u64,
    /// Allocatable ring groups (`mc_alloc_groups`).
    pub alloc_groups: u64,
    /// Bytes of all member groups' ready metaslabs, and not allocatable.
    pub space: u64,
    pub alloc: u64,
    // Unified throttle.
    pub alloc_io_size: u64,
    pub alloc_max: u64,
    pub throttle_enabled: bool,
    pub throttle_initialized: bool,
    /// Bytes reserved, all allocators (`Σ mca_reserved`).
    pub reserved: u64,
    /// Per allocator (`mca_reserved`): `alloc_max` bounds each one, so the
    /// class's in-flight bound is `spa_alloc_count × alloc_max`
    /// (`metaslab.c:metaslab_class_balance@zfs-2.4.0`; not a bound on the
    /// whole class).
    pub reserved_by: Vec<u64>,
    // Legacy throttle.
    pub slots_reserved: u64,
    /// Per allocator (`mca_alloc_slots`), each bounded by its own
    /// `max_slots_by` (`mca_alloc_max_slots`, ramped up per allocator).
    pub slots_by: Vec<u64>,
    pub max_slots_by: Vec<u64>,
    /// Bytes admitted under the legacy policy (for stats).
    pub legacy_bytes: u64,
    /// Waiters, one FIFO per allocator (OpenZFS 2.4 keeps one queue per class
    /// per allocator).
    pub waiters: Vec<VecDeque<Ticket>>,
    pub waiting_bytes: u64,
    // Scratch for balance.
    pub inputs: Vec<GroupInput>,
    pub quotas: Vec<GroupQuota>,
}

impl Class {
    pub fn new(kind: ClassKind) -> Class {
        Class {
            kind,
            is_log: kind != ClassKind::Normal,
            ring: Vec::new(),
            pos: Vec::new(),
            rotors: vec![(0, 0)],
            groups: 0,
            alloc_groups: 0,
            space: 0,
            alloc: 0,
            alloc_io_size: 128 << 10,
            alloc_max: u64::MAX,
            throttle_enabled: false,
            throttle_initialized: false,
            reserved: 0,
            reserved_by: vec![0],
            slots_reserved: 0,
            slots_by: vec![0],
            max_slots_by: vec![0],
            legacy_bytes: 0,
            waiters: vec![VecDeque::new()],
            waiting_bytes: 0,
            inputs: Vec::new(),
            quotas: Vec::new(),
        }
    }

    pub fn position(&self, v: VdevId) -> Option<usize> {
        self.pos.get(v as usize).copied().flatten()
    }

    pub fn in_ring(&self, v: VdevId) -> bool {
        self.position(v).is_some()
    }

    fn reindex(&mut self) {
        for p in self.pos.iter_mut() {
            *p = None;
        }
        for (i, &v) in self.ring.iter().enumerate() {
            if self.pos.len() <= v as usize {
                self.pos.resize(v as usize + 1, None);
            }
            self.pos[v as usize] = Some(i);
        }
    }

    /// `spa_alloc_count` allocators, each with its own rotor and visit
    /// counter.
    pub fn set_allocators(&mut self, n: usize) {
        // New allocators start spread round the ring after allocator 0's
        // rotor, where `metaslab_group_activate` would have put them had
        // they existed when the groups were activated (OpenZFS fixes the
        // count at import, before any group is activated).
        let (at, _) = self.rotors[0];
        let len = self.ring.len().max(1);
        let have = self.rotors.len();
        self.rotors
            .extend((have..n.max(1)).map(|k| ((at + k) % len, 0)));
        self.rotors.truncate(n.max(1));
        // Budgets and queues never shrink below what is outstanding: a
        // ticket's allocator index stays valid (`lane` clamps it anyway).
        let lanes = n.max(1).max(self.reserved_by.len());
        self.reserved_by.resize(lanes, 0);
        self.slots_by.resize(lanes, 0);
        let max = self.max_slots_by[0];
        self.max_slots_by.resize(lanes, max);
        self.waiters.resize_with(lanes, VecDeque::new);
    }

    /// The budget and queue index of allocator `k`.
    pub fn lane(&self, k: usize) -> usize {
        k.min(self.reserved_by.len() - 1)
    }

    /// Requests waiting in every allocator's queue.
    pub fn waiting(&self) -> usize {
        self.waiters.iter().map(|q| q.len()).sum()
    }

    pub fn allocators(&self) -> usize {
        self.rotors.len()
    }

    /// Allocator `k`'s entry in `rotors`: a ticket placed before the
    /// count shrank (`set_cpus`) uses the last allocator's, as `lane` does.
    fn at(&self, k: usize) -> usize {
        k.min(self.rotors.len() - 1)
    }

    /// Allocator `k`'s rotor, as an index into `ring`.
    pub fn rotor(&self, k: usize) -> usize {
        self.rotors[self.at(k)].0
    }

    /// Bytes allocator `k` gave its rotor group during this visit.
    pub fn visit_bytes(&self, k: usize) -> u64 {
        self.rotors[self.at(k)].1
    }

    pub fn add_visit_bytes(&mut self, k: usize, bytes: u64) {
        let k = self.at(k);
        self.rotors[k].1 += bytes;
    }

    /// Activate (`metaslab_group_activate@zfs-2.4.0`): insert right after
    /// allocator 0's rotor; allocator 0's rotor moves to the new group,
    /// allocator 1's to the one after it, and so on, so that allocators
    /// start spread over the ring rather than all on the new group.
    pub fn insert(&mut self, v: VdevId) {
        if self.in_ring(v) {
            return;
        }
        let at = if self.ring.is_empty() {
            self.ring.push(v);
            0
        } else {
            let at = self.rotors[0].0 + 1;
            self.ring.insert(at, v);
            at
        };
        let len = self.ring.len();
        for (k, r) in self.rotors.iter_mut().enumerate() {
            *r = ((at + k) % len, 0);
        }
        self.reindex();
    }

    /// Passivate: unlink; a rotor pointing at it moves to its successor.
    pub fn remove(&mut self, v: VdevId) {
        let Some(i) = self.position(v) else { return };
        self.ring.remove(i);
        let len = self.ring.len();
        for (rotor, visit) in &mut self.rotors {
            if len == 0 {
                *rotor = 0;
                continue;
            }
            if *rotor > i {
                *rotor -= 1;
            } else if *rotor == i {
                *visit = 0;
            }
            *rotor %= len;
        }
        self.reindex();
    }

    /// The group allocator `k`'s rotor is at.
    pub fn rotor_vdev(&self, k: usize) -> Option<VdevId> {
        self.ring.get(self.rotor(k)).copied()
    }

    /// Move allocator `k`'s rotor to the successor of `v` and reset its
    /// visit.
    pub fn rotate_after(&mut self, k: usize, v: VdevId) {
        if let Some(i) = self.position(v) {
            let k = self.at(k);
            self.rotors[k] = ((i + 1) % self.ring.len(), 0);
        }
    }
}
