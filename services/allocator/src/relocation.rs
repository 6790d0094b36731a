//! The balancer's moves, as the allocator tracks them. A Relocate is an
//! ordinary allocation (throttled, leased, tokened) that also names the
//! committed extent it replaces; its Commit frees that extent in the same
//! txg, so every synced txg holds exactly one of the two. Here: which
//! extents are being moved (a second Relocate or a Free of one is refused),
//! committed relocations until their txg is persisted (then the store
//! answers for them), and the progress of this start's last plan.

use std::collections::{BTreeMap, HashMap};

use aliquot_proto::v1 as pb;
use metaslab::{AllocationId, Extent, Txg};

use crate::store::RelocationRecord;

/// A relocation in flight: allocated, not yet committed.
#[derive(Clone, Copy, Debug)]
struct Moving {
    from: Extent,
    to: Extent,
    plan_id: u64,
    keep_address: bool,
}

/// What a Relocate asks of the placement of its new extent.
#[derive(Clone, Debug)]
pub struct RelocateIntent {
    pub from: Extent,
    pub plan_id: u64,
    /// Vdevs the new extent must not use: the source's and the caller's.
    pub avoid: Vec<metaslab::VdevId>,
    /// The commit keeps `from` allocated behind an indirect mapping entry
    /// instead of freeing it (`crate::indirect`).
    pub keep_address: bool,
}

/// The last plan made by this start and how much of it is committed.
#[derive(Clone, Debug, Default)]
pub struct PlanProgress {
    pub id: u64,
    pub moves: u64,
    pub bytes: u64,
    pub score_before: f64,
    pub score_after: f64,
    pub done_moves: u64,
    pub done_bytes: u64,
}

#[derive(Default)]
pub struct Relocations {
    inflight: HashMap<AllocationId, Moving>,
    /// Source extent → the relocation moving it.
    moving: HashMap<Extent, AllocationId>,
    /// Committed, txg not yet handed to the store.
    committed: BTreeMap<AllocationId, RelocationRecord>,
    /// Handed to the store with their txg, until it is persisted.
    syncing: Vec<RelocationRecord>,
    pub plan: Option<PlanProgress>,
    plans_made: u64,
}

/// A relocation's state as this allocator knows it in memory; `None`
/// means ask the store (durable) or it was never committed.
pub enum Known {
    InFlight {
        from: Extent,
        to: Extent,
        plan_id: u64,
    },
    Committed(RelocationRecord),
}

impl Relocations {
    /// The relocation moving exactly `e`, if one is in flight.
    pub fn moving(&self, e: &Extent) -> Option<AllocationId> {
        self.moving.get(e).copied()
    }

    pub fn is_relocation(&self, id: AllocationId) -> bool {
        self.inflight.contains_key(&id)
    }

    /// The source extent of in-flight relocation `id`, and whether its
    /// commit keeps the old address.
    pub fn source(&self, id: AllocationId) -> Option<(Extent, bool)> {
        self.inflight.get(&id).map(|m| (m.from, m.keep_address))
    }

    pub fn start(&mut self, id: AllocationId, intent: &RelocateIntent, to: Extent) {
        self.moving.insert(intent.from, id);
        self.inflight.insert(
            id,
            Moving {
                from: intent.from,
                to,
                plan_id: intent.plan_id,
                keep_address: intent.keep_address,
            },
        );
    }

    /// Aborted or expired: the source stays where it is.
    pub fn forget(&mut self, id: AllocationId) {
        if let Some(m) = self.inflight.remove(&id) {
            self.moving.remove(&m.from);
        }
    }

    /// Committed in `txg` (the caller freed the source in the same txg).
    pub fn committed(&mut self, id: AllocationId, txg: Txg) {
        let Some(m) = self.inflight.remove(&id) else {
            return;
        };
        self.moving.remove(&m.from);
        if let Some(p) = self
            .plan
            .as_mut()
            .filter(|p| p.id == m.plan_id && p.id != 0)
        {
            p.done_moves += 1;
            p.done_bytes += m.from.size;
        }
        self.committed.insert(
            id,
            RelocationRecord {
                allocation_id: id,
                plan_id: m.plan_id,
                from: m.from,
                to: m.to,
                txg,
            },
        );
    }

