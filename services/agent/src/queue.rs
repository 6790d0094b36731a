//! The per-device I/O queue and its worker threads, as OpenZFS's vdev queue
//! and zio taskq: requests wait here in arrival order; a worker takes the
//! oldest, and if it is a write, merges the offset-contiguous writes queued
//! before and after it into one device I/O while the merged span stays within
//! `zfs_vdev_aggregation_limit` (0 = never merge). The worker count is
//! `zio_taskq_batch_pct` % of the cores or `--taskq-cpus` (at least 1), and
//! both can change at run time. Workers are plain threads: device I/O blocks, and must never
//! run on the async runtime's workers.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::backend::Device;
use crate::error::AgentError;
use crate::payload::Payload;
use crate::stats::Stats;

/// What a completed request returns.
#[derive(Debug)]
pub enum Done {
    /// The device I/O that carried the write merged this many requests.
    Written {
        aggregated: u32,
    },
    Read(Vec<u8>),
    Flushed,
}

enum Kind {
    /// The payload as received: views of the RPC's buffers, never copied.
    Write(Payload),
    Read(usize),
    Flush,
}

struct Op {
    offset: u64,
    kind: Kind,
    enqueued: Instant,
    done: oneshot::Sender<Result<Done, AgentError>>,
}

impl Op {
    fn len(&self) -> u64 {
        match &self.kind {
            Kind::Write(d) => d.len() as u64,
            Kind::Read(n) => *n as u64,
            Kind::Flush => 0,
        }
    }
}

#[derive(Default)]
struct State {
    /// Every queued request by arrival sequence.
    fifo: BTreeMap<u64, Op>,
    /// Queued writes by (start offset, seq) and (end offset, seq), to find
    /// contiguous neighbours.
    by_start: BTreeSet<(u64, u64)>,
    by_end: BTreeSet<(u64, u64)>,
    next_seq: u64,
    target_workers: usize,
    running_workers: usize,
    shutting_down: bool,
}

