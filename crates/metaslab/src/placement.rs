//! Placement and rotation: an admitted ticket's copies placed DVA by DVA
//! over the class ring (`metaslab_alloc_dva`), group eligibility
//! (`metaslab_group_allocatable`, 2.4.0's and 2.3.0's), metaslab selection
//! within a group, the rotor and its aliquot (`metaslab_class_rotate`;
//! legacy `metaslab_alloc_dva@zfs-2.3.0`) and the legacy throttle's
//! per-txg reset. The class balance that sets each group's share is in
//! `class_balance.rs`.

use crate::class::Class;
use crate::group::{Activation, AllocCtx, Group};
use crate::throttle::{legacy, unified};
use crate::vdev::{Asize, Psize, asize_to_psize, psize_to_asize};
use crate::{
    AllocKind, Allocation, Error, Extent, Health, LogTier, NoSpaceReason, Result, SPA_MINBLOCKSIZE,
    TXG_DEFER_SIZE, ThrottlePolicy, Ticket, Txg, VdevId, VdevRole,
};

use crate::pool::*;

impl Pool {
    /// Place an admitted ticket. On failure the ticket is consumed and its
    /// reservation released.
    pub fn allocate(&mut self, ticket: Ticket, busy: bool) -> Result<Allocation> {
        self.allocate_avoiding(ticket, busy, &[])
    }

    /// `allocate`, never placing a copy on a vdev of `avoid`: a balancer
    /// move's new copy must leave its source vdev and the block's other
    /// copies' vdevs (the rotor still turns past them as past any vdev it
    /// cannot use). Only vdevs are avoided, so the class's slop and throttle
    /// rules are exactly those of any allocation.
    pub fn allocate_avoiding(
        &mut self,
        ticket: Ticket,
        busy: bool,
        avoid: &[VdevId],
    ) -> Result<Allocation> {
        self.allocate_inner(ticket, busy, avoid)
    }

    pub(crate) fn allocate_inner(
        &mut self,
        ticket: Ticket,
        busy: bool,
        avoid: &[VdevId],
    ) -> Result<Allocation> {
        match self.tickets.get(&ticket) {
            None => return Err(Error::UnknownTicket(ticket)),
            Some(st) if st.queued => return Err(Error::NotAdmitted(ticket)),
            Some(_) => {}
        }
        let st = self.tickets.remove(&ticket).expect("checked");
        let req = st.req;
        let k = st.allocator;
        let (placed, tier) = match req.kind {
            AllocKind::Data => {
                // What may still be written: the allocating space less
                // everything allocated (offline vdevs' bytes included, as
                // OpenZFS's dsl available space counts them), less slop.
                // A relocation (it avoids its source) moves bytes already
                // counted, off a draining vdev: OpenZFS's removal copies
                // are not held to the DSL's available space either
                // (`vdev_removal.c:spa_vdev_copy_segment@zfs-2.4.0`), so it
                // is checked against the whole class as before.
                let space = if avoid.is_empty() {
                    self.rdspace()
                } else {
                    self.classes[NORMAL].space
                };
                let free = space.saturating_sub(self.classes[NORMAL].alloc);
                let need = req.copies as u64 * req.size;
                let placed = if free < self.spa_get_slop_space().saturating_add(need) {
                    Err(NoSpaceReason::Full)
                } else {
                    self.place(
                        NORMAL, k, req.size, req.size, req.copies, busy, false, avoid,
                    )
                    .ok_or_else(|| self.no_space_reason(&[NORMAL], req.size, req.copies, avoid))
                };
                match placed {
                    Ok(p) => (p, None),
                    Err(reason) => {
                        self.release(st.res, st.allocator);
                        return Err(Error::NoSpace {
                            size: req.size,
                            copies: req.copies,
                            reason,
                        });
                    }
                }
            }
            AllocKind::Log => {
                let mut out = None;
                for (ci, tier) in [
                    (LOG, LogTier::Log),
                    (ELOG, LogTier::EmbeddedLog),
                    (NORMAL, LogTier::Normal),
                ] {
                    if self.classes[ci].ring.is_empty() {
                        continue;
                    }
                    if let Some(p) =
                        self.place(ci, k, req.size, req.max_size, req.copies, busy, true, avoid)
                    {
                        out = Some((p, Some(tier)));
                        break;
                    }
                }
                match out {
                    Some(o) => o,
                    // A sync helps only if it will make freed space
                    // allocatable; otherwise waiting never ends.
                    None if self.frees_pending() => {
                        return Err(Error::TxgWaitRequired {
                            until: self.open_txg + TXG_DEFER_SIZE,
                        });
                    }
                    None => {
                        return Err(Error::NoSpace {
                            size: req.size,
                            copies: req.copies,
                            reason: self.no_space_reason(
                                &[LOG, ELOG, NORMAL],
                                req.size,
                                req.copies,
                                avoid,
                            ),
                        });
                    }
                }
            }
        };
        let id = self.next_alloc;
        self.next_alloc += 1;
        // Queue depth: counted exactly for allocations holding a
        // reservation, released by commit/abort on the same predicate.
        for e in &placed.extents[..placed.n] {
            let v = &mut self.vdevs[e.vdev as usize];
            match st.res {
                Reservation::Bytes(_) => v.mg.add_queue_depth(k, req.size),
                Reservation::Slots(..) => v.mg.legacy_lane_mut(st.allocator).0 += 1,
                Reservation::None => {}
            }
            v.inflight.insert(e.offset, (e.size, id));
        }
        let extents = placed.extents[..placed.n].to_vec();
        self.inflight.insert(
            id,
            Inflight {
                extents: placed.extents,
                n: placed.n as u8,
                psize: req.size,
                res: st.res,
                allocator: st.allocator,
            },
        );
        Ok(Allocation {
            id,
            extents,
            txg: self.open_txg,
            tier,
            metaslab_loads: placed.loads,
            psize: placed.psize,
        })
    }

