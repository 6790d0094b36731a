//! The indirect mapping, in memory: old extent -> new extent for every
//! block moved with its old address kept (OpenZFS's
//! `vdev_indirect_mapping.c`, but per block instead of per segment, since
//! the allocator knows every block's extent). It answers whether an exact
//! old extent was moved and where to, and whether an extent is the new
//! home of a moved block (so freeing it there drops the entry too, and its
//! space is never given out while the old address still points at it).
//!
//! Compact: per source vdev, one sorted `Vec` of 24-byte entries (offsets
//! and sizes in 512-byte sectors, the smallest ashift; the target's vdev in
//! the top 16 bits of its offset), plus one sorted `Vec<u64>` of the
//! targets' packed starts: 32 bytes a live entry. Each vector is rebuilt at
//! its exact length when a batch of new entries is merged in; dropped
//! entries are tombstones until an eighth of a vector is dead. New entries
//! wait in small ordered buffers, so moves in any order cost one merge per
//! [`MERGE_AT`] entries instead of a shift of the whole vector per move.

use std::collections::{BTreeMap, BTreeSet};

use metaslab::{Extent, Txg, VdevId};

/// Entries buffered before they are merged into a sorted vector.
pub const MERGE_AT: usize = 4096;

const SECTOR_SHIFT: u32 = 9;
/// Bits of a packed target offset (in sectors); the vdev id is above.
const TO_BITS: u32 = 48;

/// A block moved: it was at `from`, it is at `to`, since `txg`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub from: Extent,
    pub to: Extent,
    pub txg: Txg,
}

/// One entry; `from_vdev` is the key of its vector. `to_len == 0` is a
/// dropped entry (a tombstone). Packed to 4 bytes so no padding is paid.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Entry {
    from_sec: u64,
    /// `to_vdev << TO_BITS | to_sec`.
    to: u64,
    from_len: u32,
    to_len: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 24);

fn sectors(v: u64) -> Option<u64> {
    (v & ((1 << SECTOR_SHIFT) - 1) == 0).then_some(v >> SECTOR_SHIFT)
}

/// `e`'s start packed as a target key, if it fits one.
fn target_key(e: &Extent) -> Option<u64> {
    let sec = sectors(e.offset).filter(|&s| s < 1 << TO_BITS)?;
    (e.vdev < 1 << (64 - TO_BITS)).then_some(((e.vdev as u64) << TO_BITS) | sec)
}

impl Entry {
    fn of(m: &Mapping) -> Option<Entry> {
        let len = |v: u64| {
            sectors(v)
                .and_then(|s| u32::try_from(s).ok())
                .filter(|&s| s > 0)
        };
        Some(Entry {
            from_sec: sectors(m.from.offset)?,
            to: target_key(&m.to)?,
            from_len: len(m.from.size)?,
            to_len: len(m.to.size)?,
        })
    }

    fn live(&self) -> bool {
        self.to_len != 0
    }

    fn key(&self) -> u64 {
        self.from_sec
    }

    fn mapping(&self, from_vdev: VdevId) -> Mapping {
        let (from_sec, to) = (self.from_sec, self.to);
        let (from_len, to_len) = (self.from_len, self.to_len);
        Mapping {
            from: Extent {
                vdev: from_vdev,
                offset: from_sec << SECTOR_SHIFT,
                size: (from_len as u64) << SECTOR_SHIFT,
            },
            to: Extent {
                vdev: (to >> TO_BITS) as u32,
                offset: (to & ((1 << TO_BITS) - 1)) << SECTOR_SHIFT,
                size: (to_len as u64) << SECTOR_SHIFT,
            },
            // The txg is the store's (kept there for the record); memory
            // does not need it to answer.
            txg: 0,
        }
    }
}

/// Merge two sorted runs into a vector of exactly their length.
fn merge_exact<T: Copy>(
    old: impl Iterator<Item = T>,
    new: impl Iterator<Item = T>,
    len: usize,
    key: impl Fn(&T) -> u64,
) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    let (mut old, mut new) = (old.peekable(), new.peekable());
    loop {
        let take_old = match (old.peek(), new.peek()) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(o), Some(n)) => key(o) < key(n),
        };
        let next = if take_old { old.next() } else { new.next() };
        out.push(next.unwrap());
    }
    out
}

