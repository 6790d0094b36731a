//! Transaction groups (`txg.c@zfs-2.4.0`, `metaslab.c:metaslab_sync_done`):
//! what the open txg has changed, the metaslabs it dirtied, and the defer
//! pipeline run at sync: frees of txg T wait in `defer[T % 2]` and become
//! allocatable at the end of T+2's sync, unless the class is within its slop,
//! where deferral is shortened to one sync: `sync` runs before the store has
//! the txg, so a free must not become allocatable in the very sync that closes
//! its txg (OpenZFS's nodefer frees return in `metaslab_sync_done`, after the
//! txg is on disk; here that is the next sync, which starts only once this one
//! was persisted).

use crate::metaslab::Metaslab;
use crate::{SpaceChange, TXG_DEFER_SIZE, Txg, VdevId};

/// The open txg's bookkeeping.
#[derive(Clone, Debug, Default)]
pub struct TxgLog {
    /// Committed allocations, claims and frees, in order.
    pub changes: Vec<SpaceChange>,
    /// Metaslabs to visit at sync.
    pub dirty: Vec<(VdevId, u32)>,
    /// Bytes of `changes` (allocations, claims and frees), for a dirty bound.
    pub bytes: u64,
}

impl TxgLog {
    pub fn push(&mut self, change: SpaceChange) {
        self.bytes += change.extent.size;
        self.changes.push(change);
    }

    pub fn mark_dirty(&mut self, v: VdevId, ms: &mut Metaslab) {
        if !ms.dirty {
            ms.dirty = true;
            self.dirty.push((v, ms.id));
        }
    }
}

/// `metaslab_sync_done` for one metaslab: the defer slot of `txg` (frees
/// of txg − 2) returns to allocatable, this txg's frees take its place (or,
/// when `nodefer`, join the slot the next sync releases). Returns the bytes
/// made allocatable.
pub fn sync_done(ms: &mut Metaslab, txg: Txg, nodefer: bool) -> u64 {
    let slot = (txg % TXG_DEFER_SIZE) as usize;
    let moved = {
        let (defer, alloc) = (&mut ms.defer[slot], &mut ms.allocatable);
        defer.move_into(alloc)
    };
    if nodefer {
        // Not allocatable before this txg is durable: released by the next
        // sync (the metaslab stays dirty while anything is deferred).
        let next = ((txg + 1) % TXG_DEFER_SIZE) as usize;
        let (freeing, defer) = (&mut ms.freeing, &mut ms.defer[next]);
        freeing.move_into(defer);
    } else {
        std::mem::swap(&mut ms.freeing, &mut ms.defer[slot]);
    }
    // A space map exists once something was allocated or freed here (a new
    // metaslab's first sync writes none: it reads 0 % fragmented).
    if ms.alloc() > 0 || moved > 0 {
        ms.has_space_map = true;
    }
    moved
}
