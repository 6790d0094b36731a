//! The txg sync: close the open txg, move deferred frees on, reweigh the
//! metaslabs that changed, unload idle ones after both delays and preload
//! the best of each group (`metaslab_sync_done`, `metaslab_group_preload`),
//! and return what changed.

use crate::metaslab::Role;
use crate::txg::sync_done;
use crate::{ThrottlePolicy, Txg, TxgSync, VdevId};

use crate::pool::*;

impl Pool {
    /// `sync_at` the time of the previous sync: for callers without a clock
    /// (tests); metaslabs then never pass `metaslab_unload_delay_ms`.
    pub fn sync(&mut self) -> TxgSync {
        self.sync_at(self.now_ms)
    }

    /// Close the open txg at the caller's time `now_ms` (a clock of its own:
    /// wall time in the allocator, virtual time in the simulator; never
    /// read here): deferred frees move on, balance is recomputed, metaslabs
    /// unload after both delays and the best of each group are preloaded,
    /// and exactly what changed is returned.
    pub fn sync_at(&mut self, now_ms: u64) -> TxgSync {
        self.now_ms = self.now_ms.max(now_ms);
        let txg = self.open_txg;
        let changes = std::mem::take(&mut self.txg.changes);
        // Before the freeing trees move on: what the check reads.
        let checked = self.txg_changes_fit(&changes).is_ok();
        self.txg.bytes = 0;
        let normal = &self.classes[NORMAL];
        let nodefer = normal.space.saturating_sub(normal.alloc) <= self.spa_get_slop_space();
        let dirty = std::mem::take(&mut self.txg.dirty);
        let mut undeferred = 0;
        let mut touched: Vec<VdevId> = Vec::new();
        for (v, m) in dirty {
            let vd = &mut self.vdevs[v as usize];
            let ci = vd.class_of(m);
            let count = vd.ms.len() as u64;
            let rotational = vd.spec.rotational;
            let ms = &mut vd.ms[m as usize];
            ms.dirty = false;
            let moved = sync_done(ms, txg, nodefer);
            undeferred += moved;
            let became_ready = std::mem::replace(&mut ms.new, false);
            let size = ms.size;
            let still_deferred = ms.deferred() > 0;
            let g = if ci == ELOG {
                vd.log_mg.as_mut().expect("log group")
            } else {
                &mut vd.mg
            };
            g.alloc -= moved;
            if became_ready {
                g.space += size;
                g.ready += 1;
                self.classes[ci].space += size;
            }
            self.classes[ci].alloc -= moved;
            g.reweigh(&mut vd.ms[m as usize], rotational, count, &self.tun);
            g.dirty = true;
            if still_deferred {
                self.txg.mark_dirty(v, &mut vd.ms[m as usize]);
            }
            if touched.last() != Some(&v) {
                touched.push(v);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for v in touched {
            refresh_groups(&mut self.vdevs[v as usize], &self.tun);
        }
        self.unload(txg);
        let preloaded = self.preload();
        self.open_txg += 1;
        for ci in 0..3 {
            self.recount(ci);
        }
        if self.tun.throttle_policy == ThrottlePolicy::Legacy {
            self.legacy_reset();
        }
        // Log classes are never balanced onsync (`metaslab_class_balance` is
        // called for the normal, special and dedup classes only,
        // `spa.c:spa_sync_adjust_vdev_max_queue_depth@zfs-2.4.0`).
        self.metaslab_class_balance(NORMAL, true);
        self.dispatch();
        TxgSync {
            txg,
            changes,
            undeferred_bytes: undeferred,
            preloaded,
            checked,
        }
    }

    /// Do a txg's `changes` fit the in-memory space maps as the txg closes
    /// (before its frees move on to the defer trees)? Each freed extent must
    /// lie in the freeing tree (where `free` put it, after refusing space
    /// not allocated); each allocated extent must overlap neither
    /// allocatable nor deferred space (`allocate` and `claim` took it out of
    /// the allocatable tree, refusing space not there), nor another
    /// allocation of the txg (freed space is not reusable within its txg),
    /// and no two frees overlap.
    /// Costs `O(changes · log)`, whatever the pool holds: what lets the
    /// store append a txg to its log without reading its space maps. The
    /// first change that does not fit is returned.
    pub fn txg_changes_fit(&self, changes: &[crate::SpaceChange]) -> Result<(), crate::Extent> {
        let (mut allocs, mut frees) = (Vec::new(), Vec::new());
        for c in changes {
            let e = c.extent;
            let v = self.vdevs.get(e.vdev as usize).ok_or(e)?;
            if e.size == 0 || e.offset.checked_add(e.size).is_none_or(|end| end > v.end()) {
                return Err(e);
            }
            for (m, off, len) in pieces(v.shift, &e) {
                let ms = v.ms.get(m as usize).ok_or(e)?;
                let fits = match c.kind {
                    crate::SpaceChangeKind::Free => ms.freeing.overlap_bytes(off, len) == len,
                    crate::SpaceChangeKind::Alloc => {
                        ms.allocatable.overlap_bytes(off, len) == 0
                            && ms.defer.iter().all(|d| d.overlap_bytes(off, len) == 0)
                    }
                };
                if !fits {
                    return Err(e);
                }
            }
            match c.kind {
                crate::SpaceChangeKind::Alloc => allocs.push(e),
                crate::SpaceChangeKind::Free => frees.push(e),
            }
        }
        // Each range allocated at most once and freed at most once.
        match Self::first_overlap(&allocs).or_else(|| Self::first_overlap(&frees)) {
            Some((_, later)) => Err(later),
            None => Ok(()),
        }
    }

    /// Unload metaslabs not selected for `metaslab_unload_delay` txgs *and*
    /// `metaslab_unload_delay_ms` (`metaslab.c:metaslab_evict@zfs-2.4.0`);
    /// active and embedded-log metaslabs stay loaded. The LRU is in selection
    /// order, so the walk stops at the first one too young.
    pub(crate) fn unload(&mut self, txg: Txg) {
        let delay = self.tun.metaslab_unload_delay;
        let delay_ms = self.tun.metaslab_unload_delay_ms;
        let mut keep = Vec::new();
        while let Some(&(sel, v, m)) = self.lru.first() {
            if txg <= sel.saturating_add(delay) {
                break;
            }
            let sel_ms = self.vdevs[v as usize].ms[m as usize].selected_ms;
            if self.now_ms < sel_ms.saturating_add(delay_ms) {
                break;
            }
            self.lru.pop_first();
            let ms = &mut self.vdevs[v as usize].ms[m as usize];
            if ms.role != Role::Inactive || ms.embedded_log {
                keep.push((txg, v, m));
                ms.selected_txg = txg;
            } else {
                ms.loaded = false;
            }
        }
        self.lru.extend(keep);
    }

    /// `metaslab.c:metaslab_group_preload@zfs-2.4.0`: after a sync, the first
    /// `metaslab_preload_limit` metaslabs of each group in tree order are
    /// loaded off the allocation path, so a data allocation rarely pays a
    /// load. They join the LRU as selected now. Returns the metaslabs it
    /// loaded, in order.
    pub(crate) fn preload(&mut self) -> Vec<(VdevId, u32)> {
        let mut loaded = Vec::new();
        if !self.tun.metaslab_preload_enabled || self.tun.metaslab_preload_limit == 0 {
            return loaded;
        }
        let limit = self.tun.metaslab_preload_limit as usize;
        let (txg, now_ms) = (self.open_txg, self.now_ms);
        for vd in &mut self.vdevs {
            let v = vd.id;
            let groups: Vec<Vec<u32>> = [Some(&vd.mg), vd.log_mg.as_ref()]
                .into_iter()
                .flatten()
                .map(|g| g.members().take(limit).collect())
                .collect();
            for id in groups.into_iter().flatten() {
                let ms = &mut vd.ms[id as usize];
                if ms.loaded || ms.new {
                    continue;
                }
                ms.loaded = true;
                if ms.selected_txg != 0 {
                    self.lru.remove(&(ms.selected_txg, v, id));
                }
                ms.selected_txg = txg;
                ms.selected_ms = now_ms;
                self.lru.insert((txg, v, id));
                loaded.push((v, id));
            }
        }
        loaded
    }

    pub(crate) fn txg_dirty(&self, v: VdevId, m: u32) -> bool {
        self.txg.dirty.contains(&(v, m))
    }
}