pub struct IoQueue {
    state: Mutex<State>,
    work: Condvar,
    /// Taken (and so closed, with its lock) at shutdown, once workers are gone.
    device: Mutex<Option<Arc<dyn Device>>>,
    stats: Arc<Stats>,
    aggregation_limit: AtomicU64,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl IoQueue {
    pub fn new(
        device: Box<dyn Device>,
        stats: Arc<Stats>,
        aggregation_limit: u64,
        workers: usize,
    ) -> Arc<IoQueue> {
        let q = Arc::new(IoQueue {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            device: Mutex::new(Some(Arc::from(device))),
            stats,
            aggregation_limit: AtomicU64::new(aggregation_limit),
            handles: Mutex::new(Vec::new()),
        });
        q.set_workers(workers);
        q
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn aggregation_limit(&self) -> u64 {
        self.aggregation_limit.load(Relaxed)
    }

    pub fn set_aggregation_limit(&self, v: u64) {
        self.aggregation_limit.store(v, Relaxed);
    }

    pub fn workers(&self) -> usize {
        self.lock().target_workers
    }

    /// Grow or shrink the worker pool; surplus workers exit once idle.
    pub fn set_workers(self: &Arc<Self>, n: usize) {
        let n = n.max(1);
        let mut st = self.lock();
        if st.shutting_down {
            return;
        }
        st.target_workers = n;
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.retain(|h| !h.is_finished());
        while st.running_workers < n {
            st.running_workers += 1;
            let q = Arc::clone(self);
            let h = std::thread::Builder::new()
                .name("aliquot-io".into())
                .spawn(move || q.worker())
                .expect("spawn an I/O worker thread");
            handles.push(h);
        }
        drop(handles);
        drop(st);
        self.work.notify_all();
    }

    pub async fn write(&self, offset: u64, data: Payload) -> Result<Done, AgentError> {
        self.submit(offset, Kind::Write(data)).await
    }

    pub async fn read(&self, offset: u64, len: usize) -> Result<Done, AgentError> {
        self.submit(offset, Kind::Read(len)).await
    }

    pub async fn flush(&self) -> Result<Done, AgentError> {
        self.submit(0, Kind::Flush).await
    }

    /// Queue every write of a batch under one lock (so a worker sees them
    /// all at once and merges the contiguous ones), then wait for them all.
    /// Returns each write's aggregation count in order, or the first error.
    pub async fn write_many(&self, writes: Vec<(u64, Payload)>) -> Result<Vec<u32>, AgentError> {
        let mut waits = Vec::with_capacity(writes.len());
        {
            let mut st = self.lock();
            if st.shutting_down {
                return Err(AgentError::ShuttingDown);
            }
            for (offset, data) in writes {
                let (tx, rx) = oneshot::channel();
                self.enqueue(&mut st, offset, Kind::Write(data), tx);
                waits.push(rx);
            }
        }
        self.work.notify_all();
        let mut out = Vec::with_capacity(waits.len());
        let mut first_err = None;
        // Wait for every write even after an error: none is left in flight
        // when the reply goes out.
        for rx in waits {
            match rx.await.unwrap_or(Err(AgentError::ShuttingDown)) {
                Ok(Done::Written { aggregated }) => out.push(aggregated),
                Ok(other) => unreachable!("a write completed as {other:?}"),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn enqueue(
        &self,
        st: &mut State,
        offset: u64,
        kind: Kind,
        done: oneshot::Sender<Result<Done, AgentError>>,
    ) {
        let op = Op {
            offset,
            kind,
            enqueued: Instant::now(),
            done,
        };
        let len = op.len();
        let seq = st.next_seq;
        st.next_seq += 1;
        if matches!(op.kind, Kind::Write(_)) {
            self.stats.writes.fetch_add(1, Relaxed);
            st.by_start.insert((offset, seq));
            st.by_end.insert((offset + len, seq));
        }
        st.fifo.insert(seq, op);
        self.stats.queue_ios.fetch_add(1, Relaxed);
        self.stats.queue_bytes.fetch_add(len, Relaxed);
    }

    async fn submit(&self, offset: u64, kind: Kind) -> Result<Done, AgentError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.lock();
            if st.shutting_down {
                return Err(AgentError::ShuttingDown);
            }
            self.enqueue(&mut st, offset, kind, tx);
        }
        self.work.notify_one();
        // The worker always answers; a dropped sender means it panicked.
        rx.await.unwrap_or(Err(AgentError::ShuttingDown))
    }

    /// Stop taking requests, let the workers drain the queue, and join them.
    pub fn shutdown(&self) {
        self.lock().shutting_down = true;
        self.work.notify_all();
        let handles = std::mem::take(&mut *self.handles.lock().unwrap_or_else(|p| p.into_inner()));
        for h in handles {
            let _ = h.join();
        }
        self.device.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn worker(self: Arc<Self>) {
        let device = self
            .device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(device) = device else {
            self.lock().running_workers -= 1;
            return;
        };
        loop {
            let batch = {
                let mut st = self.lock();
                loop {
                    if st.running_workers > st.target_workers
                        || (st.shutting_down && st.fifo.is_empty())
                    {
                        st.running_workers -= 1;
                        return;
                    }
                    if let Some((seq, first)) = st.fifo.pop_first() {
                        break self.gather(&mut st, seq, first);
                    }
                    st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            self.issue(&*device, batch);
        }
    }

    /// Take `first` and, for a write, its queued contiguous neighbours:
    /// backwards first, then forwards, while the span fits the limit.
    fn gather(&self, st: &mut State, seq: u64, first: Op) -> VecDeque<Op> {
        let mut batch = VecDeque::from([first]);
        let head = &batch[0];
        if !matches!(head.kind, Kind::Write(_)) {
            return batch;
        }
        let (mut start, mut end) = (head.offset, head.offset + head.len());
        remove_index(st, start, end, seq);
        let limit = self.aggregation_limit();
        if limit == 0 {
            return batch;
        }
        while let Some(&(_, seq)) = st.by_end.range((start, 0)..=(start, u64::MAX)).next() {
            let op_start = st.fifo[&seq].offset;
            if end - op_start > limit {
                break;
            }
            let op = st.fifo.remove(&seq).expect("indexed write is queued");
            remove_index(st, op_start, start, seq);
            start = op_start;
            batch.push_front(op);
        }
        while let Some(&(_, seq)) = st.by_start.range((end, 0)..=(end, u64::MAX)).next() {
            let op_end = end + st.fifo[&seq].len();
            if op_end - start > limit {
                break;
            }
            let op = st.fifo.remove(&seq).expect("indexed write is queued");
            remove_index(st, end, op_end, seq);
            end = op_end;
            batch.push_back(op);
        }
        batch
    }

    fn issue(&self, device: &dyn Device, batch: VecDeque<Op>) {
        let bytes: u64 = batch.iter().map(Op::len).sum();
        let n = batch.len() as u32;
        let offset = batch[0].offset;
        let result = match &batch[0].kind {
            Kind::Write(first) => {
                self.stats.device_writes.fetch_add(1, Relaxed);
                let r = match (n, first.as_single()) {
                    (1, Some(one)) => device.write_at(offset, one),
                    _ => {
                        // The payloads as received, in offset order: no gather copy.
                        let bufs: Vec<&[u8]> = batch
                            .iter()
                            .filter_map(|op| match &op.kind {
                                Kind::Write(d) => Some(d.slices()),
                                _ => None,
                            })
                            .flatten()
                            .collect();
                        device.write_vectored_at(offset, &bufs)
                    }
                };
                match r {
                    Ok(()) => {
                        self.stats.bytes_written.fetch_add(bytes, Relaxed);
                        Ok(None)
                    }
                    Err(e) => {
                        self.stats.write_errors.fetch_add(n as u64, Relaxed);
                        if e.kind() == std::io::ErrorKind::StorageFull {
                            self.stats.storage_full.store(true, Relaxed);
                        }
                        tracing::warn!(offset, bytes, error = %e, "device write failed");
                        Err(e)
                    }
                }
            }
            Kind::Read(len) => {
                let mut buf = vec![0u8; *len];
                match device.read_at(offset, &mut buf) {
                    Ok(()) => {
                        self.stats.reads.fetch_add(1, Relaxed);
                        self.stats.bytes_read.fetch_add(bytes, Relaxed);
                        Ok(Some(buf))
                    }
                    Err(e) => {
                        self.stats.read_errors.fetch_add(1, Relaxed);
                        tracing::warn!(offset, bytes, error = %e, "device read failed");
                        Err(e)
                    }
                }
            }
            Kind::Flush => match device.flush() {
                Ok(()) => Ok(None),
                Err(e) => {
                    self.stats.write_errors.fetch_add(1, Relaxed);
                    if e.kind() == std::io::ErrorKind::StorageFull {
                        self.stats.storage_full.store(true, Relaxed);
                    }
                    tracing::warn!(error = %e, "device flush failed");
                    Err(e)
                }
            },
        };
        self.stats.queue_ios.fetch_sub(n as u64, Relaxed);
        self.stats.queue_bytes.fetch_sub(bytes, Relaxed);
        let now = Instant::now();
        let mut result = result;
        for op in batch {
            self.stats.record_latency(now - op.enqueued);
            let reply = match (&mut result, &op.kind) {
                (Ok(data), Kind::Read(_)) => Ok(Done::Read(data.take().unwrap_or_default())),
                (Ok(_), Kind::Write(_)) => Ok(Done::Written { aggregated: n }),
                (Ok(_), Kind::Flush) => Ok(Done::Flushed),
                (Err(e), kind) => Err(AgentError::Io {
                    op: match kind {
                        Kind::Write(_) => "write",
                        Kind::Read(_) => "read",
                        Kind::Flush => "flush",
                    },
                    source: std::io::Error::new(e.kind(), e.to_string()),
                }),
            };
            // The caller may have gone away (cancelled RPC); that is fine.
            let _ = op.done.send(reply);
        }
    }
}

/// Drop a write from the neighbour indexes.
fn remove_index(st: &mut State, start: u64, end: u64, seq: u64) {
    st.by_start.remove(&(start, seq));
    st.by_end.remove(&(end, seq));
}
