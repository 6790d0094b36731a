//! A metaslab group: the metaslabs one vdev contributes to one class,
//! ordered for selection (inactive first, then primary, then secondary;
//! by descending weight, ties by offset —
//! `metaslab.c:metaslab_compare@zfs-2.4.0`), with the group's activation
//! (`metaslab_group_alloc`), `find_valid_metaslab`, eligibility state
//! (`metaslab_group_alloc_update`) and the per-group throttle counters of
//! both policies.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::ops::Bound;

use crate::metaslab::{Metaslab, Role, weight_index, weight_is_space};
use crate::{ClassKind, ThrottlePolicy, Tunables, Txg, VdevId};

/// Tree key: (band, descending weight, id).
type Key = (u8, Reverse<u64>, u32);

fn band(role: Role) -> u8 {
    match role {
        Role::Inactive => 0,
        Role::Primary => 1,
        Role::Secondary => 2,
    }
}

fn key(ms: &Metaslab) -> Key {
    (band(ms.role), Reverse(ms.weight), ms.id)
}

/// How a DVA binds to a metaslab (`metaslab.c:metaslab_group_alloc@zfs-2.4.0`):
/// PRIMARY when no copy of the block is on this vdev yet, SECONDARY when one
/// is, CLAIM ("use any, bind nothing") when two or more are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Primary,
    Secondary,
    Claim,
}

impl Activation {
    /// From the number of this block's DVAs already on the vdev.
    pub fn for_copies_on_vdev(n: usize) -> Activation {
        match n {
            0 => Activation::Primary,
            1 => Activation::Secondary,
            _ => Activation::Claim,
        }
    }
}

/// What one `metaslab_group_alloc` did.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupAllocOutcome {
    /// Metaslab, offset and size given (the size is `asize` but for a
    /// ranged log block).
    pub offset: Option<(u32, u64, u64)>,
    /// Metaslabs activated while not loaded.
    pub loads: u32,
}

/// Facts `metaslab_group_alloc` needs from its vdev and the pool.
pub struct AllocCtx<'a> {
    pub t: &'a Tunables,
    pub txg: Txg,
    /// The caller's time at the last sync, ms (selection time).
    pub now_ms: u64,
    pub try_hard: bool,
    pub rotational: bool,
    pub ms_count: u64,
    pub min_alloc: u64,
    /// The allocator placing this block (`spa_alloc_count` lanes).
    pub allocator: usize,
    /// `spa_alloc_count`.
    pub allocators: usize,
}

#[derive(Clone, Debug)]
pub struct Group {
    pub vdev: VdevId,
    pub class: ClassKind,
    tree: BTreeSet<Key>,
    /// Active metaslabs per allocator slot, (primary, secondary)
    /// (`mga_primary`, `mga_secondary`): each allocator writes its own
    /// front on the vdev while the group has enough ready metaslabs
    /// (`slot_index`). Grown on first use; slot 0 always exists.
    slots: Vec<(Option<u32>, Option<u32>)>,
    /// Bytes of members that finished their first sync.
    pub space: u64,
    /// Bytes of members not allocatable (in flight, allocated, deferred).
    pub alloc: u64,
    pub ready: u32,
    // Unified throttle (`metaslab_class_balance`,
    // `metaslab_group_alloc_increment_all`, zfs-2.4.0).
    pub aliquot: u64,
    pub queue_target: u64,
    /// Bytes placed by throttled allocations, not yet committed, per
    /// allocator (`mga_queue_depth@zfs-2.4.0`, what its rotor compares with
    /// the queue target).
    queue_depth_by: Vec<u64>,
    // Legacy throttle (zfs-2.3.0).
    /// Per allocator (requests in flight, `cur_max`): LEGACY counts queue
    /// depth and ramps it up per group per allocator (`mga_alloc_queue_depth`,
    /// `mga_cur_max_alloc_queue_depth`, `metaslab.c@zfs-2.3.0`).
    legacy_lanes: Vec<(u64, u64)>,
    pub legacy_max: u64,
    pub legacy_aliquot: u64,
    pub legacy_bias: i64,
    // Eligibility (`metaslab_group_alloc_update`).
    pub allocatable: bool,
    pub no_free_space: bool,
    pub fragmentation: Option<u64>,
    pub dirty: bool,
    // Fragmentation kept as running sums over the members (free space in
    // 512-byte units, and that times each member's fragmentation), so a
    // sync refreshes only the members that changed since the last refresh
    // (`frag_changed`) instead of walking every metaslab of the vdev.
    frag_free: u128,
    frag_weighted: u128,
    /// Membership changed: the next refresh recomputes every member.
    frag_full: bool,
    frag_changed: Vec<u32>,
}

