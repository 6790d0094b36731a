//! Space committed in this generation, per vdev, freed since or not. A Claim
//! names a block an older generation committed in a txg that may not have
//! synced; if anything committed in this generation overlaps it, its bytes
//! were given out again and written over, so the claim is refused whoever
//! committed that space (the store cannot tell: it may hold the new block in
//! exactly the claimed shape and for the same client). Freeing the new block
//! does not bring the old bytes back, so freed space stays here; ranges are
//! kept coalesced, which bounds the set by the vdev's fragmentation rather
//! than by the number of commits.

use std::collections::{BTreeMap, HashMap};

use metaslab::{Extent, VdevId};

#[derive(Debug, Default)]
pub struct GenSpace {
    /// vdev → offset → end; disjoint, non-adjacent ranges.
    by_vdev: HashMap<VdevId, BTreeMap<u64, u64>>,
}

impl GenSpace {
    pub fn committed(&mut self, extents: &[Extent]) {
        for e in extents {
            let m = self.by_vdev.entry(e.vdev).or_default();
            let (mut start, mut end) = (e.offset, e.offset.saturating_add(e.size));
            // Every range touching [start, end], including adjacent ones.
            let first = m
                .range(..=start)
                .next_back()
                .filter(|(_, x_end)| **x_end >= start)
                .map_or(start, |(o, _)| *o);
            let touching: Vec<(u64, u64)> = m.range(first..=end).map(|(o, x)| (*o, *x)).collect();
            for (o, x_end) in touching {
                m.remove(&o);
                start = start.min(o);
                end = end.max(x_end);
            }
            m.insert(start, end);
        }
    }

    /// The first range committed in this generation that `e` overlaps.
    pub fn overlapping(&self, e: &Extent) -> Option<Extent> {
        let end = e.offset.saturating_add(e.size);
        let m = self.by_vdev.get(&e.vdev)?;
        // Disjoint ranges are ordered by end as by start: the last one
        // starting before `end` is the only candidate that can reach past
        // `e.offset` if any does.
        let (&off, &x_end) = m.range(..end).next_back()?;
        (x_end > e.offset).then_some(Extent {
            vdev: e.vdev,
            offset: off,
            size: x_end - off,
        })
    }

    /// Disjoint ranges held (metrics, tests).
    pub fn len(&self) -> usize {
        self.by_vdev.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_vdev.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use metaslab::testing::ext;

    use super::*;

    #[test]
    fn overlap_is_found_exactly_in_a_sub_range_and_straddling() {
        let mut g = GenSpace::default();
        g.committed(&[ext(1, 8192, 4096), ext(1, 16384, 4096)]);
        let y = ext(1, 8192, 4096);
        assert_eq!(g.overlapping(&y), Some(y));
        assert_eq!(g.overlapping(&ext(1, 9216, 1024)), Some(y));
        assert_eq!(g.overlapping(&ext(1, 4096, 8192)), Some(y));
        assert_eq!(
            g.overlapping(&ext(1, 12288, 8192)),
            Some(ext(1, 16384, 4096))
        );
        assert_eq!(g.overlapping(&ext(1, 12288, 4096)), None);
        assert_eq!(g.overlapping(&ext(2, 8192, 4096)), None);
    }

    #[test]
    fn ranges_coalesce_and_reuse_adds_nothing() {
        let mut g = GenSpace::default();
        g.committed(&[ext(1, 0, 4096), ext(1, 8192, 4096)]);
        assert_eq!(g.len(), 2);
        // Adjacent on both sides: one range.
        g.committed(&[ext(1, 4096, 4096)]);
        assert_eq!(g.len(), 1);
        assert_eq!(g.overlapping(&ext(1, 0, 1)), Some(ext(1, 0, 12288)));
        // The same space committed again (freed and reused): still one.
        g.committed(&[ext(1, 2048, 4096), ext(1, 0, 12288)]);
        assert_eq!(g.len(), 1);
        // Straddling the end grows it.
        g.committed(&[ext(1, 10240, 8192)]);
        assert_eq!(g.overlapping(&ext(1, 0, 1)), Some(ext(1, 0, 18432)));
        assert_eq!(g.len(), 1);
    }
}
