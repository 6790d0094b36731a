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
    AllocRequest, Allocation, AllocationId, ClassKind, Extent, Pool, Submitted, Ticket, Txg, VdevId,
};
use tokio::sync::{oneshot, watch};

use crate::error::{Error, Result};
use crate::store::{Generations, Store, TxgFate, VdevRecord};

/// How many report intervals a vdev may stay silent before it is unavailable.
pub const MISSED_REPORTS: u32 = 3;

/// A committed id is remembered (a repeated Commit answers its txg) until
/// its txg synced and at least this long after the commit.
pub const COMMIT_MEMORY: Duration = Duration::from_secs(120);
/// An id aborted by its lease is remembered this long (a late Commit gets
/// LEASE_EXPIRED rather than "unknown allocation").
pub const EXPIRED_MEMORY: Duration = Duration::from_secs(600);
/// Bound on the remembered ids of each kind (memory on a busy pool).
const MEMORY_LIMIT: usize = 1 << 20;

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
    /// Reports keep coming but its queue does not drain (a hung device):
    /// health forced to Unavailable until writes move again.
    pub stalled: bool,
    /// Consecutive reports with I/Os queued and no write completed.
    pub stuck_reports: u32,
    /// The report stream that owns this vdev (a stream id), while it is open.
    pub stream: Option<u64>,
    /// The health the agent itself reported last.
    pub reported_health: metaslab::Health,
}

pub struct Inner {
    pub pool: Pool,
    /// Tickets queued in the throttle → the parked request.
    waiters: HashMap<Ticket, oneshot::Sender<()>>,
    /// In-flight allocations → lease deadline and extents.
    inflight: HashMap<AllocationId, (Instant, Vec<Extent>)>,
    /// Committed ids → (txg, when): a repeated Commit answers the same txg.
    committed: HashMap<AllocationId, (Txg, Instant)>,
    /// Ids aborted by their lease → when.
    expired: HashMap<AllocationId, Instant>,
    /// Extents freed in a txg not yet synced → that txg (a repeated Free
    /// answers it).
    recent_frees: HashMap<Extent, Txg>,
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
            committed: HashMap::new(),
            expired: HashMap::new(),
            recent_frees: HashMap::new(),
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
                self.inflight.insert(a.id, (deadline, a.extents.clone()));
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

    /// Commit allocations, all or nothing; returns the txg. Ids committed
    /// before answer their first txg (retry-safe); an id whose lease ran
    /// out fails with LeaseExpired, one never seen with UnknownAllocation.
    pub fn commit(&mut self, ids: &[AllocationId]) -> Result<Txg> {
        check_ids(ids)?;
        let mut txg = 0;
        let mut todo = Vec::with_capacity(ids.len());
        for id in ids {
            if self.inflight.contains_key(id) {
                todo.push(*id);
            } else if let Some((t, _)) = self.committed.get(id) {
                txg = txg.max(*t);
            } else if self.expired.contains_key(id) {
                return Err(Error::LeaseExpired(*id));
            } else {
                return Err(metaslab::Error::UnknownAllocation(*id).into());
            }
        }
        let now = Instant::now();
        for id in todo {
            let t = self.pool.commit(id)?;
            txg = txg.max(t);
            self.inflight.remove(&id);
            self.remember_commit(id, t, now);
        }
        self.wake_admitted();
        Ok(txg)
    }

    fn remember_commit(&mut self, id: AllocationId, txg: Txg, now: Instant) {
        if self.committed.len() >= MEMORY_LIMIT {
            // Oldest first would need an ordered map; dropping synced ones
            // (their durability can be read from SyncTxg) is enough.
            let synced_before = self.pool.open_txg();
            self.committed.retain(|_, (t, _)| *t >= synced_before);
        }
        self.committed.insert(id, (txg, now));
    }

