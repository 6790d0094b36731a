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
    AbortRequest, BalancerStatusRequest, CommitRequest, ErrorReason, GetPoolRequest,
    PlanRebalanceRequest, PoolStatus, ReadRequest, RelocateRequest, RelocationState,
    SyncTxgRequest,
};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use units::format_bytes_short as short;

use crate::client::{self, Agents, Allocator, AllocatorArgs};
use crate::manifest::{Ext, Manifest, Pending, Record};
use aliquot_proto::error::reason;

/// Which manifests a command works on (execute, verify, free, drain).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ManifestArgs {
    /// Manifests: files, or directories meaning every `*.jsonl` in them;
    /// repeatable or comma-separated. Default: the directory `write`
    /// records its runs in (`manifests/` beside --certs-dir, so
    /// `aliquot-data/manifests`).
    #[arg(long = "manifest", env = "ALIQUOT_MANIFEST", value_delimiter = ',')]
    pub manifest: Vec<PathBuf>,
}

impl ManifestArgs {
    /// The paths given, or the default manifest directory.
    pub fn paths(&self, conn: &AllocatorArgs) -> Vec<PathBuf> {
        if self.manifest.is_empty() {
            vec![crate::manifest::default_dir(&conn.tls.certs_dir)]
        } else {
            self.manifest.clone()
        }
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct ExecuteArgs {
    #[command(flatten)]
    pub manifests: ManifestArgs,
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
    #[command(flatten)]
    pub manifests: ManifestArgs,
    /// The manifests' blocks are everything in the pool: after letting the
    /// frees settle, each vdev must hold exactly the bytes of their copies;
    /// bytes no manifest covers are named (held by another manifest of the
    /// data dir, or by none: written without one, or leaked), and fail.
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
    /// `skipped` by reason: the allocator's refusal (`RELOCATION_CONFLICT`,
    /// `NOT_ALLOCATED`, `VDEVS_OFFLINE`, `NO_SPACE`, `FRAGMENTED`), or the
    /// mover's own (`MOVED_SINCE_PLAN`, `INTERRUPTED`, `NOT_COMMITTED`: the
    /// relocation's Commit did not take effect, e.g. its lease ran out).
    pub skipped_by_reason: BTreeMap<&'static str, u64>,
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
    /// The first plan's lower bound: the fewest bytes any rebalance from
    /// the starting pool must move (`moved_bytes` is compared with it).
    pub lower_bound_bytes: u64,
    pub secs: f64,
    pub stopped: String,
    /// Drained vdevs that still hold bytes (the command then fails).
    pub left: Vec<DrainLeft>,
    /// The manifests read (as given).
    pub manifests_read: String,
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
        // Without the `failpoints` feature the variable is not read.
        let spec = if cfg!(feature = "failpoints") {
            std::env::var("ALIQUOT_FAILPOINT").unwrap_or_default()
        } else {
            String::new()
        };
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

    #[cfg(feature = "failpoints")]
    fn hit(limit: Option<u64>, count: &AtomicU64, what: &str) {
        if let Some(n) = limit
            && count.fetch_add(1, Ordering::SeqCst) + 1 == n
        {
            eprintln!("failpoint: aborting after {what} {n}");
            std::process::abort();
        }
    }

    #[cfg(not(feature = "failpoints"))]
    fn hit(_: Option<u64>, _: &AtomicU64, _: &str) {}
}

struct Mover {
    failpoint: Failpoint,
    alloc: Allocator,
    agents: Agents,
    /// Every manifest whose blocks may move; a block is (manifest index,
    /// block number).
    manifests: Mutex<Vec<Manifest>>,
    timeout: Duration,
    rate: Option<f64>,
    start: Instant,
    /// Bytes admitted by the rate limiter so far.
    admitted: AtomicU64,
    stop: Arc<AtomicBool>,
    bar: ProgressBar,
    /// Relocations made and not yet committed or aborted: their leases are
    /// renewed while this mover lives. A batch of moves is copied, flushed
    /// and journaled before its one Commit; on a loaded machine that took
    /// longer than a short `--lease` (2 s in the tests: every Commit of a
    /// plan refused LEASE_EXPIRED).
    held: aliquot_client::Leases,
}

enum Outcome {
    Moved(u64),
    Skipped(Skip),
}

enum Prep {
    /// Written to its new extent (not yet flushed), on this endpoint.
    Ready(usize, Pending, String),
    Skipped(Skip),
}

/// Why a move did not happen: a reason a script can count (the allocator's
/// `ErrorReason` name when it refused the relocation) and the words of that
/// one refusal.
struct Skip {
    reason: &'static str,
    detail: String,
}

impl Skip {
    fn new(reason: &'static str, detail: impl Into<String>) -> Skip {
        Skip {
            reason,
            detail: detail.into(),
        }
    }
}

/// `"NO_SPACE 3, VDEVS_OFFLINE 21"`.
fn reason_counts(by_reason: &BTreeMap<&'static str, u64>) -> String {
    let counts: Vec<String> = by_reason.iter().map(|(r, n)| format!("{r} {n}")).collect();
    counts.join(", ")
}

/// `": NO_SPACE 3, VDEVS_OFFLINE 21"` for a plan's line, or nothing.
fn skip_counts(by_reason: &BTreeMap<&'static str, u64>) -> String {
    if by_reason.is_empty() {
        return String::new();
    }
    format!(": {}", reason_counts(by_reason))
}

/// Why a plan moved nothing, for `stopped`: each reason's count, and the
/// allocator's words for the most frequent one.
fn skip_summary(
    by_reason: &BTreeMap<&'static str, u64>,
    first: &BTreeMap<&'static str, String>,
) -> String {
    let Some((top, _)) = by_reason.iter().max_by_key(|(_, n)| **n) else {
        return "no move was tried".into();
    };
    format!(
        "every move was skipped ({}); {top}: {}",
        reason_counts(by_reason),
        first.get(top).map_or("", String::as_str)
    )
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
    fn journal_all(&self, mi: usize, recs: Vec<Record>) -> anyhow::Result<()> {
        self.manifests.lock().expect("manifest lock")[mi]
            .append_all(recs)
            .map_err(Into::into)
    }

    fn journal(&self, mi: usize, rec: Record) -> anyhow::Result<()> {
        self.journal_all(mi, vec![rec])
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
    async fn settle(&self, mi: usize, p: &Pending) -> anyhow::Result<bool> {
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
                    self.journal(
                        mi,
                        Record::Moved {
                            allocation: p.allocation,
                        },
                    )?;
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
                            self.journal(
                                mi,
                                Record::Dropped {
                                    allocation: p.allocation,
                                },
                            )?;
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
                            self.journal(
                                mi,
                                Record::Dropped {
                                    allocation: p.allocation,
                                },
                            )?;
                            return Ok(false);
                        }
                        // Committed or expired meanwhile: ask again.
                        Err(_) => continue,
                    }
                }
                RelocationState::RelocationNotCommitted | RelocationState::Unspecified => {
                    self.journal(
                        mi,
                        Record::Dropped {
                            allocation: p.allocation,
                        },
                    )?;
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
        (mi, block, copy, from): (usize, u64, usize, Ext),
    ) -> anyhow::Result<Prep> {
        let (len, avoid, nonce) = {
            let ms = self.manifests.lock().expect("manifest lock");
            let m = &ms[mi];
            let copies = &m.blocks[&block];
            if copies.get(copy).map(|c| c.at) != Some(from) {
                return Ok(Prep::Skipped(Skip::new(
                    "MOVED_SINCE_PLAN",
                    "moved since the plan",
                )));
            }
            let avoid: Vec<u32> = copies
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != copy)
                .map(|(_, c)| c.at.vdev)
                .collect();
            (copies[copy].len, avoid, m.header.nonce)
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
                // 0: the allocator sizes the new copy for the most the old
                // extent holds as a block on its vdev (its parity left
                // behind). A manifest's length is the extent's size, which
                // on RAIDZ includes parity: not a block size to send.
                psize: 0,
                // The key `aliquotctl write` placed the block with (its run's
                // nonce and 2^20-block region): the new copy goes through
                // the allocator that holds the block's neighbours.
                affinity_key: Some(nonce ^ (block >> 20)),
                // The manifest is rewritten to the new extent: the old
                // address need not keep answering.
                keep_address: false,
            })
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => {
                return match reason(&s) {
                    Some(
                        r @ (ErrorReason::RelocationConflict
                        | ErrorReason::NotAllocated
                        | ErrorReason::VdevsOffline
                        | ErrorReason::NoSpace
                        | ErrorReason::Fragmented),
                    ) => Ok(Prep::Skipped(Skip::new(r.as_str_name(), s.message()))),
                    _ => Err(client::status_msg(&format!("relocate block {block}"), &s)),
                };
            }
        };
        let (Some(to), Some(ep)) = (r.extents.first().copied(), r.endpoints.first().cloned())
        else {
            anyhow::bail!("relocate block {block}: no extent or endpoint in the reply");
        };
        self.hold(r.allocation_id, r.lease_deadline_ms);
        if let Err(e) = self.copy(eps, (block, nonce), from, len, &r).await {
            self.abort(&[r.allocation_id]).await;
            self.release(&[r.allocation_id]);
            return Err(e);
        }
        Ok(Prep::Ready(
            mi,
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

    /// A relocation to keep alive until [`Self::release`]; `deadline_ms`
    /// (unix ms) tells the allocator's lease.
    fn hold(&self, id: u64, deadline_ms: u64) {
        self.held.hold(id, deadline_ms);
    }

    /// Relocations committed, settled or aborted: no longer renewed.
    fn release(&self, ids: &[u64]) {
        self.held.release(ids);
    }

    async fn abort(&self, ids: &[u64]) {
        // Best effort: an allocation that cannot be aborted expires.
        aliquot_client::Ops::unary(self.alloc.clone())
            .abort(ids.to_vec())
            .await;
    }

    /// Second half, for a batch of written moves: flush each agent written
    /// (on stable storage before a commit can make a copy the only one),
    /// journal every move `pending` (one fsync), Commit them together
    /// (wait_synced: one txg for the batch), journal them `moved`. A Commit
    /// that fails is settled move by move with BalancerStatus.
    async fn finish(&self, ready: Vec<(usize, Pending, String)>) -> anyhow::Result<Vec<Outcome>> {
        let ids: Vec<u64> = ready.iter().map(|(_, p, _)| p.allocation).collect();
        let out = self.finish_held(ready).await;
        self.release(&ids);
        out
    }

    async fn finish_held(
        &self,
        ready: Vec<(usize, Pending, String)>,
    ) -> anyhow::Result<Vec<Outcome>> {
        if ready.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<u64> = ready.iter().map(|(_, p, _)| p.allocation).collect();
        let mut eps: Vec<&String> = ready.iter().map(|(_, _, ep)| ep).collect();
        eps.sort();
        eps.dedup();
        let eps = eps.into_iter().cloned();
        if let Err(e) = aliquot_client::flush_agents(&self.agents, eps, self.timeout).await {
            self.abort(&ids).await;
            return Err(e.into());
        }
        let mut records: BTreeMap<usize, Vec<Record>> = BTreeMap::new();
        for (mi, p, _) in &ready {
            records.entry(*mi).or_default().push(p.record());
        }
        for (mi, recs) in records {
            self.journal_all(mi, recs)?;
        }
        for _ in &ready {
            Failpoint::hit(
                self.failpoint.after_pending,
                &self.failpoint.pendings,
                "pending",
            );
        }
        // One Commit per allocator generation (a restart mid-batch splits it).
        let mut by_gen: BTreeMap<u64, Vec<(usize, &Pending)>> = BTreeMap::new();
        for (mi, p, _) in &ready {
            by_gen.entry(p.generation).or_default().push((*mi, p));
        }
        let mut out = Vec::with_capacity(ready.len());
        for (generation, group) in by_gen {
            let committed = self
                .alloc
                .clone()
                .commit(CommitRequest {
                    allocation_ids: group.iter().map(|(_, p)| p.allocation).collect(),
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
                    let mut moved: BTreeMap<usize, Vec<Record>> = BTreeMap::new();
                    for (mi, p) in &group {
                        moved.entry(*mi).or_default().push(Record::Moved {
                            allocation: p.allocation,
                        });
                    }
                    for (mi, recs) in moved {
                        self.journal_all(mi, recs)?;
                    }
                    out.extend(group.iter().map(|(_, p)| Outcome::Moved(p.from.size)));
                }
                // Expired, restarted, or an answer lost: the allocator
                // knows each one's fate (all or none committed).
                Err(e) => {
                    let why = match reason(&e) {
                        Some(r) => format!("{}: {}", r.as_str_name(), e.message()),
                        None => format!("{:?}: {}", e.code(), e.message()),
                    };
                    for (mi, p) in group {
                        out.push(if self.settle(mi, p).await? {
                            Outcome::Moved(p.from.size)
                        } else {
                            Outcome::Skipped(Skip::new(
                                "NOT_COMMITTED",
                                format!(
                                    "relocation {} of block {} did not take effect (its Commit: \
                                     {why})",
                                    p.allocation, p.block
                                ),
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
        (block, nonce): (u64, u64),
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
        let data = aliquot_client::read::read_extent(&self.alloc, &self.agents, src, at, token, t)
            .await
            .map_err(|e| anyhow::anyhow!("read block {block}: {e}"))?;
        let n = (len as usize).min(data.len());
        if crate::pattern::first_mismatch(&data[..n], nonce, block).is_some() {
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
        let ch = self.agents.channel(ep).await?;
        let w = aliquot_client::data::DataWrite {
            offset: to.offset,
            // The new extent is sized for the block on its own vdev: off a
            // RAIDZ vdev it is smaller than the old (parity), and the
            // block's bytes are the first `len` of what was read.
            len: (to.size as usize).min(data.len()),
            data,
            token: r.tokens.first().cloned().unwrap_or_default(),
        };
        tokio::time::timeout(t, aliquot_client::data::DataWriter::new(ch).write(w))
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "write block {block} to vdev {}: no answer in {t:?}",
                    to.vdev
                )
            })?
            .map_err(|s| {
                client::status_msg(&format!("write block {block} to vdev {}", to.vdev), &s)
            })?;
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
    let st = pool(&alloc).await?;
    let paths = args.manifests.paths(conn);
    let mut manifests = crate::manifest::load_all(&paths, st.guid)?;
    if manifests.is_empty() {
        anyhow::bail!(
            "no manifest in {}: `aliquotctl write` records one per run there (or give --manifest)",
            crate::manifest::describe(&paths)
        );
    }
    let drain = args
        .drain
        .iter()
        .map(|d| crate::names::resolve_vdev(&st, d).map(|(id, _)| id))
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut pending: Vec<(usize, Pending)> = Vec::new();
    for (mi, m) in manifests.iter_mut().enumerate() {
        pending.extend(m.pending.values().cloned().map(|p| (mi, p)));
        m.compact()?;
    }
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
        manifests: Mutex::new(manifests),
        timeout: args.timeout,
        rate: args.rate,
        start: Instant::now(),
        admitted: AtomicU64::new(0),
        stop: stop.clone(),
        bar: bar.clone(),
        // Dropped (and so stopped) when execute returns, however it returns.
        held: aliquot_client::Leases::start(alloc.clone()),
    });
    let mut report = ExecuteReport {
        score_start: pool_score(&st),
        ..Default::default()
    };
    for (mi, p) in &pending {
        if mover.settle(*mi, p).await? {
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
    // Frees settled once the manifests hold nothing on the drained vdevs.
    let mut settled = false;
    report.stopped = loop {
        if report.plans.len() as u32 >= args.max_plans {
            break format!("{} plans made (--max-plans)", args.max_plans);
        }
        if stop.load(Ordering::Relaxed) {
            break "interrupted".into();
        }
        // A drained vdev that holds nothing is done: planning on would only
        // plan the other vdevs' blocks, which is no drain's business.
        if !drain.is_empty() && !settled && manifests_hold(&mover, &drain) == 0 {
            settle_frees(&alloc).await?;
            settled = true;
            if let Some(done) = drained_empty(&pool(&alloc).await?, &drain) {
                break done;
            }
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
        if report.plans.is_empty() {
            report.lower_bound_bytes = plan.lower_bound_bytes;
        }
        if plan.moves.is_empty() {
            break if drain.is_empty() {
                format!("no move lowers the score ({score:.4}) further")
            } else if plan.limit_bytes > 0
                && plan.limit_bytes
                    < st.vdevs
                        .iter()
                        .filter(|v| drain.contains(&v.vdev))
                        .map(|v| v.alloc)
                        .sum::<u64>()
            {
                format!(
                    "no plan: no block on the drained vdevs fits one plan's bound of {} \
                     (--max-misplaced {} of the class's allocated bytes, or --budget); give a \
                     larger --max-misplaced (up to 1) to go on",
                    short(plan.limit_bytes),
                    args.max_misplaced
                )
            } else {
                "the drained vdevs hold nothing more to move".into()
            };
        }
        let index = index_all(&mover.manifests.lock().expect("manifest lock"));
        let mut mine = Vec::new();
        let mut foreign = 0u64;
        for m in &plan.moves {
            let Some(e) = m.extent else { continue };
            match index.get(&Ext::from(&e)) {
                Some(&(mi, b, c)) => mine.push((mi, b, c, Ext::from(&e))),
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
            break "the plan moves only extents no manifest given holds".into();
        }
        let t = Instant::now();
        let n = report.plans.len() + 1;
        bar.set_prefix(format!("plan {n}"));
        bar.set_length(mine.iter().map(|(_, _, _, e)| e.size).sum());
        bar.set_position(0);
        let eps = Arc::new(endpoints(&st));
        let mut results: Vec<anyhow::Result<Outcome>> = Vec::new();
        for batch in mine.chunks(args.batch as usize) {
            if mover.stop.load(Ordering::Relaxed) {
                results.extend(
                    batch
                        .iter()
                        .map(|_| Ok(Outcome::Skipped(Skip::new("INTERRUPTED", "interrupted")))),
                );
                continue;
            }
            let prepared: Vec<anyhow::Result<Prep>> = futures_util::stream::iter(batch.to_vec())
                .map(|mv| {
                    let (mover, eps) = (mover.clone(), eps.clone());
                    async move { mover.prepare(&eps, plan.plan_id, mv).await }
                })
                .buffer_unordered(args.concurrency as usize)
                .collect()
                .await;
            let mut ready = Vec::new();
            for p in prepared {
                match p {
                    Ok(Prep::Ready(mi, p, ep)) => ready.push((mi, p, ep)),
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
        // The first refusal's words per reason, for the lines below.
        let mut first_skip: BTreeMap<&'static str, String> = BTreeMap::new();
        for r in results {
            match r {
                Ok(Outcome::Moved(b)) => {
                    pr.moved += 1;
                    pr.moved_bytes += b;
                }
                Ok(Outcome::Skipped(skip)) => {
                    tracing::debug!(reason = skip.reason, why = %skip.detail, "move skipped");
                    pr.skipped += 1;
                    *pr.skipped_by_reason.entry(skip.reason).or_default() += 1;
                    first_skip.entry(skip.reason).or_insert(skip.detail);
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
                "plan {n}: moved {} of {} planned ({} of {}, {} skipped{}, {} not in the manifest) \
                 in {:.1} s; score {:.4} → {:.4} (predicted {:.4})",
                pr.moved,
                pr.planned_moves,
                short(pr.moved_bytes),
                short(pr.planned_bytes),
                pr.skipped,
                skip_counts(&pr.skipped_by_reason),
                pr.foreign_moves,
                pr.secs,
                pr.score_before,
                pr.score_after,
                pr.score_predicted
            );
        }
        let moved_none = pr.moved == 0;
        let why_none = skip_summary(&pr.skipped_by_reason, &first_skip);
        report.plans.push(pr);
        if let Some(e) = first_err {
            return Err(e.context(format!(
                "plan {n} stopped; what moved is recorded in {} (run execute again to go on)",
                crate::manifest::describe(&paths)
            )));
        }
        if moved_none {
            break format!("a whole plan moved nothing: {why_none}");
        }
    };
    report.secs = t0.elapsed().as_secs_f64();
    report.score_end = pool_score(&pool(&alloc).await?);
    let held: BTreeMap<u32, u64> = {
        let mut ms = mover.manifests.lock().expect("manifest lock");
        let mut held = BTreeMap::new();
        for m in ms.iter_mut() {
            m.compact()?;
            for c in m.blocks.values().flatten() {
                *held.entry(c.at.vdev).or_default() += c.at.size;
            }
        }
        held
    };
    if !drain.is_empty() && report.stopped != "interrupted" {
        report.left = drain_left(&alloc, &drain, &held).await?;
    }
    report.manifests_read = crate::manifest::describe(&paths);
    Ok(report)
}

/// Bytes the manifests' copies take on the vdevs `on`.
fn manifests_hold(mover: &Mover, on: &[u32]) -> u64 {
    let ms = mover.manifests.lock().expect("manifest lock");
    ms.iter()
        .flat_map(|m| m.blocks.values().flatten())
        .filter(|c| on.contains(&c.at.vdev))
        .map(|c| c.at.size)
        .sum()
}

/// When every drained vdev holds 0 bytes: the line `execute` stops with,
/// naming the command that takes them out of the pool.
fn drained_empty(st: &PoolStatus, drain: &[u32]) -> Option<String> {
    let vdevs: Vec<&aliquot_proto::v1::VdevStatus> = st
        .vdevs
        .iter()
        .filter(|v| drain.contains(&v.vdev))
        .collect();
    if vdevs.is_empty() || vdevs.iter().any(|v| v.alloc > 0) {
        return None;
    }
    let labels: Vec<String> = vdevs
        .iter()
        .map(|v| crate::names::vdev_label(v.vdev, &v.name))
        .collect();
    let removes: Vec<String> = vdevs
        .iter()
        .map(|v| format!("`aliquotctl vdev remove {}`", v.name))
        .collect();
    Some(format!(
        "{} {} empty: {} {} out of the pool",
        labels.join(", "),
        if vdevs.len() == 1 { "is" } else { "are" },
        removes.join(", "),
        if vdevs.len() == 1 {
            "takes it"
        } else {
            "take them"
        }
    ))
}

/// Extent → (manifest, block, copy) over every manifest.
fn index_all(ms: &[Manifest]) -> std::collections::HashMap<Ext, (usize, u64, usize)> {
    let mut out = std::collections::HashMap::new();
    for (mi, m) in ms.iter().enumerate() {
        for (e, (b, c)) in m.index() {
            out.insert(e, (mi, b, c));
        }
    }
    out
}

/// Let deferred frees become free (TXG_DEFER_SIZE + 1 syncs), so a vdev's
/// allocated bytes are what is referenced.
async fn settle_frees(alloc: &Allocator) -> anyhow::Result<()> {
    for _ in 0..3 {
        alloc
            .clone()
            .sync_txg(SyncTxgRequest::default())
            .await
            .map_err(|s| client::status_msg("sync txg", &s))?;
    }
    Ok(())
}

/// What a drained vdev still holds after the mover ran.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DrainLeft {
    pub vdev: u32,
    pub name: String,
    /// Bytes allocated on it (frees settled).
    pub alloc: u64,
    /// Of those, bytes of copies the manifests list (moves that were
    /// skipped: run execute again).
    pub in_manifests: u64,
}

async fn drain_left(
    alloc: &Allocator,
    drain: &[u32],
    held: &BTreeMap<u32, u64>,
) -> anyhow::Result<Vec<DrainLeft>> {
    settle_frees(alloc).await?;
    let st = pool(alloc).await?;
    let mut out = Vec::new();
    for &d in drain {
        let Some(v) = st.vdevs.iter().find(|v| v.vdev == d) else {
            continue;
        };
        let in_manifests = held.get(&d).copied().unwrap_or(0);
        if v.alloc > 0 {
            out.push(DrainLeft {
                vdev: d,
                name: v.name.clone(),
                alloc: v.alloc,
                in_manifests,
            });
        }
    }
    Ok(out)
}

/// `"; 1.08 × the lower bound of 24.0M"`, or nothing when the start was
/// balanced already (nothing had to move).
fn against_bound(moved: u64, bound: u64) -> String {
    if bound == 0 {
        return String::new();
    }
    format!(
        "; {:.2} × the lower bound of {}",
        moved as f64 / bound as f64,
        short(bound)
    )
}

pub fn render_execute(r: &ExecuteReport) -> String {
    let mut out = format!(
        "moved {} blocks ({}{}) in {:.1} s over {} plans; score {:.4} → {:.4}\nstopped: {}\n",
        r.moved,
        short(r.moved_bytes),
        against_bound(r.moved_bytes, r.lower_bound_bytes),
        r.secs,
        r.plans.len(),
        r.score_start,
        r.score_end,
        r.stopped
    );
    for l in &r.left {
        out.push_str(&format!("{}\n", drain_left_message(l, &r.manifests_read)));
    }
    out
}

/// Why a drained vdev is not empty, and what would empty it.
pub fn drain_left_message(l: &DrainLeft, manifests: &str) -> String {
    let label = crate::names::vdev_label(l.vdev, &l.name);
    let unlisted = l.alloc.saturating_sub(l.in_manifests);
    let mut s = format!(
        "vdev {label} still holds {} ({} bytes)",
        short(l.alloc),
        l.alloc
    );
    if l.in_manifests > 0 {
        s.push_str(&format!(
            "; {} of it is listed in the manifests but was not moved this time (busy or no \
             room): run `balancer execute --drain {}` again",
            short(l.in_manifests),
            l.name
        ));
    }
    if unlisted > 0 {
        s.push_str(&format!(
            "; {} ({unlisted} bytes) is in no manifest of {manifests}: blocks written without one \
             (`write --no-manifest`, another client, or a manifest kept elsewhere). Only whoever \
             holds their references can move them (give their manifest with --manifest, or \
             Relocate them from your client) or free them (`aliquotctl free --manifest FILE`); \
             `vdev remove {}` needs the vdev empty",
            short(unlisted),
            l.name
        ));
    }
    s
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyManifestReport {
    pub manifests: u64,
    pub blocks: u64,
    pub copies: u64,
    pub bytes: u64,
    /// Relocations recorded as pending (run execute to settle them).
    pub pending: u64,
    /// Per vdev: (bytes the manifests' copies take, bytes the vdev holds).
    pub vdevs: BTreeMap<u32, (u64, u64)>,
}

/// `balancer verify`: every copy of every block of the manifests read back
/// and compared; with --exclusive, every vdev holds exactly their copies'
/// bytes, and what it holds beyond them is told apart: bytes another
/// manifest of the data dir lists (not given here) from bytes no manifest
/// lists (written without one, or leaked), and bytes a manifest lists that
/// the vdev does not hold (lost).
pub async fn verify(
    conn: &AllocatorArgs,
    args: &VerifyManifestArgs,
) -> anyhow::Result<VerifyManifestReport> {
    let alloc = conn.connect().await?;
    let mut st = pool(&alloc).await?;
    let paths = args.manifests.paths(conn);
    let ms = crate::manifest::load_all(&paths, st.guid)?;
    if ms.is_empty() {
        anyhow::bail!(
            "no manifest in {}: `aliquotctl write` records one per run there (or give --manifest)",
            crate::manifest::describe(&paths)
        );
    }
    let eps = Arc::new(endpoints(&st));
    let agents = conn.agents()?;
    let tokens = Arc::new(
        client::read_tokens(
            &alloc,
            ms.iter().flat_map(|m| {
                m.blocks
                    .values()
                    .flat_map(|cs| cs.iter().map(|c| aliquot_proto::v1::Extent::from(c.at)))
            }),
        )
        .await?,
    );
    let work: Vec<(u64, u64, crate::manifest::Copy)> = ms
        .iter()
        .flat_map(|m| {
            let nonce = m.header.nonce;
            m.blocks
                .iter()
                .flat_map(move |(&b, cs)| cs.iter().map(move |c| (nonce, b, *c)))
        })
        .collect();
    let mut report = VerifyManifestReport {
        manifests: ms.len() as u64,
        blocks: ms.iter().map(|m| m.blocks.len() as u64).sum(),
        copies: work.len() as u64,
        pending: ms.iter().map(|m| m.pending.len() as u64).sum(),
        ..Default::default()
    };
    for (_, _, c) in &work {
        report.bytes += c.len;
        report.vdevs.entry(c.at.vdev).or_default().0 += c.at.size;
    }
    let results: Vec<anyhow::Result<()>> = futures_util::stream::iter(work)
        .map(|(nonce, b, c)| {
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
        settle_frees(&alloc).await?;
        st = pool(&alloc).await?;
        for v in &st.vdevs {
            report.vdevs.entry(v.vdev).or_default().1 = v.alloc;
        }
        // Bytes other manifests of the default directory list, per vdev:
        // covered, just not by the manifests given.
        let given = crate::manifest::expand(&paths)?;
        let dir = [crate::manifest::default_dir(&conn.tls.certs_dir)];
        let mut elsewhere: BTreeMap<u32, u64> = BTreeMap::new();
        let mut other_files = 0;
        for f in crate::manifest::expand(&dir).unwrap_or_default() {
            if given.contains(&f) {
                continue;
            }
            if let Ok(m) = Manifest::load(&f)
                && m.header.pool_guid == st.guid
            {
                other_files += 1;
                for c in m.blocks.values().flatten() {
                    *elsewhere.entry(c.at.vdev).or_default() += c.at.size;
                }
            }
        }
        let name = |id: u32| {
            let n = st
                .vdevs
                .iter()
                .find(|v| v.vdev == id)
                .map_or("", |v| v.name.as_str());
            crate::names::vdev_label(id, n)
        };
        let mut off = Vec::new();
        for (&v, &(want, got)) in &report.vdevs {
            if got < want {
                off.push(format!(
                    "vdev {} holds {} bytes but the manifests' copies on it take {want}: {} LOST \
                     (listed, not allocated)",
                    name(v),
                    got,
                    want - got
                ));
            } else if got > want {
                let extra = got - want;
                let other = elsewhere.get(&v).copied().unwrap_or(0).min(extra);
                let none = extra - other;
                let mut parts = Vec::new();
                if other > 0 {
                    parts.push(format!(
                        "{other} bytes listed by {other_files} other manifest(s) in {} (give \
                         --manifest {} to cover them)",
                        dir[0].display(),
                        dir[0].display()
                    ));
                }
                if none > 0 {
                    parts.push(format!(
                        "{none} bytes ({}) in no manifest: written without one or by another \
                         client, else leaked",
                        short(none)
                    ));
                }
                off.push(format!(
                    "vdev {} holds {got} bytes, {extra} more than these manifests cover: {}",
                    name(v),
                    parts.join("; ")
                ));
            }
        }
        if !off.is_empty() {
            anyhow::bail!(
                "not exclusive: the pool holds bytes these manifests ({}) do not account for: {}",
                crate::manifest::describe(&paths),
                off.join("; ")
            );
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_that_moved_nothing_says_why_by_reason() {
        let mut by: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut first: BTreeMap<&'static str, String> = BTreeMap::new();
        assert_eq!(skip_counts(&by), "");
        assert_eq!(skip_summary(&by, &first), "no move was tried");
        by.insert("NO_SPACE", 3);
        by.insert("VDEVS_OFFLINE", 21);
        first.insert("NO_SPACE", "no room on vdev 2".into());
        first.insert("VDEVS_OFFLINE", "vdev 1 missed its report".into());
        assert_eq!(skip_counts(&by), ": NO_SPACE 3, VDEVS_OFFLINE 21");
        assert_eq!(
            skip_summary(&by, &first),
            "every move was skipped (NO_SPACE 3, VDEVS_OFFLINE 21); \
             VDEVS_OFFLINE: vdev 1 missed its report"
        );
    }

    #[test]
    fn the_report_compares_what_moved_with_the_lower_bound() {
        let mib = 1u64 << 20;
        let mut r = ExecuteReport {
            moved: 27,
            moved_bytes: 27 * mib,
            lower_bound_bytes: 24 * mib,
            stopped: "score 0.0100 is at or below the target 0.01".into(),
            ..Default::default()
        };
        let t = render_execute(&r);
        assert!(t.contains("27.0M; 1.12 × the lower bound of 24.0M"), "{t}");
        // Balanced from the start: no ratio to a bound of nothing.
        r.lower_bound_bytes = 0;
        let t = render_execute(&r);
        assert!(!t.contains("lower bound"), "{t}");
    }
}
