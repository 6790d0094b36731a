//! The agent's state: the open device, its I/O queue, counters and
//! tunables; what GetStats and the report stream read, and the request
//! validation every Write and Read passes before touching the device.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aliquot_proto::v1::{AgentReport, AgentStats, AgentTunables, VdevHealth};
use tonic::codegen::Bytes;

use crate::backend::{self, DeviceInfo};
use crate::config::{self, Config};
use crate::error::AgentError;
use crate::gate::WriteGate;
use crate::payload::Payload;
use crate::queue::{Done, IoQueue};
use crate::stats::Stats;

/// Largest single Write or Read: OpenZFS's largest block (16 MiB).
pub const MAX_IO: u64 = 16 << 20;
const NO_VDEV: u64 = u64::MAX;

/// One vdev's agent; cheap to clone (shared state).
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    info: DeviceInfo,
    children: u32,
    parity: u32,
    log: bool,
    queue: Arc<IoQueue>,
    stats: Arc<Stats>,
    batch_pct: AtomicU32,
    /// What the percentage is of (`--taskq-cpus`; None: the cores).
    taskq_cpus: Option<u32>,
    /// The vdev id the allocator gave us (NO_VDEV until registered).
    vdev: AtomicU64,
    tunables: std::sync::Mutex<()>,
    gate: WriteGate,
    uberblocks: Arc<crate::uberblock::Uberblocks>,
    /// Device I/Os of moves (CopyFrom, ReadForCopy) queued or in flight.
    move_ios: AtomicU64,
}

impl Agent {
    /// Validate the config, open (or create) the device, start the workers.
    pub fn open(cfg: &Config) -> Result<Agent, AgentError> {
        cfg.validate()?;
        let opened = backend::open(cfg)?;
        let data_io = opened.device.data_io();
        let verifier = match &cfg.token_key {
            Some(p) => Some(
                aliquot_auth::TokenVerifier::load(p)
                    .map_err(|e| AgentError::Config(format!("--token-key: {e}")))?,
            ),
            None => None,
        };
        let stats = Arc::new(Stats::default());
        let uberblocks = Arc::new(opened.uberblocks);
        let queue = IoQueue::new(
            opened.device,
            Arc::clone(&stats),
            cfg.aggregation_limit(),
            config::workers_for_pct(cfg.zio_taskq_batch_pct, cfg.taskq_cpus),
        );
        let agent = Agent {
            inner: Arc::new(Inner {
                info: opened.info,
                children: cfg.children,
                parity: cfg.parity,
                log: cfg.log,
                queue,
                stats,
                batch_pct: AtomicU32::new(cfg.zio_taskq_batch_pct),
                taskq_cpus: cfg.taskq_cpus,
                vdev: AtomicU64::new(NO_VDEV),
                tunables: std::sync::Mutex::new(()),
                gate: WriteGate::new(verifier),
                uberblocks,
                move_ios: AtomicU64::new(0),
            }),
        };
        let i = &agent.inner;
        tracing::info!(
            name = %i.info.name,
            guid = i.info.guid,
            backend = i.info.backend.as_str(),
            capacity = i.info.capacity,
            ashift = i.info.ashift,
            rotational = i.info.rotational,
            zfs_vdev_aggregation_limit = i.queue.aggregation_limit(),
            zio_taskq_batch_pct = cfg.zio_taskq_batch_pct,
            io_workers = i.queue.workers(),
            data_io,
            "device open"
        );
        Ok(agent)
    }