    /// Give back in-flight allocations. Ids already given back by their
    /// lease are fine (retry-safe); committed or unknown ids fail.
    pub fn abort(&mut self, ids: &[AllocationId]) -> Result<()> {
        check_ids(ids)?;
        for id in ids {
            if !self.inflight.contains_key(id) && !self.expired.contains_key(id) {
                return Err(metaslab::Error::UnknownAllocation(*id).into());
            }
        }
        for id in ids {
            if self.inflight.remove(id).is_some() {
                self.pool.abort(*id)?;
            }
        }
        self.wake_admitted();
        Ok(())
    }

    /// Extend the leases of in-flight allocations to `now + lease`.
    pub fn renew(&mut self, ids: &[AllocationId], deadline: Instant) -> Result<()> {
        check_ids(ids)?;
        for id in ids {
            if self.inflight.contains_key(id) || self.committed.contains_key(id) {
                continue;
            }
            if self.expired.contains_key(id) {
                return Err(Error::LeaseExpired(*id));
            }
            return Err(metaslab::Error::UnknownAllocation(*id).into());
        }
        for id in ids {
            if let Some((d, _)) = self.inflight.get_mut(id) {
                *d = deadline;
                self.leases.push(Reverse((deadline, *id)));
            }
        }
        Ok(())
    }

    /// Free committed extents; extents freed in a txg not yet synced answer
    /// that txg (retry-safe). Returns the txg the frees belong to.
    pub fn free(&mut self, extents: &[Extent]) -> Result<Txg> {
        let mut txg = 0;
        let todo: Vec<Extent> = extents
            .iter()
            .filter(|e| match self.recent_frees.get(e) {
                Some(t) => {
                    txg = txg.max(*t);
                    false
                }
                None => true,
            })
            .copied()
            .collect();
        if todo.is_empty() {
            return Ok(txg);
        }
        let t = self.pool.free(&todo)?;
        for e in todo {
            self.recent_frees.insert(e, t);
        }
        Ok(txg.max(t))
    }

    /// After txg `synced` is durable: forget what no retry needs any more.
    pub fn forget_synced(&mut self, synced: Txg, now: Instant) {
        self.recent_frees.retain(|_, t| *t > synced);
        self.committed
            .retain(|_, (t, at)| *t > synced || now.duration_since(*at) < COMMIT_MEMORY);
        self.expired
            .retain(|_, at| now.duration_since(*at) < EXPIRED_MEMORY);
    }
}

/// A non-empty id list without duplicates.
fn check_ids(ids: &[AllocationId]) -> Result<()> {
    if ids.is_empty() {
        return Err(Error::invalid("allocation_ids", "no allocation ids given"));
    }
    for (i, id) in ids.iter().enumerate() {
        if ids[..i].contains(id) {
            return Err(Error::invalid(
                "allocation_ids",
                format!("allocation {id} is listed twice"),
            ));
        }
    }
    Ok(())
}

