//! A metaslab class (spec §1.2): the ring of groups with the allocator's
//! rotor and visit counter, the unified throttle's budget (`alloc_max`,
//! `reserved`, `alloc_io_size`), the legacy throttle's slots, and the FIFO
//! of waiting tickets. One allocator per class.

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
    /// Index into `ring` (`mca_rotor`).
    pub rotor: usize,
    /// Bytes given to the rotor group during this visit (`mca_aliquot`).
    pub visit_bytes: u64,
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
    pub reserved: u64,
    // Legacy throttle.
    pub slots_reserved: u64,
    pub max_slots: u64,
    /// Bytes admitted under the legacy policy (for stats).
    pub legacy_bytes: u64,
    // Waiters (FIFO).
    pub waiters: VecDeque<Ticket>,
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
            rotor: 0,
            visit_bytes: 0,
            groups: 0,
            alloc_groups: 0,
            space: 0,
            alloc: 0,
            alloc_io_size: 128 << 10,
            alloc_max: u64::MAX,
            throttle_enabled: false,
            throttle_initialized: false,
            reserved: 0,
            slots_reserved: 0,
            max_slots: 0,
            legacy_bytes: 0,
            waiters: VecDeque::new(),
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

    /// Activate: insert right after the rotor and make it the rotor
    /// (spec §1.3).
    pub fn insert(&mut self, v: VdevId) {
        if self.in_ring(v) {
            return;
        }
        if self.ring.is_empty() {
            self.ring.push(v);
            self.rotor = 0;
        } else {
            self.ring.insert(self.rotor + 1, v);
            self.rotor += 1;
        }
        self.visit_bytes = 0;
        self.reindex();
    }

    /// Passivate: unlink; a rotor pointing at it moves to its successor.
    pub fn remove(&mut self, v: VdevId) {
        let Some(i) = self.position(v) else { return };
        self.ring.remove(i);
        if self.ring.is_empty() {
            self.rotor = 0;
        } else {
            if self.rotor > i {
                self.rotor -= 1;
            } else if self.rotor == i {
                self.visit_bytes = 0;
            }
            self.rotor %= self.ring.len();
        }
        self.reindex();
    }

    pub fn rotor_vdev(&self) -> Option<VdevId> {
        self.ring.get(self.rotor).copied()
    }

    /// Move the rotor to the successor of `v` and reset the visit.
    pub fn rotate_after(&mut self, v: VdevId) {
        if let Some(i) = self.position(v) {
            self.rotor = (i + 1) % self.ring.len();
            self.visit_bytes = 0;
        }
    }
}
