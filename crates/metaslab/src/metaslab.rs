//! One metaslab: a fixed LBA range of a vdev with its free-space trees
//! (allocatable, freeing in the open txg, two defer slots), the
//! dynamic-fit block allocator (`metaslab.c:metaslab_df_alloc@zfs-2.4.0`),
//! weights (`metaslab_weight`) and the fragmentation metric
//! (`metaslab_set_fragmentation`).

use crate::range_tree::{RangeTree, highbit};
use crate::{TXG_DEFER_SIZE, Tunables, Txg};

pub const WEIGHT_PRIMARY: u64 = 1 << 63;
pub const WEIGHT_SECONDARY: u64 = 1 << 62;
pub const WEIGHT_CLAIM: u64 = 1 << 61;
pub const WEIGHT_TYPE: u64 = 1 << 60;
pub const ACTIVE_MASK: u64 = WEIGHT_PRIMARY | WEIGHT_SECONDARY | WEIGHT_CLAIM;
const SEG_INDEX_SHIFT: u32 = 54;
const SEG_COUNT_MASK: u64 = (1 << SEG_INDEX_SHIFT) - 1;
/// SPACE_MAP_HISTOGRAM_SIZE (`space_map.h@zfs-2.4.0`).
const SPACE_MAP_HISTOGRAM_SIZE: u32 = 32;
/// MAX_LBAS: one cursor per alignment class.
const MAX_LBAS: usize = 64;

/// Fragmentation table indexed by log2(segment size) − 9 (`zfs_frag_table`,
/// `metaslab.c@zfs-2.4.0`).
const FRAG_TABLE: [u64; 21] = [
    100, 99, 97, 93, 88, 83, 77, 71, 64, 57, 50, 43, 36, 29, 23, 17, 12, 7, 3, 1, 0,
];

/// Whether a weight is space-based (bit 60, or 0).
pub fn weight_is_space(w: u64) -> bool {
    w == 0 || w & WEIGHT_TYPE != 0
}

/// A segment weight from (count, bucket index).
pub fn segment_weight(count: u64, index: u32) -> u64 {
    ((index as u64) << SEG_INDEX_SHIFT) | (count & SEG_COUNT_MASK)
}

/// The bucket index of a segment weight.
pub fn weight_index(w: u64) -> u32 {
    ((w & !ACTIVE_MASK & !WEIGHT_TYPE) >> SEG_INDEX_SHIFT) as u32
}

/// Activation role of a metaslab in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Inactive,
    Primary,
    Secondary,
}

#[derive(Clone, Debug)]
pub struct Metaslab {
    pub id: u32,
    pub start: u64,
    pub size: u64,
    pub ashift: u8,
    pub allocatable: RangeTree,
    /// Freed in the open txg.
    pub freeing: RangeTree,
    /// Frees of earlier txgs waiting out TXG_DEFER_SIZE syncs, by `txg % 2`.
    pub defer: [RangeTree; TXG_DEFER_SIZE as usize],
    lbas: [u64; MAX_LBAS],
    /// Created but not yet through its first sync (never allocatable).
    pub new: bool,
    pub loaded: bool,
    pub selected_txg: Txg,
    /// Caller's time (ms) of the sync before the last selection.
    pub selected_ms: u64,
    /// Weight without activation bits (the tree key).
    pub weight: u64,
    /// Weight when activated (0 when inactive), for the switch rule.
    pub activation_weight: u64,
    pub role: Role,
    pub fragmentation: u64,
    /// On the dirty list of the open txg.
    pub dirty: bool,
    /// The vdev's embedded log metaslab (lives in the log group).
    pub embedded_log: bool,
    /// Has been through a sync with changes (OpenZFS: has a space map);
    /// fragmentation is 0 until then.
    pub has_space_map: bool,
    /// Its share of its group's fragmentation at the group's last refresh:
    /// (free space in 512-byte units, fragmentation).
    pub frag_share: (u128, u128),
    /// On its group's list of metaslabs to refresh.
    pub frag_noted: bool,
}

impl Metaslab {
    pub fn new(id: u32, shift: u8, ashift: u8, new: bool) -> Metaslab {
        let start = (id as u64) << shift;
        let size = 1u64 << shift;
        let mut allocatable = RangeTree::new();
        let _ = allocatable.add(start, size);
        Metaslab {
            id,
            start,
            size,
            ashift,
            allocatable,
            freeing: RangeTree::plain(),
            defer: [RangeTree::plain(), RangeTree::plain()],
            lbas: [0; MAX_LBAS],
            new,
            loaded: false,
            selected_txg: 0,
            selected_ms: 0,
            weight: 0,
            activation_weight: 0,
            role: Role::Inactive,
            fragmentation: 0,
            dirty: false,
            embedded_log: false,
            has_space_map: false,
            frag_share: (0, 0),
            frag_noted: false,
        }
    }

