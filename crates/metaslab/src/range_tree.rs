//! Range trees (`range_tree.c@zfs-2.4.0`): disjoint half-open segments `[start,
//! end)` kept in an offset-ordered map, with a size-ordered companion set and a
//! 64-bucket power-of-two histogram, so both "what is at this offset" and "the
//! smallest segment of at least this size" are O(log n).
//!
//! A tree built with [`RangeTree::plain`] keeps only the offset map and the
//! space total (the freeing and defer trees need nothing more).

use std::collections::{BTreeMap, BTreeSet};

/// Number of histogram buckets: bucket `i` counts segments of size in
/// `[2^i, 2^(i+1))`.
pub const RANGE_TREE_HISTOGRAM_SIZE: usize = 64;

/// 1-based index of the most significant set bit; `highbit(0) == 0`.
#[inline]
pub fn highbit(x: u64) -> u32 {
    64 - x.leading_zeros()
}

#[inline]
fn bucket(size: u64) -> usize {
    (highbit(size) - 1) as usize
}

#[derive(Clone, Debug)]
pub struct RangeTree {
    segs: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    hist: [u64; RANGE_TREE_HISTOGRAM_SIZE],
    space: u64,
    indexed: bool,
}

impl Default for RangeTree {
    fn default() -> Self {
        Self::new()
    }
}

impl RangeTree {
    /// A tree with the size index and histogram.
    pub fn new() -> Self {
        RangeTree {
            segs: BTreeMap::new(),
            by_size: BTreeSet::new(),
            hist: [0; RANGE_TREE_HISTOGRAM_SIZE],
            space: 0,
            indexed: true,
        }
    }

    /// A tree without the size index (its histogram is kept: 64 counters,
    /// so fragmentation can add the free and defer trees in O(1)).
    pub fn plain() -> Self {
        RangeTree {
            indexed: false,
            ..Self::new()
        }
    }

    pub fn space(&self) -> u64 {
        self.space
    }

