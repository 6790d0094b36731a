//! The reference mover: `aliquotctl balancer execute --manifest FILE`
//! carries out the allocator's rebalance plans for the blocks a manifest
//! owns. Per move: Relocate (a new extent off the over-full vdev and off
//! the block's other copies) → read the copy and check its pattern → write
//! it to the new extent with the reply's token → flush that agent → journal
//! `pending` (fsync) → Commit with wait_synced (the allocator frees the old
//! extent in the same txg) → journal `moved`. A crash anywhere leaves either
//! nothing to do or a `pending` record, which the next run settles with
//! BalancerStatus (durable: moved; committed: wait for its txg; in flight:
//! abort; not committed: dropped), so no block is lost or moved twice and
//! no space leaks. `balancer verify --manifest` reads every block back.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aliquot_proto::v1::{
    AbortRequest, BalancerStatusRequest, CommitRequest, ErrorReason, FlushRequest, GetPoolRequest,
    PlanRebalanceRequest, PoolStatus, ReadRequest, RelocateRequest, RelocationState,
    SyncTxgRequest, WriteRequest,
};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use units::format_bytes_short as short;

use crate::client::{self, Agents, Allocator, AllocatorArgs};
use crate::manifest::{Ext, Manifest, Pending, Record};
use crate::write::reason;

#[derive(Clone, Debug, clap::Args)]
pub struct ExecuteArgs {
    /// The manifest of the blocks to move (`aliquotctl write --manifest`).
    #[arg(long, env = "ALIQUOT_MANIFEST")]
    pub manifest: PathBuf,
    /// Fraction of the class's allocated bytes one plan may move.
    #[arg(long, env = "ALIQUOT_BALANCER_MAX_MISPLACED", default_value_t = 0.05)]
    pub max_misplaced: f64,
    /// Bytes one plan may move at most (default: no limit but the above).
    #[arg(long, env = "ALIQUOT_BALANCER_BUDGET", value_parser = units::size_arg)]
    pub budget: Option<u64>,
    /// Copy at most this fast, e.g. 100MiB/s (default: as fast as it goes).
    #[arg(long, env = "ALIQUOT_BALANCER_RATE", value_parser = units::rate_arg)]
    pub rate: Option<f64>,
    /// Stop once the normal class's balance score is at or below this.
    #[arg(long, env = "ALIQUOT_BALANCER_TARGET_SCORE", default_value_t = 0.01)]
    pub target_score: f64,
    /// Stop after this many plans.
    #[arg(long, env = "ALIQUOT_BALANCER_MAX_PLANS", default_value_t = 100)]
    pub max_plans: u32,
    /// Moves copied at once.
    #[arg(long, env = "ALIQUOT_BALANCER_CONCURRENCY", default_value_t = 4,
        value_parser = clap::value_parser!(u32).range(1..=256))]
    pub concurrency: u32,
    /// Moves committed together: one flush per agent, one journal fsync and
    /// one txg for the batch (1 = a move at a time).
    #[arg(long, env = "ALIQUOT_BALANCER_BATCH", default_value_t = 16,
        value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub batch: u32,
    /// Move everything of the manifest off these vdevs (names or ids; they
    /// must be offline: `aliquotctl vdev drain`). The target score is then
    /// ignored: plans go on until the drained vdevs hold none of its blocks.
    #[arg(long, env = "ALIQUOT_BALANCER_DRAIN", value_delimiter = ',')]
    pub drain: Vec<String>,
    /// Per-move deadline for each agent read, write and flush.
    #[arg(long, env = "ALIQUOT_BALANCER_TIMEOUT", value_parser = units::duration_arg, default_value = "30s")]
    pub timeout: Duration,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long, env = "ALIQUOT_NO_PROGRESS")]
    pub no_progress: bool,
    /// Print the report as JSON.
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
}

#[derive(Clone, Debug, clap::Args)]
pub struct VerifyManifestArgs {
    /// The manifest whose blocks to read back.
    #[arg(long, env = "ALIQUOT_MANIFEST")]
    pub manifest: PathBuf,
    /// The manifest's blocks are everything in the pool: after letting the
    /// frees settle, each vdev must hold exactly the bytes of its copies (a
    /// difference is leaked or lost space, and fails).
    #[arg(long, env = "ALIQUOT_VERIFY_EXCLUSIVE")]
    pub exclusive: bool,
    /// Reads in flight at once.
    #[arg(long, env = "ALIQUOT_VERIFY_CONCURRENCY", default_value_t = 16,
        value_parser = clap::value_parser!(u32).range(1..=256))]
    pub concurrency: u32,
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
}