impl Inner {
    /// End the allocations whose lease ended by `now`; returns them. Their
    /// space is NOT free at once: the late writer may still land on it, so
    /// it is committed and freed in the open txg, i.e. deferred like any
    /// free (TXG_DEFER_SIZE synced txgs) before it can be handed out again.
    pub fn expire_leases(&mut self, now: Instant) -> Vec<AllocationId> {
        let mut expired = Vec::new();
        while let Some(Reverse((deadline, id))) = self.leases.peek().cloned() {
            if deadline > now {
                break;
            }
            self.leases.pop();
            // Stale heap entries (committed, aborted or renewed since) are skipped.
            if self.inflight.get(&id).map(|(d, _)| *d) == Some(deadline) {
                let (_, extents) = self.inflight.remove(&id).expect("present");
                let fenced = self
                    .pool
                    .commit(id)
                    .and_then(|_| self.pool.free(&extents).map(|_| ()));
                if let Err(e) = fenced {
                    // Cannot happen for a placed allocation; never hand the
                    // space out early because of it.
                    tracing::error!(allocation = id, error = %e, "expired allocation not fenced");
                }
                if self.expired.len() < MEMORY_LIMIT {
                    self.expired.insert(id, now);
                }
                expired.push(id);
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
    /// The longest lease a client may ask for (`--max-lease`).
    pub max_lease: Duration,
    /// Length of the claim window after a restart (`--claim-window`).
    pub claim_window: Duration,
}

/// Allocation ids on the wire carry their generation in the top bits, so
/// an id of a dead generation can never name an allocation of this one.
pub const ID_GENERATION_SHIFT: u32 = 40;

pub struct Shared {
    inner: Mutex<Inner>,
    pub settings: ServiceSettings,
    pub pool_guid: u64,
    /// The store's generation: counts allocator opens (the fencing token).
    pub generation: u64,
    pub generations: Generations,
    /// After a restart: until then Claim is served and Allocate waits.
    pub claim_until: Option<Instant>,
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
        generations: Generations,
        restarted: bool,
    ) -> Arc<Shared> {
        // Like ZFS claiming its intent log at import: what clients wrote
        // after the last synced txg is re-asserted before anything new is
        // allocated.
        let claim_until = (restarted && !settings.claim_window.is_zero())
            .then(|| Instant::now() + settings.claim_window);
        Arc::new(Shared {
            inner: Mutex::new(Inner::new(pool)),
            settings,
            pool_guid,
            generation: generations.current,
            generations,
            claim_until,
            store,
            synced: watch::Sender::new(synced_txg),
            wanted: watch::Sender::new(synced_txg),
            shutting_down: AtomicBool::new(false),
            txg_timeout_changed: tokio::sync::Notify::new(),
            stop: watch::Sender::new(false),
            closed: watch::Sender::new(false),
        })
    }

    /// Time left in the claim window (zero when closed).
    pub fn claim_window_left(&self) -> Duration {
        self.claim_until.map_or(Duration::ZERO, |t| {
            t.saturating_duration_since(Instant::now())
        })
    }

    /// Allocate waits here while the claim window is open.
    pub async fn wait_claim_window(&self) -> Result<()> {
        let left = self.claim_window_left();
        if left.is_zero() {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(left) => self.check_serving(),
            _ = self.stopping() => Err(Error::ShuttingDown),
        }
    }

    /// An allocation id as the client sees it.
    pub fn wire_id(&self, id: AllocationId) -> u64 {
        (self.generation << ID_GENERATION_SHIFT) | id
    }

    /// The ids of this generation behind wire ids. Ids of an ended
    /// generation are `Err(AllocatorRestarted)` when `strict`, dropped
    /// otherwise (an Abort of them has nothing left to give back); ids no
    /// generation handed out are UnknownAllocation.
    pub fn local_ids(&self, wire: &[u64], strict: bool) -> Result<Vec<AllocationId>> {
        let mut out = Vec::with_capacity(wire.len());
        for &w in wire {
            let g = w >> ID_GENERATION_SHIFT;
            let id = w & ((1 << ID_GENERATION_SHIFT) - 1);
            if g == self.generation {
                out.push(id);
            } else if g > 0 && g < self.generation {
                if strict {
                    return Err(self.restarted(g, format!("allocation {w}")));
                }
            } else {
                return Err(metaslab::Error::UnknownAllocation(w).into());
            }
        }
        Ok(out)
    }

    /// The error for something of ended generation `g`.
    pub fn restarted(&self, g: u64, what: String) -> Error {
        let last_synced = match self.generations.fate(g, u64::MAX, self.synced_txg()) {
            TxgFate::Lost { last_synced } => last_synced,
            _ => self.synced_txg(),
        };
        Error::AllocatorRestarted {
            what,
            generation: g,
            current: self.generation,
            last_synced,
        }
    }

    /// A request's generation (0 = current) must be the current one.
    pub fn check_generation(&self, g: u64, what: impl FnOnce() -> String) -> Result<()> {
        if g == 0 || g == self.generation {
            Ok(())
        } else if self.generations.synced_at_open.contains_key(&g) && g < self.generation {
            Err(self.restarted(g, what()))
        } else {
            Err(Error::GenerationMismatch {
                asked: g,
                current: self.generation,
            })
        }
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
