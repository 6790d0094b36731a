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
//! the top 16 bits of its offset), plus a reverse index, one sorted `Vec`
//! of (target start, source start) packed the same way: 40 bytes a live
//! entry. The reverse index answers a lookup by new extent (a Free or move
//! of a block at its new home) without a scan of every entry. Each vector
//! is rebuilt at its exact length when a batch of new entries is merged in;
//! dropped entries are tombstones until an eighth of a vector is dead. New
//! entries wait in small ordered buffers, so moves in any order cost one
//! merge per [`MERGE_AT`] entries instead of a shift of the whole vector
//! per move.

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

/// `e`'s start packed as `vdev << TO_BITS | sector`, if it fits: the key of
/// a target, and a source as the reverse index holds it.
fn target_key(e: &Extent) -> Option<u64> {
    let sec = sectors(e.offset).filter(|&s| s < 1 << TO_BITS)?;
    (e.vdev < 1 << (64 - TO_BITS)).then_some(((e.vdev as u64) << TO_BITS) | sec)
}

/// A packed start as an extent of one sector (what an error names).
fn key_extent(k: u64) -> Extent {
    let (vdev, sec) = unpack(k);
    Extent {
        vdev,
        offset: sec << SECTOR_SHIFT,
        size: 1 << SECTOR_SHIFT,
    }
}

/// A packed start's vdev and sector.
fn unpack(k: u64) -> (VdevId, u64) {
    ((k >> TO_BITS) as VdevId, k & ((1 << TO_BITS) - 1))
}