/// What one plan did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanReport {
    pub plan_id: String,
    pub planned_moves: u64,
    pub planned_bytes: u64,
    /// Planned moves of extents the manifest does not own (skipped).
    pub foreign_moves: u64,
    pub moved: u64,
    pub moved_bytes: u64,
    /// Moves that did not happen (extent busy or gone, no room): retried by a later plan.
    pub skipped: u64,
    pub score_before: f64,
    pub score_predicted: f64,
    pub score_after: f64,
    pub secs: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ExecuteReport {
    /// Relocations left pending by an earlier run, settled first.
    pub resumed_moved: u64,
    pub resumed_dropped: u64,
    pub plans: Vec<PlanReport>,
    pub moved: u64,
    pub moved_bytes: u64,
    pub score_start: f64,
    pub score_end: f64,
    pub secs: f64,
    pub stopped: String,
}

/// Test-only crash points (`ALIQUOT_FAILPOINT=mover-after-pending:N` or
/// `mover-after-commit:N`): the process aborts, as under kill -9, right
/// after the N-th move journaled `pending` or got its Commit answered and
/// before it journaled `moved`; the crash tests drive resumption with them.
struct Failpoint {
    after_pending: Option<u64>,
    after_commit: Option<u64>,
    pendings: AtomicU64,
    commits: AtomicU64,
}

impl Failpoint {
    fn from_env() -> Failpoint {
        let spec = std::env::var("ALIQUOT_FAILPOINT").unwrap_or_default();
        let at = |name: &str| {
            spec.strip_prefix(name)
                .and_then(|n| n.strip_prefix(':'))
                .and_then(|n| n.parse().ok())
        };
        Failpoint {
            after_pending: at("mover-after-pending"),
            after_commit: at("mover-after-commit"),
            pendings: AtomicU64::new(0),
            commits: AtomicU64::new(0),
        }
    }

    fn hit(limit: Option<u64>, count: &AtomicU64, what: &str) {
        if let Some(n) = limit
            && count.fetch_add(1, Ordering::SeqCst) + 1 == n
        {
            eprintln!("failpoint: aborting after {what} {n}");
            std::process::abort();
        }
    }
}

struct Mover {
    failpoint: Failpoint,
    alloc: Allocator,
    agents: Agents,
    manifest: Mutex<Manifest>,
    nonce: u64,
    timeout: Duration,
    rate: Option<f64>,
    start: Instant,
    /// Bytes admitted by the rate limiter so far.
    admitted: AtomicU64,
    stop: Arc<AtomicBool>,
    bar: ProgressBar,
}

enum Outcome {
    Moved(u64),
    Skipped(String),
}

enum Prep {
    /// Written to its new extent (not yet flushed), on this endpoint.
    Ready(Pending, String),
    Skipped(String),
}

fn pool_score(st: &PoolStatus) -> f64 {
    st.classes
        .iter()
        .find(|c| c.name == "normal")
        .map_or(0.0, |c| c.balance_score)
}

fn endpoints(st: &PoolStatus) -> BTreeMap<u32, String> {
    st.vdevs
        .iter()
        .map(|v| (v.vdev, v.endpoint.clone()))
        .collect()
}

impl Mover {
    fn journal_all(&self, recs: Vec<Record>) -> anyhow::Result<()> {
        self.manifest
            .lock()
            .expect("manifest lock")
            .append_all(recs)
            .map_err(Into::into)
    }

    fn journal(&self, rec: Record) -> anyhow::Result<()> {
        self.journal_all(vec![rec])
    }

