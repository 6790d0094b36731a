//! Keeping allocations alive between their write and their Commit: a
//! batch commits its blocks together, a mover its moves, and an allocation
//! written early must not expire while the rest are written. A task renews
//! every allocation held, a third of the lease apart; a client that dies
//! stops renewing, so what it held is still released one lease later.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aliquot_proto::v1::RenewLeaseRequest;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use crate::connect::Allocator;

/// The allocations being renewed (see the module comment). Renewal stops
/// when this is dropped.
pub struct Leases {
    inner: Arc<Inner>,
    _task: AbortOnDropHandle<()>,
}

struct Inner {
    alloc: Allocator,
    held: std::sync::Mutex<BTreeSet<u64>>,
    /// The allocator's lease, learnt from a reply (0: not yet known).
    lease_ms: AtomicU64,
}

impl Leases {
    /// Renew on `alloc` what is held.
    pub fn start(alloc: Allocator) -> Leases {
        let inner = Arc::new(Inner {
            alloc,
            held: Default::default(),
            lease_ms: AtomicU64::new(0),
        });
        let task = tokio::spawn(renew(inner.clone()).in_current_span());
        Leases {
            inner,
            _task: AbortOnDropHandle::new(task),
        }
    }

    /// Keep allocation `id` alive until [`Leases::release`]; `deadline_ms`
    /// (unix ms, from its Allocate reply) tells the allocator's lease.
    pub fn hold(&self, id: u64, deadline_ms: u64) {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        if deadline_ms > now_ms {
            self.inner
                .lease_ms
                .store(deadline_ms - now_ms, Ordering::Relaxed);
        }
        self.inner.held.lock().expect("held lock").insert(id);
    }

    /// Allocations committed or aborted: no longer renewed.
    pub fn release(&self, ids: &[u64]) {
        let mut held = self.inner.held.lock().expect("held lock");
        for id in ids {
            held.remove(id);
        }
    }
}

async fn renew(me: Arc<Inner>) {
    loop {
        let lease = me.lease_ms.load(Ordering::Relaxed);
        let period = if lease == 0 {
            Duration::from_millis(500)
        } else {
            Duration::from_millis(lease / 3)
                .clamp(Duration::from_millis(100), Duration::from_secs(10))
        };
        tokio::time::sleep(period).await;
        let ids: Vec<u64> = me.held.lock().expect("held lock").iter().copied().collect();
        if ids.is_empty() {
            continue;
        }
        let renew = |ids: Vec<u64>| {
            let mut alloc = me.alloc.clone();
            async move {
                alloc
                    .renew_lease(RenewLeaseRequest {
                        allocation_ids: ids,
                        lease_ms: 0,
                    })
                    .await
            }
        };
        if let Err(e) = renew(ids.clone()).await {
            // One expired or committed id refuses the whole request: the
            // others one at a time. Their Commit reports what was lost.
            tracing::debug!(error = %e, "renewing held allocations; one by one");
            for id in ids {
                let _ = renew(vec![id]).await;
            }
        }
    }
}