impl Group {
    pub fn new(vdev: VdevId, class: ClassKind) -> Group {
        Group {
            vdev,
            class,
            tree: BTreeSet::new(),
            slots: vec![(None, None)],
            space: 0,
            alloc: 0,
            ready: 0,
            aliquot: 0,
            queue_target: 0,
            queue_depth_by: Vec::new(),
            legacy_lanes: Vec::new(),
            legacy_max: 0,
            legacy_aliquot: 0,
            legacy_bias: 0,
            allocatable: false,
            no_free_space: true,
            fragmentation: Some(0),
            dirty: false,
            frag_free: 0,
            frag_weighted: 0,
            frag_full: true,
            frag_changed: Vec::new(),
        }
    }

    /// `ms`'s free space or fragmentation may have changed: its share of
    /// the group's fragmentation is recomputed at the next refresh (each
    /// metaslab listed once, so the list never outgrows the members).
    pub fn note_changed(&mut self, ms: &mut Metaslab) {
        if self.frag_full || ms.frag_noted {
            return;
        }
        ms.frag_noted = true;
        self.frag_changed.push(ms.id);
    }

    pub fn members(&self) -> impl Iterator<Item = u32> + '_ {
        self.tree.iter().map(|k| k.2)
    }

    pub fn insert(&mut self, ms: &Metaslab) {
        self.tree.insert(key(ms));
        self.frag_full = true;
        self.frag_changed.clear();
        self.alloc += ms.alloc();
        if !ms.new {
            self.space += ms.size;
            self.ready += 1;
        }
    }

    /// Re-key `ms` after its weight changed.
    pub fn set_weight(&mut self, ms: &mut Metaslab, weight: u64) {
        if ms.weight != weight {
            self.tree.remove(&key(ms));
            ms.weight = weight;
            self.tree.insert(key(ms));
        }
    }

    fn set_role(&mut self, ms: &mut Metaslab, role: Role) {
        self.tree.remove(&key(ms));
        ms.role = role;
        self.tree.insert(key(ms));
    }

    /// Allocator `k`'s LEGACY (requests in flight, cur_max).
    pub fn legacy_lane(&self, k: usize) -> (u64, u64) {
        self.legacy_lanes.get(k).copied().unwrap_or((0, 0))
    }

    pub fn legacy_lane_mut(&mut self, k: usize) -> &mut (u64, u64) {
        if self.legacy_lanes.len() <= k {
            let cur_max = self.legacy_lanes.first().map_or(0, |l| l.1);
            self.legacy_lanes.resize(k + 1, (0, cur_max));
        }
        &mut self.legacy_lanes[k]
    }

    /// Every allocator's bytes in flight on this group (the stats).
    pub fn queue_depth(&self) -> u64 {
        self.queue_depth_by.iter().sum()
    }

    /// Allocator `k`'s bytes in flight on this group.
    pub fn queue_depth_of(&self, k: usize) -> u64 {
        self.queue_depth_by.get(k).copied().unwrap_or(0)
    }

    pub fn add_queue_depth(&mut self, k: usize, bytes: u64) {
        if self.queue_depth_by.len() <= k {
            self.queue_depth_by.resize(k + 1, 0);
        }
        self.queue_depth_by[k] += bytes;
    }

    pub fn sub_queue_depth(&mut self, k: usize, bytes: u64) {
        if let Some(d) = self.queue_depth_by.get_mut(k) {
            *d = d.saturating_sub(bytes);
        }
    }

    /// The per-txg reset
    /// (`spa.c:spa_sync_adjust_vdev_max_queue_depth@zfs-2.3.0`): `n`
    /// allocators, each at `cur_max`.
    pub fn legacy_reset(&mut self, n: usize, cur_max: u64) {
        if self.legacy_lanes.len() < n {
            self.legacy_lanes.resize(n, (0, 0));
        }
        for l in &mut self.legacy_lanes {
            l.1 = cur_max;
        }
    }

    /// LEGACY requests in flight, all allocators.
    pub fn legacy_requests(&self) -> u64 {
        self.legacy_lanes.iter().map(|l| l.0).sum()
    }

    /// Σ cur_max over the allocators (the group's LEGACY queue target).
    pub fn legacy_cur_max(&self) -> u64 {
        self.legacy_lanes.iter().map(|l| l.1).sum()
    }

    /// The allocator slot allocator `allocator` of `allocators` uses here
    /// (`metaslab.c:metaslab_group_alloc@zfs-2.4.0`): its own while the group
    /// has at least three ready metaslabs per slot up to it (`allocator <
    /// mg_ms_ready / 3`), else slot 0, so a vdev with few metaslabs shares one
    /// pair among allocators (`metaslab_group_alloc`,
    /// module/zfs/metaslab.c@be7657e3f2:5055-5056). LEGACY shared slot 0 among
    /// all allocators until the group had three per allocator (`mg_ms_ready <
    /// mg_allocators × 3`, @3862ebbf1f:4855-4856).
    pub fn slot_index(&self, allocator: usize, allocators: usize, legacy: bool) -> usize {
        let ready = u64::from(self.ready);
        let shared = if legacy {
            ready < allocators as u64 * 3
        } else {
            allocator as u64 >= ready / 3
        };
        if shared { 0 } else { allocator }
    }

    /// The active (primary, secondary) metaslabs of allocator slot `i`.
    pub fn active(&self, i: usize) -> (Option<u32>, Option<u32>) {
        self.slots.get(i).copied().unwrap_or((None, None))
    }

    /// Bind `ms` to slot `i`'s role for `activation` (CLAIM binds nothing).
    pub fn activate(&mut self, ms: &mut Metaslab, activation: Activation, i: usize) {
        if self.slots.len() <= i {
            self.slots.resize(i + 1, (None, None));
        }
        let (role, slot) = match activation {
            Activation::Primary => (Role::Primary, &mut self.slots[i].0),
            Activation::Secondary => (Role::Secondary, &mut self.slots[i].1),
            Activation::Claim => return,
        };
        *slot = Some(ms.id);
        ms.activation_weight = ms.weight;
        self.set_role(ms, role);
    }

    fn slot(&self, activation: Activation, i: usize) -> Option<u32> {
        let (p, s) = self.active(i);
        match activation {
            Activation::Primary => p,
            Activation::Secondary => s,
            Activation::Claim => None,
        }
    }

    /// Passivate `ms` with its recomputed weight.
    pub fn passivate(&mut self, ms: &mut Metaslab) {
        // A metaslab is active for at most one slot and role; clear
        // wherever it is.
        for (p, s) in &mut self.slots {
            if *p == Some(ms.id) {
                *p = None;
            }
            if *s == Some(ms.id) {
                *s = None;
            }
        }
        ms.activation_weight = 0;
        self.set_role(ms, Role::Inactive);
    }

    /// Recompute `ms`'s weight and re-key it (keeping its role).
    pub fn reweigh(&mut self, ms: &mut Metaslab, rotational: bool, ms_count: u64, t: &Tunables) {
        self.tree.remove(&key(ms));
        ms.metaslab_weight(rotational, ms_count, t);
        self.tree.insert(key(ms));
        self.note_changed(ms);
    }

    /// `metaslab.c:find_valid_metaslab@zfs-2.4.0`. `holding` are the metaslabs
    /// of this vdev that already hold a DVA of the block: a ditto copy lands in
    /// another one (`metaslab_is_unique`) unless it is the first copy on the
    /// vdev, the candidate is already active (OpenZFS is then "desperate
    /// enough" to use another allocator's metaslab and does not look at
    /// distances), or the pass is trying hard: 2.3.0's rule
    /// (`metaslab.c:find_valid_metaslab@zfs-2.3.0`, `want_unique =
    /// !try_hard`); 2.4.0 takes only active metaslabs then and gangs the
    /// rest, which Aliquot cannot (DESIGN.md, "Try-hard ditto copies").
    fn find_valid_metaslab(
        &self,
        ms: &[Metaslab],
        search: Option<Key>,
        asize: u64,
        activation: Activation,
        holding: &[u32],
        ctx: &AllocCtx<'_>,
    ) -> Option<Key> {
        let lower = match search {
            Some(k) => Bound::Excluded(k),
            None => Bound::Unbounded,
        };
        let mut tries = 0u64;
        for k in self.tree.range((lower, Bound::Unbounded)) {
            tries += 1;
            if !ctx.try_hard && tries > ctx.t.zfs_metaslab_find_max_tries {
                return None;
            }
            let m = &ms[k.2 as usize];
            if m.new || !m.should_allocate(asize) {
                continue;
            }
            let was_active = m.role != Role::Inactive;
            if activation != Activation::Primary
                && !was_active
                && !ctx.try_hard
                && holding.contains(&m.id)
            {
                continue;
            }
            return Some(*k);
        }
        None
    }

    /// `metaslab.c:metaslab_group_alloc@zfs-2.4.0` for one DVA: use the
    /// metaslab active in the slot of `activation`, else the best valid one; on
    /// failure reweigh and move on. `holding`: metaslabs of this vdev that hold
    /// other DVAs of the block. `selected` is told of (re)selections: `(id, old
    /// selected txg, was loaded)`. A metaslab is chosen for `asize`; it gives
    /// up to `max_asize` where one free segment holds it.
    #[allow(clippy::too_many_arguments)]
    pub fn alloc(
        &mut self,
        ms: &mut [Metaslab],
        asize: u64,
        max_asize: u64,
        activation: Activation,
        holding: &[u32],
        ctx: &AllocCtx<'_>,
        selected: &mut impl FnMut(u32, Txg, bool),
    ) -> GroupAllocOutcome {
        let mut out = GroupAllocOutcome::default();
        let mut search: Option<Key> = None;
        let mut tried_slot = false;
        let si = self.slot_index(
            ctx.allocator,
            ctx.allocators,
            ctx.t.throttle_policy == ThrottlePolicy::Legacy,
        );
        // Bounded: each iteration either succeeds or moves the search past
        // a metaslab; the cap guards against a weight that does not drop.
        let mut budget = self.tree.len() + 2;
        while budget > 0 {
            budget -= 1;
            // The allocator's active metaslab for this copy is used as it
            // is, without the uniqueness check (`metaslab_group_alloc`).
            let id = match self.slot(activation, si) {
                Some(p) if !tried_slot => {
                    tried_slot = true;
                    p
                }
                _ => match self.find_valid_metaslab(ms, search, asize, activation, holding, ctx) {
                    Some(k) => {
                        search = Some(k);
                        k.2
                    }
                    None => break,
                },
            };
            let m = &mut ms[id as usize];
            // Mark selected; load if it was unloaded.
            let was_loaded = m.loaded;
            if m.selected_txg != ctx.txg || !was_loaded {
                selected(id, m.selected_txg, was_loaded);
                m.selected_txg = ctx.txg;
                m.selected_ms = ctx.now_ms;
            }
            if !was_loaded {
                m.loaded = true;
                out.loads += 1;
            }
            if m.role == Role::Inactive {
                if m.weight == 0 || m.new {
                    continue;
                }
                // A taken slot (its metaslab holds a DVA of this block, or
                // failed just now): use this one without owning it.
                if self.slot(activation, si).is_none() {
                    self.activate(m, activation, si);
                }
            }
            let owned = activation != Activation::Claim && self.slot(activation, si) == Some(id);
            if m.should_allocate(asize)
                && let Some((off, got)) = m.metaslab_df_alloc(asize, max_asize, ctx.t)
            {
                self.note_changed(m);
                if owned {
                    self.may_passivate(ms, id, ctx);
                }
                out.offset = Some((id, off, got));
                return out;
            }
            // Failed: reweigh, and passivate if ours.
            let m = &mut ms[id as usize];
            if owned {
                // Re-keyed before passivating (the tree key holds the
                // weight): changing the weight in place would leave its old
                // key behind, a phantom member.
                self.reweigh(m, ctx.rotational, ctx.ms_count, ctx.t);
                self.passivate(m);
            } else {
                self.reweigh(m, ctx.rotational, ctx.ms_count, ctx.t);
            }
        }
        if asize <= ctx.min_alloc {
            self.no_free_space = true;
        }
        out
    }

    /// Switch away from a segment-weighted metaslab whose best bucket has
    /// dropped (`metaslab.c:metaslab_segment_may_passivate@zfs-2.4.0`).
    fn may_passivate(&mut self, ms: &mut [Metaslab], id: u32, ctx: &AllocCtx<'_>) {
        let m = &mut ms[id as usize];
        if weight_is_space(m.activation_weight) {
            return;
        }
        let free = m.allocatable.space();
        if m.allocatable.max_size() > free / 16 * 15 {
            return;
        }
        let w = m.metaslab_segment_weight();
        let act = weight_index(m.activation_weight);
        if act >= weight_index(w) + ctx.t.zfs_metaslab_switch_threshold as u32 {
            self.set_weight(m, w);
            m.metaslab_set_fragmentation();
            self.note_changed(m);
            self.passivate(m);
        }
    }

    /// Refresh fragmentation
    /// (`metaslab.c:metaslab_group_fragmentation@zfs-2.4.0`: weighted by free
    /// space in 512-byte units) and the allocatable state
    /// (`metaslab.c:metaslab_group_alloc_update@zfs-2.4.0`).
    pub fn refresh(&mut self, ms: &mut [Metaslab], vs_space: u64, vs_alloc: u64, t: &Tunables) {
        let share = |m: &Metaslab| {
            (
                (m.allocatable.space() >> 9) as u128,
                m.fragmentation as u128,
            )
        };
        if self.frag_full {
            (self.frag_free, self.frag_weighted) = (0, 0);
            for k in &self.tree {
                let m = &mut ms[k.2 as usize];
                m.frag_noted = false;
                m.frag_share = share(m);
                self.frag_free += m.frag_share.0;
                self.frag_weighted += m.frag_share.0 * m.frag_share.1;
            }
            self.frag_full = false;
            self.frag_changed.clear();
        } else {
            for id in self.frag_changed.drain(..) {
                let m = &mut ms[id as usize];
                m.frag_noted = false;
                let (f, w) = m.frag_share;
                self.frag_free -= f;
                self.frag_weighted -= f * w;
                m.frag_share = share(m);
                self.frag_free += m.frag_share.0;
                self.frag_weighted += m.frag_share.0 * m.frag_share.1;
            }
        }
        #[cfg(debug_assertions)]
        {
            // The walk the running sums replace: they must agree exactly.
            let (mut total, mut weighted) = (0u128, 0u128);
            for id in self.members() {
                let (f, w) = share(&ms[id as usize]);
                total += f;
                weighted += f * w;
            }
            // Members whose recorded share is out of date (for the message).
            let stale: Vec<u32> = self
                .members()
                .filter(|&id| ms[id as usize].frag_share != share(&ms[id as usize]))
                .take(3)
                .collect();
            debug_assert_eq!(
                (total, weighted),
                (self.frag_free, self.frag_weighted),
                "vdev {} group fragmentation sums drifted (a change not noted; metaslabs {stale:?})",
                self.vdev
            );
        }
        self.fragmentation = self
            .frag_weighted
            .checked_div(self.frag_free)
            .map(|f| f as u64);
        let free_pct = vs_space.saturating_sub(vs_alloc) as u128 * 100 / (vs_space as u128 + 1);
        self.allocatable = self.ready > 0
            && free_pct > t.zfs_mg_noalloc_threshold as u128
            && self
                .fragmentation
                .is_none_or(|f| f <= t.zfs_mg_fragmentation_threshold);
        if self.ready > 0 {
            self.no_free_space = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_rules_differ_between_policies_with_four_allocators() {
        // 9 ready metaslabs, 4 allocators: HEAD gives allocators 0..2 their
        // own slots (k < 9 / 3 = 3) and 3 shares slot 0; LEGACY shares slot
        // 0 for all (9 < 4 × 3); at 12 ready LEGACY gives each its own.
        let mut g = Group::new(0, ClassKind::Normal);
        for id in 0..12 {
            g.insert(&Metaslab::new(id, 26, 12, false));
            let want_legacy: Vec<usize> = if id + 1 >= 12 {
                vec![0, 1, 2, 3]
            } else {
                vec![0; 4]
            };
            let legacy: Vec<usize> = (0..4).map(|k| g.slot_index(k, 4, true)).collect();
            assert_eq!(legacy, want_legacy, "{} ready", g.ready);
        }
        let mut g = Group::new(0, ClassKind::Normal);
        for id in 0..9 {
            g.insert(&Metaslab::new(id, 26, 12, false));
        }
        let head: Vec<usize> = (0..4).map(|k| g.slot_index(k, 4, false)).collect();
        assert_eq!(head, vec![0, 1, 2, 0]);
    }

    /// DESIGN.md, "Try-hard ditto copies: 2.3.0's rule": a second copy may
    /// take an inactive metaslab that holds the first only when trying
    /// hard; 2.4.0 would take neither inactive metaslab then.
    #[test]
    fn try_hard_ditto_copy_takes_an_inactive_metaslab_as_2_3_0() {
        let t = Tunables::default();
        let mut ms: Vec<Metaslab> = (0..2).map(|id| Metaslab::new(id, 24, 12, false)).collect();
        let mut g = Group::new(0, ClassKind::Normal);
        for m in &mut ms {
            m.metaslab_weight(false, 2, &t);
            g.insert(m);
        }
        let ctx = |try_hard| AllocCtx {
            t: &t,
            txg: 5,
            now_ms: 0,
            try_hard,
            rotational: false,
            ms_count: 2,
            min_alloc: 4096,
            allocator: 0,
            allocators: 1,
        };
        let holding = [0, 1];
        let find = |try_hard| {
            g.find_valid_metaslab(
                &ms,
                None,
                4096,
                Activation::Secondary,
                &holding,
                &ctx(try_hard),
            )
        };
        assert_eq!(find(false), None, "both hold a copy: not unique");
        assert!(find(true).is_some(), "trying hard, uniqueness is waived");
        // A first copy never asks.
        let first =
            g.find_valid_metaslab(&ms, None, 4096, Activation::Primary, &holding, &ctx(false));
        assert!(first.is_some());
    }
}