    /// Segments in the tree (tests check coalescing with it).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.segs.len()
    }

    /// The segment-size histogram.
    pub fn histogram(&self) -> &[u64; RANGE_TREE_HISTOGRAM_SIZE] {
        &self.hist
    }

    #[inline]
    fn index_add(&mut self, start: u64, end: u64) {
        let size = end - start;
        self.hist[bucket(size)] += 1;
        if self.indexed {
            self.by_size.insert((size, start));
        }
    }

    #[inline]
    fn index_remove(&mut self, start: u64, end: u64) {
        let size = end - start;
        self.hist[bucket(size)] -= 1;
        if self.indexed {
            self.by_size.remove(&(size, start));
        }
    }

    /// The segment overlapping `[start, end)` that starts last, if any.
    #[inline]
    fn last_overlap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let (&s, &e) = self.segs.range(..end).next_back()?;
        (e > start).then_some((s, e))
    }

    /// Add `[start, start+size)`, merging with touching neighbours. An
    /// overlap with a present segment is refused and returns that segment
    /// (the tree is unchanged).
    pub fn add(&mut self, start: u64, size: u64) -> Result<(), (u64, u64)> {
        debug_assert!(size > 0);
        let end = start + size;
        if let Some(seg) = self.last_overlap(start, end) {
            return Err(seg);
        }
        let mut new_start = start;
        let mut new_end = end;
        if start > 0
            && let Some((&ls, &le)) = self.segs.range(..start).next_back()
            && le == start
        {
            self.index_remove(ls, le);
            self.segs.remove(&ls);
            new_start = ls;
        }
        if let Some(re) = self.segs.get(&end).copied() {
            self.index_remove(end, re);
            self.segs.remove(&end);
            new_end = re;
        }
        self.segs.insert(new_start, new_end);
        self.index_add(new_start, new_end);
        self.space += size;
        Ok(())
    }

    /// Remove `[start, start+size)`, which must lie inside one segment;
    /// returns false (tree unchanged) otherwise.
    pub fn remove(&mut self, start: u64, size: u64) -> bool {
        let end = start + size;
        let Some((&s, &e)) = self.segs.range(..=start).next_back() else {
            return false;
        };
        if e < end {
            return false;
        }
        self.index_remove(s, e);
        if s < start {
            self.segs.insert(s, start);
            self.index_add(s, start);
        } else {
            self.segs.remove(&s);
        }
        if end < e {
            self.segs.insert(end, e);
            self.index_add(end, e);
        }
        self.space -= size;
        true
    }

    /// Remove many ranges at once: `ranges` are `(start, size)`, sorted by
    /// start and disjoint, each inside one segment. One pass over the tree
    /// and a bulk rebuild of its maps, instead of a split per range (a
    /// restart removes every allocated extent of a metaslab from its
    /// single free segment: millions of splits otherwise). Returns false,
    /// the tree unchanged, when a range is out of order or not inside one
    /// segment.
    pub fn remove_sorted(&mut self, ranges: &[(u64, u64)]) -> bool {
        if ranges.is_empty() {
            return true;
        }
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(self.segs.len() + ranges.len());
        let mut segs = self.segs.iter().map(|(&s, &e)| (s, e)).peekable();
        // The part of the current segment not yet removed from.
        let mut cur: Option<(u64, u64)> = None;
        let mut removed = 0u64;
        let mut last_end = 0u64;
        for (n, &(start, size)) in ranges.iter().enumerate() {
            let end = start + size;
            if size == 0 || (n > 0 && start < last_end) {
                return false;
            }
            last_end = end;
            // Advance to the segment containing `start`.
            loop {
                match cur {
                    Some((s, e)) if e > start => {
                        if s > start {
                            return false;
                        }
                        break;
                    }
                    Some(seg) => out.push(seg),
                    None => {}
                }
                match segs.next() {
                    Some(seg) => cur = Some(seg),
                    None => return false,
                }
            }
            let (s, e) = cur.expect("found above");
            if e < end {
                return false;
            }
            if s < start {
                out.push((s, start));
            }
            cur = (end < e).then_some((end, e));
            removed += size;
        }
        out.extend(cur);
        out.extend(segs);
        self.hist = [0; RANGE_TREE_HISTOGRAM_SIZE];
        for &(s, e) in &out {
            self.hist[bucket(e - s)] += 1;
        }
        if self.indexed {
            let mut by_size: Vec<(u64, u64)> = out.iter().map(|&(s, e)| (e - s, s)).collect();
            by_size.sort_unstable();
            self.by_size = by_size.into_iter().collect();
        }
        // Already in offset order: the map is built in bulk.
        self.segs = out.into_iter().collect();
        self.space -= removed;
        true
    }

    /// Whether `[start, start+size)` lies entirely inside one segment.
    #[cfg(test)]
    pub fn contains(&self, start: u64, size: u64) -> bool {
        match self.segs.range(..=start).next_back() {
            Some((_, &e)) => e >= start + size,
            None => false,
        }
    }

    /// Bytes of `[start, start+size)` present in the tree.
    pub fn overlap_bytes(&self, start: u64, size: u64) -> u64 {
        let end = start + size;
        if self.segs.is_empty() {
            return 0;
        }
        let mut total = 0;
        let first = match self.segs.range(..start).next_back() {
            Some((&s, &e)) if e > start => s,
            _ => start,
        };
        for (&s, &e) in self.segs.range(first..end) {
            total += e.min(end) - s.max(start);
        }
        total
    }

    /// The first present sub-range of `[start, start+size)`.
    pub fn find_in(&self, start: u64, size: u64) -> Option<(u64, u64)> {
        let end = start + size;
        if let Some((_, &e)) = self.segs.range(..start).next_back()
            && e > start
        {
            return Some((start, e.min(end) - start));
        }
        let (&s, &e) = self.segs.range(start..end).next()?;
        Some((s, e.min(end) - s))
    }

    /// The segment containing `offset`, else the first one after it
    /// (`metaslab.c:metaslab_block_find@zfs-2.4.0` with `size == max_size`).
    pub fn find_at_or_after(&self, offset: u64) -> Option<(u64, u64)> {
        if let Some((&s, &e)) = self.segs.range(..=offset).next_back()
            && e > offset
        {
            return Some((s, e));
        }
        self.segs.range(offset..).next().map(|(&s, &e)| (s, e))
    }

    /// Segments starting at or after `offset`, in offset order.
    pub fn iter_from(&self, offset: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segs.range(offset..).map(|(&s, &e)| (s, e))
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segs.iter().map(|(&s, &e)| (s, e))
    }

    /// Smallest segment of at least `size` bytes, lowest offset among equals
    /// (indexed trees only).
    pub fn smallest_fit(&self, size: u64) -> Option<(u64, u64)> {
        self.by_size
            .range((size, 0)..)
            .next()
            .map(|&(sz, s)| (s, s + sz))
    }

    /// For a size range (`metaslab_block_find` over the size tree,
    /// zfs-2.4.0): the largest segment smaller than `max` when it holds
    /// `min`, else the smallest of at least `max` (indexed trees only).
    pub fn range_fit(&self, min: u64, max: u64) -> Option<(u64, u64)> {
        if let Some(&(sz, s)) = self.by_size.range(..(max, 0)).next_back()
            && sz >= min
        {
            return Some((s, s + sz));
        }
        self.smallest_fit(max)
    }

    /// The largest segment (indexed trees only).
    pub fn largest(&self) -> Option<(u64, u64)> {
        self.by_size.iter().next_back().map(|&(sz, s)| (s, s + sz))
    }

    /// Size of the largest segment, 0 when empty (indexed trees only).
    pub fn max_size(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(sz, _)| sz)
    }

    /// Remove every segment, returning them in offset order.
    pub fn take(&mut self) -> Vec<(u64, u64)> {
        let segs = std::mem::take(&mut self.segs);
        self.by_size.clear();
        self.hist = [0; RANGE_TREE_HISTOGRAM_SIZE];
        self.space = 0;
        segs.into_iter().collect()
    }

    /// Move every segment into `other`. Fails without change to `other`'s
    /// contents on overlap only in a corrupt state, which callers rule out.
    pub fn move_into(&mut self, other: &mut RangeTree) -> u64 {
        let moved = self.space;
        for (s, e) in self.take() {
            // Disjointness is an invariant of the callers (free trees of one
            // metaslab never overlap); an overlap here is skipped rather than
            // panicking, and `verify` reports the lost bytes.
            let _ = other.add(s, e - s);
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_merges_and_remove_splits() {
        let mut t = RangeTree::new();
        t.add(0, 10).unwrap();
        t.add(20, 10).unwrap();
        t.add(10, 10).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.space(), 30);
        assert_eq!(t.histogram()[4], 1); // 30 in [16, 32)
        assert!(t.remove(5, 5));
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![(0, 5), (10, 30)]);
        assert!(!t.remove(3, 5));
        assert_eq!(t.add(4, 2), Err((0, 5)));
        assert_eq!(t.add(29, 2), Err((10, 30)));
        assert_eq!(t.space(), 25);
        assert_eq!(t.smallest_fit(6), Some((10, 30)));
        assert_eq!(t.smallest_fit(5), Some((0, 5)));
        assert_eq!(t.largest(), Some((10, 30)));
        assert_eq!(t.overlap_bytes(3, 10), 2 + 3);
        assert_eq!(t.find_in(5, 10), Some((10, 5)));
        assert_eq!(t.find_at_or_after(7), Some((10, 30)));
        assert_eq!(t.find_at_or_after(2), Some((0, 5)));
        assert!(t.contains(12, 18));
        assert!(!t.contains(12, 19));
    }

    #[test]
    fn remove_sorted_matches_one_remove_at_a_time() {
        let mut bulk = RangeTree::new();
        bulk.add(0, 1000).unwrap();
        bulk.add(2000, 1000).unwrap();
        let mut single = bulk.clone();
        let ranges = [(0, 10), (20, 5), (990, 10), (2000, 1000)];
        assert!(bulk.remove_sorted(&ranges));
        for &(s, l) in &ranges {
            assert!(single.remove(s, l));
        }
        assert_eq!(
            bulk.iter().collect::<Vec<_>>(),
            single.iter().collect::<Vec<_>>()
        );
        assert_eq!(bulk.space(), single.space());
        assert_eq!(bulk.histogram(), single.histogram());
        assert_eq!(bulk.largest(), single.largest());
        assert_eq!(bulk.smallest_fit(6), single.smallest_fit(6));
        // Refused, tree unchanged: out of order, across a gap, overlapping.
        let before: Vec<_> = bulk.iter().collect();
        assert!(!bulk.remove_sorted(&[(30, 5), (25, 1)]));
        assert!(!bulk.remove_sorted(&[(980, 20)]));
        assert!(!bulk.remove_sorted(&[(30, 10), (35, 10)]));
        assert!(!bulk.remove_sorted(&[(1500, 1)]));
        assert_eq!(bulk.iter().collect::<Vec<_>>(), before);
        assert_eq!(bulk.space(), single.space());
    }

    #[test]
    fn highbit_matches_spec() {
        assert_eq!(highbit(0), 0);
        assert_eq!(highbit(1), 1);
        assert_eq!(highbit(512), 10);
        assert_eq!(highbit(u64::MAX), 64);
    }
}
