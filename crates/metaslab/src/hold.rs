//! Held space: free space kept out of allocation for a while without being
//! allocated. After a takeover, the extents the lost txgs gave out (named by
//! the vdevs' agents, which recorded every write) may hold blocks that their
//! clients will re-assert with Claim during the claim window: nothing else
//! may be placed there meanwhile, while the rest of the vdev serves new
//! allocations at once. A claim takes held space as if it were free; at the
//! end of the window the rest is released. Nothing here is persisted: the
//! store never sees held space.

use std::collections::BTreeMap;

use crate::{Error, Extent, Result, VdevId};

use crate::pool::*;

impl Pool {
    /// Keep the allocatable parts of `e` out of allocation; returns the
    /// bytes newly held (space already allocated, in flight, deferred or
    /// held is left as it is).
    pub fn hold(&mut self, e: &Extent) -> Result<u64> {
        self.check_extent(e)?;
        let v = &mut self.vdevs[e.vdev as usize];
        let shift = v.shift;
        let mut held = 0;
        for (m, off, len) in pieces(shift, e) {
            let ci = v.class_of(m);
            let (ms, g) = v.ms_and_group(m, ci);
            let end = off + len;
            let mut taken: Vec<(u64, u64)> = Vec::new();
            let mut cur = off;
            while cur < end {
                let Some((s, l)) = ms.allocatable.find_in(cur, end - cur) else {
                    break;
                };
                taken.push((s, l));
                cur = s + l;
            }
            if taken.is_empty() {
                continue;
            }
            let mut bytes = 0;
            for &(s, l) in &taken {
                // Each found inside one free segment.
                let ok = ms.allocatable.remove(s, l);
                debug_assert!(ok, "held pieces were allocatable");
                bytes += l;
            }
            if let Some(g) = g {
                g.alloc += bytes;
                g.note_changed(ms);
            }
            self.classes[ci].alloc += bytes;
            held += bytes;
            v.held.extend(taken);
        }
        Ok(held)
    }

    /// Give back the held pieces overlapping `e` (whole pieces); returns
    /// them, so that a caller whose use of the space failed can hold them
    /// again.
    pub fn release_held(&mut self, e: &Extent) -> Vec<Extent> {
        let Some(v) = self.vdevs.get(e.vdev as usize) else {
            return Vec::new();
        };
        let pieces = overlapping(&v.held, e.offset, e.size);
        for &(off, len) in &pieces {
            self.give_back_held(e.vdev, off, len);
        }
        pieces
            .into_iter()
            .map(|(offset, size)| Extent {
                vdev: e.vdev,
                offset,
                size,
            })
            .collect()
    }

    /// The end of the hold: every held piece becomes allocatable again.
    pub fn release_all_held(&mut self) -> u64 {
        let mut bytes = 0;
        for id in 0..self.vdevs.len() {
            let held = std::mem::take(&mut self.vdevs[id].held);
            for (off, len) in held {
                self.vdevs[id].held.insert(off, len);
                self.give_back_held(id as VdevId, off, len);
                bytes += len;
            }
        }
        bytes
    }

    /// Bytes held over the pool.
    pub fn held_bytes(&self) -> u64 {
        self.vdevs.iter().flat_map(|v| v.held.values()).sum()
    }

    /// The first held piece overlapping `e`, if any.
    pub fn held_overlap(&self, e: &Extent) -> Option<Extent> {
        let v = self.vdevs.get(e.vdev as usize)?;
        overlapping(&v.held, e.offset, e.size)
            .first()
            .map(|&(offset, size)| Extent {
                vdev: e.vdev,
                offset,
                size,
            })
    }

    /// Held extents overlapping `extents`, as `Error::NotAllocated`: what a
    /// free must refuse (held space was never committed).
    pub(crate) fn check_not_held(&self, extents: &[Extent]) -> Result<()> {
        match extents.iter().find(|e| self.held_overlap(e).is_some()) {
            Some(e) => Err(Error::NotAllocated(*e)),
            None => Ok(()),
        }
    }

    fn give_back_held(&mut self, vdev: VdevId, off: u64, len: u64) {
        let v = &mut self.vdevs[vdev as usize];
        if v.held.remove(&off).is_none() {
            return;
        }
        let m = (off >> v.shift) as u32;
        let ci = v.class_of(m);
        let (ms, g) = v.ms_and_group(m, ci);
        let ok = ms.give_back(off, len);
        debug_assert!(ok, "a held piece was allocatable");
        if let Some(g) = g {
            g.alloc -= len;
            g.note_changed(ms);
        }
        self.classes[ci].alloc -= len;
    }
}

/// The pieces of `held` overlapping `[off, off+size)`.
fn overlapping(held: &BTreeMap<u64, u64>, off: u64, size: u64) -> Vec<(u64, u64)> {
    let end = off.saturating_add(size);
    let first = held
        .range(..off)
        .next_back()
        .filter(|(s, l)| **s + **l > off)
        .map_or(off, |(s, _)| *s);
    held.range(first..end).map(|(s, l)| (*s, *l)).collect()
}

#[cfg(test)]
mod tests {
    use crate::*;

    use crate::testing::{data, place, pool_of};

    fn pool() -> Pool {
        pool_of(&[1 << 30])
    }

    /// On the one vdev of [`pool`].
    fn ext(offset: u64, size: u64) -> Extent {
        crate::testing::ext(0, offset, size)
    }

    #[test]
    fn held_space_is_not_placed_claims_take_it_frees_refuse_it() {
        let mut p = pool();
        let a = ext(0, 1 << 20);
        assert_eq!(p.hold(&a).unwrap(), 1 << 20);
        assert_eq!(p.held_bytes(), 1 << 20);
        p.verify().unwrap();
        // Allocations land elsewhere.
        for _ in 0..8 {
            let got = place(&mut p, data(128 << 10, 1)).unwrap();
            for e in &got.extents {
                assert!(p.held_overlap(e).is_none(), "{e} placed in held space");
                assert!(e.offset >= a.offset + a.size, "{e}");
            }
            p.commit(got.id).unwrap();
        }
        p.sync();
        // A free of held space is refused: it was never committed.
        assert!(matches!(
            p.free(&[ext(4096, 4096)]),
            Err(Error::NotAllocated(_))
        ));
        // A claim inside it takes its part; the rest stays held.
        let c = ext(64 << 10, 64 << 10);
        p.claim(&[c]).unwrap();
        assert!(p.held_overlap(&c).is_none());
        assert_eq!(p.held_bytes(), (1 << 20) - (64 << 10));
        p.free(&[c]).unwrap();
        p.verify().unwrap();
        // The end of the window: all allocatable again.
        assert_eq!(p.release_all_held(), (1 << 20) - (64 << 10));
        assert_eq!(p.held_bytes(), 0);
        p.verify().unwrap();
        assert!(p.claim(&[ext(0, 64 << 10)]).is_ok());
    }

    #[test]
    fn hold_skips_allocated_space_and_a_failed_claim_keeps_the_hold() {
        let mut p = pool();
        p.claim(&[ext(8192, 8192)]).unwrap();
        assert_eq!(p.hold(&ext(0, 32768)).unwrap(), 32768 - 8192);
        // A claim straddling allocated and held space fails; the hold stays.
        assert!(p.claim(&[ext(4096, 8192)]).is_err());
        assert_eq!(p.held_bytes(), 32768 - 8192);
        p.verify().unwrap();
    }
}
