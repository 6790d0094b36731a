//! `aliquotctl write`: a load generator that does the whole write path
//! through the client library (`aliquot_client::Writer`). Per block:
//! Allocate (unary, or pipelined over AllocateStream), write the block's
//! pattern to every extent's agent, Commit. This file adds what a load
//! generator does: workers, rate, statistics, the progress bar, the
//! manifest and the report. At the end: Flush every
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

use aliquot_client::{Claims, Observe, Ops, WriteOptions, Writer};
use aliquot_proto::v1::{
    AllocateReply, AllocationClass, CommitReply, Extent, FlushRequest, FreeRequest, GetPoolRequest,
    LogTier,
};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tracing::Instrument;

use crate::client::{self, Agents, Allocator, AllocatorArgs};
use crate::pattern;

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
    /// the unary throughput in the `data_path` bench) or `unary`.
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
    /// The allocation id a claim of its extents names (`Block::claim_id`).
    claim_id: u64,
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds")
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).max(1)
}

/// `WorkerOut` as the client library's observer: each step's latency.
impl Observe for WorkerOut {
    fn allocated(&mut self, took: Duration, reply: &AllocateReply) {
        self.allocate.saturating_record(micros(took));
        self.wait.saturating_record(reply.throttle_wait_us);
        if self.log {
            *self.tiers.entry(reply.tier).or_insert(0) += 1;
        }
    }
    fn wrote(&mut self, took: Duration) {
        self.write.saturating_record(micros(took));
    }
    fn committed(&mut self, took: Duration, _: &CommitReply) {
        self.commit.saturating_record(micros(took));
    }
    fn retried(&mut self, _: &aliquot_client::Error) {
        self.retries += 1;
    }
    fn timed_out(&mut self) {
        self.timeouts += 1;
    }
}

struct WorkerOut {
    allocate: Histogram<u64>,
    write: Histogram<u64>,
    commit: Histogram<u64>,
    wait: Histogram<u64>,
    /// LOG blocks: count the tier that served each.
    log: bool,
    vdev_bytes: HashMap<u32, u64>,
    tiers: HashMap<i32, u64>,
    placed: Vec<Placed>,
    retries: u64,
    /// Block writes given up at the deadline.
    timeouts: u64,
    /// Why this worker stopped early (the run then fails, after recording
    /// what was placed).
    failed: Option<anyhow::Error>,
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
    /// The allocator (unary), for the report, the manifest and verify.
    alloc: Allocator,
    /// Blocks committed and not yet known synced: claimed back after an
    /// allocator restart (the client library's).
    claims: Arc<Claims>,
    /// The pool's guid, asked once at the start.
    pool_guid: AtomicU64,
    /// Micros from `start` to the last block completed, and the longest
    /// gap between completions so far.
    last_done_us: AtomicU64,
    max_stall_us: AtomicU64,
    /// The command's root span: each block is a trace of its own, linked
    /// to it (a GiB of blocks under one root is too big a trace to read).
    run: tracing::Span,
    /// Its trace id, recorded on every block span.
    run_trace: String,
}

/// Bytes of one WriteBatch at most (the agent takes 16 MiB + 64 KiB a
/// message; extents may exceed the block by the ashift rounding).
const MAX_BATCH_BYTES: u64 = 8 << 20;

impl Shared {
    /// A block completed: track the longest gap in progress.
    fn block_done(&self) {
        let now = micros(self.start.elapsed());
        let prev = self.last_done_us.fetch_max(now, Ordering::Relaxed);
        self.max_stall_us
            .fetch_max(now.saturating_sub(prev), Ordering::Relaxed);
    }