    /// Wait until `bytes` more fit the rate.
    async fn pace(&self, bytes: u64) {
        let Some(rate) = self.rate else { return };
        let before = self.admitted.fetch_add(bytes, Ordering::Relaxed);
        let due = self.start + Duration::from_secs_f64(before as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
    }

    /// Settle a relocation whose Commit may or may not have taken effect.
    /// Returns whether the block now lives at `p.to`.
    async fn settle(&self, p: &Pending) -> anyhow::Result<bool> {
        for _ in 0..3 {
            let st = self
                .alloc
                .clone()
                .balancer_status(BalancerStatusRequest {
                    allocation_ids: vec![p.allocation],
                })
                .await
                .map_err(|s| client::status_msg("balancer status", &s))?
                .into_inner();
            let r = st
                .relocations
                .first()
                .ok_or_else(|| anyhow::anyhow!("balancer status answered no relocation"))?;
            let state = RelocationState::try_from(r.state).unwrap_or_default();
            match state {
                RelocationState::RelocationDurable => {
                    if r.to.map(|e| Ext::from(&e)) != Some(p.to) {
                        anyhow::bail!(
                            "relocation {} is durable at {:?}, but the manifest recorded {}",
                            p.allocation,
                            r.to,
                            p.to
                        );
                    }
                    self.journal(Record::Moved {
                        allocation: p.allocation,
                    })?;
                    return Ok(true);
                }
                RelocationState::RelocationCommitted => {
                    match self
                        .alloc
                        .clone()
                        .sync_txg(SyncTxgRequest {
                            txg: r.txg,
                            generation: p.generation,
                        })
                        .await
                    {
                        Ok(_) => continue, // durable now: the next query says so
                        Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) => {
                            // Its txg was lost with the restart: so were the
                            // new extent and the free of the old one.
                            self.journal(Record::Dropped {
                                allocation: p.allocation,
                            })?;
                            return Ok(false);
                        }
                        Err(s) => return Err(client::status_msg("sync a relocation's txg", &s)),
                    }
                }
                RelocationState::RelocationInFlight => {
                    // Fence it: once aborted, no late Commit can land.
                    match self
                        .alloc
                        .clone()
                        .abort(AbortRequest {
                            allocation_ids: vec![p.allocation],
                        })
                        .await
                    {
                        Ok(_) => {
                            self.journal(Record::Dropped {
                                allocation: p.allocation,
                            })?;
                            return Ok(false);
                        }
                        // Committed or expired meanwhile: ask again.
                        Err(_) => continue,
                    }
                }
                RelocationState::RelocationNotCommitted | RelocationState::Unspecified => {
                    self.journal(Record::Dropped {
                        allocation: p.allocation,
                    })?;
                    return Ok(false);
                }
            }
        }
        anyhow::bail!(
            "relocation {} of block {} did not settle; run execute again",
            p.allocation,
            p.block
        )
    }