impl Entry {
    fn of(m: &Mapping) -> Option<Entry> {
        let len = |v: u64| {
            sectors(v)
                .and_then(|s| u32::try_from(s).ok())
                .filter(|&s| s > 0)
        };
        // The source must pack too: the reverse index holds it so.
        target_key(&m.from)?;
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
        let (to_vdev, to_sec) = unpack(to);
        Mapping {
            from: Extent {
                vdev: from_vdev,
                offset: from_sec << SECTOR_SHIFT,
                size: (from_len as u64) << SECTOR_SHIFT,
            },
            to: Extent {
                vdev: to_vdev,
                offset: to_sec << SECTOR_SHIFT,
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

/// The reverse index: each live entry's target start -> its source start,
/// both packed ([`target_key`]). A vector sorted by target, the targets
/// dropped from it, and new pairs not merged yet. Target starts are unique
/// (a second entry to the same start is refused), so the start alone keys
/// it; the source's entry then gives the sizes.
#[derive(Debug, Default)]
struct Reverse {
    sorted: Vec<(u64, u64)>,
    gone: BTreeSet<u64>,
    pending: BTreeMap<u64, u64>,
}

impl Reverse {
    fn get(&self, k: u64) -> Option<u64> {
        if let Some(&src) = self.pending.get(&k) {
            return Some(src);
        }
        let i = self.sorted.binary_search_by_key(&k, |p| p.0).ok()?;
        (!self.gone.contains(&k)).then_some(self.sorted[i].1)
    }

    fn contains(&self, k: u64) -> bool {
        self.get(k).is_some()
    }

    fn insert(&mut self, k: u64, src: u64) {
        if self.gone.remove(&k) {
            // Its dropped pair is still in the vector: reuse the slot.
            if let Ok(i) = self.sorted.binary_search_by_key(&k, |p| p.0) {
                self.sorted[i].1 = src;
            }
        } else {
            self.pending.insert(k, src);
        }
        if self.pending.len() >= MERGE_AT {
            self.rebuild();
        }
    }

    fn remove(&mut self, k: u64) {
        if self.pending.remove(&k).is_none() {
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
            self.sorted.iter().copied().filter(|p| !gone.contains(&p.0)),
            pending.into_iter(),
            live,
            |p| p.0,
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

/// Every live mapping entry, per source vdev, and the reverse index.
#[derive(Debug, Default)]
pub struct IndirectMap {
    vdevs: BTreeMap<VdevId, VdevMap>,
    reverse: Reverse,
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
            // `Entry::of` checked that the source packs.
            targets.push((e.to, target_key(&m.from).unwrap_or_default()));
            map.live += 1;
            map.bytes += m.from.size;
        }
        // Entries added out of order (above) are in the index already.
        let r = std::mem::take(&mut map.reverse);
        targets.extend(r.sorted);
        targets.extend(r.pending);
        targets.sort_unstable();
        if let Some(w) = targets.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(MappingError::AlreadyTarget(key_extent(w[0].0)));
        }
        targets.shrink_to_fit();
        map.reverse.sorted = targets;
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
        if self.reverse.contains(e.to) {
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
        self.reverse
            .insert(e.to, target_key(&m.from).unwrap_or_default());
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
        target_key(e).is_some_and(|k| self.reverse.contains(k))
    }

    /// The old extent of the entry whose new extent is exactly `to` (a Free
    /// or move of a block at its new address): the reverse index names the
    /// source, whose entry says whether the sizes match.
    pub fn source_of(&self, to: &Extent) -> Option<Extent> {
        let (vdev, sec) = unpack(self.reverse.get(target_key(to)?)?);
        let m = self.vdevs.get(&vdev)?.find(sec)?.mapping(vdev);
        (m.to == *to).then_some(m.from)
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
            self.reverse.remove(k);
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
        let key = std::mem::size_of::<(u64, u64)>();
        let entries: usize = self
            .vdevs
            .values()
            .map(|v| (v.sorted.capacity() + v.pending.len()) * entry)
            .sum();
        entries + (self.reverse.sorted.capacity() + self.reverse.pending.len()) * key
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
        assert_eq!(again.memory_bytes(), again.len() * 40);
    }

    /// The reverse index agrees with a scan of every entry through random
    /// inserts and removes: targets are reused after their entry goes (a
    /// dropped pair given a new source), merges and tombstone rebuilds
    /// happen, and a probe of the right start but another size is no hit.
    #[test]
    fn the_reverse_index_agrees_with_a_scan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let mut map = IndirectMap::default();
        let mut live: Vec<Extent> = Vec::new();
        // Few target slots, many sources: a target start comes back often.
        let slots = 3 * MERGE_AT as u64;
        let slot = |k: u64| ext(5 + (k % 2) as u32, (k / 2) * 65536, 4096);
        let mut next_from = 0u64;
        for _ in 0..6 {
            for _ in 0..4 * MERGE_AT {
                if !live.is_empty() && rng.random_bool(0.45) {
                    let i = rng.random_range(0..live.len());
                    let from = live.swap_remove(i);
                    assert!(map.remove(&from).is_some());
                } else {
                    let to = slot(rng.random_range(0..slots));
                    let from = ext((next_from % 3) as u32, next_from * 8192, 4096);
                    next_from += 1;
                    match map.insert(m(from, to)) {
                        Ok(()) => live.push(from),
                        Err(e) => assert_eq!(e, MappingError::AlreadyTarget(to)),
                    }
                }
            }
            // Every slot, and each at another size, against one scan of
            // every entry.
            let scan: BTreeMap<Extent, Extent> = map.iter().map(|m| (m.to, m.from)).collect();
            for to in (0..slots).map(slot) {
                assert_eq!(map.source_of(&to), scan.get(&to).copied(), "{to}");
                let other = Extent { size: 8192, ..to };
                assert_eq!(map.source_of(&other), None);
            }
            assert_eq!(map.len(), live.len());
        }
        let again = IndirectMap::from_sorted(map.iter()).unwrap();
        for k in 0..slots {
            assert_eq!(again.source_of(&slot(k)), map.source_of(&slot(k)));
        }
        assert!(
            live.iter()
                .all(|f| map.source_of(&map.get(f).unwrap()) == Some(*f))
        );
    }

    /// Rows loaded out of order, or naming one target twice, are checked
    /// against the rest of the load.
    #[test]
    fn a_load_refuses_a_target_named_twice() {
        let rows = [
            m(ext(0, 65536, 4096), ext(3, 0, 4096)),
            m(ext(0, 0, 4096), ext(3, 8192, 4096)),
            m(ext(1, 0, 4096), ext(3, 8192, 4096)),
        ];
        assert!(matches!(
            IndirectMap::from_sorted(rows),
            Err(MappingError::AlreadyTarget(e)) if (e.vdev, e.offset) == (3, 8192)
        ));
        let map = IndirectMap::from_sorted(rows[..2].iter().copied()).unwrap();
        assert_eq!(map.source_of(&ext(3, 8192, 4096)), Some(ext(0, 0, 4096)));
        assert_eq!(map.source_of(&ext(3, 0, 4096)), Some(ext(0, 65536, 4096)));
    }
}
