//! `aliquotctl write`: a load generator that does the whole write path.
//! Per block: Allocate (unary, or pipelined over AllocateStream), write the
//! block's pattern to every extent's agent, Commit. At the end: Flush every
//! agent used and SyncTxg, so the figures are for durable data; `--verify`
//! then reads every copy back. Traces: the command is an `aliquotctl.write`
//! root span (streams, flushes, sync, verify); each block is a trace of its
//! own, an `aliquotctl.block` root span linked to it (and carrying its trace
//! id as `write_trace`), the parent of that block's allocator and agent
//! server spans.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aliquot_proto::v1::stream_reply::Result as StreamResult;
use aliquot_proto::v1::stream_request::Op;
use aliquot_proto::v1::{
    AbortRequest, AllocateReply, AllocateRequest, AllocationClass, ClaimRequest, CommitReply,
    CommitRequest, ErrorReason, Extent, FlushRequest, FreeRequest, GetPoolRequest, LogTier,
    ReadRequest, StreamReply, StreamRequest, SyncTxgRequest,
};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::client::{self, Agents, Allocator, AllocatorArgs, PatternWrite};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassArg {
    Data,
    Log,
}

/// How allocations and commits reach the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// One Allocate and one Commit RPC per block (trace context per block).
    Unary,
    /// One AllocateStream per worker, requests pipelined by id.
    Stream,
}

#[derive(Clone, Debug, clap::Args)]
pub struct WriteArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    /// Bytes to write in all (rounded up to whole blocks).
    #[arg(long, env = "ALIQUOT_WRITE_TOTAL", value_parser = units::size_arg, default_value = "256MiB")]
    pub total: u64,
    /// Size of each allocation and write, 1 B ..= 16 MiB.
    #[arg(long, env = "ALIQUOT_WRITE_BLOCK_SIZE", value_parser = units::size_arg, default_value = "1MiB")]
    pub block_size: u64,
    /// Blocks in flight at once.
    #[arg(long, env = "ALIQUOT_WRITE_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrency: u32,
    /// Cap on the offered load in block bytes (copies not counted), e.g.
    /// 200MiB/s (default: as fast as the pool goes).
    #[arg(long, env = "ALIQUOT_WRITE_RATE", value_parser = units::rate_arg)]
    pub rate: Option<f64>,
    /// Allocation class: data (throttled) or log (intent-log blocks, never throttled).
    #[arg(long, env = "ALIQUOT_WRITE_CLASS", value_enum, default_value_t = ClassArg::Data)]
    pub class: ClassArg,
    /// Copies of each block, each on a different vdev.
    #[arg(long, env = "ALIQUOT_WRITE_COPIES", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=3))]
    pub copies: u32,
    /// Read every copy back and compare it with what was written.
    #[arg(long, env = "ALIQUOT_WRITE_VERIFY")]
    pub verify: bool,
    /// Free every block at the end (the space is reusable after 2 synced txgs).
    #[arg(long, env = "ALIQUOT_WRITE_FREE")]
    pub free: bool,
    /// How allocations reach the allocator: `stream` (the default, 1.36×
    /// the unary throughput in issue 14's measurements) or `unary`.
    #[arg(long, env = "ALIQUOT_WRITE_API", value_enum, default_value_t = Api::Stream)]
    pub api: Api,
    /// Agent writes per request: 1 sends a Write per copy; N > 1 gathers
    /// the copies queued for one agent (from all workers) into WriteBatch
    /// requests of up to N, at most 4 in flight per agent, for small blocks
    /// (one HTTP/2 request per N). N × block size is at most 8 MiB. The
    /// agent refuses a batch whole if any of its writes is refused; each
    /// block of a refused batch is then handled as if its own write failed.
    #[arg(long, env = "ALIQUOT_WRITE_BATCH", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batch: u32,
    /// Lease of each allocation (default: the allocator's).
    #[arg(long, env = "ALIQUOT_WRITE_LEASE", value_parser = units::duration_arg)]
    pub lease: Option<Duration>,
    /// Deadline of each agent write, flush and read. A block whose write
    /// misses it is written again elsewhere, so one hung agent does not
    /// stall the others (its allocation is left to the lease, not aborted:
    /// the late write may still land).
    #[arg(long, env = "ALIQUOT_WRITE_TIMEOUT", value_parser = units::duration_arg, default_value = "5s")]
    pub timeout: Duration,
    /// Attempts per block before the run fails (agent timeouts, expired
    /// leases, a vdev gone offline).
    #[arg(long, env = "ALIQUOT_WRITE_ATTEMPTS", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub attempts: u32,
    /// How long a block waits for an unreachable or restarting allocator
    /// (or for any vdev to be allocatable again) before the run fails;
    /// these waits do not count as attempts.
    #[arg(long, env = "ALIQUOT_WRITE_ALLOCATOR_WAIT", value_parser = units::duration_arg, default_value = "60s")]
    pub allocator_wait: Duration,
    /// Skip the final agent Flush and SyncTxg.
    #[arg(long, env = "ALIQUOT_WRITE_NO_SYNC")]
    pub no_sync: bool,
    /// Print the report as JSON on stdout.
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long, env = "ALIQUOT_NO_PROGRESS")]
    pub no_progress: bool,
    /// Record what was written (block → the extents of its copies) in this
    /// file, once it is durable. Default: a new file per run in
    /// `manifests/` beside --certs-dir (aliquot-data/manifests), where
    /// `balancer execute`, `balancer verify`, `vdev drain` and `free` find
    /// it; not with --free (nothing stays) or --no-sync (not durable), nor
    /// when that data dir does not exist (no `up` pool here).
    #[arg(long, env = "ALIQUOT_WRITE_MANIFEST", conflicts_with_all = ["free", "no_sync"])]
    pub manifest: Option<std::path::PathBuf>,
    /// Record no manifest by default (--manifest still records one): the
    /// blocks stay allocated and aliquotctl cannot move or free them.
    #[arg(long, env = "ALIQUOT_WRITE_NO_MANIFEST")]
    pub no_manifest: bool,
}

impl WriteArgs {
    /// The manifest this run records: --manifest, else a new file in the
    /// default directory (unless --no-manifest, --free or --no-sync).
    pub fn manifest_path(&self) -> Option<std::path::PathBuf> {
        if let Some(m) = &self.manifest {
            return Some(m.clone());
        }
        if self.no_manifest || self.free || self.no_sync {
            return None;
        }
        let dir = crate::manifest::default_dir(&self.conn.tls.certs_dir);
        // The pool's data dir (`up`'s), where the certificates are.
        if !dir.parent().is_some_and(|d| d.is_dir()) {
            return None;
        }
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Some(dir.join(format!("write-{secs}-{:08x}.jsonl", rand::random::<u32>())))
    }

    /// The defaults, aimed at `allocator` (for `demo` and tests).
    pub fn new(allocator: &str) -> WriteArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            w: WriteArgs,
        }
        let mut w = P::parse_from(["write"]).w;
        w.conn.allocator = allocator.to_string();
        w
    }
}

