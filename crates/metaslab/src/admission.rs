//! Admission: a request becomes a ticket the throttle admits now or
//! queues FIFO (unified: bytes against the class limit,
//! `metaslab_class_throttle_reserve@zfs-2.4.0`; legacy: slots, the same
//! function at zfs-2.3.0), tickets leave the queue as space comes back, and
//! whether the pool is busy (the dirty-data rule inside
//! `metaslab.c:metaslab_class_rotate@zfs-2.4.0`).

use crate::throttle::{legacy, unified};
use crate::{
    AllocKind, AllocRequest, Error, Result, SPA_MAXBLOCKSIZE, Submitted, ThrottlePolicy, Ticket,
};

use crate::pool::*;

impl Pool {
    /// Validate a request and pass it through the throttle. Log requests are
    /// always `Ready`.
    pub fn submit(&mut self, req: AllocRequest) -> Result<Submitted> {
        if req.size == 0 {
            return Err(Error::ZeroSize);
        }
        if req.size > SPA_MAXBLOCKSIZE {
            return Err(Error::TooLarge(req.size));
        }
        if !(1..=3).contains(&req.copies) {
            return Err(Error::BadCopies(req.copies));
        }
        if let Some(max_size) = req.max_size
            && (req.kind != AllocKind::Log || max_size < req.size || max_size > SPA_MAXBLOCKSIZE)
        {
            return Err(Error::BadSizeRange {
                size: req.size,
                max_size,
            });
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let allocator = match req.affinity {
            Some(key) => self.allocator_for(key),
            None => {
                let k = self.next_allocator % self.alloc_count;
                self.next_allocator = self.next_allocator.wrapping_add(1);
                k
            }
        };
        let mut st = TicketState {
            req: TicketReq {
                kind: req.kind,
                copies: req.copies,
                size: req.size,
                max_size: req.max_size.unwrap_or(req.size),
            },
            allocator,
            queued: false,
            res: Reservation::None,
        };
        if req.kind == AllocKind::Log {
            self.tickets.insert(ticket, st);
            return Ok(Submitted::Ready(ticket));
        }
        let bytes = req.copies as u64 * req.size;
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[NORMAL];
        if policy == ThrottlePolicy::Off || !c.throttle_enabled {
            self.tickets.insert(ticket, st);
            return Ok(Submitted::Ready(ticket));
        }
        if policy == ThrottlePolicy::Unified && req.size > c.alloc_io_size {
            // A larger block raises the estimate and rebalances now
            // (`metaslab_class_throttle_reserve@zfs-2.4.0`).
            c.alloc_io_size = req.size;
            self.metaslab_class_balance(NORMAL, false);
        }
        let c = &mut self.classes[NORMAL];
        let lane = c.lane(allocator);
        if c.waiters[lane].is_empty() {
            let granted = match policy {
                ThrottlePolicy::Unified => {
                    unified::reserve(&mut c.reserved_by[lane], c.alloc_max, bytes, false).0 && {
                        c.reserved += bytes;
                        st.res = Reservation::Bytes(bytes);
                        true
                    }
                }
                _ => {
                    legacy::reserve(
                        &mut c.slots_by[lane],
                        c.max_slots_by[lane],
                        req.copies as u64,
                    ) && {
                        c.slots_reserved += req.copies as u64;
                        c.legacy_bytes += bytes;
                        st.res = Reservation::Slots(req.copies as u64, bytes);
                        true
                    }
                }
            };
            if granted {
                self.tickets.insert(ticket, st);
                return Ok(Submitted::Ready(ticket));
            }
        }
        st.queued = true;
        c.waiters[lane].push_back(ticket);
        c.waiting_bytes += bytes;
        self.tickets.insert(ticket, st);
        self.dispatch();
        Ok(Submitted::Queued(ticket))
    }

    /// Tickets admitted from the FIFO since the last call, in order.
    pub fn take_admitted(&mut self) -> Vec<Ticket> {
        std::mem::take(&mut self.admitted)
    }

    /// Admit waiters from the head of every allocator's queue while its
    /// budget allows (`zio.c:zio_allocate_dispatch@zfs-2.4.0`).
    pub(crate) fn dispatch(&mut self) {
        for lane in 0..self.classes[NORMAL].waiters.len() {
            self.dispatch_lane(lane);
        }
    }

    fn dispatch_lane(&mut self, lane: usize) {
        let policy = self.tun.throttle_policy;
        let c = &mut self.classes[NORMAL];
        while let Some(&t) = c.waiters[lane].front() {
            let Some(st) = self.tickets.get_mut(&t) else {
                c.waiters[lane].pop_front();
                continue;
            };
            let bytes = st.req.copies as u64 * st.req.size;
            let mut more = true;
            let res = if policy == ThrottlePolicy::Off || !c.throttle_enabled {
                Reservation::None
            } else if policy == ThrottlePolicy::Unified {
                let (granted, m) =
                    unified::reserve(&mut c.reserved_by[lane], c.alloc_max, bytes, false);
                if !granted {
                    break;
                }
                c.reserved += bytes;
                more = m;
                Reservation::Bytes(bytes)
            } else {
                let slots = st.req.copies as u64;
                if !legacy::reserve(&mut c.slots_by[lane], c.max_slots_by[lane], slots) {
                    break;
                }
                c.slots_reserved += slots;
                c.legacy_bytes += bytes;
                Reservation::Slots(slots, bytes)
            };
            st.res = res;
            st.queued = false;
            c.waiters[lane].pop_front();
            c.waiting_bytes -= bytes;
            self.admitted.push(t);
            if !more {
                break;
            }
        }
    }

    /// Release a reservation; wake waiters when the throttle says so.
    pub(crate) fn release(&mut self, res: Reservation, allocator: usize) {
        let c = &mut self.classes[NORMAL];
        let lane = c.lane(allocator);
        let wake = match res {
            Reservation::None => false,
            Reservation::Bytes(b) => {
                c.reserved = c.reserved.saturating_sub(b);
                unified::unreserve(&mut c.reserved_by[lane], c.alloc_max, b)
            }
            Reservation::Slots(s, b) => {
                c.slots_reserved = c.slots_reserved.saturating_sub(s);
                c.slots_by[lane] = c.slots_by[lane].saturating_sub(s);
                c.legacy_bytes = c.legacy_bytes.saturating_sub(b);
                true
            }
        };
        if wake && !c.waiters[lane].is_empty() {
            self.dispatch_lane(lane);
        }
    }

    /// Drop a queued or admitted-but-not-placed ticket (the client went away).
    pub fn cancel(&mut self, ticket: Ticket) -> Result<()> {
        let st = self
            .tickets
            .remove(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        if st.queued {
            let c = &mut self.classes[NORMAL];
            let lane = c.lane(st.allocator);
            if let Some(i) = c.waiters[lane].iter().position(|&t| t == ticket) {
                c.waiters[lane].remove(i);
            }
            c.waiting_bytes -= st.req.copies as u64 * st.req.size;
            self.dispatch_lane(lane);
        } else {
            self.release(st.res, st.allocator);
        }
        Ok(())
    }

    /// Busy for `metaslab_perf_bias`, OpenZFS 2.4's rule
    /// (`metaslab.c:metaslab_class_rotate@zfs-2.4.0`): the caller's `dirty`
    /// bytes (written and not yet synced, `dp_dirty_total`) above
    /// `dirty_max` (`zfs_dirty_data_max`) × (min% + max%) / 200 of the two
    /// `zfs_vdev_async_write_active_*_dirty_percent` tunables, or
    /// `sync_pending` (a pending sync task). The caller measures dirty data
    /// (the allocator: bytes of the open and syncing txgs; the simulator:
    /// its modelled dirty data).
    pub fn busy_dirty(&self, dirty: u64, dirty_max: u64, sync_pending: bool) -> bool {
        unified::busy_dirty(dirty, dirty_max, self.tun.busy_pct_sum(), sync_pending)
    }

    /// `spa_alloc_count` from the machine's CPU count (a fact the caller
    /// passes; OpenZFS fixes it at import): `max(1, min(spa_num_allocators,
    /// cpus / spa_cpus_per_allocator))`. Each allocator of a class has its
    /// own rotor position and aliquot counter; requests take them in turn
    /// (OpenZFS spreads blocks over them by object). Returns the count.
    pub fn set_cpus(&mut self, cpus: u64) -> usize {
        let t = &self.tun;
        let n = (cpus / t.spa_cpus_per_allocator.max(1))
            .min(t.spa_num_allocators)
            .max(1);
        self.alloc_count = n as usize;
        self.next_allocator = 0;
        for c in &mut self.classes {
            c.set_allocators(self.alloc_count);
        }
        self.alloc_count
    }

    /// The allocator a request with affinity `key` goes to: a fixed hash
    /// of the key (the splitmix64 finalizer: stable across processes and
    /// releases, so a client's key keeps its allocator after a restart)
    /// modulo `spa_alloc_count`.
    pub fn allocator_for(&self, key: u64) -> usize {
        let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z % self.alloc_count.max(1) as u64) as usize
    }

    pub fn allocator_count(&self) -> usize {
        self.alloc_count
    }

    /// Busy for a data allocation (`metaslab_perf_bias`): `busy_dirty`
    /// without a pending sync task, the one rule the allocator and the
    /// simulator both use (neither runs sync tasks). The throttle's own
    /// state (requests waiting, bytes reserved) plays no part, as in
    /// OpenZFS: a waiting request says the vdevs' queues are full, which
    /// every large txg's burst does, not that the writers outrun the pool.
    pub fn busy_with_dirty(&self, dirty: u64, dirty_max: u64) -> bool {
        self.busy_dirty(dirty, dirty_max, false)
    }

    /// The normal class's space that takes allocations: OpenZFS's
    /// `spa_rdspace`, the class's space less that of its non-allocating
    /// (offline) vdevs, allocated bytes included, so that what they hold can
    /// be rewritten elsewhere (`spa_misc.c:spa_update_dspace@zfs-2.4.0`).
    pub(crate) fn rdspace(&self) -> u64 {
        let nonallocating: u64 = self
            .offline_normal
            .iter()
            .map(|&v| self.vdevs[v as usize].mg.space)
            .sum();
        debug_assert_eq!(
            nonallocating,
            self.vdevs
                .iter()
                .filter(|v| !v.removed && !v.online && v.main_class() == NORMAL)
                .map(|v| v.mg.space)
                .sum::<u64>(),
            "offline_normal is stale"
        );
        self.classes[NORMAL].space.saturating_sub(nonallocating)
    }

    /// Slop space, raw bytes, on [`Self::rdspace`]
    /// (`spa_misc.c:spa_get_slop_space@zfs-2.4.0`).
    pub(crate) fn spa_get_slop_space(&self) -> u64 {
        let rd = self.rdspace();
        let elog = self.classes[ELOG].space;
        let mut slop = (rd >> self.tun.spa_slop_shift).min(128 << 30);
        slop -= elog.min(slop / 2);
        slop.max((rd / 2).min(128 << 20))
    }
}