    /// The relocations committed in txgs up to `txg`, for its record; kept
    /// in memory until `persisted(txg)`.
    pub fn take_committed(&mut self, txg: Txg) -> Vec<RelocationRecord> {
        let (now, later): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut self.committed)
            .into_iter()
            .partition(|(_, r)| r.txg <= txg);
        self.committed = later;
        let now: Vec<RelocationRecord> = now.into_values().collect();
        self.syncing.extend(now.iter().copied());
        now
    }

    /// The store has txg `txg`: it answers for those relocations now.
    pub fn persisted(&mut self, txg: Txg) {
        self.syncing.retain(|r| r.txg > txg);
    }

    pub fn known(&self, id: AllocationId) -> Option<Known> {
        if let Some(m) = self.inflight.get(&id) {
            return Some(Known::InFlight {
                from: m.from,
                to: m.to,
                plan_id: m.plan_id,
            });
        }
        self.committed
            .get(&id)
            .or_else(|| self.syncing.iter().find(|r| r.allocation_id == id))
            .map(|r| Known::Committed(*r))
    }

    /// The vdevs where the copy at `at` is or is about to be: its own, and
    /// the target of a relocation of it in flight or committed but not yet
    /// persisted (then its own vdev no longer holds it, or soon not).
    pub fn homes(&self, at: (metaslab::VdevId, u64)) -> Vec<metaslab::VdevId> {
        let mut out = vec![at.0];
        let is_at = |e: &Extent| (e.vdev, e.offset) == at;
        for m in self.inflight.values().filter(|m| is_at(&m.from)) {
            out.push(m.to.vdev);
        }
        // A copy moved again is followed through each hop, in txg order.
        let mut done: Vec<&RelocationRecord> =
            self.committed.values().chain(self.syncing.iter()).collect();
        done.sort_by_key(|r| r.txg);
        let mut cur = at;
        for r in done {
            if (r.from.vdev, r.from.offset) == cur {
                cur = (r.to.vdev, r.to.offset);
                out.push(cur.0);
            }
        }
        out
    }

    pub fn in_flight(&self) -> (u32, u64) {
        (
            self.inflight.len() as u32,
            self.inflight.values().map(|m| m.from.size).sum(),
        )
    }

    /// Record a new plan; returns its id (unique per generation).
    pub fn new_plan(&mut self, generation: u64, plan: &pb::RebalancePlan) -> u64 {
        self.plans_made += 1;
        let id = (generation << 32) | self.plans_made;
        self.plan = Some(PlanProgress {
            id,
            moves: plan.moves.len() as u64,
            bytes: plan.bytes,
            score_before: plan.score_before,
            score_after: plan.score_after,
            done_moves: 0,
            done_bytes: 0,
        });
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4 KiB extent: these tests are about which blocks, not sizes.
    fn ext(vdev: u32, offset: u64) -> Extent {
        metaslab::testing::ext(vdev, offset, 4096)
    }

    #[test]
    fn a_relocation_is_known_until_the_store_has_it() {
        let mut r = Relocations::default();
        let plan = r.new_plan(
            3,
            &pb::RebalancePlan {
                bytes: 8192,
                ..Default::default()
            },
        );
        assert_eq!(plan >> 32, 3);
        let intent = RelocateIntent {
            from: ext(0, 0),
            plan_id: plan,
            avoid: vec![0],
            keep_address: false,
        };
        r.start(7, &intent, ext(1, 4096));
        assert_eq!(r.moving(&ext(0, 0)), Some(7));
        assert!(matches!(r.known(7), Some(Known::InFlight { .. })));
        r.committed(7, 10);
        assert_eq!(r.moving(&ext(0, 0)), None);
        assert_eq!(r.plan.as_ref().unwrap().done_moves, 1);
        assert!(r.take_committed(9).is_empty());
        let taken = r.take_committed(10);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].to, ext(1, 4096));
        // Between the hand-off and the persist, memory still answers.
        assert!(matches!(r.known(7), Some(Known::Committed(_))));
        r.persisted(10);
        assert!(r.known(7).is_none());
    }

    #[test]
    fn an_aborted_relocation_frees_its_source_for_another() {
        let mut r = Relocations::default();
        let intent = RelocateIntent {
            from: ext(0, 0),
            plan_id: 0,
            avoid: vec![],
            keep_address: false,
        };
        r.start(1, &intent, ext(1, 0));
        r.forget(1);
        assert_eq!(r.moving(&ext(0, 0)), None);
        assert!(r.known(1).is_none());
        r.start(2, &intent, ext(2, 0));
        assert_eq!(r.moving(&ext(0, 0)), Some(2));
    }
}