#[derive(Debug, Serialize, Clone, Copy, Default)]
pub struct Latency {
    pub count: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Latency {
        Latency {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
            mean_us: h.mean(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct WriteReport {
    pub blocks: u64,
    pub block_size: u64,
    pub copies: u32,
    pub class: ClassArg,
    pub api: Api,
    /// Agent writes per request (`--batch`).
    pub batch: u32,
    /// Logical bytes written (blocks × block size), what --total asks for;
    /// throughput counts these.
    pub bytes: u64,
    /// Bytes that reached the agents: `bytes` × copies.
    pub physical_bytes: u64,
    /// From the first Allocate to the last Commit.
    pub write_secs: f64,
    /// Final Flush of the agents + SyncTxg.
    pub sync_secs: f64,
    /// bytes / (write_secs + sync_secs): durable throughput.
    pub bytes_per_sec: f64,
    pub allocate: Latency,
    pub write: Latency,
    pub commit: Latency,
    pub throttle_wait: Latency,
    /// Bytes placed per vdev id (every copy counted).
    pub vdev_bytes: BTreeMap<u32, u64>,
    /// The name of each vdev in `vdev_bytes`, as the pool knows it.
    pub vdev_names: BTreeMap<u32, String>,
    /// LOG allocations by the tier that served them.
    pub tiers: BTreeMap<String, u64>,
    pub synced_txg: Option<u64>,
    pub verified_blocks: u64,
    pub verify_secs: f64,
    pub freed_blocks: u64,
    /// The manifest that lists this run's blocks (None: --no-manifest,
    /// --free or --no-sync).
    pub manifest: Option<String>,
    /// Blocks written again (agent timeout, expired lease, allocator restart).
    pub retries: u64,
    /// The allocator's generation at the end.
    pub generation: u64,
    /// Longest time without a block completing (from the start): how long
    /// a hung agent or a restart stalled the whole run.
    pub max_stall_us: u64,
    /// Block writes given up at the deadline (`--timeout`); their
    /// allocations are left to their lease, never aborted (see `one_block`).
    pub timeouts: u64,
}

/// What a block went to, for verify and free.
#[derive(Clone, Debug)]
struct Placed {
    block: u64,
    extents: Vec<Extent>,
    endpoints: Vec<String>,
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds")
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).max(1)
}

/// Allocate/commit, unary or over a pipelined stream.
#[derive(Clone)]
enum Ops {
    Unary(Allocator),
    Stream(Arc<ReStream>),
}

/// An AllocateStream that is opened again after the allocator went away
/// (killed, restarted, or a takeover): the calls in flight fail as
/// UNAVAILABLE and the next call opens a new stream.
struct ReStream {
    alloc: Allocator,
    cur: tokio::sync::Mutex<Arc<StreamOps>>,
}

impl ReStream {
    async fn open(alloc: Allocator) -> anyhow::Result<ReStream> {
        // An allocator away at the start (restarting, or a takeover under
        // way) is waited for like one lost later: the first call reopens.
        let s = match StreamOps::open(alloc.clone()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "allocate stream: the allocator is away; blocks wait for it (--allocator-wait)");
                StreamOps::closed()
            }
        };
        Ok(ReStream {
            alloc,
            cur: tokio::sync::Mutex::new(Arc::new(s)),
        })
    }

    async fn call(&self, op: Op) -> Result<StreamResult, tonic::Status> {
        let s = {
            let mut g = self.cur.lock().await;
            if g.closed.load(Ordering::Relaxed) {
                let fresh = StreamOps::open(self.alloc.clone())
                    .await
                    .map_err(|e| tonic::Status::unavailable(format!("{e:#}")))?;
                *g = Arc::new(fresh);
            }
            g.clone()
        };
        s.call(op).await
    }
}

struct StreamOps {
    tx: mpsc::Sender<StreamRequest>,
    pending: Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<StreamReply>>>>,
    next: AtomicU64,
    /// The allocator ended the stream (or it broke): open another.
    closed: Arc<AtomicBool>,
}

impl StreamOps {
    /// A stream already ended: the next call opens a real one.
    fn closed() -> StreamOps {
        let (tx, _) = mpsc::channel(1);
        StreamOps {
            tx,
            pending: Default::default(),
            next: AtomicU64::new(1),
            closed: Arc::new(AtomicBool::new(true)),
        }
    }

    async fn open(mut c: Allocator) -> anyhow::Result<StreamOps> {
        let (tx, rx) = mpsc::channel::<StreamRequest>(1024);
        let mut replies = c
            .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| client::status_msg("allocate stream", &s))?
            .into_inner();
        let pending: Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<StreamReply>>>> =
            Default::default();
        let p = pending.clone();
        let closed = Arc::new(AtomicBool::new(false));
        let done = closed.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = replies.message().await {
                if let Some(w) = p.lock().expect("pending lock").remove(&r.request_id) {
                    let _ = w.send(r);
                }
            }
            done.store(true, Ordering::Relaxed);
            // Dropping the senders fails every request still waiting.
            p.lock().expect("pending lock").clear();
        });
        Ok(StreamOps {
            tx,
            pending,
            next: AtomicU64::new(1),
            closed,
        })
    }

    async fn call(&self, op: Op) -> Result<StreamResult, tonic::Status> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (w, r) = oneshot::channel();
        self.pending.lock().expect("pending lock").insert(id, w);
        self.tx
            .send(StreamRequest {
                request_id: id,
                op: Some(op),
                // The caller's span is this message's block's: the
                // allocator's span for it joins the block's trace.
                trace_context: telemetry::context_map(),
            })
            .await
            .map_err(|_| tonic::Status::unavailable("allocate stream closed"))?;
        let reply = r
            .await
            .map_err(|_| tonic::Status::unavailable("allocate stream closed by the allocator"))?;
        match reply.result {
            Some(StreamResult::Error(e)) => Err(with_reason(
                tonic::Status::new(tonic::Code::from_i32(e.code), e.message),
                &e.reason,
            )),
            Some(r) => Ok(r),
            None => Err(tonic::Status::internal("empty stream reply")),
        }
    }
}

impl Ops {
    async fn allocate(&self, req: AllocateRequest) -> Result<AllocateReply, tonic::Status> {
        match self {
            Ops::Unary(c) => Ok(c.clone().allocate(req).await?.into_inner()),
            // A span of the block's own trace for its stream message: the
            // stream itself is the command's (one per 8 workers).
            Ops::Stream(s) => match s
                .call(Op::Allocate(req))
                .instrument(tracing::info_span!(
                    "aliquotctl.stream.allocate",
                    otel.kind = "client"
                ))
                .await?
            {
                StreamResult::Allocate(a) => Ok(a),
                _ => Err(tonic::Status::internal(
                    "allocate stream: reply of the wrong kind",
                )),
            },
        }
    }

    async fn commit(&self, id: u64, generation: u64) -> Result<CommitReply, tonic::Status> {
        let req = CommitRequest {
            allocation_ids: vec![id],
            wait_synced: false,
            generation,
        };
        match self {
            Ops::Unary(c) => Ok(c.clone().commit(req).await?.into_inner()),
            Ops::Stream(s) => match s
                .call(Op::Commit(req))
                .instrument(tracing::info_span!(
                    "aliquotctl.stream.commit",
                    otel.kind = "client"
                ))
                .await?
            {
                StreamResult::Commit(r) => Ok(r),
                _ => Err(tonic::Status::internal(
                    "allocate stream: reply of the wrong kind",
                )),
            },
        }
    }

    async fn abort(&self, id: u64) {
        let req = AbortRequest {
            allocation_ids: vec![id],
        };
        let _ = match self {
            Ops::Unary(c) => c.clone().abort(req).await.map(|_| ()),
            Ops::Stream(s) => s.call(Op::Abort(req)).await.map(|_| ()),
        };
    }
}

/// The `ErrorReason` of a status (from its ErrorInfo, or a stream error's
/// reason carried in metadata by `with_reason`).
pub fn reason(s: &tonic::Status) -> Option<ErrorReason> {
    use tonic_types::StatusExt;
    let name = s.get_details_error_info().map(|i| i.reason).or_else(|| {
        s.metadata()
            .get("aliquot-reason")
            .and_then(|v| v.to_str().ok().map(str::to_string))
    })?;
    ErrorReason::from_str_name(&name)
}

