//! What happens to placed space afterwards: commit (durable with the open
//! txg), abort, lease expiry (deferred like a free), free (deferred for
//! TXG_DEFER_SIZE syncs) and claim (re-asserting an extent after a
//! restart), with the extent checks they share.

use crate::{AllocationId, Error, Extent, Result, SpaceChange, SpaceChangeKind, Txg};

use crate::pool::*;

impl Pool {
    /// Release the throttle and queue depth of a finished allocation (none
    /// left if `written` gave them back already).
    pub(crate) fn finish(&mut self, a: &Inflight) {
        for e in a.extents() {
            self.vdevs[e.vdev as usize].inflight.remove(&e.offset);
        }
        self.release_throttle(a);
    }

    /// Give back an allocation's queue depth in each chosen group and its
    /// reservation in the class.
    fn release_throttle(&mut self, a: &Inflight) {
        for e in a.extents() {
            let v = &mut self.vdevs[e.vdev as usize];
            match a.res {
                Reservation::Bytes(_) => v.mg.sub_queue_depth(a.allocator, a.psize),
                Reservation::Slots(..) => {
                    let l = v.mg.legacy_lane_mut(a.allocator);
                    l.0 = l.0.saturating_sub(1);
                }
                Reservation::None => {}
            }
        }
        self.release(a.res, a.allocator);
    }

    /// Legacy ramp-up: +1 per completed write up to the group max, for the
    /// allocator that placed it (its group lane and its class slots,
    /// `metaslab.c:metaslab_group_alloc_decrement@zfs-2.3.0`).
    fn ramp_up(&mut self, a: &Inflight) {
        if let Reservation::Slots(..) = a.res {
            let lane = self.classes[NORMAL].lane(a.allocator);
            for e in a.extents() {
                let g = &mut self.vdevs[e.vdev as usize].mg;
                let max = g.legacy_max;
                let l = g.legacy_lane_mut(a.allocator);
                if l.1 < max {
                    l.1 += 1;
                    self.classes[NORMAL].max_slots_by[lane] += 1;
                }
            }
        }
    }

    /// Every copy of the block is written (its device acknowledged it):
    /// its throttle reservation and queue depth end here, not at the
    /// commit, as OpenZFS gives them back when a block's write is done
    /// (`zio.c:zio_dva_throttle_done@zfs-2.4.0`), so a caller committing
    /// many blocks together never waits on its own reservations. The space
    /// stays placed, in flight, until `commit`, `abort` or `expire`.
    /// Repeating it is a no-op.
    pub fn written(&mut self, id: AllocationId) -> Result<()> {
        let mut a = self
            .inflight
            .remove(&id)
            .ok_or(Error::UnknownAllocation(id))?;
        self.ramp_up(&a);
        self.release_throttle(&a);
        a.res = Reservation::None;
        self.inflight.insert(id, a);
        Ok(())
    }

    /// The block is to be kept: release throttle bytes and queue depth (if
    /// `written` did not already); the allocation becomes part of the open
    /// txg, which is returned.
    pub fn commit(&mut self, id: AllocationId) -> Result<Txg> {
        let a = self
            .inflight
            .remove(&id)
            .ok_or(Error::UnknownAllocation(id))?;
        self.ramp_up(&a);
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

    /// The id the next allocation will get (ids only grow).
    pub fn next_allocation_id(&self) -> AllocationId {
        self.next_alloc
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
    pub(crate) fn check_extent(&self, e: &Extent) -> Result<&Vdev> {
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
    pub(crate) fn first_overlap(extents: &[Extent]) -> Option<(Extent, Extent)> {
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
        self.check_not_held(extents)?;
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
        // Held space is taken as free; whatever of it the claim did not
        // take (all of it, if the claim failed) is held again.
        let mut released = Vec::new();
        for e in extents {
            released.extend(self.release_held(e));
        }
        let r = self.claim_unheld(extents);
        for e in &released {
            let _ = self.hold(e);
        }
        r
    }

    fn claim_unheld(&mut self, extents: &[Extent]) -> Result<Txg> {
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
}