    /// The pool's marks on the device (see [`crate::uberblock`]).
    pub fn uberblocks(&self) -> &Arc<crate::uberblock::Uberblocks> {
        &self.inner.uberblocks
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    pub fn children(&self) -> u32 {
        self.inner.children
    }
    pub fn parity(&self) -> u32 {
        self.inner.parity
    }
    pub fn log(&self) -> bool {
        self.inner.log
    }

    pub fn vdev(&self) -> Option<u32> {
        match self.inner.vdev.load(Relaxed) {
            NO_VDEV => None,
            v => Some(v as u32),
        }
    }

    pub fn set_vdev(&self, vdev: u32) {
        self.inner.vdev.store(vdev as u64, Relaxed);
    }

    pub fn io_workers(&self) -> usize {
        self.inner.queue.workers()
    }

    /// Close the current latency interval (called once a report interval).
    pub fn rotate_interval(&self) {
        self.inner.stats.rotate();
    }

    fn sector(&self) -> u64 {
        1 << self.inner.info.ashift
    }

    /// Refuse empty, unaligned, oversized or out-of-device requests.
    pub(crate) fn check_range(&self, what: &str, offset: u64, len: u64) -> Result<(), AgentError> {
        let sector = self.sector();
        let ashift = self.inner.info.ashift;
        let cap = self.inner.info.capacity;
        let bad = |m: String| Err(AgentError::InvalidArgument(m));
        if len == 0 {
            return bad(format!(
                "empty {what}: the size must be at least one {sector}-byte sector"
            ));
        }
        if len > MAX_IO {
            return bad(format!(
                "{what} of {len} bytes exceeds the {MAX_IO}-byte (16 MiB) maximum"
            ));
        }
        if !offset.is_multiple_of(sector) {
            return bad(format!(
                "{what} offset {offset} is not a multiple of the {sector}-byte sector (ashift {ashift})"
            ));
        }
        if !len.is_multiple_of(sector) {
            return bad(format!(
                "{what} size {len} is not a multiple of the {sector}-byte sector (ashift {ashift})"
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= cap => Ok(()),
            _ => bad(format!(
                "{what} [{offset}, {offset}+{len}) lies outside the device ({cap} bytes of data area)"
            )),
        }
    }

    /// Write `data` at `offset` through the queue; returns the requests the
    /// carrying device I/O merged.
    /// The write capabilities this agent checks (see [`WriteGate`]).
    pub fn gate(&self) -> &WriteGate {
        &self.inner.gate
    }

    /// A client's write: the token is checked before anything else.
    pub async fn write_with_token(
        &self,
        token: &[u8],
        offset: u64,
        data: impl Into<Payload>,
    ) -> Result<u32, AgentError> {
        let data = data.into();
        self.inner
            .gate
            .check(token, self.vdev(), offset, data.len() as u64)?;
        self.write(offset, data).await
    }

    /// A client's batch of `(token, offset, data)` writes, all or nothing at
    /// the gate: every token and range is checked before any write is
    /// queued, and the first refused one (by index) refuses the batch. The
    /// writes are then queued together so contiguous ones merge.
    pub async fn write_batch_with_token(
        &self,
        writes: Vec<(Vec<u8>, u64, Bytes)>,
    ) -> Result<Vec<u32>, AgentError> {
        if writes.is_empty() {
            return Err(AgentError::InvalidArgument(
                "empty write batch: send at least one write".into(),
            ));
        }
        let vdev = self.vdev();
        for (index, (token, offset, data)) in writes.iter().enumerate() {
            let len = data.len() as u64;
            self.inner
                .gate
                .check(token, vdev, *offset, len)
                .and_then(|()| self.check_range("write", *offset, len))
                .map_err(|e| AgentError::InBatch {
                    index,
                    source: Box::new(e),
                })?;
        }
        self.inner
            .queue
            .write_many(writes.into_iter().map(|(_, o, d)| (o, d.into())).collect())
            .await
    }

    /// A write without a token check (in-process callers only).
    pub async fn write(&self, offset: u64, data: impl Into<Payload>) -> Result<u32, AgentError> {
        let data = data.into();
        self.check_range("write", offset, data.len() as u64)?;
        match self.inner.queue.write(offset, data).await? {
            Done::Written { aggregated } => Ok(aggregated),
            other => unreachable!("a write completed as {other:?}"),
        }
    }

    pub async fn read(&self, offset: u64, size: u64) -> Result<Vec<u8>, AgentError> {
        self.check_range("read", offset, size)?;
        match self.inner.queue.read(offset, size as usize).await? {
            Done::Read(d) => Ok(d),
            other => unreachable!("a read completed as {other:?}"),
        }
    }

    /// A move's turn: wait while client I/O is queued here (at most
    /// `limit`); returns the time waited (`crate::copy`).
    pub async fn yield_to_clients(&self, limit: Duration, step: Duration) -> Duration {
        let (stats, moves) = (&self.inner.stats, &self.inner.move_ios);
        // Moves do not wait for each other: only I/O beyond theirs is a
        // client's.
        let clients_queued = || stats.queue_ios.load(Relaxed) > moves.load(Relaxed);
        crate::copy::wait_idle(clients_queued, limit, step).await
    }

    /// Count a move's device I/O as such while `io` runs (see
    /// [`Self::yield_to_clients`]).
    pub async fn as_move<T>(&self, io: impl std::future::Future<Output = T>) -> T {
        self.inner.move_ios.fetch_add(1, Relaxed);
        let out = io.await;
        self.inner.move_ios.fetch_sub(1, Relaxed);
        out
    }

    pub async fn flush(&self) -> Result<(), AgentError> {
        self.inner.queue.flush().await.map(|_| ())
    }

    pub fn tunables(&self) -> AgentTunables {
        AgentTunables {
            zfs_vdev_aggregation_limit: Some(self.inner.queue.aggregation_limit()),
            zio_taskq_batch_pct: Some(self.inner.batch_pct.load(Relaxed)),
        }
    }

    /// Validate every given field first, then apply them all (or none).
    pub fn set_tunables(&self, t: &AgentTunables) -> Result<AgentTunables, AgentError> {
        if let Some(v) = t.zfs_vdev_aggregation_limit {
            config::validate_aggregation_limit(v).map_err(AgentError::InvalidArgument)?;
        }
        if let Some(v) = t.zio_taskq_batch_pct {
            config::validate_batch_pct(v).map_err(AgentError::InvalidArgument)?;
        }
        let _serial = self
            .inner
            .tunables
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(v) = t.zfs_vdev_aggregation_limit {
            let old = self.inner.queue.aggregation_limit();
            self.inner.queue.set_aggregation_limit(v);
            if old != v {
                tracing::info!(old, new = v, "tunable zfs_vdev_aggregation_limit changed");
            }
        }
        if let Some(v) = t.zio_taskq_batch_pct {
            let old = self.inner.batch_pct.swap(v, Relaxed);
            let workers = config::workers_for_pct(v, self.inner.taskq_cpus);
            self.inner.queue.set_workers(workers);
            if old != v {
                tracing::info!(
                    old,
                    new = v,
                    io_workers = workers,
                    "tunable zio_taskq_batch_pct changed"
                );
            }
        }
        Ok(self.tunables())
    }

    fn health(&self, recent_errors: u64) -> VdevHealth {
        if recent_errors > 0 {
            VdevHealth::Degraded
        } else {
            VdevHealth::Healthy
        }
    }

    /// Unary Writes served by the fast path since the agent started.
    pub fn fast_writes(&self) -> u64 {
        self.inner.stats.fast_writes.load(Relaxed)
    }

    pub(crate) fn count_fast_write(&self) {
        self.inner.stats.fast_writes.fetch_add(1, Relaxed);
    }

    pub fn stats(&self) -> AgentStats {
        let s = self.inner.stats.snapshot();
        let i = &self.inner.info;
        AgentStats {
            name: i.name.clone(),
            device_guid: i.guid,
            backend: i.backend.as_str().into(),
            capacity: i.capacity,
            ashift: i.ashift,
            rotational: i.rotational,
            health: self.health(s.recent_errors) as i32,
            latency_p50_us: s.latency_p50_us,
            latency_p99_us: s.latency_p99_us,
            queue_depth_ios: s.queue_ios.min(u32::MAX as u64) as u32,
            queue_depth_bytes: s.queue_bytes,
            bytes_written: s.bytes_written,
            bytes_read: s.bytes_read,
            writes: s.writes,
            device_writes: s.device_writes,
            write_errors: s.write_errors,
            read_errors: s.read_errors,
            tunables: Some(self.tunables()),
            vdev: self.vdev(),
        }
    }

    pub fn report(&self, vdev: u32) -> AgentReport {
        let s = self.stats();
        AgentReport {
            vdev,
            capacity: s.capacity,
            health: s.health,
            latency_p50_us: s.latency_p50_us,
            latency_p99_us: s.latency_p99_us,
            queue_depth_ios: s.queue_depth_ios,
            queue_depth_bytes: s.queue_depth_bytes,
            bytes_written: s.bytes_written,
            bytes_read: s.bytes_read,
            write_errors: s.write_errors,
            read_errors: s.read_errors,
            writes: s.writes,
            device_writes: s.device_writes,
            out_of_space: self.out_of_space(),
            time_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            // Only the first report after a registration names them
            // (`WriteGate::name_older_writes`).
            ..Default::default()
        }
    }

    /// A write met ENOSPC and the file system has not had room since: room
    /// means at least `RESUME_FREE` bytes available to us again (statvfs of
    /// the device file's file system), checked at each report.
    pub fn out_of_space(&self) -> bool {
        const RESUME_FREE: u64 = 64 << 20;
        let full = &self.inner.stats.storage_full;
        if !full.load(Relaxed) {
            return false;
        }
        let Some(path) = &self.inner.info.path else {
            return true;
        };
        match free_bytes(path) {
            Some(free) if free >= RESUME_FREE => {
                full.store(false, Relaxed);
                tracing::info!(free, "the device's file system has room again");
                false
            }
            _ => true,
        }
    }

    /// Drain the queue and stop the workers (blocking, so off the runtime).
    pub async fn shutdown(&self) {
        let q = Arc::clone(&self.inner.queue);
        let _ = tokio::task::spawn_blocking(move || q.shutdown()).await;
    }
}

/// Bytes available to unprivileged writers on the file system of `path`.
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out-pointer.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (r == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}