fn with_reason(mut s: tonic::Status, reason: &str) -> tonic::Status {
    if let Ok(v) = reason.parse() {
        s.metadata_mut().insert("aliquot-reason", v);
    }
    s
}

/// Failures after which the block is simply written again (new
/// allocation): its space was given back or will be by its lease.
fn retry_block(s: &tonic::Status) -> bool {
    matches!(
        reason(s),
        Some(ErrorReason::LeaseExpired | ErrorReason::AllocatorRestarted)
    )
}

/// An agent's answer to a write after which the block is written again
/// with a new allocation: the agent is gone or restarting (transport
/// errors), its device is full (ENOSPC), or it no longer honours the
/// allocation's token (it restarted, or the allocator did).
fn rewrite_elsewhere(s: &tonic::Status) -> bool {
    use tonic::Code;
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => true,
        Code::Aborted | Code::ResourceExhausted => true,
        Code::PermissionDenied => matches!(
            token_reason(s).as_deref(),
            Some("WRITE_TOKEN_BEFORE_AGENT_START" | "WRITE_TOKEN_OLD_GENERATION")
        ),
        _ => false,
    }
}

/// The ErrorInfo reason of an agent's refusal (its reasons are strings,
/// not the allocator's enum).
fn token_reason(s: &tonic::Status) -> Option<String> {
    use tonic_types::StatusExt;
    s.get_details_error_info().map(|i| i.reason)
}

/// The allocator cannot place anything right now but will (it is down,
/// restarting, or no vdev is allocatable yet): wait, not an attempt.
fn allocator_away(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
    ) || reason(s) == Some(ErrorReason::VdevsOffline)
}

/// Failures of a retry-safe call worth repeating as they are.
fn transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
    ) && !matches!(reason(s), Some(ErrorReason::VdevsOffline))
}

struct WorkerOut {
    allocate: Histogram<u64>,
    write: Histogram<u64>,
    commit: Histogram<u64>,
    wait: Histogram<u64>,
    vdev_bytes: HashMap<u32, u64>,
    tiers: HashMap<i32, u64>,
    placed: Vec<Placed>,
    retries: u64,
    /// Why this worker stopped early (the run then fails, after recording
    /// what was placed).
    failed: Option<anyhow::Error>,
}

/// A block's commit: the generation and txg it joined, and its extents.
struct Committed {
    generation: u64,
    txg: u64,
    extents: Vec<Extent>,
}

struct Shared {
    args: WriteArgs,
    blocks: u64,
    next: AtomicU64,
    stop: AtomicBool,
    nonce: u64,
    start: Instant,
    agents: Agents,
    bar: ProgressBar,
    /// The allocator's generation in the last reply (0 before any).
    generation: AtomicU64,
    /// The allocator (unary), for the restart check.
    alloc: Allocator,
    /// Blocks committed, by the generation that committed them, not yet
    /// re-asserted in a later one: if that generation ended before their
    /// txg synced, they must be claimed in the next one's claim window,
    /// before its Allocate may hand their space to anyone (our own next
    /// blocks included).
    committed: std::sync::Mutex<Vec<Committed>>,
    /// Poked when the allocator was away (an error reaching it, or
    /// ALLOCATOR_RESTARTED): the restart watcher then probes it until it
    /// answers, and claims at once (see `claim_if_restarted`).
    away: tokio::sync::Notify,
    /// One restart check at a time.
    restart_check: tokio::sync::Mutex<()>,
    /// Blocks a late claim could not re-assert (their space was given out):
    /// the run fails naming them.
    lost: std::sync::Mutex<Vec<Extent>>,
    /// The pool's guid, asked once at the start.
    pool_guid: AtomicU64,
    /// Micros from `start` to the last block completed, and the longest
    /// gap between completions so far.
    last_done_us: AtomicU64,
    max_stall_us: AtomicU64,
    timeouts: AtomicU64,
    /// The command's root span: each block is a trace of its own, linked
    /// to it (a GiB of blocks under one root is too big a trace to read).
    run: tracing::Span,
    /// Its trace id, recorded on every block span.
    run_trace: String,
    /// `--batch` > 1: each agent's batcher, started on first use.
    batchers: std::sync::Mutex<HashMap<String, Batcher>>,
}

/// Bytes of one WriteBatch at most (the agent takes 16 MiB + 64 KiB a
/// message; extents may exceed the block by the ashift rounding).
const MAX_BATCH_BYTES: u64 = 8 << 20;
/// WriteBatch requests in flight per agent: while they are out, the next
/// batch fills.
const BATCHES_IN_FLIGHT: usize = 4;

type BatchItem = (
    aliquot_proto::v1::WriteRequest,
    oneshot::Sender<Result<(), tonic::Status>>,
);

/// One agent's write batcher (`--batch N`): workers hand it their writes,
/// a task sends whatever is queued (up to N) as one WriteBatch, without
/// waiting for more (batches form while earlier ones are in flight).
#[derive(Clone)]
struct Batcher {
    tx: mpsc::Sender<BatchItem>,
}

impl Batcher {
    fn start(agents: Agents, ep: String, max: usize) -> Batcher {
        let (tx, mut rx) = mpsc::channel::<BatchItem>(4 * max);
        tokio::spawn(
            async move {
                let slots = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
                while let Some(first) = rx.recv().await {
                    let mut items = vec![first];
                    while items.len() < max {
                        match rx.try_recv() {
                            Ok(it) => items.push(it),
                            Err(_) => break,
                        }
                    }
                    let slot = slots.clone().acquire_owned().await.expect("never closed");
                    let agents = agents.clone();
                    let ep = ep.clone();
                    tokio::spawn(async move {
                        let (writes, waiters): (Vec<_>, Vec<_>) = items.into_iter().unzip();
                        let r = match agents.get(&ep).await {
                            Ok(mut c) => c
                                .write_batch(aliquot_proto::v1::WriteBatchRequest { writes })
                                .await
                                .map(|_| ()),
                            Err(e) => Err(tonic::Status::unavailable(format!("{e:#}"))),
                        };
                        for w in waiters {
                            let _ = w.send(r.clone());
                        }
                        drop(slot);
                    });
                }
            }
            .in_current_span(),
        );
        Batcher { tx }
    }

    async fn write(&self, w: aliquot_proto::v1::WriteRequest) -> Result<(), tonic::Status> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send((w, done))
            .await
            .map_err(|_| tonic::Status::unavailable("write batcher stopped"))?;
        wait.await
            .unwrap_or_else(|_| Err(tonic::Status::unavailable("write batcher stopped")))
    }
}

impl Shared {
    /// The batcher of agent `ep` (`--batch` > 1).
    fn batcher(&self, ep: &str) -> Batcher {
        let mut m = self.batchers.lock().expect("batchers lock");
        m.entry(ep.to_string())
            .or_insert_with(|| {
                Batcher::start(
                    self.agents.clone(),
                    ep.to_string(),
                    self.args.batch as usize,
                )
            })
            .clone()
    }

    /// Remember the generation of a reply; a change means the allocator
    /// restarted (or another one took the store over): say so.
    fn saw_generation(&self, generation: u64) {
        if generation == 0 {
            return;
        }
        let old = self.generation.swap(generation, Ordering::Relaxed);
        if old != 0 && old != generation {
            tracing::warn!(from = old, to = generation, "allocator generation changed");
            self.bar.suspend(|| {
                eprintln!(
                    "aliquotctl write: allocator generation {old} -> {generation} (it restarted)"
                )
            });
        }
    }