    /// First half of a move of copy `copy` of `block` (now at `from`):
    /// Relocate, read and check the copy, write it to the new extent. The
    /// batch then flushes, journals and commits (`finish`).
    async fn prepare(
        &self,
        eps: &BTreeMap<u32, String>,
        plan_id: u64,
        block: u64,
        copy: usize,
        from: Ext,
    ) -> anyhow::Result<Prep> {
        let (len, avoid) = {
            let m = self.manifest.lock().expect("manifest lock");
            let copies = &m.blocks[&block];
            if copies.get(copy).map(|c| c.at) != Some(from) {
                return Ok(Prep::Skipped("moved since the plan".into()));
            }
            let avoid: Vec<u32> = copies
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != copy)
                .map(|(_, c)| c.at.vdev)
                .collect();
            (copies[copy].len, avoid)
        };
        self.pace(from.size).await;
        let r = match self
            .alloc
            .clone()
            .relocate(RelocateRequest {
                extent: Some(from.into()),
                avoid_vdevs: avoid,
                lease_ms: 0,
                plan_id,
            })
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => {
                return match reason(&s) {
                    Some(
                        ErrorReason::RelocationConflict
                        | ErrorReason::NotAllocated
                        | ErrorReason::VdevsOffline
                        | ErrorReason::NoSpace
                        | ErrorReason::Fragmented,
                    ) => Ok(Prep::Skipped(s.message().to_string())),
                    _ => Err(client::status_msg(&format!("relocate block {block}"), &s)),
                };
            }
        };
        let (Some(to), Some(ep)) = (r.extents.first().copied(), r.endpoints.first().cloned())
        else {
            anyhow::bail!("relocate block {block}: no extent or endpoint in the reply");
        };
        if let Err(e) = self.copy(eps, block, from, len, &r).await {
            self.abort(&[r.allocation_id]).await;
            return Err(e);
        }
        Ok(Prep::Ready(
            Pending {
                block,
                copy,
                from,
                to: Ext::from(&to),
                allocation: r.allocation_id,
                generation: r.generation,
            },
            ep,
        ))
    }

    async fn abort(&self, ids: &[u64]) {
        for &id in ids {
            // Best effort: an allocation that cannot be aborted expires.
            let _ = self
                .alloc
                .clone()
                .abort(AbortRequest {
                    allocation_ids: vec![id],
                })
                .await;
        }
    }

    /// Second half, for a batch of written moves: flush each agent written
    /// (on stable storage before a commit can make a copy the only one),
    /// journal every move `pending` (one fsync), Commit them together
    /// (wait_synced: one txg for the batch), journal them `moved`. A Commit
    /// that fails is settled move by move with BalancerStatus.
    async fn finish(&self, ready: Vec<(Pending, String)>) -> anyhow::Result<Vec<Outcome>> {
        if ready.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<u64> = ready.iter().map(|(p, _)| p.allocation).collect();
        let mut eps: Vec<&String> = ready.iter().map(|(_, ep)| ep).collect();
        eps.sort();
        eps.dedup();
        let t = self.timeout;
        let flushes = eps.iter().map(|ep| async move {
            let mut d = self.agents.get(ep).await?;
            tokio::time::timeout(t, d.flush(FlushRequest {}))
                .await
                .map_err(|_| anyhow::anyhow!("flush {ep}: no answer in {t:?}"))?
                .map_err(|s| client::status_msg(&format!("flush {ep}"), &s))?;
            anyhow::Ok(())
        });
        for r in futures_util::future::join_all(flushes).await {
            if let Err(e) = r {
                self.abort(&ids).await;
                return Err(e);
            }
        }
        let records = ready.iter().map(|(p, _)| p.record()).collect();
        self.journal_all(records)?;
        for _ in &ready {
            Failpoint::hit(
                self.failpoint.after_pending,
                &self.failpoint.pendings,
                "pending",
            );
        }
        // One Commit per allocator generation (a restart mid-batch splits it).
        let mut by_gen: BTreeMap<u64, Vec<&Pending>> = BTreeMap::new();
        for (p, _) in &ready {
            by_gen.entry(p.generation).or_default().push(p);
        }
        let mut out = Vec::with_capacity(ready.len());
        for (generation, group) in by_gen {
            let committed = self
                .alloc
                .clone()
                .commit(CommitRequest {
                    allocation_ids: group.iter().map(|p| p.allocation).collect(),
                    wait_synced: true,
                    generation,
                })
                .await;
            match committed {
                Ok(_) => {
                    Failpoint::hit(
                        self.failpoint.after_commit,
                        &self.failpoint.commits,
                        "commit",
                    );
                    self.journal_all(
                        group
                            .iter()
                            .map(|p| Record::Moved {
                                allocation: p.allocation,
                            })
                            .collect(),
                    )?;
                    out.extend(group.iter().map(|p| Outcome::Moved(p.from.size)));
                }
                // Expired, restarted, or an answer lost: the allocator
                // knows each one's fate (all or none committed).
                Err(_) => {
                    for p in group {
                        out.push(if self.settle(p).await? {
                            Outcome::Moved(p.from.size)
                        } else {
                            Outcome::Skipped(format!(
                                "relocation {} of block {} did not take effect",
                                p.allocation, p.block
                            ))
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Read the copy at `from`, check it, write it to the new extent.
    async fn copy(
        &self,
        eps: &BTreeMap<u32, String>,
        block: u64,
        from: Ext,
        len: u64,
        r: &aliquot_proto::v1::AllocateReply,
    ) -> anyhow::Result<()> {
        let src = eps
            .get(&from.vdev)
            .ok_or_else(|| anyhow::anyhow!("vdev {} has no agent endpoint", from.vdev))?;
        let t = self.timeout;
        let at: aliquot_proto::v1::Extent = from.into();
        let token = client::read_tokens(&self.alloc, [at])
            .await?
            .remove(&(at.vdev, at.offset))
            .unwrap_or_default();
        let mut c = self.agents.get(src).await?;
        let data = tokio::time::timeout(
            t,
            c.read(ReadRequest {
                offset: from.offset,
                size: from.size,
                token,
            }),
        )
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "read block {block} from vdev {}: no answer in {t:?}",
                from.vdev
            )
        })?
        .map_err(|s| {
            client::status_msg(&format!("read block {block} from vdev {}", from.vdev), &s)
        })?
        .into_inner()
        .data;
        let n = (len as usize).min(data.len());
        if data.len() as u64 != from.size
            || crate::pattern::first_mismatch(&data[..n], self.nonce, block).is_some()
        {
            // Never spread a bad copy: the operator must look at it.
            anyhow::bail!(
                "block {block} at {from} does not hold what the manifest says (read {} bytes); \
                 not moved",
                data.len()
            );
        }
        let ep = r
            .endpoints
            .first()
            .ok_or_else(|| anyhow::anyhow!("relocate block {block}: no endpoint in the reply"))?;
        let to = r.extents[0];
        let mut d = self.agents.get(ep).await?;
        tokio::time::timeout(
            t,
            d.write(WriteRequest {
                offset: to.offset,
                data,
                token: r.tokens.first().cloned().unwrap_or_default(),
            }),
        )
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "write block {block} to vdev {}: no answer in {t:?}",
                to.vdev
            )
        })?
        .map_err(|s| client::status_msg(&format!("write block {block} to vdev {}", to.vdev), &s))?;
        Ok(())
    }
}