    /// Every extent placed and the allocation id a claim of each names,
    /// for a claim or a sync.
    fn extents(placed: &[Placed]) -> (Vec<Extent>, Vec<u64>) {
        placed
            .iter()
            .flat_map(|p| p.extents.iter().map(|e| (*e, p.claim_id)))
            .unzip()
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
    let claims = {
        let bar = bar.clone();
        Arc::new(
            Claims::new(alloc.clone(), args.allocator_wait).on_generation_change(
                move |old, generation| {
                    bar.suspend(|| {
                        eprintln!(
                            "aliquotctl write: allocator generation {old} -> {generation} (it restarted)"
                        )
                    })
                },
            ),
        )
    };
    let agents = args.conn.agents()?;
    let shared = Arc::new(Shared {
        args: args.clone(),
        blocks,
        next: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        nonce: rand::random(),
        start: Instant::now(),
        agents: agents.clone(),
        bar,
        alloc: alloc.clone(),
        claims: claims.clone(),
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
        run: tracing::Span::current(),
        run_trace: telemetry::trace_id(&tracing::Span::current()).unwrap_or_default(),
    });
    let watcher = claims.watch();
    let base = Writer::new(
        Ops::unary(alloc.clone()),
        agents,
        claims.clone(),
        WriteOptions {
            class: match args.class {
                ClassArg::Data => AllocationClass::Data,
                ClassArg::Log => AllocationClass::Log,
            },
            copies: args.copies,
            lease: args.lease,
            timeout: args.timeout,
            attempts: args.attempts,
            allocator_wait: args.allocator_wait,
            agent_batch: args.batch,
        },
    );
    let mut tasks = Vec::new();
    // A stream per 8 workers: enough pipelining, without one HTTP/2 stream
    // becoming the bottleneck.
    let mut writer: Option<Arc<Writer>> = None;
    for w in 0..args.concurrency {
        let wr = match args.api {
            Api::Unary => writer.get_or_insert_with(|| Arc::new(base.with_ops(base.ops.clone()))),
            Api::Stream => {
                if w % 8 == 0 || writer.is_none() {
                    writer = Some(Arc::new(base.with_ops(Ops::stream(alloc.clone()).await)));
                }
                writer.as_ref().expect("stream opened")
            }
        };
        tasks.push(tokio::spawn(
            worker(shared.clone(), wr.clone()).in_current_span(),
        ));
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
    let timeouts: u64 = outs.iter().map(|o| o.timeouts).sum();
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
    // A failure here fails the run as a worker's does: what is durable is
    // recorded in the manifest first (`salvage`).
    let t_sync = Instant::now();
    let mut synced_txg = None;
    if !args.no_sync {
        let flushed =
            aliquot_client::flush_agents(&shared.agents, shared.agents.endpoints(), args.timeout)
                .await;
        if let Err(e) = flushed {
            return Err(salvage(&alloc, &shared, placed, e.into()).await);
        }
        // A restart seen only now (no worker was waiting when it
        // happened): claim before the final sync.
        claims.claim_if_restarted().await;
        drop(watcher);
        let (extents, ids) = Shared::extents(&placed);
        match claims.sync_or_claim(&extents, &ids).await {
            Ok(t) => synced_txg = Some(t),
            Err(e) => return Err(salvage(&alloc, &shared, placed, e.into()).await),
        }
        if let Err(e) = claims.check_lost() {
            return Err(salvage(&alloc, &shared, placed, e.into()).await);
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
        generation: claims.generation(),
        max_stall_us: shared.max_stall_us.load(Ordering::Relaxed),
        timeouts,
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
            let (extents, ids) = Shared::extents(&placed);
            match sh.claims.sync_or_claim(&extents, &ids).await {
                Ok(_) => durable = true,
                Err(e) => why_not = format!("{e:#}"),
            }
        }
    }
    // Extents a claim could not re-assert may be someone else's now: their
    // blocks are lost, and a manifest listing them would have `free` free
    // another's block. The manifest keeps every other copy.
    let lost: std::collections::HashSet<(u32, u64, u64)> = sh
        .claims
        .lost()
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    let mut kept = placed;
    for p in &mut kept {
        p.extents
            .retain(|e| !lost.contains(&(e.vdev, e.offset, e.size)));
    }
    kept.retain(|p| !p.extents.is_empty());
    let listed = kept.len() as u64;
    let mut recorded = String::new();
    if n > listed {
        recorded = format!(
            "; {} blocks are lost (every copy's space was given out before a claim could \
             take it back)",
            n - listed
        );
    }
    if let Some(path) = &args.manifest {
        match write_manifest(alloc, sh, &kept, path).await {
            Ok(()) => {
                recorded += &format!(
                    "; the {listed} {} listed in the manifest {} (`aliquotctl free \
                     --manifest {}` frees them)",
                    if n > listed {
                        "others are"
                    } else {
                        "blocks are"
                    },
                    path.display(),
                    path.display()
                )
            }
            Err(e) => recorded += &format!("; the manifest could not be written: {e:#}"),
        }
    }
    if args.manifest.is_none() && !args.free {
        recorded += "; no manifest lists them (--no-manifest, --no-sync, or no pool data dir \
                    here), so aliquotctl cannot move or free them";
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

async fn worker(sh: Arc<Shared>, writer: Arc<Writer>) -> anyhow::Result<WorkerOut> {
    let a = &sh.args;
    let mut out = WorkerOut {
        allocate: hist(),
        write: hist(),
        commit: hist(),
        wait: hist(),
        log: a.class == ClassArg::Log,
        vdev_bytes: HashMap::new(),
        tiers: HashMap::new(),
        placed: Vec::new(),
        retries: 0,
        timeouts: 0,
        failed: None,
    };
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
        let data = pattern::Block {
            nonce: sh.nonce,
            block,
            size: a.block_size,
        };
        // This run is one object: its blocks keep one allocator per
        // 2^20-block region, as OpenZFS's spa_select_allocator does.
        let key = Some(sh.nonce ^ (block >> 20));
        match writer.put(&data, key, &mut out).instrument(span).await {
            Ok(b) => {
                for e in &b.extents {
                    *out.vdev_bytes.entry(e.vdev).or_insert(0) += e.size;
                }
                out.placed.push(Placed {
                    block,
                    claim_id: b.claim_id(),
                    extents: b.extents,
                    endpoints: b.endpoints,
                });
            }
            Err(e) => {
                sh.stop.store(true, Ordering::Relaxed);
                // What this worker placed is still reported (and recorded).
                out.failed = Some(anyhow::Error::new(e).context(format!("block {block}")));
                return Ok(out);
            }
        }
        sh.block_done();
        sh.bar.inc(a.block_size);
    }
    Ok(out)
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
        tasks.push(tokio::spawn(
            async move {
                let mut n = 0u64;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(p) = placed.get(i) else { break };
                    for (e, ep) in p.extents.iter().zip(&p.endpoints) {
                        let deadline = sh.args.timeout.max(Duration::from_secs(30));
                        let token = tokens.get(&(e.vdev, e.offset)).cloned().unwrap_or_default();
                        let data = aliquot_client::read::read_extent(
                            &sh.alloc, &sh.agents, ep, *e, token, deadline,
                        )
                        .await
                        .map_err(|err| anyhow::anyhow!("verify: block {}: {err}", p.block))?;
                        if let Some(at) = pattern::first_mismatch(&data, sh.nonce, p.block) {
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
            }
            .in_current_span(),
        ));
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