    /// The allocator was away: if it came back in a new generation (a
    /// restart, or another allocator took the pool over), re-assert every
    /// block committed in an older one. Inside the new generation's claim
    /// window (its Allocate waits meanwhile) that is a Claim of each (those
    /// that did sync claim as no-ops). After the window the space of an
    /// unsynced block may already be someone else's — even ours, in the
    /// very same shape, which a Claim would take for a no-op — so then the
    /// allocator is asked which of the older generation's txgs synced
    /// (SyncTxg names the last), and the blocks of later txgs are lost: the
    /// run fails naming them. False: the allocator did not answer.
    async fn claim_if_restarted(&self) -> bool {
        let _one = self.restart_check.lock().await;
        let mut c = self.alloc.clone();
        let st = match tokio::time::timeout(Duration::from_secs(5), c.get_pool(GetPoolRequest {}))
            .await
        {
            Ok(Ok(st)) => st.into_inner(),
            _ => return false,
        };
        let now = st.generation;
        let older: Vec<Committed> = {
            let mut g = self.committed.lock().unwrap_or_else(|p| p.into_inner());
            let (old, cur): (Vec<Committed>, Vec<Committed>) =
                g.drain(..).partition(|b| b.generation != now);
            *g = cur;
            old
        };
        self.saw_generation(now);
        if older.is_empty() {
            return true;
        }
        let mut retry: Vec<Committed> = Vec::new();
        if st.claim_window_remaining_ms > 0 {
            tracing::warn!(
                generation = now,
                blocks = older.len(),
                "the allocator changed generation: claiming what older ones committed"
            );
            let mut it = older.into_iter().peekable();
            while it.peek().is_some() {
                let chunk: Vec<Committed> = it.by_ref().take(512).collect();
                let extents: Vec<Extent> = chunk
                    .iter()
                    .flat_map(|b| b.extents.iter().cloned())
                    .collect();
                match claim_each(&mut c, extents).await {
                    Ok(refused) if refused.is_empty() => {}
                    Ok(refused) => {
                        // Only what the allocator refused is lost: the rest
                        // of the chunk is claimed.
                        tracing::error!(
                            extents = refused.len(),
                            why = %refused[0].1,
                            "claim refused"
                        );
                        self.lose(refused.into_iter().map(|(e, _)| e));
                    }
                    Err(s) if transient(&s) => retry.extend(chunk),
                    Err(s) => {
                        tracing::error!(error = %s, "claim refused");
                        self.lose(chunk.iter().flat_map(|b| b.extents.iter().cloned()));
                    }
                }
            }
        } else {
            // Which txgs of each older generation synced?
            let mut by_gen: BTreeMap<u64, Vec<Committed>> = BTreeMap::new();
            for b in older {
                by_gen.entry(b.generation).or_default().push(b);
            }
            for (g, blocks) in by_gen {
                let max = blocks.iter().map(|b| b.txg).max().unwrap_or(0);
                let synced = match c
                    .sync_txg(SyncTxgRequest {
                        txg: max,
                        generation: g,
                    })
                    .await
                {
                    Ok(_) => max,
                    Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) => {
                        use tonic_types::StatusExt;
                        s.get_details_error_info()
                            .and_then(|i| i.metadata.get("synced_txg")?.parse().ok())
                            .unwrap_or(0)
                    }
                    Err(_) => {
                        retry.extend(blocks);
                        continue;
                    }
                };
                let (kept, lost): (Vec<Committed>, Vec<Committed>) =
                    blocks.into_iter().partition(|b| b.txg <= synced);
                drop(kept);
                if !lost.is_empty() {
                    tracing::error!(
                        generation = g,
                        synced,
                        blocks = lost.len(),
                        "the claim window closed before these blocks could be claimed"
                    );
                    self.lose(lost.iter().flat_map(|b| b.extents.iter().cloned()));
                }
            }
        }
        let answered = retry.is_empty();
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(retry);
        answered
    }

    fn lose(&self, extents: impl Iterator<Item = Extent>) {
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(extents);
    }

    /// The restart watcher: each time the allocator was away, probe it
    /// (every 100 ms, for up to --allocator-wait) until it answers, and
    /// claim at once: GetPool is served during the claim window while
    /// Allocate waits, so the claims land before anyone can be given the
    /// space.
    async fn watch_restarts(self: Arc<Self>) {
        loop {
            self.away.notified().await;
            let since = Instant::now();
            while !self.claim_if_restarted().await && since.elapsed() < self.args.allocator_wait {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// A block completed: track the longest gap in progress.
    fn block_done(&self) {
        let now = micros(self.start.elapsed());
        let prev = self.last_done_us.fetch_max(now, Ordering::Relaxed);
        self.max_stall_us
            .fetch_max(now.saturating_sub(prev), Ordering::Relaxed);
    }
}

/// Run the workload and return its figures (no printing but the bar).
pub async fn write(args: &WriteArgs) -> anyhow::Result<WriteReport> {
    let mut resolved = args.clone();
    resolved.manifest = args.manifest_path();
    let args = &resolved;
    if let Some(dir) = args.manifest.as_ref().and_then(|m| m.parent())
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).map_err(|e| {
            anyhow::anyhow!(
                "cannot make the manifest directory {}: {e} (--manifest FILE elsewhere, or \
                 --no-manifest)",
                dir.display()
            )
        })?;
    }
    if args.block_size == 0 || args.block_size > 16 << 20 {
        anyhow::bail!(
            "--block-size {} is out of range: 1 B ..= 16 MiB",
            units::format_bytes(args.block_size)
        );
    }
    if args.total == 0 {
        anyhow::bail!("--total must be more than 0");
    }
    if args.batch > 1 && args.batch as u64 * args.block_size > MAX_BATCH_BYTES {
        anyhow::bail!(
            "--batch {} of {} blocks is more than {} per request: use a smaller --batch",
            args.batch,
            units::format_bytes(args.block_size),
            units::format_bytes(MAX_BATCH_BYTES)
        );
    }
    let blocks = args.total.div_ceil(args.block_size);
    let alloc = args.conn.connect().await?;
    let bar = if args.no_progress || args.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::with_draw_target(
            Some(blocks * args.block_size),
            ProgressDrawTarget::stderr(),
        );
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("progress template"),
        );
        b
    };
    let shared = Arc::new(Shared {
        args: args.clone(),
        blocks,
        next: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        nonce: rand::random(),
        start: Instant::now(),
        agents: args.conn.agents()?,
        bar,
        generation: AtomicU64::new(0),
        alloc: alloc.clone(),
        committed: Default::default(),
        away: tokio::sync::Notify::new(),
        restart_check: Default::default(),
        lost: Default::default(),
        // For the manifest, even if the allocator is gone at the end.
        pool_guid: AtomicU64::new(
            alloc
                .clone()
                .get_pool(GetPoolRequest {})
                .await
                .map_or(0, |p| p.into_inner().guid),
        ),
        last_done_us: AtomicU64::new(0),
        max_stall_us: AtomicU64::new(0),
        timeouts: AtomicU64::new(0),
        run: tracing::Span::current(),
        run_trace: telemetry::trace_id(&tracing::Span::current()).unwrap_or_default(),
        batchers: Default::default(),
    });
    let watcher = tokio::spawn(shared.clone().watch_restarts().in_current_span());
    let mut tasks = Vec::new();
    // A stream per 8 workers: enough pipelining, without one HTTP/2 stream
    // becoming the bottleneck.
    let mut stream: Option<Ops> = None;
    for w in 0..args.concurrency {
        let ops = match args.api {
            Api::Unary => Ops::Unary(alloc.clone()),
            Api::Stream => {
                if w % 8 == 0 || stream.is_none() {
                    stream = Some(Ops::Stream(Arc::new(ReStream::open(alloc.clone()).await?)));
                }
                stream.clone().expect("stream opened")
            }
        };
        tasks.push(tokio::spawn(worker(shared.clone(), ops).in_current_span()));
    }
    // Ctrl-C or SIGTERM: stop taking blocks, finish those in flight, and
    // record what was written (as for any failure) instead of vanishing
    // with blocks allocated that no manifest lists.
    let interrupted = Arc::new(AtomicBool::new(false));
    let signals = {
        let (sh, flag) = (shared.clone(), interrupted.clone());
        tokio::spawn(async move {
            let term = async {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term => {}
            }
            flag.store(true, Ordering::Relaxed);
            sh.stop.store(true, Ordering::Relaxed);
        })
    };
    let mut outs = Vec::new();
    let mut first_err = None;
    for t in tasks {
        match t.await {
            Ok(Ok(mut o)) => {
                if let Some(e) = o.failed.take() {
                    first_err.get_or_insert(e);
                }
                outs.push(o)
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(anyhow::anyhow!("write worker failed: {e}"));
            }
        }
    }
    signals.abort();
    shared.bar.finish_and_clear();
    if first_err.is_none() && interrupted.load(Ordering::Relaxed) {
        first_err = Some(anyhow::anyhow!("interrupted (SIGINT or SIGTERM)"));
    }
    if let Some(e) = first_err {
        let placed: Vec<Placed> = outs.into_iter().flat_map(|o| o.placed).collect();
        return Err(salvage(&alloc, &shared, placed, e).await);
    }
    let write_secs = shared.start.elapsed().as_secs_f64();

    let mut allocate = hist();
    let mut writeh = hist();
    let mut commit = hist();
    let mut wait = hist();
    let mut vdev_bytes = BTreeMap::new();
    let mut tiers = BTreeMap::new();
    let mut placed = Vec::new();
    let outs_retries: u64 = outs.iter().map(|o| o.retries).sum();
    for o in outs {
        allocate.add(&o.allocate).expect("same bounds");
        writeh.add(&o.write).expect("same bounds");
        commit.add(&o.commit).expect("same bounds");
        wait.add(&o.wait).expect("same bounds");
        for (v, b) in o.vdev_bytes {
            *vdev_bytes.entry(v).or_insert(0) += b;
        }
        for (t, n) in o.tiers {
            let name = LogTier::try_from(t)
                .map(|t| {
                    t.as_str_name()
                        .trim_start_matches("LOG_TIER_")
                        .to_lowercase()
                })
                .unwrap_or_else(|_| format!("tier {t}"));
            *tiers.entry(name).or_insert(0) += n;
        }
        placed.extend(o.placed);
    }

    // Durable: data on stable storage at every agent, then the txg synced.
    let t_sync = Instant::now();
    let mut synced_txg = None;
    if !args.no_sync {
        let mut flushes = Vec::new();
        for ep in shared.agents.endpoints() {
            let agents = shared.agents.clone();
            let deadline = args.timeout.max(Duration::from_secs(30));
            flushes.push(async move {
                let mut c = agents.get(&ep).await?;
                tokio::time::timeout(deadline, c.flush(FlushRequest {}))
                    .await
                    .map_err(|_| anyhow::anyhow!("flush {ep}: no answer in {deadline:?}"))?
                    .map_err(|s| client::status_msg(&format!("flush {ep}"), &s))?;
                anyhow::Ok(())
            });
        }
        for r in futures_util::future::join_all(flushes).await {
            r?;
        }
        // A restart seen only now (no worker was waiting when it
        // happened): claim before the final sync.
        shared.claim_if_restarted().await;
        watcher.abort();
        synced_txg = Some(sync_or_claim(&alloc, &shared, &placed).await?);
        let lost = shared
            .lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if !lost.is_empty() {
            anyhow::bail!(
                "{} extents committed before the allocator changed generation could not be \
                 claimed in the new one (their space was given out first): those blocks are \
                 lost; first: {}",
                lost.len(),
                lost.iter()
                    .take(4)
                    .map(|e| format!("{}:{}+{}", e.vdev, e.offset, e.size))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let sync_secs = t_sync.elapsed().as_secs_f64();

    let bytes = placed.len() as u64 * args.block_size;
    // Names for the report; a pool that cannot answer now only costs them.
    let vdev_names: BTreeMap<u32, String> = match alloc.clone().get_pool(GetPoolRequest {}).await {
        Ok(p) => p
            .into_inner()
            .vdevs
            .into_iter()
            .map(|v| (v.vdev, v.name))
            .collect(),
        Err(_) => BTreeMap::new(),
    };
    let retries: u64 = outs_retries;
    if let Some(path) = &args.manifest {
        write_manifest(&alloc, &shared, &placed, path).await?;
    }
    let mut verified_blocks = 0;
    let t_verify = Instant::now();
    if args.verify {
        let tokens = client::read_tokens(
            &alloc,
            placed.iter().flat_map(|p| p.extents.iter().cloned()),
        )
        .await?;
        // In the command's trace: every agent Read below is a child of it.
        let span = tracing::info_span!("aliquotctl.verify", blocks = placed.len());
        verified_blocks = verify(&shared, &placed, Arc::new(tokens))
            .instrument(span)
            .await?;
    }
    let verify_secs = t_verify.elapsed().as_secs_f64();
    let mut freed_blocks = 0;
    if args.free {
        let mut c = alloc.clone();
        for chunk in placed.chunks(1024) {
            let extents = chunk
                .iter()
                .flat_map(|p| p.extents.iter().cloned())
                .collect();
            c.free(FreeRequest { extents })
                .await
                .map_err(|s| client::status_msg("free", &s))?;
            freed_blocks += chunk.len() as u64;
        }
    }
    Ok(WriteReport {
        blocks: placed.len() as u64,
        block_size: args.block_size,
        copies: args.copies,
        class: args.class,
        api: args.api,
        batch: args.batch,
        bytes,
        physical_bytes: bytes * args.copies as u64,
        write_secs,
        sync_secs,
        bytes_per_sec: bytes as f64 / (write_secs + sync_secs).max(1e-9),
        allocate: Latency::of(&allocate),
        write: Latency::of(&writeh),
        commit: Latency::of(&commit),
        throttle_wait: Latency::of(&wait),
        vdev_bytes,
        vdev_names,
        tiers,
        synced_txg,
        verified_blocks,
        verify_secs,
        freed_blocks,
        manifest: args.manifest.as_ref().map(|m| m.display().to_string()),
        retries,
        generation: shared.generation.load(Ordering::Relaxed),
        max_stall_us: shared.max_stall_us.load(Ordering::Relaxed),
        timeouts: shared.timeouts.load(Ordering::Relaxed),
    })
}

/// A run that failed part way: make what it placed durable (flush the
/// agents, sync or claim), record it in the manifest when one was asked
/// for, and say how much was written and what was not, so nothing written
/// is left unreachable.
async fn salvage(
    alloc: &Allocator,
    sh: &Shared,
    placed: Vec<Placed>,
    err: anyhow::Error,
) -> anyhow::Error {
    let args = &sh.args;
    let n = placed.len() as u64;
    let bytes = units::format_bytes(n * args.block_size);
    if n == 0 {
        return err.context("nothing was written");
    }
    let mut durable = false;
    let mut why_not = String::new();
    if !args.no_sync {
        let mut flushed = true;
        for ep in sh.agents.endpoints() {
            let r = async {
                let mut c = sh.agents.get(&ep).await?;
                tokio::time::timeout(Duration::from_secs(10), c.flush(FlushRequest {}))
                    .await
                    .map_err(|_| anyhow::anyhow!("flush {ep}: no answer"))?
                    .map_err(|s| client::status_msg(&format!("flush {ep}"), &s))?;
                anyhow::Ok(())
            }
            .await;
            if let Err(e) = r {
                // An agent that is gone holds blocks of this run: they are
                // not durable (its file may still have them).
                flushed = false;
                why_not = format!("{e:#}");
            }
        }
        if flushed {
            match sync_or_claim(alloc, sh, &placed).await {
                Ok(_) => durable = true,
                Err(e) => why_not = format!("{e:#}"),
            }
        }
    }
    let mut recorded = String::new();
    if let Some(path) = &args.manifest {
        match write_manifest(alloc, sh, &placed, path).await {
            Ok(()) => {
                recorded = format!(
                    "; all {n} are listed in the manifest {} (`aliquotctl free --manifest {}` \
                     frees them)",
                    path.display(),
                    path.display()
                )
            }
            Err(e) => recorded = format!("; the manifest could not be written: {e:#}"),
        }
    }
    if args.manifest.is_none() && !args.free {
        recorded = "; no manifest lists them (--no-manifest, --no-sync, or no pool data dir \
                    here), so aliquotctl cannot move or free them"
            .into();
    }
    let state = if durable {
        "durable".to_string()
    } else if args.no_sync {
        "allocated and committed (not synced: --no-sync)".to_string()
    } else {
        format!("committed but NOT known durable ({why_not})")
    };
    err.context(format!(
        "the run stopped after {n} of {} blocks ({bytes}), which are {state} and stay \
         allocated{recorded}; the other {} blocks were not written",
        sh.blocks,
        sh.blocks.saturating_sub(n)
    ))
}

/// The manifest of a durable run: its blocks in order, each copy with the
/// bytes of pattern it holds (the whole extent, as written).
async fn write_manifest(
    alloc: &crate::client::Allocator,
    sh: &Shared,
    placed: &[Placed],
    path: &std::path::Path,
) -> anyhow::Result<()> {
    use crate::manifest::{Block, Copy, Header, Manifest, VERSION};
    let pool_guid = match sh.pool_guid.load(Ordering::Relaxed) {
        0 => {
            alloc
                .clone()
                .get_pool(GetPoolRequest {})
                .await
                .map_err(|s| client::status_msg("get pool (for the manifest)", &s))?
                .into_inner()
                .guid
        }
        g => g,
    };
    let mut blocks: Vec<Block> = placed
        .iter()
        .map(|p| Block {
            block: p.block,
            copies: p
                .extents
                .iter()
                .map(|e| Copy {
                    at: e.into(),
                    len: e.size,
                })
                .collect(),
        })
        .collect();
    blocks.sort_by_key(|b| b.block);
    let header = Header {
        aliquot_manifest: VERSION,
        pool_guid,
        nonce: sh.nonce,
        block_size: sh.args.block_size,
    };
    Manifest::create(path, header, &blocks)?;
    Ok(())
}

/// Claim `extents`, each answered on its own: the ones refused, with why.
async fn claim_each(
    c: &mut Allocator,
    extents: Vec<Extent>,
) -> Result<Vec<(Extent, String)>, tonic::Status> {
    claim_each_gen(c, extents).await.map(|(refused, _)| refused)
}

/// [`claim_each`], and the generation that answered.
async fn claim_each_gen(
    c: &mut Allocator,
    extents: Vec<Extent>,
) -> Result<(Vec<(Extent, String)>, u64), tonic::Status> {
    let r = c
        .claim(ClaimRequest {
            extents,
            per_extent: true,
        })
        .await?
        .into_inner();
    // An allocator that does not answer per extent answers all or nothing:
    // an Ok without results claimed everything.
    let refused = r
        .results
        .into_iter()
        .filter(|x| !x.claimed)
        .filter_map(|x| Some((x.extent?, x.message)))
        .collect();
    Ok((refused, r.generation))
}

/// Sync the txg holding this run's commits. If the allocator restarted
/// before that txg synced (reason ALLOCATOR_RESTARTED), re-assert every
/// block written with Claim (those that did sync are allocated exactly so
/// and claim as no-ops) and sync again in the new generation.
async fn sync_or_claim(alloc: &Allocator, sh: &Shared, placed: &[Placed]) -> anyhow::Result<u64> {
    let mut c = alloc.clone();
    for attempt in 0..3 {
        let generation = sh.generation.load(Ordering::Relaxed);
        match c.sync_txg(SyncTxgRequest { txg: 0, generation }).await {
            Ok(r) => return Ok(r.into_inner().synced_txg),
            Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) && attempt < 2 => {
                tracing::warn!(
                    blocks = placed.len(),
                    "allocator restarted before the txg synced: claiming what was written"
                );
                let mut new_gen = 0;
                let mut lost: Vec<(Extent, String)> = Vec::new();
                for chunk in placed.chunks(512) {
                    let extents = chunk
                        .iter()
                        .flat_map(|p| p.extents.iter().cloned())
                        .collect();
                    let (refused, generation) = claim_each_gen(&mut c, extents)
                        .await
                        .map_err(|s| client::status_msg("claim after an allocator restart", &s))?;
                    lost.extend(refused);
                    new_gen = generation;
                }
                if !lost.is_empty() {
                    anyhow::bail!(
                        "claim after an allocator restart: {} extents were refused (their \
                         blocks are lost; the others were claimed); first: {}:{}+{} ({})",
                        lost.len(),
                        lost[0].0.vdev,
                        lost[0].0.offset,
                        lost[0].0.size,
                        lost[0].1
                    );
                }
                sh.saw_generation(new_gen);
            }
            Err(s) if transient(&s) && attempt < 2 => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(s) => return Err(client::status_msg("sync txg", &s)),
        }
    }
    anyhow::bail!("sync txg: the allocator kept restarting")
}

async fn worker(sh: Arc<Shared>, ops: Ops) -> anyhow::Result<WorkerOut> {
    let mut out = WorkerOut {
        allocate: hist(),
        write: hist(),
        commit: hist(),
        wait: hist(),
        vdev_bytes: HashMap::new(),
        tiers: HashMap::new(),
        placed: Vec::new(),
        retries: 0,
        failed: None,
    };
    let a = &sh.args;
    let class = match a.class {
        ClassArg::Data => AllocationClass::Data,
        ClassArg::Log => AllocationClass::Log,
    };
    let lease_ms = a
        .lease
        .map(|d| d.as_millis().clamp(1, u32::MAX as u128) as u32)
        .unwrap_or(0);
    loop {
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
        let block = sh.next.fetch_add(1, Ordering::Relaxed);
        if block >= sh.blocks {
            break;
        }
        if let Some(rate) = a.rate {
            // Block n is due when n blocks' bytes have been offered at `rate`.
            let due = sh.start + Duration::from_secs_f64(block as f64 * a.block_size as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let span = tracing::info_span!(
            parent: None,
            "aliquotctl.block",
            write_trace = %sh.run_trace,
            block,
            size = a.block_size,
            copies = a.copies,
            class = ?a.class,
            allocation = tracing::field::Empty,
            txg = tracing::field::Empty,
        );
        telemetry::link(&span, &sh.run);
        let mut attempt = 1;
        let mut waiting_since: Option<Instant> = None;
        let r = loop {
            match one_block(&sh, &ops, &mut out, block, class, lease_ms)
                .instrument(span.clone())
                .await
            {
                Err(BlockError::Wait(why))
                    if waiting_since.get_or_insert_with(Instant::now).elapsed()
                        < a.allocator_wait =>
                {
                    let waited = waiting_since.map_or(Duration::ZERO, |t| t.elapsed());
                    if waited < Duration::from_millis(200) {
                        tracing::info!(block, %why, "waiting for the allocator");
                    }
                    sh.away.notify_one();
                    // 100 ms, doubling, at most 1 s between tries.
                    let n = (waited.as_millis() / 100).min(10) as u64;
                    tokio::time::sleep(Duration::from_millis((100 + n * 100).min(1000))).await;
                }
                Err(BlockError::Wait(e)) => {
                    break Err(e.context(format!(
                        "the allocator did not place block {block} within --allocator-wait {:?}",
                        a.allocator_wait
                    )));
                }
                Err(BlockError::Retry(why)) | Err(BlockError::Abandon(why))
                    if attempt < a.attempts =>
                {
                    tracing::info!(block, attempt, %why, "writing the block again");
                    out.retries += 1;
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100 * attempt as u64)).await;
                }
                Err(BlockError::Retry(e))
                | Err(BlockError::Abandon(e))
                | Err(BlockError::Fatal(e)) => break Err(e),
                Ok(()) => break Ok(()),
            }
        };
        if let Err(e) = r {
            sh.stop.store(true, Ordering::Relaxed);
            // What this worker placed is still reported (and recorded).
            out.failed = Some(e.context(format!("block {block}")));
            return Ok(out);
        }
        sh.block_done();
        sh.bar.inc(a.block_size);
    }
    Ok(out)
}

/// How one attempt at a block failed.
enum BlockError {
    /// Write it again with a new allocation.
    Retry(anyhow::Error),
    /// The allocator is away: try again when it is back, without counting
    /// an attempt (bounded by --allocator-wait).
    Wait(anyhow::Error),
    /// Write it again, but leave this allocation to its lease: a write that
    /// timed out may still land when the agent wakes, so its space must not
    /// be reusable before the allocator's lease expiry defers it.
    Abandon(anyhow::Error),
    Fatal(anyhow::Error),
}

impl From<anyhow::Error> for BlockError {
    fn from(e: anyhow::Error) -> Self {
        BlockError::Fatal(e)
    }
}

async fn one_block(
    sh: &Shared,
    ops: &Ops,
    out: &mut WorkerOut,
    block: u64,
    class: AllocationClass,
    lease_ms: u32,
) -> Result<(), BlockError> {
    let a = &sh.args;
    let t0 = Instant::now();
    let reply = ops
        .allocate(AllocateRequest {
            class: class as i32,
            size: a.block_size,
            copies: a.copies,
            lease_ms,
            max_size: 0,
            // This run is one object: its blocks keep one allocator per
            // 2^20-block region, as OpenZFS's spa_select_allocator does.
            affinity_key: Some(sh.nonce ^ (block >> 20)),
        })
        .await
        .map_err(|s| {
            let e = client::status_msg(&format!("allocate block {block}"), &s);
            // The allocator is away or restarting, or no vdev is placeable
            // right now: wait for it (bounded by --allocator-wait).
            if allocator_away(&s) {
                BlockError::Wait(e)
            } else {
                BlockError::Fatal(e)
            }
        })?;
    sh.saw_generation(reply.generation);
    out.allocate.saturating_record(micros(t0.elapsed()));
    out.wait.saturating_record(reply.throttle_wait_us);
    tracing::Span::current().record("allocation", reply.allocation_id);
    if reply.extents.len() != reply.endpoints.len() || reply.extents.is_empty() {
        ops.abort(reply.allocation_id).await;
        return Err(anyhow::anyhow!(
            "allocate block {block}: the reply has {} extents but {} endpoints",
            reply.extents.len(),
            reply.endpoints.len()
        )
        .into());
    }
    if class == AllocationClass::Log {
        *out.tiers.entry(reply.tier).or_insert(0) += 1;
    }

    let t1 = Instant::now();
    let mut writes = Vec::with_capacity(reply.extents.len());
    for (i, (e, ep)) in reply.extents.iter().zip(&reply.endpoints).enumerate() {
        let agents = sh.agents.clone();
        // Every copy's pattern is generated into its own request as it is
        // encoded (cheaper than copying one buffer into each). The extent
        // may exceed the block (ashift rounding): it is written whole, so
        // reads compare whole.
        let w = PatternWrite {
            offset: e.offset,
            len: e.size as usize,
            nonce: sh.nonce,
            block,
            token: reply.tokens.get(i).cloned().unwrap_or_default(),
        };
        let (offset, vdev) = (e.offset, e.vdev);
        let deadline = a.timeout;
        let batcher = (a.batch > 1).then(|| sh.batcher(ep));
        writes.push(async move {
            let what = || format!("write block {block} to vdev {vdev} at {offset}");
            let r = tokio::time::timeout(deadline, async {
                let sent = match batcher {
                    // Batched: the pattern is materialised (the batch is
                    // encoded by prost, not by the pattern codec).
                    Some(b) => {
                        b.write(aliquot_proto::v1::WriteRequest {
                            offset: w.offset,
                            data: crate::pattern::make(w.len, w.nonce, w.block).into(),
                            token: w.token,
                        })
                        .await
                    }
                    None => {
                        let mut c = agents.pattern_writer(ep).await.map_err(|e| {
                            if e.downcast_ref::<client::Unresolvable>().is_some() {
                                BlockError::Fatal(e)
                            } else {
                                BlockError::Retry(e)
                            }
                        })?;
                        c.write(w).await.map(|_| ())
                    }
                };
                sent.map_err(|s| {
                    let e = client::status_msg(&what(), &s);
                    if rewrite_elsewhere(&s) {
                        BlockError::Retry(e)
                    } else {
                        BlockError::Fatal(e)
                    }
                })?;
                Ok::<(), BlockError>(())
            })
            .await;
            match r {
                Ok(r) => r,
                // A hung agent: this block goes elsewhere.
                Err(_) => Err(BlockError::Abandon(anyhow::anyhow!(
                    "{}: no answer in {deadline:?}",
                    what()
                ))),
            }
        });
    }
    let results = futures_util::future::join_all(writes).await;
    let mut failed = None;
    for r in results {
        // One timed-out copy decides: the allocation is abandoned.
        if let Err(e) = r
            && (failed.is_none() || matches!(e, BlockError::Abandon(_)))
        {
            failed = Some(e);
        }
    }
    match failed {
        None => {}
        Some(e @ BlockError::Abandon(_)) => {
            // Aborting would make the space reusable at once, and the hung
            // agent may still apply the write when it resumes (the request
            // may be in its socket buffers): another client's block would
            // be overwritten. The lease expiry defers the space instead.
            sh.timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        Some(e) => {
            // The agents answered (with an error): nothing is in flight,
            // give the space back now rather than at the lease.
            ops.abort(reply.allocation_id).await;
            return Err(e);
        }
    }
    out.write.saturating_record(micros(t1.elapsed()));

    let t2 = Instant::now();
    // Commit is retry-safe: a repeat answers the first txg.
    // The allocator may be restarting: keep asking (bounded by
    // --allocator-wait); once it is back, a Commit of the old generation's
    // allocation answers ALLOCATOR_RESTARTED and the block is written again.
    let mut tries = 0u32;
    let since = Instant::now();
    let c = loop {
        match ops.commit(reply.allocation_id, reply.generation).await {
            Ok(c) => break c,
            Err(s) if transient(&s) && since.elapsed() < a.allocator_wait => {
                sh.away.notify_one();
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100 << tries.min(4))).await;
            }
            Err(s) => {
                if reason(&s) == Some(ErrorReason::AllocatorRestarted) {
                    sh.away.notify_one();
                }
                let e = client::status_msg(&format!("commit block {block}"), &s);
                return Err(if retry_block(&s) {
                    BlockError::Retry(e)
                } else {
                    BlockError::Fatal(e)
                });
            }
        }
    };
    out.commit.saturating_record(micros(t2.elapsed()));
    tracing::Span::current().record("txg", c.txg);

    sh.committed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Committed {
            generation: reply.generation,
            txg: c.txg,
            extents: reply.extents.clone(),
        });
    for e in &reply.extents {
        *out.vdev_bytes.entry(e.vdev).or_insert(0) += e.size;
    }
    out.placed.push(Placed {
        block,
        extents: reply.extents,
        endpoints: reply.endpoints,
    });
    Ok(())
}

