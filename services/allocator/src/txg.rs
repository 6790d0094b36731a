//! The txg clock: closes the open txg every `zfs_txg_timeout`, or sooner
//! when somebody waits for it (SyncTxg, Commit{wait_synced}, a new vdev).
//! A sync is `pool.sync()` under the lock, then `store.persist` outside it;
//! waiters are released only once the store returned. A txg the store
//! refuses (a full disk, a failed COMMIT) is retried with backoff until it
//! persists: meanwhile nothing waiting on it (or on a later txg) is
//! answered, and the failure is shown (`Shared::persist_failure`: GetPool,
//! health NOT_SERVING, `aliquot_txg_persist_failing`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::state::Shared;
use crate::store::TxgRecord;

/// A txg the store has not taken yet (shown while it lasts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PersistFailure {
    pub txg: metaslab::Txg,
    /// The store's last error.
    pub error: String,
    /// Unix ms of the first failed attempt.
    pub since_ms: u64,
    /// Failed attempts so far.
    pub attempts: u64,
}

/// How a sync ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synced {
    /// The store has the txg; its waiters were answered.
    Persisted,
    /// Another allocator leads the pool: nothing was persisted.
    Lost,
    /// The store was refused as older than the pool's devices: no txg
    /// syncs (an empty txg synced while refused would let a later start
    /// pass the labels' txg and serve the older store).
    Refused,
    /// Shutdown came while the store refused the txg: nothing more will
    /// be persisted, its waiters hear Unavailable.
    GaveUp,
}

/// Attempts a refused txg still gets once shutdown started (a store that
/// takes it at once is not abandoned; a full one does not hold the exit).
const ATTEMPTS_AFTER_STOP: u32 = 3;

/// Run until shutdown starts; a last sync is done on the way out so
/// committed allocations are not lost.
pub async fn run(shared: Arc<Shared>) {
    let mut shutdown = shared.stop.subscribe();
    let mut wanted = shared.wanted.subscribe();
    // No txg before a device's label vouched for the store (a restarted
    // pool): a store restored from an older copy must not sync its way past
    // the labels' txg while no device is there to object.
    let mut vouched = shared.labels_vouched.subscribe();
    tokio::select! {
        _ = vouched.wait_for(|v| *v) => {}
        _ = shutdown.wait_for(|s| *s) => {
            tracing::info!("shutting down before any device's label vouched for the store: no last txg");
            shared.closed.send_replace(true);
            return;
        }
    }
    loop {
        // Sync until every waiter's txg is durable. This comes first: the
        // task subscribes after it is spawned, so a waiter that raised
        // `wanted` before that is already "seen" and `changed()` alone
        // would never report it (a test hung on exactly that, 1 run in
        // ~300, with the 600 s timer as the only way out).
        loop {
            let want = *wanted.borrow_and_update();
            if shared.synced_txg() >= want {
                break;
            }
            if sync_once(&shared).await != Synced::Persisted {
                return fenced(&shared);
            }
        }
        let timeout = shared.txg_timeout();
        let by_timer = tokio::select! {
            _ = tokio::time::sleep(timeout) => true,
            r = wanted.changed() => {
                if r.is_err() { break; }
                false
            }
            _ = shared.txg_timeout_changed.notified() => continue,
            _ = shutdown.wait_for(|s| *s) => break,
        };
        if by_timer && sync_once(&shared).await != Synced::Persisted {
            return fenced(&shared);
        }
    }
    sync_once(&shared).await;
    shared.closed.send_replace(true);
}

/// Another allocator leads, the store was refused as older than the pool,
/// or shutdown came while the store refused a txg: the clock stops; waiters
/// hear why.
fn fenced(shared: &Shared) {
    shared.lock().drop_waiters();
    shared.closed.send_replace(true);
}

/// Has this allocator lost the pool (a persist was fenced, or the lease
/// was taken)? Then nothing it holds may be persisted or acknowledged.
fn lost_the_pool(shared: &Shared) -> bool {
    let deposed = shared.lease.get().is_some_and(|l| l.is_deposed());
    if shared.store.fenced() {
        if let Some(l) = shared.lease.get() {
            l.depose("", "a txg's fencing check found a newer generation");
        }
        return true;
    }
    deposed
}

