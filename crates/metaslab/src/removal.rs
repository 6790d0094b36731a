//! Vdev removal, the end of a drain: a vdev that is offline and holds
//! nothing (no allocated, deferred or in-flight bytes, no metaslab waiting
//! for a sync) leaves the pool. As OpenZFS's device removal does, the
//! allocator's mover first copies what is on the vdev elsewhere behind a
//! mapping (the room for that is [`Pool::evacuation_room`]); the vdev is
//! forgotten here once nothing is left on it.
//! The id stays as a tombstone (ids index `Pool::vdevs` and the store), so
//! no id is ever reused and a new vdev gets the next one.

use crate::pool::{ELOG, NORMAL, Pool};
use crate::{Error, Result, VdevId, VdevRole};

impl Pool {
    /// Whether `vdev` exists and has not been removed.
    pub(crate) fn check_present(&self, vdev: VdevId) -> Result<()> {
        match self.vdevs.get(vdev as usize) {
            None => Err(Error::UnknownVdev(vdev)),
            Some(v) if v.removed => Err(Error::VdevRemoved(vdev)),
            Some(_) => Ok(()),
        }
    }

    /// Whether `vdev` was removed (false for an unknown id).
    pub fn is_removed(&self, vdev: VdevId) -> bool {
        self.vdevs.get(vdev as usize).is_some_and(|v| v.removed)
    }

    /// May `vdev` start draining (its data to be moved elsewhere)? OpenZFS
    /// asks, before it stops allocating on a device to remove it, that the
    /// pool's available space hold the whole device
    /// (`vdev_removal.c:spa_vdev_remove_top_check@zfs-2.4.0`: available
    /// `>= vs_dspace`, checked only while the device still allocates); a
    /// drain started without that room would stop half way with the pool
    /// full. An offline vdev passes (its space already left the pool's
    /// writable space, see `rdspace`); so does a log vdev (not moved).
    pub fn check_drain_room(&self, vdev: VdevId) -> Result<()> {
        self.check_present(vdev)?;
        let v = &self.vdevs[vdev as usize];
        if !v.online || v.spec.role != VdevRole::Normal {
            return Ok(());
        }
        let available = self
            .rdspace()
            .saturating_sub(self.classes[NORMAL].alloc)
            .saturating_sub(self.spa_get_slop_space());
        let need = v.vs_space();
        if available < need {
            return Err(Error::NoRoomToDrain {
                vdev,
                need,
                available,
            });
        }
        Ok(())
    }

    /// Where an evacuation of `vdev` can put its blocks: the free bytes of
    /// the other normal vdevs that take allocations (online, not removed),
    /// less the slop kept back from data. Refused when no such vdev is left
    /// (the last vdev's blocks have nowhere to go).
    pub fn evacuation_room(&self, vdev: VdevId) -> Result<u64> {
        self.check_present(vdev)?;
        let others: Vec<&crate::pool::Vdev> = self
            .vdevs
            .iter()
            .enumerate()
            .filter(|&(i, v)| {
                i != vdev as usize && !v.removed && v.online && v.spec.role == VdevRole::Normal
            })
            .map(|(_, v)| v)
            .collect();
        if others.is_empty() {
            return Err(Error::LastVdev(vdev));
        }
        let free: u64 = others
            .iter()
            .map(|v| v.vs_space().saturating_sub(v.vs_alloc()))
            .sum();
        Ok(free.saturating_sub(self.spa_get_slop_space()))
    }

    /// Allocations on `vdev` still in flight (placed, not committed).
    pub fn inflight_on(&self, vdev: VdevId) -> usize {
        self.vdevs
            .get(vdev as usize)
            .map_or(0, |v| v.inflight.len())
    }

    /// Forget an empty, offline vdev. Refused (nothing changed) while it is
    /// online, holds or defers any byte, has an extent in flight, or has a
    /// metaslab the open txg still has to sync.
    pub fn remove_vdev(&mut self, vdev: VdevId) -> Result<()> {
        self.check_present(vdev)?;
        let v = &self.vdevs[vdev as usize];
        let alloc = v.vs_alloc();
        let not_empty = |why: String| Error::VdevNotEmpty {
            vdev,
            alloc,
            online: v.online,
            why,
        };
        if v.online {
            return Err(not_empty(
                "it is online: take it offline first (a drain does)".into(),
            ));
        }
        if alloc > 0 {
            return Err(not_empty(format!(
                "it still holds {alloc} bytes (deferred frees included): move them off and let \
                 the frees sync"
            )));
        }
        if !v.inflight.is_empty() {
            return Err(not_empty(format!(
                "{} allocations on it are in flight",
                v.inflight.len()
            )));
        }
        if self.txg.dirty.iter().any(|&(d, _)| d == vdev) {
            return Err(not_empty(
                "metaslabs of it change in the open txg: retry after the next sync".into(),
            ));
        }
        let main = v.main_class();
        let mut space = [0u64; 3];
        for ms in &v.ms {
            let ci = if ms.embedded_log { ELOG } else { main };
            if !ms.new {
                space[ci] += ms.size;
            }
        }
        for (ci, s) in space.iter().enumerate() {
            self.classes[ci].space -= s;
        }
        self.lru.retain(|&(_, d, _)| d != vdev);
        let mut tomb = self.vdevs[vdev as usize].clone_empty();
        tomb.removed = true;
        tomb.online = false;
        tomb.elog = None;
        self.vdevs[vdev as usize] = tomb;
        self.refresh_offline_normal();
        // Not in any ring (it was offline); recount and rebalance the rest.
        for ci in 0..3 {
            self.recount(ci);
            self.metaslab_class_balance(ci, false);
        }
        Ok(())
    }
}