#[derive(Debug, Default)]
struct VdevMap {
    /// Sorted by `from_sec`, live entries unique.
    sorted: Vec<Entry>,
    dead: usize,
    /// New entries by `from_sec`, not merged yet.
    pending: BTreeMap<u64, Entry>,
}

impl VdevMap {
    fn find(&self, sec: u64) -> Option<&Entry> {
        if let Some(e) = self.pending.get(&sec) {
            return Some(e);
        }
        let i = self.sorted.binary_search_by_key(&sec, Entry::key).ok()?;
        Some(&self.sorted[i]).filter(|e| e.live())
    }

    fn rebuild(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let live = self.sorted.len() - self.dead + pending.len();
        self.sorted = merge_exact(
            self.sorted.iter().filter(|e| e.live()).copied(),
            pending.into_values(),
            live,
            Entry::key,
        );
        self.dead = 0;
    }
}

/// The targets' packed starts: a sorted vector, the ones dropped from it,
/// and new ones not merged yet.
#[derive(Debug, Default)]
struct Targets {
    sorted: Vec<u64>,
    gone: BTreeSet<u64>,
    pending: BTreeSet<u64>,
}

impl Targets {
    fn contains(&self, k: u64) -> bool {
        self.pending.contains(&k)
            || (self.sorted.binary_search(&k).is_ok() && !self.gone.contains(&k))
    }

    fn insert(&mut self, k: u64) {
        if !self.gone.remove(&k) {
            self.pending.insert(k);
        }
        if self.pending.len() >= MERGE_AT {
            self.rebuild();
        }
    }

    fn remove(&mut self, k: u64) {
        if !self.pending.remove(&k) {
            self.gone.insert(k);
            if self.gone.len() * 8 > self.sorted.len() {
                self.rebuild();
            }
        }
    }

    fn rebuild(&mut self) {
        let (gone, pending) = (
            std::mem::take(&mut self.gone),
            std::mem::take(&mut self.pending),
        );
        let live = self.sorted.len() - gone.len() + pending.len();
        self.sorted = merge_exact(
            self.sorted.iter().copied().filter(|k| !gone.contains(k)),
            pending.into_iter(),
            live,
            |k| *k,
        );
    }
}

/// Why an entry cannot be added.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MappingError {
    #[error("extent {0} is already mapped")]
    AlreadyMapped(Extent),
    #[error("extent {0} is already the new home of a moved block")]
    AlreadyTarget(Extent),
    #[error(
        "move {from} -> {to}: extents must be whole 512-byte sectors, at most 2 TiB, \
         below 128 PiB of a vdev numbered below 65536"
    )]
    OutOfRange { from: Extent, to: Extent },
}

/// Every live mapping entry, per source vdev, and their targets.
#[derive(Debug, Default)]
pub struct IndirectMap {
    vdevs: BTreeMap<VdevId, VdevMap>,
    targets: Targets,
    live: usize,
    bytes: u64,
}