/// Close the open txg and persist it. Anything but `Persisted`: nothing
/// was persisted and nothing is acknowledged.
pub async fn sync_once(shared: &Shared) -> Synced {
    // Held until the txg is persisted and `synced_state` says so: a label
    // check waits for it, and after a refusal no txg closes at all.
    let _gate = shared.sync_gate.lock().await;
    if shared.is_rolled_back() {
        tracing::warn!(
            "the store is older than the pool's devices: no txg syncs until an operator restores it or restarts with --rewind-to"
        );
        return Synced::Refused;
    }
    let start = Instant::now();
    let record = {
        let mut g = shared.lock();
        // The policy's clock is ours: unload delays and preload use it.
        let sync = g.pool.sync_at(crate::convert::unix_ms());
        g.syncing_bytes = sync.changes.iter().map(|c| c.extent.size).sum();
        // Undeferred space and the new balance can let waiters in.
        g.wake_admitted();
        let vdevs = std::mem::take(&mut g.pending_vdevs);
        let vdev_states = std::mem::take(&mut g.pending_vdev_states);
        let relocations = g.relocations.take_committed(sync.txg);
        let owners = g.extent_owners.take_changes();
        let mappings = g.take_mappings(sync.txg);
        let copies = g.pending_copies.take(sync.txg);
        let mut rec = TxgRecord {
            sync,
            vdevs,
            vdev_states,
            relocations,
            owners,
            mappings,
            copies,
            state_digest: 0,
        };
        // Syncs run one at a time: the pair holds the previous txg's digest.
        let prev = shared
            .synced_state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1;
        rec.state_digest = crate::store::state_digest(prev, &rec);
        rec
    };
    let txg = record.sync.txg;
    let span = tracing::info_span!(
        "txg.sync",
        txg,
        changes = record.sync.changes.len(),
        undeferred_bytes = record.sync.undeferred_bytes,
        duration_us = tracing::field::Empty,
    );
    let persisted = async {
        // Capped low: a file system that has room again is used within
        // seconds, and a refusing one costs one attempt every 2 s or so.
        let mut backoff =
            telemetry::backoff::Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        let mut stop = shared.stop.subscribe();
        let mut after_stop = 0u32;
        loop {
            let r = shared.store.persist(&record).await;
            let rpc = shared.lock().rpc.clone();
            if let Some(m) = &rpc {
                m.txg_persist(r.is_ok());
            }
            let e = match r {
                Ok(()) => break,
                Err(e) => e,
            };
            if lost_the_pool(shared) {
                tracing::error!(txg, error = %e, "txg not persisted: another allocator leads the pool");
                return Synced::Lost;
            }
            // Waiters stay parked: durability is not claimed until the
            // store has the txg. Said in GetPool, health and metrics.
            let mut attempts = 0;
            shared.persist_failure.send_modify(|f| {
                let f = f.get_or_insert_with(|| PersistFailure {
                    txg,
                    error: String::new(),
                    since_ms: crate::convert::unix_ms(),
                    attempts: 0,
                });
                f.error = e.to_string();
                f.attempts += 1;
                attempts = f.attempts;
            });
            let stopping = *stop.borrow();
            if stopping {
                after_stop += 1;
                if after_stop >= ATTEMPTS_AFTER_STOP {
                    tracing::error!(txg, error = %e, attempts,
                        "txg not persisted and shutting down: its commits were never acknowledged");
                    return Synced::GaveUp;
                }
            }
            let delay = backoff.next_delay();
            tracing::error!(txg, error = %e, attempts, retry_in_ms = delay.as_millis() as u64,
                "txg persist failed: nothing waiting on it is answered until the store takes it");
            if stopping {
                tokio::time::sleep(delay.min(Duration::from_millis(200))).await;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }
        }
        let mut was = None;
        shared.persist_failure.send_if_modified(|f| {
            was = f.take();
            was.is_some()
        });
        if let Some(f) = was {
            tracing::warn!(txg, attempts = f.attempts, failing_for_ms = crate::convert::unix_ms().saturating_sub(f.since_ms),
                "txg persisted again after failed attempts");
        }
        let us = start.elapsed().as_micros() as u64;
        tracing::Span::current().record("duration_us", us);
        tracing::debug!(txg, duration_us = us, "txg synced");
        Synced::Persisted
    }
    .instrument(span)
    .await;
    if persisted != Synced::Persisted {
        return persisted;
    }
    // Retries of what this txg made durable no longer need remembering
    // (commit ids for a few txgs more), and the store now has its extents.
    {
        let mut g = shared.lock();
        g.syncing_bytes = 0;
        g.synced(txg, Instant::now());
    }
    *shared
        .synced_state
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = (txg, record.state_digest);
    shared.synced.send_replace(txg);
    Synced::Persisted
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicU64;

    use super::*;
    use crate::state::{Fencing, ServiceSettings};
    use crate::store::{MemStore, Store};

    /// A waiter that raised `wanted` before the clock task first ran (and
    /// so before it subscribed) is still served, without the timer.
    #[tokio::test]
    async fn a_waiter_from_before_the_clock_started_is_served() {
        let pool = metaslab::Pool::new(metaslab::Tunables::default());
        let synced = pool.open_txg() - 1;
        let settings = ServiceSettings {
            pool_name: "t".into(),
            default_lease: Duration::from_secs(30),
            report_interval: Duration::from_secs(600),
            txg_timeout_us: AtomicU64::new(600_000_000),
            txg_dirty_max: u64::MAX,
            max_lease: Duration::from_secs(300),
            max_lease_lifetime: Duration::from_secs(600),
            max_leased_per_client: 0,
            token_signer: None,
        };
        let fencing = Fencing {
            generation: 1,
            synced_at_open: synced,
            claim_window_until: None,
            history: BTreeMap::new(),
            rewind_generation: 0,
        };
        let store = Arc::new(MemStore::new());
        store.create(1).await.unwrap();
        let shared = Shared::new(pool, settings, 1, fencing, store, synced);
        shared.labels_vouched.send_replace(true);
        // What `wait_synced` does, before the clock exists.
        shared.wanted.send_replace(synced + 1);
        let clock = tokio::spawn(run(shared.clone()));
        let mut rx = shared.synced.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|s| *s > synced))
            .await
            .expect("the clock must sync the txg wanted before it started")
            .unwrap();
        shared.stop.send_replace(true);
        clock.await.unwrap();
    }
}
