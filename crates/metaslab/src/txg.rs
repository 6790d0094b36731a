//! Transaction groups (spec §6.1–6.2): what the open txg has changed, the
//! metaslabs it dirtied, and the defer pipeline run at sync: frees of txg
//! T wait in `defer[T % 2]` and become allocatable at the end of T+2's sync,
//! unless the class is within its slop, where deferral is skipped.

use crate::metaslab::Metaslab;
use crate::{SpaceChange, TXG_DEFER_SIZE, Txg, VdevId};

/// The open txg's bookkeeping.
#[derive(Clone, Debug, Default)]
pub struct TxgLog {
    /// Committed allocations, claims and frees, in order.
    pub changes: Vec<SpaceChange>,
    /// Metaslabs to visit at sync.
    pub dirty: Vec<(VdevId, u32)>,
}

impl TxgLog {
    pub fn mark_dirty(&mut self, v: VdevId, ms: &mut Metaslab) {
        if !ms.dirty {
            ms.dirty = true;
            self.dirty.push((v, ms.id));
        }
    }
}

/// `metaslab_sync_done` for one metaslab: the defer slot of `txg` (frees
/// of txg − 2) returns to allocatable, this txg's frees take its place (or
/// return at once when `nodefer`). Returns the bytes made allocatable.
pub fn sync_done(ms: &mut Metaslab, txg: Txg, nodefer: bool) -> u64 {
    let slot = (txg % TXG_DEFER_SIZE) as usize;
    let mut moved = {
        let (defer, alloc) = (&mut ms.defer[slot], &mut ms.allocatable);
        defer.move_into(alloc)
    };
    if nodefer {
        let (freeing, alloc) = (&mut ms.freeing, &mut ms.allocatable);
        moved += freeing.move_into(alloc);
    } else {
        std::mem::swap(&mut ms.freeing, &mut ms.defer[slot]);
    }
    ms.has_space_map = true;
    moved
}
