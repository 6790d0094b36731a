//! The allocator's shared state: the `metaslab::Pool` behind one
//! `std::sync::Mutex` (short critical sections, never held across an
//! `.await`), the tickets parked in the throttle, the leases of in-flight
//! allocations, and what the registry knows about each vdev. The policy is
//! asked, never second-guessed: this module only waits, wakes and times.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use metaslab::{
    AllocRequest, Allocation, AllocationId, ClassKind, Pool, Submitted, Ticket, Txg, VdevId,
};
use tokio::sync::{oneshot, watch};

use crate::error::{Error, Result};
use crate::store::{Store, VdevRecord};

/// How many report intervals a vdev may stay silent before it is unavailable.
pub const MISSED_REPORTS: u32 = 3;

/// What the registry knows about one vdev besides the pool's view.
#[derive(Clone, Debug)]
pub struct VdevInfo {
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    pub backend: String,
    pub last_report: Option<pb::AgentReport>,
    /// Time of the last report (or of registration).
    pub last_seen: Instant,
    /// The report before `last_report`, for throughput deltas.
    pub prev_report: Option<(Instant, pb::AgentReport)>,
    pub last_report_at: Option<Instant>,
    /// Silent for `MISSED_REPORTS` intervals: health forced to Unavailable.
    pub silent: bool,
    /// The health the agent itself reported last.
    pub reported_health: metaslab::Health,
}

pub struct Inner {
    pub pool: Pool,
    /// Tickets queued in the throttle → the parked request.
    waiters: HashMap<Ticket, oneshot::Sender<()>>,
    /// In-flight allocations → lease deadline.
    inflight: HashMap<AllocationId, Instant>,
    leases: BinaryHeap<Reverse<(Instant, AllocationId)>>,
    pub vdevs: BTreeMap<VdevId, VdevInfo>,
    pub by_guid: HashMap<u64, VdevId>,
    /// Vdev records to persist with the next txg.
    pub pending_vdevs: Vec<VdevRecord>,
    /// Events since the last metrics snapshot.
    pub events: Vec<pb::PoolEvent>,
}

impl Inner {
    pub fn new(pool: Pool) -> Inner {
        Inner {
            pool,
            waiters: HashMap::new(),
            inflight: HashMap::new(),
            leases: BinaryHeap::new(),
            vdevs: BTreeMap::new(),
            by_guid: HashMap::new(),
            pending_vdevs: Vec::new(),
            events: Vec::new(),
        }
    }

    /// After anything that can release throttle bytes: wake the tickets the
    /// throttle admitted, in FIFO order. A ticket whose request went away is
    /// cancelled (the waiter's guard also cancels; either way it is once).
    pub fn wake_admitted(&mut self) {
        loop {
            let admitted = self.pool.take_admitted();
            if admitted.is_empty() {
                return;
            }
            for t in admitted {
                match self.waiters.remove(&t) {
                    Some(tx) => {
                        if tx.send(()).is_err() {
                            let _ = self.pool.cancel(t);
                        }
                    }
                    // Nobody waits for it any more: give its bytes back.
                    None => {
                        let _ = self.pool.cancel(t);
                    }
                }
            }
        }
    }

    /// Place an admitted ticket and start its lease.
    fn place(&mut self, ticket: Ticket, lease: Duration) -> Result<Allocation> {
        let busy = self.pool.busy(ClassKind::Normal);
        match self.pool.allocate(ticket, busy) {
            Ok(a) => {
                let deadline = Instant::now() + lease;
                self.inflight.insert(a.id, deadline);
                self.leases.push(Reverse((deadline, a.id)));
                Ok(a)
            }
            Err(e) => {
                // The failed allocate released its reservation.
                self.wake_admitted();
                Err(e.into())
            }
        }
    }