async fn verify(
    sh: &Arc<Shared>,
    placed: &[Placed],
    tokens: Arc<HashMap<(u32, u64), Vec<u8>>>,
) -> anyhow::Result<u64> {
    let next = Arc::new(AtomicU64::new(0));
    let placed: Arc<Vec<Placed>> = Arc::new(placed.to_vec());
    let mut tasks = Vec::new();
    for _ in 0..sh.args.concurrency.min(64) {
        let (sh, next, placed, tokens) = (sh.clone(), next.clone(), placed.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(p) = placed.get(i) else { break };
                for (e, ep) in p.extents.iter().zip(&p.endpoints) {
                    let mut c = sh.agents.get(ep).await?;
                    let deadline = sh.args.timeout.max(Duration::from_secs(30));
                    let mut token = tokens.get(&(e.vdev, e.offset)).cloned().unwrap_or_default();
                    let mut asked_again = false;
                    let data = loop {
                        let r = tokio::time::timeout(
                            deadline,
                            c.read(ReadRequest {
                                offset: e.offset,
                                size: e.size,
                                token: token.clone(),
                            }),
                        )
                        .await
                        .map_err(|_| {
                            anyhow::anyhow!(
                                "read block {} from vdev {}: no answer in {deadline:?}",
                                p.block,
                                e.vdev
                            )
                        })?;
                        // An agent that restarted since the token was
                        // granted refuses it (it cannot know what was
                        // written meanwhile): ask for the block's token again.
                        match r {
                            Err(s)
                                if !asked_again
                                    && token_reason(&s).as_deref()
                                        == Some("READ_TOKEN_BEFORE_AGENT_START") =>
                            {
                                asked_again = true;
                                token = client::read_tokens(&sh.alloc, [*e])
                                    .await?
                                    .remove(&(e.vdev, e.offset))
                                    .unwrap_or_default();
                            }
                            r => break r,
                        }
                    }
                    .map_err(|s| {
                        client::status_msg(
                            &format!("read block {} from vdev {}", p.block, e.vdev),
                            &s,
                        )
                    })?
                    .into_inner()
                    .data;
                    if data.len() as u64 != e.size {
                        anyhow::bail!(
                            "verify: block {} on vdev {} at offset {}: read {} bytes, expected {}",
                            p.block,
                            e.vdev,
                            e.offset,
                            data.len(),
                            e.size
                        );
                    }
                    if let Some(at) = crate::pattern::first_mismatch(&data, sh.nonce, p.block) {
                        anyhow::bail!(
                            "verify: block {} on vdev {} at offset {}: data differs at byte {at}",
                            p.block,
                            e.vdev,
                            e.offset
                        );
                    }
                }
                n += 1;
            }
            anyhow::Ok(n)
        }.in_current_span()));
    }
    let mut total = 0;
    for t in tasks {
        total += t
            .await
            .map_err(|e| anyhow::anyhow!("verify worker failed: {e}"))??;
    }
    Ok(total)
}