    /// Place `copies` DVAs of `psize` in class `ci`
    /// (`metaslab.c:metaslab_alloc@zfs-2.4.0`); on failure undo what was
    /// placed. With `max_psize` above `psize` (a ranged log block) each copy
    /// may be larger, up to the smallest copy placed so far
    /// (`metaslab_alloc_range@zfs-2.4.0`), so all hold the block given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn place(
        &mut self,
        ci: usize,
        k: usize,
        psize: u64,
        max_psize: u64,
        copies: u8,
        busy: bool,
        zil: bool,
        avoid: &[VdevId],
    ) -> Option<Placed> {
        let mut placed = Placed::default();
        let mut max_psize = max_psize.max(psize);
        for d in 0..copies as usize {
            match self.metaslab_alloc_dva(ci, k, psize, max_psize, d, &placed, busy, zil, avoid) {
                Some((e, loads)) => {
                    if max_psize > psize {
                        let vd = &self.vdevs[e.vdev as usize];
                        max_psize =
                            max_psize.min(asize_to_psize(&vd.spec, Asize(e.size)).0.max(psize));
                    }
                    placed.extents[d] = e;
                    placed.n += 1;
                    placed.loads += loads;
                }
                None => {
                    for e in &placed.extents[..placed.n] {
                        self.unplace(e);
                    }
                    return None;
                }
            }
        }
        placed.psize = max_psize;
        Some(placed)
    }

    /// `spa_min_alloc`: the smallest allocation a normal-class vdev can
    /// make. Log vdevs do not count (`vdev.c:vdev_open@zfs-2.4.0` tracks it
    /// only for `vdev_islog == 0`; `vdev_metaslab_group_create` only for the
    /// normal class), so a small-ashift log device does not make a data
    /// block look like one at the minimum size.
    pub(crate) fn spa_min_alloc(&self) -> u64 {
        self.vdevs
            .iter()
            .filter(|v| v.vs_space() > 0 && v.spec.role == VdevRole::Normal)
            .map(|v| v.min_alloc())
            .min()
            .unwrap_or(SPA_MINBLOCKSIZE)
    }

    /// Whether some allocatable vdev of class `ci` has a free segment that
    /// holds `psize` in one piece (only asked after a failed first pass).
    pub(crate) fn fits_whole(&self, ci: usize, psize: u64, avoid: &[VdevId]) -> bool {
        self.classes[ci].ring.iter().any(|&v| {
            let vd = &self.vdevs[v as usize];
            let Asize(asize) = psize_to_asize(&vd.spec, Psize(psize));
            vd.vdev_allocatable()
                && !avoid.contains(&v)
                && vd.group(ci).is_some_and(|g| {
                    g.members().any(|m| {
                        !vd.ms[m as usize].new && vd.ms[m as usize].allocatable.max_size() >= asize
                    })
                })
        })
    }

    /// Whether a txg sync would make freed space allocatable again.
    pub(crate) fn frees_pending(&self) -> bool {
        self.vdevs
            .iter()
            .any(|v| v.ms.iter().any(|m| m.deferred() > 0))
    }

    /// Why `copies` copies of `psize` failed in classes `cis` (it was not
    /// the slop check): no allocatable vdev; or FULL, when the free space of
    /// the vdevs that could take them (metaslabs a sync has made ready) does
    /// not hold the copies however cut; else FRAGMENTED, with the largest
    /// free segment: the bytes are there, in pieces too small (OpenZFS would
    /// gang the block; smaller blocks fit).
    pub(crate) fn no_space_reason(
        &self,
        cis: &[usize],
        psize: u64,
        copies: u8,
        avoid: &[VdevId],
    ) -> NoSpaceReason {
        let mut any = false;
        // Both in psize: the largest block one free segment holds, and
        // what the free space holds in all. A segment's raw size is not a
        // block size on RAIDZ (parity and padding come on top), so a hint
        // given in raw bytes would fail again when the client retries at it.
        let mut largest_free = Psize(0);
        let mut free = 0u64;
        for &ci in cis {
            for &v in &self.classes[ci].ring {
                let vd = &self.vdevs[v as usize];
                if !vd.vdev_allocatable() || avoid.contains(&v) {
                    continue;
                }
                any = true;
                if let Some(g) = vd.group(ci) {
                    let (mut largest, mut space) = (0u64, 0u64);
                    for m in g.members() {
                        let ms = &vd.ms[m as usize];
                        if ms.new {
                            continue;
                        }
                        largest = largest.max(ms.allocatable.max_size());
                        space += ms.allocatable.space();
                    }
                    largest_free = largest_free.max(asize_to_psize(&vd.spec, Asize(largest)));
                    free += asize_to_psize(&vd.spec, Asize(space)).0;
                }
            }
        }
        if !any {
            NoSpaceReason::VdevsOffline
        } else if largest_free.0 == 0 || free < psize.saturating_mul(copies as u64) {
            NoSpaceReason::Full
        } else {
            NoSpaceReason::Fragmented { largest_free }
        }
    }

    /// Return a placed-but-uncommitted extent to its metaslab.
    pub(crate) fn unplace(&mut self, e: &Extent) {
        let v = &mut self.vdevs[e.vdev as usize];
        let m = (e.offset >> v.shift) as u32;
        let ci = v.class_of(m);
        let (ms, g) = v.ms_and_group(m, ci);
        if ms.give_back(e.offset, e.size) {
            let g = g.expect("group of its class");
            g.alloc -= e.size;
            g.note_changed(ms);
            self.classes[ci].alloc -= e.size;
        }
    }

    /// `metaslab.c:metaslab_alloc_dva@zfs-2.4.0`: copy `d` of a block over the
    /// ring of class `ci` from allocator `k`'s rotor, never on a vdev of
    /// `avoid`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn metaslab_alloc_dva(
        &mut self,
        ci: usize,
        k: usize,
        psize: u64,
        max_psize: u64,
        d: usize,
        placed: &Placed,
        busy: bool,
        zil: bool,
        avoid: &[VdevId],
    ) -> Option<(Extent, u32)> {
        let n = self.classes[ci].ring.len();
        if n == 0 {
            return None;
        }
        for try_hard in [false, true] {
            // The try-hard pass (ignoring the group checks) is for blocks
            // OpenZFS cannot gang: intent-log blocks and blocks at the minimum
            // size, or every block with zfs_metaslab_try_hard_before_gang
            // (`metaslab.c:metaslab_alloc_dva_range@zfs-2.4.0`). Any other
            // block OpenZFS writes as a gang block whose members are placed
            // trying hard: where one free segment still holds the whole block,
            // Aliquot (no gang blocks) places it whole the same way; where none
            // does, it fails as FRAGMENTED.
            if try_hard
                && !(zil
                    || self.tun.zfs_metaslab_try_hard_before_gang
                    || psize <= self.spa_min_alloc()
                    || self.fits_whole(ci, psize, avoid))
            {
                break;
            }
            let c = &self.classes[ci];
            let start = if d == 0 {
                c.rotor(k) % n
            } else {
                let prev = placed.extents[d - 1].vdev;
                c.position(prev).map_or(c.rotor(k) % n, |p| (p + 1) % n)
            };
            for i in 0..n {
                // A vdev holding a copy already is not skipped: the copy goes
                // to another of its metaslabs
                // (`metaslab.c:metaslab_group_alloc@zfs-2.4.0`,
                // `find_valid_metaslab`).
                let v = self.classes[ci].ring[(start + i) % n];
                if !self.metaslab_group_allocatable(ci, k, v, d, try_hard, zil, avoid) {
                    self.metaslab_class_rotate(ci, k, v, psize, 0, false, busy, zil);
                    continue;
                }
                match self.metaslab_group_alloc(ci, k, v, psize, max_psize, placed, try_hard) {
                    Some((e, loads)) => {
                        self.metaslab_class_rotate(ci, k, v, psize, e.size, true, busy, zil);
                        return Some((e, loads));
                    }
                    None => self.metaslab_class_rotate(ci, k, v, psize, 0, false, busy, zil),
                }
            }
        }
        None
    }

    /// Group eligibility at allocation time for allocator `k`
    /// (`metaslab.c:metaslab_group_allocatable@zfs-2.4.0`; legacy: the same
    /// function at zfs-2.3.0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn metaslab_group_allocatable(
        &self,
        ci: usize,
        k: usize,
        v: VdevId,
        d: usize,
        try_hard: bool,
        zil: bool,
        avoid: &[VdevId],
    ) -> bool {
        let vd = &self.vdevs[v as usize];
        if !vd.vdev_allocatable() || avoid.contains(&v) {
            return false;
        }
        let Some(g) = vd.group(ci) else { return false };
        if try_hard {
            return true;
        }
        // Only a non-redundant (leaf) vdev below healthy is spared the first
        // copy; a degraded RAIDZ or mirror still takes its share.
        if d == 0 && vd.health == Health::Degraded && vd.spec.children <= 1 {
            return false;
        }
        let c = &self.classes[ci];
        if self.tun.throttle_policy == ThrottlePolicy::Legacy && ci == NORMAL {
            return self.legacy_group_allocatable(c, k, g, d, zil);
        }
        !(g.no_free_space || (!g.allocatable && c.alloc_groups > 0))
    }

    /// LEGACY `metaslab.c:metaslab_group_allocatable@zfs-2.3.0`.
    pub(crate) fn legacy_group_allocatable(
        &self,
        c: &Class,
        k: usize,
        g: &Group,
        d: usize,
        zil: bool,
    ) -> bool {
        if c.groups <= 1 {
            return true;
        }
        if !g.allocatable {
            return c.alloc_groups == 0;
        }
        if !c.throttle_enabled {
            return true;
        }
        if g.no_free_space {
            return false;
        }
        if zil {
            return true;
        }
        // Per allocator (`mga_alloc_queue_depth[allocator]`,
        // `cur_max[allocator]`).
        let (depth, cur_max) = g.legacy_lane(k);
        if depth < legacy::qmax(cur_max, d) || c.alloc_groups == 1 {
            return true;
        }
        let n = c.ring.len();
        let Some(pos) = c.position(g.vdev) else {
            return true;
        };
        let rotor = c.rotor(k) % n;
        let mut i = (pos + 1) % n;
        while i != rotor && i != pos {
            let h = &self.vdevs[c.ring[i] as usize].mg;
            let (depth, cur_max) = h.legacy_lane(k);
            if depth < legacy::qmax(cur_max, d) && !h.no_free_space {
                return false;
            }
            i = (i + 1) % n;
        }
        true
    }

    /// `metaslab_group_alloc` on vdev `v`'s group of class `ci`: `psize`
    /// decides the metaslab, which gives up to `max_psize` (a ranged log
    /// block; 0 or `psize` otherwise) where one free segment holds it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn metaslab_group_alloc(
        &mut self,
        ci: usize,
        k: usize,
        v: VdevId,
        psize: u64,
        max_psize: u64,
        placed: &Placed,
        try_hard: bool,
    ) -> Option<(Extent, u32)> {
        let Pool {
            vdevs,
            classes,
            tun,
            lru,
            now_ms,
            txg,
            open_txg,
            ..
        } = self;
        let vd = &mut vdevs[v as usize];
        let Asize(asize) = psize_to_asize(&vd.spec, Psize(psize));
        let ctx = AllocCtx {
            t: tun,
            txg: *open_txg,
            now_ms: *now_ms,
            try_hard,
            rotational: vd.spec.rotational,
            ms_count: vd.ms.len() as u64,
            min_alloc: 1 << vd.spec.ashift,
            allocator: k,
            allocators: classes[ci].allocators(),
        };
        let g = if ci == ELOG {
            vd.log_mg.as_mut()?
        } else {
            &mut vd.mg
        };
        let mut selected = |id: u32, old: Txg, was_loaded: bool| {
            if was_loaded {
                lru.remove(&(old, v, id));
            }
            lru.insert((*open_txg, v, id));
        };
        let (holding, n) = placed.holding(v, vd.shift);
        let activation = Activation::for_copies_on_vdev(n);
        let max_asize = if max_psize > psize {
            psize_to_asize(&vd.spec, Psize(max_psize)).0
        } else {
            asize
        };
        let out = g.alloc(
            &mut vd.ms,
            asize,
            max_asize,
            activation,
            &holding[..n],
            &ctx,
            &mut selected,
        );
        let (m, off, got) = out.offset?;
        g.alloc += got;
        classes[ci].alloc += got;
        txg.mark_dirty(v, &mut vd.ms[m as usize]);
        Some((
            Extent {
                vdev: v,
                offset: off,
                size: got,
            },
            out.loads,
        ))
    }

    /// The rotor rules: unified (`metaslab_class_rotate`), legacy
    /// (`metaslab_alloc_dva@zfs-2.3.0`) or off (strict quota).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn metaslab_class_rotate(
        &mut self,
        ci: usize,
        k: usize,
        v: VdevId,
        psize: u64,
        asize: u64,
        success: bool,
        busy: bool,
        zil: bool,
    ) {
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[ci];
        if c.ring.is_empty() {
            return;
        }
        if policy == ThrottlePolicy::Legacy {
            if !success {
                c.rotate_after(k, v);
                return;
            }
            let vd = &mut self.vdevs[v as usize];
            let bias_enabled = self.tun.metaslab_bias_enabled;
            let vs_free = vd.vs_space().saturating_sub(vd.vs_alloc());
            let mc_free = c.space.saturating_sub(c.alloc);
            let alloc_groups = c.alloc_groups;
            let Some(g) = vd.group_mut(ci) else { return };
            if c.visit_bytes(k) == 0 && bias_enabled {
                g.legacy_bias =
                    legacy::space_bias(vs_free, mc_free, alloc_groups, g.legacy_aliquot);
            } else if !bias_enabled {
                g.legacy_bias = 0;
            }
            c.add_visit_bytes(k, asize);
            if legacy::should_rotate(zil, c.visit_bytes(k), g.legacy_aliquot, g.legacy_bias) {
                c.rotate_after(k, v);
            }
            return;
        }
        if c.groups < 2 || c.rotor_vdev(k) != Some(v) {
            return;
        }
        if success {
            c.add_visit_bytes(k, psize);
        }
        let Some(g) = self.vdevs[v as usize].group(ci) else {
            return;
        };
        let perf_bias = if policy == ThrottlePolicy::Off {
            0
        } else {
            self.tun.metaslab_perf_bias
        };
        let rotate = unified::should_rotate(&unified::RotateInput {
            success,
            is_log: c.is_log,
            psize,
            visit_bytes: c.visit_bytes(k),
            aliquot: g.aliquot,
            queue_target: g.queue_target,
            // Per allocator (`mga_queue_depth`).
            queue_depth: g.queue_depth_of(k),
            perf_bias,
            busy,
        });
        if rotate {
            c.rotate_after(k, v);
        }
    }

    /// Legacy per-txg reset
    /// (`spa.c:spa_sync_adjust_vdev_max_queue_depth@zfs-2.3.0`): group limits
    /// back to the default queue depth, class slots = that × initialized
    /// groups.
    pub(crate) fn legacy_reset(&mut self) {
        let t = &self.tun;
        let gmax = t.zfs_vdev_async_write_max_active * t.zfs_vdev_queue_depth_pct / 100;
        let c = &mut self.classes[NORMAL];
        let n = c.allocators();
        let mut groups = 0;
        for &v in &c.ring {
            let vd = &mut self.vdevs[v as usize];
            if vd.vs_space() == 0 {
                continue;
            }
            groups += 1;
            vd.mg.legacy_max = gmax;
            vd.mg.legacy_reset(n, t.zfs_vdev_def_queue_depth);
        }
        // Each allocator's own `mca_alloc_max_slots`.
        for m in &mut c.max_slots_by {
            *m = t.zfs_vdev_def_queue_depth * groups;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Pool, Tunables, VdevRole, VdevSpec};

    fn spec(ashift: u8, role: VdevRole) -> VdevSpec {
        VdevSpec {
            capacity: 1 << 30,
            ashift,
            children: 1,
            parity: 0,
            rotational: false,
            role,
            metaslab_shift: None,
        }
    }

    /// A 512-byte log device does not lower the pool's minimum allocation:
    /// OpenZFS tracks `spa_min_alloc` over normal-class vdevs only.
    #[test]
    fn log_vdevs_do_not_set_the_minimum_allocation() {
        let mut pool = Pool::new(Tunables::default());
        pool.add_vdev(spec(12, VdevRole::Normal)).unwrap();
        pool.add_vdev(spec(9, VdevRole::Log)).unwrap();
        pool.sync();
        assert_eq!(pool.spa_min_alloc(), 4096);
        pool.add_vdev(spec(9, VdevRole::Normal)).unwrap();
        pool.sync();
        assert_eq!(pool.spa_min_alloc(), 512, "a normal one does");
    }
}
