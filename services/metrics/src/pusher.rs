//! The client side of ingestion, for the allocator: `push` a snapshot and
//! move on. A bounded buffer sits between the caller and the network; a
//! background task sends it in batches (`RecordBatch`), reconnecting with
//! backoff while the metrics service is down and sending the backlog when it
//! returns. A metrics outage never slows the caller: when the buffer is full
//! the oldest snapshot is dropped and counted, and the count travels in each
//! snapshot's `dropped_snapshots`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aliquot_proto::v1::metrics_client::MetricsClient;
use aliquot_proto::v1::{PoolSnapshot, SnapshotBatch};
use tokio::sync::Notify;
use tracing::Instrument;

/// Snapshots per RecordBatch call.
const BATCH: usize = 256;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

struct Shared {
    queue: Mutex<VecDeque<PoolSnapshot>>,
    capacity: usize,
    dropped: AtomicU64,
    rejected: AtomicU64,
    sent: AtomicU64,
    in_flight: AtomicU64,
    connected: AtomicBool,
    closed: AtomicBool,
    work: Notify,
    idle: Notify,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<PoolSnapshot>> {
        // A panic while holding the lock cannot leave the queue inconsistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> u64 {
        self.lock().len() as u64 + self.in_flight.load(Ordering::Acquire)
    }
}

/// A non-blocking snapshot sender; see the module docs.
pub struct SnapshotPusher {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl SnapshotPusher {
    /// Start the sender for `endpoint` (`http://host:port`), buffering at most
    /// `capacity` snapshots (at least 1). Must be called inside a Tokio runtime.
    pub fn spawn(endpoint: impl Into<String>, capacity: usize) -> SnapshotPusher {
        SnapshotPusher::spawn_with(endpoint, aliquot_auth::ClientTls::Insecure, capacity)
    }

    /// As [`spawn`](Self::spawn), connecting with `tls` (the allocator's own
    /// certificate: only the allocator role may record snapshots).
    pub fn spawn_with(
        endpoint: impl Into<String>,
        tls: aliquot_auth::ClientTls,
        capacity: usize,
    ) -> SnapshotPusher {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::with_capacity(capacity.clamp(1, 4096))),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            work: Notify::new(),
            idle: Notify::new(),
        });
        let task = tokio::spawn(send_loop(endpoint.into(), tls, shared.clone()));
        SnapshotPusher { shared, task }
    }

    /// Queue `snap`; never waits. When the buffer is full the oldest queued
    /// snapshot is dropped (and counted) to make room.
    pub fn push(&self, mut snap: PoolSnapshot) {
        let mut q = self.shared.lock();
        if q.len() >= self.shared.capacity {
            q.pop_front();
            self.shared.dropped.fetch_add(1, Ordering::AcqRel);
        }
        snap.dropped_snapshots = self.shared.dropped.load(Ordering::Acquire);
        q.push_back(snap);
        drop(q);
        self.shared.work.notify_one();
    }

    /// Snapshots dropped because the buffer was full (cumulative).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Acquire)
    }

    /// Snapshots queued or being sent.
    pub fn pending(&self) -> u64 {
        self.shared.pending()
    }

    /// Snapshots the metrics service acknowledged.
    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::Acquire)
    }

    /// Snapshots the service refused as invalid (not retried).
    pub fn rejected(&self) -> u64 {
        self.shared.rejected.load(Ordering::Acquire)
    }

    /// Whether the last send attempt reached the service.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    /// Wait until everything queued so far was sent, or `timeout` passed;
    /// true when the buffer is empty.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let idle = self.shared.idle.notified();
            if self.pending() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.pending() == 0;
            }
        }
    }

    /// Flush for up to `timeout`, then stop; returns the snapshots left unsent.
    pub async fn shutdown(self, timeout: Duration) -> u64 {
        self.flush(timeout).await;
        let left = self.pending();
        self.shared.closed.store(true, Ordering::Release);
        self.task.abort();
        left
    }
}

impl Drop for SnapshotPusher {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.task.abort();
    }
}

async fn connect(
    endpoint: &str,
    tls: &aliquot_auth::ClientTls,
) -> Result<MetricsClient<telemetry::TracedChannel>, String> {
    let ep = tls
        .endpoint(endpoint, aliquot_auth::Role::Metrics)
        .map_err(|e| format!("bad metrics endpoint {endpoint:?}: {e}"))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(RPC_TIMEOUT);
    let channel = ep.connect().await.map_err(|e| e.to_string())?;
    Ok(MetricsClient::with_interceptor(
        channel,
        telemetry::TraceInjector,
    ))
}

async fn send_loop(endpoint: String, tls: aliquot_auth::ClientTls, shared: Arc<Shared>) {
    let mut client = None;
    let mut backoff = telemetry::backoff::Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut down_logged = false;
    loop {
        // Wait for work; `notify_one` keeps a permit, so no wake-up is lost.
        loop {
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            if !shared.lock().is_empty() {
                break;
            }
            shared.idle.notify_waiters();
            shared.work.notified().await;
        }
        if client.is_none() {
            match connect(&endpoint, &tls).await {
                Ok(c) => {
                    if down_logged {
                        tracing::info!(endpoint = %endpoint, backlog = shared.pending(), "metrics service reachable again, sending backlog");
                    }
                    client = Some(c);
                    down_logged = false;
                }
                Err(e) => {
                    shared.connected.store(false, Ordering::Release);
                    if !down_logged {
                        tracing::warn!(endpoint = %endpoint, error = %e, "metrics service unreachable, buffering snapshots");
                        down_logged = true;
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            }
        }
        let batch: Vec<PoolSnapshot> = {
            let mut q = shared.lock();
            let n = q.len().min(BATCH);
            shared.in_flight.store(n as u64, Ordering::Release);
            q.drain(..n).collect()
        };
        let n = batch.len() as u64;
        let Some(c) = client.as_mut() else { continue };
        let span = tracing::info_span!("metrics.push", snapshots = n, otel.kind = "client");
        let result = c
            .record_batch(SnapshotBatch {
                snapshots: batch.clone(),
            })
            .instrument(span)
            .await;
        match result {
            Ok(_) => {
                shared.sent.fetch_add(n, Ordering::AcqRel);
                shared.in_flight.store(0, Ordering::Release);
                shared.connected.store(true, Ordering::Release);
                backoff.reset();
            }
            Err(status) if status.code() == tonic::Code::InvalidArgument => {
                shared.rejected.fetch_add(n, Ordering::AcqRel);
                shared.in_flight.store(0, Ordering::Release);
                tracing::warn!(error = %status.message(), snapshots = n, "metrics service rejected snapshots");
            }
            Err(status) => {
                // Put the batch back in front, oldest first; when new pushes
                // filled the buffer meanwhile, the oldest are the ones dropped.
                {
                    let mut q = shared.lock();
                    for s in batch.into_iter().rev() {
                        if q.len() >= shared.capacity {
                            shared.dropped.fetch_add(1, Ordering::AcqRel);
                        } else {
                            q.push_front(s);
                        }
                    }
                    shared.in_flight.store(0, Ordering::Release);
                }
                shared.connected.store(false, Ordering::Release);
                if !down_logged {
                    tracing::warn!(endpoint = %endpoint, error = %status.message(), "sending snapshots failed, buffering");
                    down_logged = true;
                }
                client = None;
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}