async fn pool(alloc: &Allocator) -> anyhow::Result<PoolStatus> {
    Ok(alloc
        .clone()
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|s| client::status_msg("get pool", &s))?
        .into_inner())
}

/// `balancer execute`.
pub async fn execute(conn: &AllocatorArgs, args: &ExecuteArgs) -> anyhow::Result<ExecuteReport> {
    let alloc = conn.connect().await?;
    let mut manifest = Manifest::load(&args.manifest)?;
    let st = pool(&alloc).await?;
    if manifest.header.pool_guid != st.guid {
        anyhow::bail!(
            "manifest {} is of pool {:#x}, but the allocator serves pool {:#x}",
            args.manifest.display(),
            manifest.header.pool_guid,
            st.guid
        );
    }
    let drain = args
        .drain
        .iter()
        .map(|d| crate::names::resolve_vdev(&st, d).map(|(id, _)| id))
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let nonce = manifest.header.nonce;
    let pending: Vec<Pending> = manifest.pending.values().cloned().collect();
    manifest.compact()?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!(
                    "interrupted: finishing the moves in flight (run execute again to go on)"
                );
                stop.store(true, Ordering::Relaxed);
            }
        });
    }
    let show = !args.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bar = if show {
        ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("progress template"),
    );
    let mover = Arc::new(Mover {
        failpoint: Failpoint::from_env(),
        alloc: alloc.clone(),
        agents: conn.agents()?,
        manifest: Mutex::new(manifest),
        nonce,
        timeout: args.timeout,
        rate: args.rate,
        start: Instant::now(),
        admitted: AtomicU64::new(0),
        stop: stop.clone(),
        bar: bar.clone(),
    });
    let mut report = ExecuteReport {
        score_start: pool_score(&st),
        ..Default::default()
    };
    for p in &pending {
        if mover.settle(p).await? {
            report.resumed_moved += 1;
        } else {
            report.resumed_dropped += 1;
        }
    }
    if !pending.is_empty() && !args.json {
        eprintln!(
            "resumed: {} moves of an interrupted run were durable, {} had not taken effect",
            report.resumed_moved, report.resumed_dropped
        );
    }
    let t0 = Instant::now();
    report.stopped = loop {
        if report.plans.len() as u32 >= args.max_plans {
            break format!("{} plans made (--max-plans)", args.max_plans);
        }
        if stop.load(Ordering::Relaxed) {
            break "interrupted".into();
        }
        let st = pool(&alloc).await?;
        let score = pool_score(&st);
        if drain.is_empty() && score <= args.target_score {
            break format!(
                "score {score:.4} is at or below the target {}",
                args.target_score
            );
        }
        let plan = alloc
            .clone()
            .plan_rebalance(PlanRebalanceRequest {
                max_misplaced: args.max_misplaced,
                byte_budget: args.budget.unwrap_or(0),
                bytes_per_sec: args.rate.map_or(0, |r| r as u64),
                drain: drain.clone(),
            })
            .await
            .map_err(|s| client::status_msg("plan rebalance", &s))?
            .into_inner();
        if plan.moves.is_empty() {
            break if drain.is_empty() {
                format!("no move lowers the score ({score:.4}) further")
            } else {
                "the drained vdevs hold nothing more to move".into()
            };
        }
        let index = mover.manifest.lock().expect("manifest lock").index();
        let mut mine = Vec::new();
        let mut foreign = 0u64;
        for m in &plan.moves {
            let Some(e) = m.extent else { continue };
            match index.get(&Ext::from(&e)) {
                Some(&(b, c)) => mine.push((b, c, Ext::from(&e))),
                None => foreign += 1,
            }
        }
        let mut pr = PlanReport {
            plan_id: plan.plan_id.to_string(),
            planned_moves: plan.moves.len() as u64,
            planned_bytes: plan.bytes,
            foreign_moves: foreign,
            score_before: plan.score_before,
            score_predicted: plan.score_after,
            ..Default::default()
        };
        if mine.is_empty() {
            report.plans.push(pr);
            break "the plan moves only extents this manifest does not own".into();
        }
        let t = Instant::now();
        let n = report.plans.len() + 1;
        bar.set_prefix(format!("plan {n}"));
        bar.set_length(mine.iter().map(|(_, _, e)| e.size).sum());
        bar.set_position(0);
        let eps = Arc::new(endpoints(&st));
        let mut results: Vec<anyhow::Result<Outcome>> = Vec::new();
        for batch in mine.chunks(args.batch as usize) {
            if mover.stop.load(Ordering::Relaxed) {
                results.extend(
                    batch
                        .iter()
                        .map(|_| Ok(Outcome::Skipped("interrupted".into()))),
                );
                continue;
            }
            let prepared: Vec<anyhow::Result<Prep>> = futures_util::stream::iter(batch.to_vec())
                .map(|(b, c, e)| {
                    let (mover, eps) = (mover.clone(), eps.clone());
                    async move { mover.prepare(&eps, plan.plan_id, b, c, e).await }
                })
                .buffer_unordered(args.concurrency as usize)
                .collect()
                .await;
            let mut ready = Vec::new();
            for p in prepared {
                match p {
                    Ok(Prep::Ready(p, ep)) => ready.push((p, ep)),
                    Ok(Prep::Skipped(why)) => results.push(Ok(Outcome::Skipped(why))),
                    Err(e) => results.push(Err(e)),
                }
            }
            match mover.finish(ready).await {
                Ok(outs) => {
                    for o in outs {
                        if let Outcome::Moved(bytes) = &o {
                            mover.bar.inc(*bytes);
                        }
                        results.push(Ok(o));
                    }
                }
                Err(e) => results.push(Err(e)),
            }
            if results.iter().any(|r| r.is_err()) {
                break;
            }
        }
        let mut first_err = None;
        for r in results {
            match r {
                Ok(Outcome::Moved(b)) => {
                    pr.moved += 1;
                    pr.moved_bytes += b;
                }
                Ok(Outcome::Skipped(why)) => {
                    tracing::debug!(%why, "move skipped");
                    pr.skipped += 1;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        pr.secs = t.elapsed().as_secs_f64();
        pr.score_after = pool_score(&pool(&alloc).await?);
        bar.finish_and_clear();
        report.moved += pr.moved;
        report.moved_bytes += pr.moved_bytes;
        if !args.json {
            eprintln!(
                "plan {n}: moved {} of {} planned ({} of {}, {} skipped, {} not in the manifest) \
                 in {:.1} s; score {:.4} → {:.4} (predicted {:.4})",
                pr.moved,
                pr.planned_moves,
                short(pr.moved_bytes),
                short(pr.planned_bytes),
                pr.skipped,
                pr.foreign_moves,
                pr.secs,
                pr.score_before,
                pr.score_after,
                pr.score_predicted
            );
        }
        let moved_none = pr.moved == 0;
        report.plans.push(pr);
        if let Some(e) = first_err {
            return Err(e.context(format!(
                "plan {n} stopped; what moved is recorded in {} (run execute again to go on)",
                args.manifest.display()
            )));
        }
        if moved_none {
            break "a whole plan moved nothing (its extents were busy or there was no room)".into();
        }
    };
    report.secs = t0.elapsed().as_secs_f64();
    report.score_end = pool_score(&pool(&alloc).await?);
    mover.manifest.lock().expect("manifest lock").compact()?;
    Ok(report)
}

pub fn render_execute(r: &ExecuteReport) -> String {
    format!(
        "moved {} blocks ({}) in {:.1} s over {} plans; score {:.4} → {:.4}\nstopped: {}\n",
        r.moved,
        short(r.moved_bytes),
        r.secs,
        r.plans.len(),
        r.score_start,
        r.score_end,
        r.stopped
    )
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyManifestReport {
    pub blocks: u64,
    pub copies: u64,
    pub bytes: u64,
    /// Relocations recorded as pending (run execute to settle them).
    pub pending: u64,
    /// Per vdev: (bytes the manifest's copies take, bytes the vdev holds).
    pub vdevs: BTreeMap<u32, (u64, u64)>,
}

/// `balancer verify --manifest`: every copy of every block read back and
/// compared; with --exclusive, every vdev holds exactly its copies' bytes.
pub async fn verify(
    conn: &AllocatorArgs,
    args: &VerifyManifestArgs,
) -> anyhow::Result<VerifyManifestReport> {
    let alloc = conn.connect().await?;
    let m = Manifest::load(&args.manifest)?;
    let mut st = pool(&alloc).await?;
    if m.header.pool_guid != st.guid {
        anyhow::bail!(
            "manifest {} is of pool {:#x}, not {:#x}",
            args.manifest.display(),
            m.header.pool_guid,
            st.guid
        );
    }
    let eps = Arc::new(endpoints(&st));
    let agents = conn.agents()?;
    let nonce = m.header.nonce;
    let tokens = Arc::new(
        client::read_tokens(
            &alloc,
            m.blocks
                .values()
                .flat_map(|cs| cs.iter().map(|c| aliquot_proto::v1::Extent::from(c.at))),
        )
        .await?,
    );
    let work: Vec<(u64, crate::manifest::Copy)> = m
        .blocks
        .iter()
        .flat_map(|(&b, cs)| cs.iter().map(move |c| (b, *c)))
        .collect();
    let mut report = VerifyManifestReport {
        blocks: m.blocks.len() as u64,
        copies: work.len() as u64,
        pending: m.pending.len() as u64,
        ..Default::default()
    };
    for (_, c) in &work {
        report.bytes += c.len;
        report.vdevs.entry(c.at.vdev).or_default().0 += c.at.size;
    }
    let results: Vec<anyhow::Result<()>> = futures_util::stream::iter(work)
        .map(|(b, c)| {
            let (agents, eps, tokens) = (agents.clone(), eps.clone(), tokens.clone());
            async move {
                let ep = eps.get(&c.at.vdev).ok_or_else(|| {
                    anyhow::anyhow!("block {b}: vdev {} is not in the pool", c.at.vdev)
                })?;
                let data = agents
                    .get(ep)
                    .await?
                    .read(ReadRequest {
                        offset: c.at.offset,
                        size: c.len,
                        token: tokens
                            .get(&(c.at.vdev, c.at.offset))
                            .cloned()
                            .unwrap_or_default(),
                    })
                    .await
                    .map_err(|s| client::status_msg(&format!("read block {b} at {}", c.at), &s))?
                    .into_inner()
                    .data;
                if data.len() as u64 != c.len {
                    anyhow::bail!(
                        "block {b} at {}: read {} bytes, expected {}",
                        c.at,
                        data.len(),
                        c.len
                    );
                }
                if let Some(at) = crate::pattern::first_mismatch(&data, nonce, b) {
                    anyhow::bail!("block {b} at {}: data differs at byte {at}", c.at);
                }
                Ok(())
            }
        })
        .buffer_unordered(args.concurrency as usize)
        .collect()
        .await;
    let bad: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    if !bad.is_empty() {
        anyhow::bail!(
            "{} of {} copies are not intact; first: {}",
            bad.len(),
            report.copies,
            bad[0]
        );
    }
    if args.exclusive {
        // Let every deferred free become free (TXG_DEFER_SIZE + 1 syncs).
        for _ in 0..3 {
            alloc
                .clone()
                .sync_txg(SyncTxgRequest::default())
                .await
                .map_err(|s| client::status_msg("sync txg", &s))?;
        }
        st = pool(&alloc).await?;
        for v in &st.vdevs {
            if v.class == "normal" {
                report.vdevs.entry(v.vdev).or_default().1 = v.alloc;
            }
        }
        let off: Vec<String> = report
            .vdevs
            .iter()
            .filter(|(_, (want, got))| want != got)
            .map(|(v, (want, got))| format!("vdev {v} holds {got} bytes, its copies take {want}"))
            .collect();
        if !off.is_empty() {
            anyhow::bail!("space does not add up (leaked or lost): {}", off.join("; "));
        }
    }
    Ok(report)
}