impl IndirectMap {
    /// Build from mappings in `(from.vdev, from.offset)` order (as the store
    /// returns them), each vector at its exact length.
    pub fn from_sorted(it: impl IntoIterator<Item = Mapping>) -> Result<IndirectMap, MappingError> {
        let mut map = IndirectMap::default();
        let mut targets = Vec::new();
        for m in it {
            let e = Entry::of(&m).ok_or(MappingError::OutOfRange {
                from: m.from,
                to: m.to,
            })?;
            let v = map.vdevs.entry(m.from.vdev).or_default();
            if v.sorted.last().is_some_and(|l| l.from_sec >= e.from_sec) {
                // Out of order: the buffered path checks it.
                map.insert(m)?;
                continue;
            }
            v.sorted.push(e);
            targets.push(e.to);
            map.live += 1;
            map.bytes += m.from.size;
        }
        targets.sort_unstable();
        if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
            let to = Entry {
                from_sec: 0,
                to: w[0],
                from_len: 1,
                to_len: 1,
            }
            .mapping(0)
            .to;
            return Err(MappingError::AlreadyTarget(to));
        }
        for k in targets {
            map.targets.pending.insert(k);
        }
        map.targets.rebuild();
        for v in map.vdevs.values_mut() {
            v.rebuild();
        }
        Ok(map)
    }

    /// Whether `m` fits an entry (sector-aligned, in range).
    pub fn check(m: &Mapping) -> Result<(), MappingError> {
        Entry::of(m).map(|_| ()).ok_or(MappingError::OutOfRange {
            from: m.from,
            to: m.to,
        })
    }

    /// Record that the block at `m.from` now lives at `m.to`.
    pub fn insert(&mut self, m: Mapping) -> Result<(), MappingError> {
        let e = Entry::of(&m).ok_or(MappingError::OutOfRange {
            from: m.from,
            to: m.to,
        })?;
        if self.targets.contains(e.to) {
            return Err(MappingError::AlreadyTarget(m.to));
        }
        let v = self.vdevs.entry(m.from.vdev).or_default();
        if v.find(e.from_sec).is_some() {
            return Err(MappingError::AlreadyMapped(m.from));
        }
        v.pending.insert(e.from_sec, e);
        if v.pending.len() >= MERGE_AT {
            v.rebuild();
        }
        self.targets.insert(e.to);
        self.live += 1;
        self.bytes += m.from.size;
        Ok(())
    }

    /// Where the block whose old extent is exactly `from` lives now.
    pub fn get(&self, from: &Extent) -> Option<Extent> {
        let v = self.vdevs.get(&from.vdev)?;
        let e = v.find(sectors(from.offset)?)?;
        let m = e.mapping(from.vdev);
        (m.from == *from).then_some(m.to)
    }

    /// Whether some entry's new extent starts where `e` does (a moved
    /// block's new home, or a part of one).
    pub fn is_target(&self, e: &Extent) -> bool {
        target_key(e).is_some_and(|k| self.targets.contains(k))
    }

    /// The old extent of the entry whose new extent is exactly `to`: a scan
    /// (the reverse index holds only the starts), for the rare Free or move
    /// of a block at its new address.
    pub fn source_of(&self, to: &Extent) -> Option<Extent> {
        if !self.is_target(to) {
            return None;
        }
        self.iter().find(|m| m.to == *to).map(|m| m.from)
    }

    /// Drop the entry of exactly `from`; returns where the block was mapped.
    pub fn remove(&mut self, from: &Extent) -> Option<Extent> {
        let to = self.get(from)?;
        let sec = from.offset >> SECTOR_SHIFT;
        let v = self.vdevs.get_mut(&from.vdev)?;
        if v.pending.remove(&sec).is_none() {
            let i = v.sorted.binary_search_by_key(&sec, Entry::key).ok()?;
            v.sorted[i].to_len = 0;
            v.dead += 1;
            if v.dead * 8 > v.sorted.len() {
                v.rebuild();
            }
        }
        if v.sorted.len() == v.dead && v.pending.is_empty() {
            self.vdevs.remove(&from.vdev);
        }
        if let Some(k) = target_key(&to) {
            self.targets.remove(k);
        }
        self.live -= 1;
        self.bytes -= from.size;
        Some(to)
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Bytes of the old extents mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.bytes
    }

    /// Live entries whose old extent is on `vdev`.
    pub fn entries_on(&self, vdev: VdevId) -> usize {
        self.vdevs
            .get(&vdev)
            .map_or(0, |v| v.sorted.len() - v.dead + v.pending.len())
    }

    /// Bytes the mapping holds (what `status` reports): the sorted
    /// vectors' allocations, and the entries still buffered at the size
    /// they take once merged (the buffers are bounded by [`MERGE_AT`]).
    pub fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<Entry>();
        let key = std::mem::size_of::<u64>();
        let entries: usize = self
            .vdevs
            .values()
            .map(|v| (v.sorted.capacity() + v.pending.len()) * entry)
            .sum();
        entries + (self.targets.sorted.capacity() + self.targets.pending.len()) * key
    }

    /// Every live mapping, in `(from.vdev, from.offset)` order.
    pub fn iter(&self) -> impl Iterator<Item = Mapping> + '_ {
        self.vdevs.iter().flat_map(|(&vdev, v)| {
            let mut all: Vec<Mapping> = v
                .sorted
                .iter()
                .filter(|e| e.live())
                .chain(v.pending.values())
                .map(|e| e.mapping(vdev))
                .collect();
            all.sort_by_key(|m| m.from.offset);
            all.into_iter()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(vdev: u32, offset: u64, size: u64) -> Extent {
        Extent { vdev, offset, size }
    }

    fn m(from: Extent, to: Extent) -> Mapping {
        Mapping { from, to, txg: 0 }
    }

    #[test]
    fn entries_answer_exactly_their_old_extent_until_dropped() {
        let mut map = IndirectMap::default();
        map.insert(m(ext(0, 8192, 4096), ext(2, 0, 4096))).unwrap();
        map.insert(m(ext(0, 0, 8192), ext(1, 1 << 40, 8192)))
            .unwrap();
        assert_eq!(map.get(&ext(0, 8192, 4096)), Some(ext(2, 0, 4096)));
        assert_eq!(map.get(&ext(0, 0, 8192)), Some(ext(1, 1 << 40, 8192)));
        // Not the exact extent: no answer.
        assert_eq!(map.get(&ext(0, 0, 4096)), None);
        assert_eq!(map.get(&ext(1, 0, 8192)), None);
        assert_eq!(
            map.insert(m(ext(0, 0, 8192), ext(2, 8192, 8192))),
            Err(MappingError::AlreadyMapped(ext(0, 0, 8192)))
        );
        assert!(matches!(
            map.insert(m(ext(0, 100, 512), ext(2, 0, 512))),
            Err(MappingError::OutOfRange { .. })
        ));
        assert_eq!((map.len(), map.mapped_bytes()), (2, 12288));
        assert!(map.is_target(&ext(2, 0, 4096)));
        assert_eq!(map.source_of(&ext(2, 0, 4096)), Some(ext(0, 8192, 4096)));
        assert!(!map.is_target(&ext(2, 4096, 4096)));
        assert_eq!(
            map.insert(m(ext(0, 65536, 4096), ext(2, 0, 4096))),
            Err(MappingError::AlreadyTarget(ext(2, 0, 4096)))
        );
        assert_eq!(map.remove(&ext(0, 0, 8192)), Some(ext(1, 1 << 40, 8192)));
        assert!(!map.is_target(&ext(1, 1 << 40, 8192)));
        assert_eq!(map.remove(&ext(0, 0, 8192)), None);
        assert_eq!(map.get(&ext(0, 0, 8192)), None);
        assert_eq!(map.entries_on(0), 1);
        assert_eq!(map.remove(&ext(0, 8192, 4096)), Some(ext(2, 0, 4096)));
        assert!(map.is_empty());
        assert_eq!(map.entries_on(0), 0);
    }

    /// Many entries in random order, some dropped: every lookup agrees with
    /// a plain map, through merges and tombstone rebuilds, and a rebuild
    /// from the sorted list is the same map.
    #[test]
    fn a_large_map_agrees_with_a_plain_one() {
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(42);
        let mut offsets: Vec<u64> = (0..20_000u64).collect();
        offsets.shuffle(&mut rng);
        let mut map = IndirectMap::default();
        let mut plain = BTreeMap::new();
        for (k, &o) in offsets.iter().enumerate() {
            let from = ext((o % 3) as u32, o * 65536, 4096 * (1 + o % 4));
            let to = ext(7, k as u64 * 65536, from.size);
            map.insert(m(from, to)).unwrap();
            plain.insert(from, to);
            if rng.random_bool(0.3) {
                let victim = *plain.keys().nth(rng.random_range(0..plain.len())).unwrap();
                assert_eq!(map.remove(&victim), plain.remove(&victim));
            }
        }
        assert_eq!(map.len(), plain.len());
        for (f, t) in &plain {
            assert_eq!(map.get(f), Some(*t));
            assert!(map.is_target(t));
        }
        let listed: Vec<(Extent, Extent)> = map.iter().map(|m| (m.from, m.to)).collect();
        let want: Vec<(Extent, Extent)> = plain.iter().map(|(f, t)| (*f, *t)).collect();
        assert_eq!(listed, want);
        let again = IndirectMap::from_sorted(map.iter()).unwrap();
        assert_eq!(again.len(), map.len());
        assert_eq!(again.mapped_bytes(), map.mapped_bytes());
        assert_eq!(again.memory_bytes(), again.len() * 32);
    }
}
