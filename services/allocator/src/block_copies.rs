//! Which extents are copies of one block. A block written with several
//! copies is one allocation with an extent per copy; its Commit links them
//! (a row per copy in `block_copies`, keyed by the copy's (vdev, start),
//! naming the block by its allocation id, unique in the pool). A move of
//! one copy (the balancer's, the mover's) then keeps off the vdevs of the
//! others: placing two copies of a block on one vdev loses the block with
//! that vdev (OpenZFS spreads a block's DVAs over vdevs for that reason,
//! `metaslab.c:metaslab_alloc_dva@zfs-2.4.0`).
//!
//! Nothing of it is kept in memory but the links of the open txgs: a
//! lookup asks the store (`Store::copies_of`), which answers one indexed
//! query. A txg applies, in this order: each committed relocation moves its
//! source's row to the new extent (a move that keeps its address too: the
//! row always names where the copy's bytes are), each freed range deletes
//! the rows starting in it, then the new links are inserted. Blocks
//! committed before links existed have no rows: they are moved as blocks
//! of one copy (only the source vdev is avoided).

use std::collections::{BTreeMap, BTreeSet};

use metaslab::{Extent, SpaceChangeKind, Txg, VdevId};

use crate::store::TxgRecord;

/// The copies `(vdev, offset)` of several blocks, one set per block.
pub type CopySets = Vec<Vec<(VdevId, u64)>>;

/// The copies of one block, committed together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyLink {
    /// The allocation id that committed the block (its name in the store).
    pub block: u64,
    /// One extent per copy, on distinct vdevs when placed so.
    pub extents: Vec<Extent>,
}

/// Links committed in txgs not yet handed to the store.
#[derive(Debug, Default)]
pub struct PendingCopies {
    links: Vec<(Txg, CopyLink)>,
}

impl PendingCopies {
    /// A block of `extents` committed by allocation `block` in `txg`;
    /// blocks of one copy are not linked.
    pub fn committed(&mut self, txg: Txg, block: u64, extents: &[Extent]) {
        if extents.len() > 1 {
            self.links.push((
                txg,
                CopyLink {
                    block,
                    extents: extents.to_vec(),
                },
            ));
        }
    }

    /// `extents` were freed in the open txg: a copy committed in it and
    /// freed again is not linked (the txg's frees delete rows before its
    /// links are inserted, so the store would keep it).
    pub fn freed(&mut self, extents: &[Extent]) {
        if self.links.is_empty() {
            return;
        }
        for (_, l) in &mut self.links {
            l.extents.retain(|e| {
                !extents
                    .iter()
                    .any(|f| f.vdev == e.vdev && f.offset == e.offset)
            });
        }
        self.links.retain(|(_, l)| l.extents.len() > 1);
    }

    /// The links of txgs up to `txg`, for its record.
    pub fn take(&mut self, txg: Txg) -> Vec<CopyLink> {
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.links)
            .into_iter()
            .partition(|(t, _)| *t <= txg);
        self.links = later;
        now.into_iter().map(|(_, l)| l).collect()
    }

    /// The other copies of the copy at `at` among links not yet persisted.
    pub fn copies_of(&self, at: (VdevId, u64)) -> Option<Vec<(VdevId, u64)>> {
        let (_, l) = self
            .links
            .iter()
            .find(|(_, l)| l.extents.iter().any(|e| (e.vdev, e.offset) == at))?;
        Some(
            l.extents
                .iter()
                .map(|e| (e.vdev, e.offset))
                .filter(|k| *k != at)
                .collect(),
        )
    }
}

/// Every freed range of `rec`, `(vdev, start, end)`: the rows a txg deletes.
pub fn freed_ranges(rec: &TxgRecord) -> impl Iterator<Item = (VdevId, u64, u64)> + '_ {
    rec.sync
        .changes
        .iter()
        .filter(|c| c.kind == SpaceChangeKind::Free)
        .map(|c| {
            let e = c.extent;
            (e.vdev, e.offset, e.offset.saturating_add(e.size))
        })
}

/// The links as the memory store keeps them.
#[derive(Debug, Default)]
pub struct MemCopies {
    block_of: BTreeMap<(VdevId, u64), u64>,
    copies: BTreeMap<u64, BTreeSet<(VdevId, u64)>>,
}

impl MemCopies {
    fn remove(&mut self, at: (VdevId, u64)) -> Option<u64> {
        let b = self.block_of.remove(&at)?;
        if let Some(s) = self.copies.get_mut(&b) {
            s.remove(&at);
            if s.is_empty() {
                self.copies.remove(&b);
            }
        }
        Some(b)
    }

    fn remove_range(&mut self, vdev: VdevId, start: u64, end: u64) {
        let gone: Vec<(VdevId, u64)> = self
            .block_of
            .range((vdev, start)..(vdev, end))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            self.remove(k);
        }
    }

    fn insert(&mut self, at: (VdevId, u64), block: u64) {
        self.remove(at);
        self.block_of.insert(at, block);
        self.copies.entry(block).or_default().insert(at);
    }

    /// One txg's changes, in the order every store applies them.
    pub fn apply(&mut self, rec: &TxgRecord) {
        for r in &rec.relocations {
            self.remove_range(
                r.to.vdev,
                r.to.offset,
                r.to.offset.saturating_add(r.to.size),
            );
            if let Some(b) = self.remove((r.from.vdev, r.from.offset)) {
                self.insert((r.to.vdev, r.to.offset), b);
            }
        }
        for (vdev, start, end) in freed_ranges(rec) {
            self.remove_range(vdev, start, end);
        }
        for l in &rec.copies {
            for e in &l.extents {
                self.insert((e.vdev, e.offset), l.block);
            }
        }
    }

    /// `crate::store::Store::copies_on`: the sets of the copies on `vdev`
    /// at `starts`, by start.
    pub fn copies_on(&self, vdev: VdevId, starts: &[u64]) -> CopySets {
        let mut starts = starts.to_vec();
        starts.sort_unstable();
        starts.dedup();
        starts
            .into_iter()
            .filter_map(|s| self.block_of.get(&(vdev, s)))
            .map(|b| self.copies[b].iter().copied().collect())
            .collect()
    }

    pub fn copies_of(&self, at: (VdevId, u64)) -> Vec<(VdevId, u64)> {
        let Some(b) = self.block_of.get(&at) else {
            return Vec::new();
        };
        self.copies[b]
            .iter()
            .copied()
            .filter(|k| *k != at)
            .collect()
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
    fn a_copy_committed_and_freed_in_one_txg_is_not_linked() {
        let mut p = PendingCopies::default();
        p.committed(5, 9, &[ext(0, 0), ext(1, 0)]);
        p.committed(5, 10, &[ext(0, 4096)]);
        assert_eq!(p.copies_of((0, 0)), Some(vec![(1, 0)]));
        p.freed(&[ext(1, 0)]);
        assert_eq!(p.copies_of((0, 0)), None);
        assert!(p.take(5).is_empty());
    }

    #[test]
    fn links_are_taken_by_txg() {
        let mut p = PendingCopies::default();
        p.committed(5, 9, &[ext(0, 0), ext(1, 0)]);
        p.committed(6, 11, &[ext(0, 8192), ext(2, 0), ext(1, 4096)]);
        assert_eq!(p.take(5).len(), 1);
        assert_eq!(p.copies_of((2, 0)), Some(vec![(0, 8192), (1, 4096)]));
        assert_eq!(p.take(6)[0].block, 11);
    }
}