    pub fn end(&self) -> u64 {
        self.start + self.size
    }

    /// Bytes not allocatable: allocated, in flight, freeing or deferred.
    pub fn alloc(&self) -> u64 {
        self.size - self.allocatable.space()
    }

    pub fn deferred(&self) -> u64 {
        self.freeing.space() + self.defer[0].space() + self.defer[1].space()
    }

    /// Bytes of `[off, off+size)` that are free in any sense (allocatable,
    /// freeing or deferred); these trees are disjoint.
    pub fn free_overlap(&self, off: u64, size: u64) -> u64 {
        self.allocatable.overlap_bytes(off, size)
            + self.freeing.overlap_bytes(off, size)
            + self.defer[0].overlap_bytes(off, size)
            + self.defer[1].overlap_bytes(off, size)
    }

    /// First sub-range of `[off, off+size)` that is not free in any sense.
    pub fn first_allocated_in(&self, off: u64, size: u64) -> Option<(u64, u64)> {
        let end = off + size;
        let mut pos = off;
        while pos < end {
            let mut next_free: Option<(u64, u64)> = None;
            for t in [
                &self.allocatable,
                &self.freeing,
                &self.defer[0],
                &self.defer[1],
            ] {
                if let Some((s, l)) = t.find_in(pos, end - pos)
                    && next_free.is_none_or(|(ns, _)| s < ns)
                {
                    next_free = Some((s, l));
                }
            }
            match next_free {
                Some((s, l)) if s == pos => pos = s + l,
                Some((s, _)) => return Some((pos, s - pos)),
                None => return Some((pos, end - pos)),
            }
        }
        None
    }

    /// Fragmentation percent of the free space
    /// (`metaslab.c:metaslab_set_fragmentation@zfs-2.4.0`), each segment
    /// counted at its bucket's lower bound. The histogram is the space map's,
    /// which OpenZFS rebuilds at each sync from the allocatable tree plus the
    /// frees of the txg and both defer slots (`metaslab_sync`), so deferred
    /// frees count as free space here. A metaslab that was never allocated from
    /// has no space map and reads 0.
    pub fn metaslab_set_fragmentation(&mut self) {
        if !self.has_space_map {
            self.fragmentation = 0;
            return;
        }
        let mut hist = *self.allocatable.histogram();
        for t in [&self.freeing, &self.defer[0], &self.defer[1]] {
            for (h, n) in hist.iter_mut().zip(t.histogram()) {
                *h += n;
            }
        }
        let mut total: u128 = 0;
        let mut frag: u128 = 0;
        for (i, &n) in hist.iter().enumerate() {
            if n == 0 || i < 9 {
                continue;
            }
            let bytes = (n as u128) << i;
            total += bytes;
            frag += bytes * FRAG_TABLE[(i - 9).min(20)] as u128;
        }
        self.fragmentation = frag.checked_div(total).unwrap_or(0) as u64;
    }

    /// Segment weight from the in-core tree
    /// (`metaslab.c:metaslab_segment_weight@zfs-2.4.0`, loaded case).
    pub fn metaslab_segment_weight(&self) -> u64 {
        let max_idx = SPACE_MAP_HISTOGRAM_SIZE + self.ashift as u32 - 1;
        let hist = self.allocatable.histogram();
        let mut segments: u64 = 0;
        for i in (9..64u32).rev() {
            segments = segments.saturating_mul(2).saturating_add(hist[i as usize]);
            if i > max_idx {
                continue;
            }
            if segments != 0 {
                return segment_weight(segments, i);
            }
        }
        0
    }

    /// Recompute `weight` (without activation bits) per the tunables.
    pub fn metaslab_weight(&mut self, rotational: bool, ms_count: u64, t: &Tunables) {
        self.metaslab_set_fragmentation();
        let free = self.allocatable.space();
        self.weight = if free == 0 {
            0
        } else if t.zfs_metaslab_segment_weight_enabled {
            if free == self.size {
                let max_idx = SPACE_MAP_HISTOGRAM_SIZE + self.ashift as u32 - 1;
                let idx = highbit(self.size) - 1;
                if idx < max_idx {
                    segment_weight(1, idx)
                } else {
                    segment_weight(1 << (idx - max_idx), max_idx)
                }
            } else {
                self.metaslab_segment_weight()
            }
        } else {
            self.metaslab_space_weight(rotational, ms_count, t)
        };
    }