    pub fn endpoints(&self, a: &Allocation) -> Vec<String> {
        a.extents
            .iter()
            .map(|e| {
                self.vdevs
                    .get(&e.vdev)
                    .map(|v| v.endpoint.clone())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Commit in-flight allocations, all or nothing; returns the txg.
    pub fn commit(&mut self, ids: &[AllocationId]) -> Result<Txg> {
        self.check_inflight(ids)?;
        let mut txg = self.pool.open_txg();
        for id in ids {
            txg = txg.max(self.pool.commit(*id)?);
            self.inflight.remove(id);
        }
        self.wake_admitted();
        Ok(txg)
    }

    pub fn abort(&mut self, ids: &[AllocationId]) -> Result<()> {
        self.check_inflight(ids)?;
        for id in ids {
            self.pool.abort(*id)?;
            self.inflight.remove(id);
        }
        self.wake_admitted();
        Ok(())
    }

    fn check_inflight(&self, ids: &[AllocationId]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument("no allocation ids given".into()));
        }
        for (i, id) in ids.iter().enumerate() {
            if !self.inflight.contains_key(id) {
                return Err(metaslab::Error::UnknownAllocation(*id).into());
            }
            if ids[..i].contains(id) {
                return Err(Error::InvalidArgument(format!(
                    "allocation {id} is listed twice"
                )));
            }
        }
        Ok(())
    }

    /// Abort the allocations whose lease ended by `now`; returns them.
    pub fn expire_leases(&mut self, now: Instant) -> Vec<AllocationId> {
        let mut expired = Vec::new();
        while let Some(Reverse((deadline, id))) = self.leases.peek().copied() {
            if deadline > now {
                break;
            }
            self.leases.pop();
            // Stale heap entries (committed or aborted since) are skipped.
            if self.inflight.get(&id) == Some(&deadline) {
                self.inflight.remove(&id);
                if self.pool.abort(id).is_ok() {
                    expired.push(id);
                }
            }
        }
        if !expired.is_empty() {
            self.wake_admitted();
        }
        expired
    }

    pub fn inflight_count(&self) -> usize {
        self.inflight.len()
    }

    /// Shutting down: every parked request is told so (its sender drops).
    pub fn drop_waiters(&mut self) {
        self.waiters.clear();
    }

    pub fn event(&mut self, kind: &str, vdev: VdevId, detail: String) {
        self.events.push(pb::PoolEvent {
            time_ms: crate::convert::unix_ms() as i64,
            kind: kind.to_string(),
            vdev,
            detail,
        });
        // Bounded: without a metrics sink nobody drains them.
        if self.events.len() > 1024 {
            self.events.drain(..512);
        }
    }
}

/// Service settings that are not policy (the tunables the service owns).
pub struct ServiceSettings {
    pub pool_name: String,
    pub default_lease: Duration,
    pub report_interval: Duration,
    /// `zfs_txg_timeout`, in microseconds (settable at run time).
    pub txg_timeout_us: AtomicU64,
    /// The open txg closes early once it changed this many bytes.
    pub txg_dirty_max: u64,
}

pub struct Shared {
    inner: Mutex<Inner>,
    pub settings: ServiceSettings,
    pub pool_guid: u64,
    /// The store's generation: counts allocator opens (the fencing token).
    pub generation: u64,
    pub store: Arc<dyn Store>,
    /// The last txg whose sync was persisted.
    pub synced: watch::Sender<Txg>,
    /// The highest txg somebody waits for; the txg clock syncs up to it.
    pub wanted: watch::Sender<Txg>,
    pub shutting_down: AtomicBool,
    /// Wakes the txg clock when `zfs_txg_timeout` changed.
    pub txg_timeout_changed: tokio::sync::Notify,
    /// Turns true when shutdown starts: streams end, the txg clock does
    /// its last sync.
    pub stop: watch::Sender<bool>,
    /// Turns true after the last sync: nothing more will become durable.
    pub closed: watch::Sender<bool>,
}

/// How a `begin_allocate` ended.
pub enum Begun {
    Placed(Allocation, Vec<String>),
    Queued(Ticket, oneshot::Receiver<()>),
}

impl Shared {
    pub fn new(
        pool: Pool,
        settings: ServiceSettings,
        pool_guid: u64,
        store: Arc<dyn Store>,
        synced_txg: Txg,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            inner: Mutex::new(Inner::new(pool)),
            settings,
            pool_guid,
            generation: 0,
            store,
            synced: watch::Sender::new(synced_txg),
            wanted: watch::Sender::new(synced_txg),
            shutting_down: AtomicBool::new(false),
            txg_timeout_changed: tokio::sync::Notify::new(),
            stop: watch::Sender::new(false),
            closed: watch::Sender::new(false),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in the policy; keep
        // serving what state there is rather than poisoning every RPC.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Past the dirty bound, ask the txg clock to close the open txg now
    /// (without waiting for it). Called after commits, frees and claims.
    pub fn kick_if_dirty(&self, g: &Inner) {
        if g.pool.dirty_bytes() >= self.settings.txg_dirty_max {
            let open = g.pool.open_txg();
            self.wanted.send_if_modified(|w| {
                if *w < open {
                    *w = open;
                    true
                } else {
                    false
                }
            });
        }
    }

    pub fn txg_timeout(&self) -> Duration {
        Duration::from_micros(self.settings.txg_timeout_us.load(Ordering::Relaxed))
    }

    pub fn check_serving(&self) -> Result<()> {
        if self.shutting_down.load(Ordering::Relaxed) {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// Submit a request; place it at once when the throttle admits it,
    /// otherwise park it (FIFO) and return the receiver to wait on.
    pub fn begin_allocate(&self, req: AllocRequest, lease: Duration) -> Result<Begun> {
        let mut g = self.lock();
        // Checked under the lock: shutdown drops the waiters under it too.
        self.check_serving()?;
        match g.pool.submit(req)? {
            Submitted::Ready(t) => {
                let a = g.place(t, lease)?;
                let eps = g.endpoints(&a);
                Ok(Begun::Placed(a, eps))
            }
            Submitted::Queued(t) => {
                let (tx, rx) = oneshot::channel();
                g.waiters.insert(t, tx);
                // It may have been admitted between submit and now by no
                // one else (we hold the lock), but a submit can itself move
                // the FIFO: wake whatever it admitted.
                g.wake_admitted();
                Ok(Begun::Queued(t, rx))
            }
        }
    }

    /// Wait for a parked ticket's admission, then place it. Dropping the
    /// future (client gone) cancels the ticket.
    pub async fn finish_allocate(
        self: &Arc<Self>,
        ticket: Ticket,
        rx: oneshot::Receiver<()>,
        lease: Duration,
    ) -> Result<(Allocation, Vec<String>)> {
        let mut guard = CancelOnDrop {
            shared: self,
            ticket,
            armed: true,
        };
        let woke = rx.await;
        guard.armed = false;
        if woke.is_err() {
            // The sender went away: shutdown.
            let mut g = self.lock();
            let _ = g.pool.cancel(ticket);
            g.wake_admitted();
            return Err(Error::ShuttingDown);
        }
        self.check_serving().inspect_err(|_| {
            let mut g = self.lock();
            let _ = g.pool.cancel(ticket);
            g.wake_admitted();
        })?;
        let mut g = self.lock();
        let a = g.place(ticket, lease)?;
        let eps = g.endpoints(&a);
        Ok((a, eps))
    }

    /// Allocate, waiting in the throttle if need be; returns the allocation,
    /// its endpoints and the time waited.
    pub async fn allocate(
        self: &Arc<Self>,
        req: AllocRequest,
        lease: Duration,
    ) -> Result<(Allocation, Vec<String>, Duration)> {
        let start = Instant::now();
        match self.begin_allocate(req, lease)? {
            Begun::Placed(a, eps) => Ok((a, eps, Duration::ZERO)),
            Begun::Queued(t, rx) => {
                let (a, eps) = self.finish_allocate(t, rx, lease).await?;
                Ok((a, eps, start.elapsed()))
            }
        }
    }

    /// Ask the txg clock to sync up to `txg` and wait until it is persisted.
    pub async fn wait_synced(&self, txg: Txg) -> Result<Txg> {
        let mut rx = self.synced.subscribe();
        if *rx.borrow() >= txg {
            return Ok(*rx.borrow());
        }
        self.wanted.send_if_modified(|w| {
            if *w < txg {
                *w = txg;
                true
            } else {
                false
            }
        });
        let mut closed = self.closed.subscribe();
        tokio::select! {
            r = rx.wait_for(|s| *s >= txg) => match r {
                Ok(s) => Ok(*s),
                Err(_) => Err(Error::ShuttingDown),
            },
            _ = closed.wait_for(|c| *c) => {
                // The last sync is done; it may have covered `txg`.
                let s = *self.synced.borrow();
                if s >= txg { Ok(s) } else { Err(Error::ShuttingDown) }
            }
        }
    }

    /// Resolves when shutdown starts.
    pub async fn stopping(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    pub fn synced_txg(&self) -> Txg {
        *self.synced.borrow()
    }
}

/// Cancels a parked ticket when the waiting request is dropped.
struct CancelOnDrop<'a> {
    shared: &'a Shared,
    ticket: Ticket,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut g = self.shared.lock();
            g.waiters.remove(&self.ticket);
            let _ = g.pool.cancel(self.ticket);
            g.wake_admitted();
            tracing::debug!(ticket = self.ticket, "throttled request went away");
        }
    }
}
