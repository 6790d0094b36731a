//! The txg clock: closes the open txg every `zfs_txg_timeout`, or sooner
//! when somebody waits for it (SyncTxg, Commit{wait_synced}, a new vdev).
//! A sync is `pool.sync()` under the lock, then `store.persist` outside it;
//! waiters are released only once the store returned.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::state::Shared;
use crate::store::TxgRecord;

/// Run until shutdown starts; a last sync is done on the way out so
/// committed allocations are not lost.
pub async fn run(shared: Arc<Shared>) {
    let mut shutdown = shared.stop.subscribe();
    let mut wanted = shared.wanted.subscribe();
    loop {
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
        if by_timer {
            sync_once(&shared).await;
        }
        // Sync until every waiter's txg is durable.
        loop {
            let want = *wanted.borrow_and_update();
            if shared.synced_txg() >= want {
                break;
            }
            sync_once(&shared).await;
        }
    }
    sync_once(&shared).await;
    shared.closed.send_replace(true);
}

/// Close the open txg and persist it.
pub async fn sync_once(shared: &Shared) {
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
        TxgRecord {
            sync,
            vdevs,
            vdev_states,
            relocations,
        }
    };
    let txg = record.sync.txg;
    let span = tracing::info_span!(
        "txg.sync",
        txg,
        changes = record.sync.changes.len(),
        undeferred_bytes = record.sync.undeferred_bytes,
        duration_us = tracing::field::Empty,
    );
    async {
        let mut backoff = Duration::from_millis(50);
        loop {
            match shared.store.persist(&record).await {
                Ok(()) => break,
                Err(e) => {
                    // Waiters stay parked: durability is not claimed until
                    // the store has the txg.
                    tracing::error!(txg, error = %e, "txg persist failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        let us = start.elapsed().as_micros() as u64;
        tracing::Span::current().record("duration_us", us);
        tracing::debug!(txg, duration_us = us, "txg synced");
    }
    .instrument(span)
    .await;
    // Retries of what this txg made durable no longer need remembering
    // (commit ids for a few txgs more), and the store now has its extents.
    {
        let mut g = shared.lock();
        g.syncing_bytes = 0;
        g.synced(txg, Instant::now());
    }
    shared.synced.send_replace(txg);
}