    /// Space-based weight (`metaslab.c:metaslab_space_weight@zfs-2.4.0`).
    fn metaslab_space_weight(&self, rotational: bool, ms_count: u64, t: &Tunables) -> u64 {
        let mut w = self.allocatable.space();
        if t.metaslab_fragmentation_factor_enabled {
            w = ((w as u128) * (101 - self.fragmentation.min(100)) as u128 / 100) as u64;
            if w > 0 && w < 512 {
                w = 512;
            }
        }
        if rotational && t.metaslab_lba_weighting_enabled && ms_count > 0 {
            let w128 = w as u128;
            w = (2 * w128 - (self.id as u128 * w128) / ms_count as u128) as u64;
        }
        (w & !(ACTIVE_MASK | WEIGHT_TYPE)) | WEIGHT_TYPE
    }

    /// `metaslab_should_allocate` for a loaded metaslab: the largest free
    /// segment fits.
    pub fn should_allocate(&self, asize: u64) -> bool {
        !self.new && self.allocatable.max_size() >= asize
    }

    /// The dynamic-fit allocator (`metaslab.c:metaslab_df_alloc@zfs-2.4.0`) for
    /// any size in `[size, max_size]` (`metaslab_df_alloc@zfs-2.4.0`; equal for
    /// every block but a ranged log block). Removes the range from
    /// `allocatable` and returns its offset and size.
    pub fn metaslab_df_alloc(
        &mut self,
        size: u64,
        max_size: u64,
        t: &Tunables,
    ) -> Option<(u64, u64)> {
        let slot_of = |x: u64| (highbit(x & x.wrapping_neg()) - 1) as usize;
        // The cursor of the largest size's alignment first, so blocks of
        // one size keep to one area of the metaslab.
        let mut slot = slot_of(max_size);
        let free = self.allocatable.space();
        let free_pct = free * 100 / self.size;
        let largest = self.allocatable.max_size();
        let mut found = None;
        if largest >= t.metaslab_df_alloc_threshold && free_pct >= t.metaslab_df_free_pct {
            found = self.metaslab_block_picker(slot, size, max_size, t.metaslab_df_max_search);
            if max_size != size && found.is_none() {
                slot = slot_of(size);
                found = self.metaslab_block_picker(slot, size, max_size, t.metaslab_df_max_search);
            }
        } else {
            slot = slot_of(size);
        }
        if found.is_none() {
            let rs = if t.metaslab_df_use_largest_segment {
                self.allocatable.largest()
            } else if max_size == size {
                self.allocatable.smallest_fit(size)
            } else {
                self.allocatable.range_fit(size, max_size)
            };
            if let Some((s, e)) = rs
                && e - s >= size
            {
                let got = (e - s).min(max_size);
                found = Some((s, got));
                self.lbas[slot] = s + got;
            }
        }
        let (off, got) = found?;
        let removed = self.allocatable.remove(off, got);
        debug_assert!(removed);
        Some((off, got))
    }

    /// Cursor first fit (`metaslab.c:metaslab_block_picker@zfs-2.4.0`): the
    /// first segment from the cursor that holds `size`, taking up to
    /// `max_size`.
    fn metaslab_block_picker(
        &mut self,
        slot: usize,
        size: u64,
        max_size: u64,
        max_search: u64,
    ) -> Option<(u64, u64)> {
        if self.lbas[slot] == 0 {
            self.lbas[slot] = self.start;
        }
        let cursor = self.lbas[slot];
        let Some(first) = self.allocatable.find_at_or_after(cursor) else {
            self.lbas[slot] = 0;
            return None;
        };
        let first_start = first.0;
        for (n, (s, e)) in self.allocatable.iter_from(first_start).enumerate() {
            if !(s - first_start <= max_search || n < 100) {
                break;
            }
            if s + size <= e {
                let got = (e - s).min(max_size);
                self.lbas[slot] = s + got;
                return Some((s, got));
            }
        }
        self.lbas[slot] = 0;
        None
    }