/// `aliquotctl write`: run and print the report.
pub async fn run(args: WriteArgs) -> anyhow::Result<()> {
    // The command's trace: its streams, flushes, txg sync and verify; each
    // block is a trace of its own linked to this one (`worker`).
    let root = tracing::info_span!(
        "aliquotctl.write",
        total = args.total,
        block_size = args.block_size,
        concurrency = args.concurrency,
        copies = args.copies,
        class = ?args.class,
        api = ?args.api,
    );
    let r = write(&args).instrument(root).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", render(&r));
    }
    Ok(())
}

pub fn render(r: &WriteReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let total = r.write_secs + r.sync_secs;
    let _ = writeln!(
        s,
        "wrote {} in {} blocks of {} ({}, {:?}, {:?} api) in {:.2} s (+ {:.2} s flush and txg sync): {}",
        units::format_bytes(r.bytes),
        r.blocks,
        units::format_bytes(r.block_size),
        if r.copies == 1 {
            "1 copy".to_string()
        } else {
            format!(
                "{} copies: {} to the agents",
                r.copies,
                units::format_bytes(r.physical_bytes)
            )
        },
        r.class,
        r.api,
        r.write_secs,
        r.sync_secs,
        units::format_rate(r.bytes as f64 / total.max(1e-9)),
    );
    let _ = writeln!(
        s,
        "{:<14} {:>10} {:>10} {:>10} {:>10}",
        "latency", "p50", "p99", "max", "count"
    );
    let us = units::format_micros;
    for (name, l) in [
        ("allocate", r.allocate),
        ("throttle wait", r.throttle_wait),
        ("write", r.write),
        ("commit", r.commit),
    ] {
        let _ = writeln!(
            s,
            "{name:<14} {:>10} {:>10} {:>10} {:>10}",
            us(l.p50_us),
            us(l.p99_us),
            us(l.max_us),
            l.count
        );
    }
    let _ = write!(s, "placed per vdev:");
    for (v, b) in &r.vdev_bytes {
        let name = r.vdev_names.get(v).map(String::as_str).unwrap_or("");
        let _ = write!(
            s,
            "  {} {}",
            crate::names::vdev_label(*v, name),
            units::format_bytes_short(*b)
        );
    }
    s.push('\n');
    if !r.tiers.is_empty() {
        let _ = write!(s, "log tiers:");
        for (t, n) in &r.tiers {
            let _ = write!(s, "  {t} {n}");
        }
        s.push('\n');
    }
    if let Some(t) = r.synced_txg {
        let _ = writeln!(
            s,
            "durable: agents flushed, txg {t} synced (allocator generation {})",
            r.generation
        );
    }
    if r.retries > 0 {
        let _ = writeln!(
            s,
            "retried: {} block writes (agent timeouts, expired leases, restarts); \
             {} agent writes timed out; longest stall {} ms",
            r.retries,
            r.timeouts,
            r.max_stall_us / 1000
        );
    }
    if r.verified_blocks > 0 {
        let _ = writeln!(
            s,
            "verified: {} blocks read back intact in {:.2} s",
            r.verified_blocks, r.verify_secs
        );
    }
    if r.freed_blocks > 0 {
        let _ = writeln!(s, "freed: {} blocks", r.freed_blocks);
    }
    if r.manifest.is_none() && r.freed_blocks == 0 {
        let _ = writeln!(
            s,
            "manifest: none (--no-manifest, --no-sync, or no pool data dir here): nothing \
             aliquotctl runs can move or free these blocks; --manifest FILE records them"
        );
    }
    if let Some(m) = &r.manifest {
        let _ = writeln!(
            s,
            "manifest: {m} (`balancer execute`, `vdev drain` and `free` move or free these \
             blocks; `free --manifest {m}` releases them)"
        );
    }
    s
}