    /// Return a range to `allocatable` (abort, undefer). Returns false on
    /// an overlap, which callers rule out by validation.
    pub fn give_back(&mut self, off: u64, size: u64) -> bool {
        self.allocatable.add(off, size).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragmentation_table() {
        let mut ms = Metaslab::new(0, 24, 9, false);
        ms.metaslab_set_fragmentation();
        assert_eq!(ms.fragmentation, 0); // no space map yet
        ms.has_space_map = true;
        ms.metaslab_set_fragmentation();
        assert_eq!(ms.fragmentation, 17); // one 16 MiB segment
        // Carve the metaslab into 4 KiB free segments separated by 4 KiB.
        let mut ms = Metaslab::new(0, 24, 12, false);
        ms.has_space_map = true;
        assert!(ms.allocatable.remove(0, 1 << 24));
        for i in 0..100u64 {
            ms.allocatable.add(i * 8192, 4096).unwrap();
        }
        ms.metaslab_set_fragmentation();
        assert_eq!(ms.fragmentation, 93);
        // Mixed: 1 × 128 KiB (64 %) and 1 × 4 KiB (93 %), byte weighted.
        let mut ms = Metaslab::new(0, 24, 12, false);
        ms.has_space_map = true;
        assert!(ms.allocatable.remove(0, 1 << 24));
        ms.allocatable.add(0, 128 << 10).unwrap();
        ms.allocatable.add(1 << 20, 4096).unwrap();
        ms.metaslab_set_fragmentation();
        assert_eq!(
            ms.fragmentation,
            (131072 * 64 + 4096 * 93) / (131072 + 4096)
        );
    }

    #[test]
    fn segment_weights() {
        let t = Tunables::default();
        let mut ms = Metaslab::new(0, 29, 12, false);
        ms.metaslab_weight(false, 1, &t);
        assert_eq!(ms.weight, segment_weight(1, 29));
        assert!(ms.allocatable.remove(0, 1 << 28));
        ms.metaslab_weight(false, 1, &t);
        assert_eq!(ms.weight, segment_weight(1, 28));
        // Full metaslab: 0.
        assert!(ms.allocatable.remove(1 << 28, 1 << 28));
        ms.metaslab_weight(false, 1, &t);
        assert_eq!(ms.weight, 0);
        // A segment weight of a higher bucket outranks more segments below.
        assert!(segment_weight(1, 20) > segment_weight(1000, 19));
        assert!(WEIGHT_TYPE | 1 > segment_weight(1000, 40));
    }

    #[test]
    fn space_weight_lba() {
        let t = Tunables {
            zfs_metaslab_segment_weight_enabled: false,
            ..Default::default()
        };
        let mut ms = Metaslab::new(0, 24, 12, false);
        ms.metaslab_weight(true, 4, &t);
        // Free 16 MiB, no space map (frag 0) → × 101/100, LBA × 2 at id 0.
        let w = (16u64 << 20) * 101 / 100 * 2;
        assert_eq!(ms.weight, w | WEIGHT_TYPE);
    }

    #[test]
    fn df_first_fit_then_best_fit() {
        let t = Tunables::default();
        let mut ms = Metaslab::new(0, 24, 12, false);
        assert_eq!(ms.metaslab_df_alloc(4096, 4096, &t).map(|f| f.0), Some(0));
        assert_eq!(
            ms.metaslab_df_alloc(4096, 4096, &t).map(|f| f.0),
            Some(4096)
        );
        assert_eq!(
            ms.metaslab_df_alloc(8192, 8192, &t).map(|f| f.0),
            Some(8192)
        );
        // Fragment: only small segments → best fit picks smallest that fits.
        let mut ms = Metaslab::new(0, 24, 12, false);
        assert!(ms.allocatable.remove(0, 1 << 24));
        ms.allocatable.add(0, 8192).unwrap();
        ms.allocatable.add(65536, 4096).unwrap();
        assert_eq!(
            ms.metaslab_df_alloc(4096, 4096, &t).map(|f| f.0),
            Some(65536)
        );
        assert_eq!(ms.metaslab_df_alloc(8192, 8192, &t).map(|f| f.0), Some(0));
        assert_eq!(ms.metaslab_df_alloc(4096, 4096, &t).map(|f| f.0), None);
    }

    /// A size range (`metaslab_df_alloc@zfs-2.4.0`): first fit takes
    /// `min(segment, max)` from the first segment holding the smallest size;
    /// best fit (the metaslab low on space) the largest segment below max
    /// that holds the smallest, else the smallest segment of at least max.
    #[test]
    fn df_size_range_takes_what_a_segment_holds() {
        let t = Tunables::default();
        let k = 1024;
        let mut ms = Metaslab::new(0, 24, 12, false);
        // Fresh: the whole of max.
        assert_eq!(ms.metaslab_df_alloc(8 * k, 128 * k, &t), Some((0, 128 * k)));
        // Low on space (best fit): segments of 16K, 48K and 256K.
        let mut ms = Metaslab::new(0, 24, 12, false);
        assert!(ms.allocatable.remove(0, 1 << 24));
        ms.allocatable.add(0, 16 * k).unwrap();
        ms.allocatable.add(1 << 20, 48 * k).unwrap();
        ms.allocatable.add(2 << 20, 256 * k).unwrap();
        assert_eq!(
            ms.metaslab_df_alloc(32 * k, 128 * k, &t),
            Some((1 << 20, 48 * k)),
            "the largest below max that holds min"
        );
        assert_eq!(
            ms.metaslab_df_alloc(32 * k, 128 * k, &t),
            Some((2 << 20, 128 * k)),
            "else the smallest of at least max, cut to max"
        );
        assert_eq!(
            ms.metaslab_df_alloc(32 * k, 128 * k, &t),
            Some(((2 << 20) + 128 * k, 128 * k))
        );
        assert_eq!(ms.metaslab_df_alloc(32 * k, 128 * k, &t), None);
        assert_eq!(ms.metaslab_df_alloc(4 * k, 128 * k, &t), Some((0, 16 * k)));
    }
}
