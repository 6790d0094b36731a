//! `aliquotctl free`: give back every block a manifest lists (what a
//! `write` run left allocated), so a test pool can be emptied without
//! deleting its files. The manifest is renamed `NAME.freeing` first (so no
//! command reads it as live any more), its extents are freed a chunk at a
//! time (Free, then the sync of its txg), and the file is removed.
//!
//! A Free must never be sent twice blindly: once its txg synced, the space
//! is given out again two txgs later, possibly as exactly the same extent,
//! and a second Free would free someone else's block. So each chunk is
//! journaled in the `.freeing` file (see `manifest.rs`): `free_sent` before
//! its Free goes out, `freed` once its txg synced. An allocator that is
//! away, refuses as a standby or changes leader (a takeover) is waited for
//! (`--leader-wait`), and the chunk goes on: a Free the allocator refused
//! (an error with a reason) did nothing and is sent again; a Free whose
//! answer was lost (the connection broke), or whose generation ended before
//! its txg was known to sync, may or may not have freed: its extents are
//! then each looked at before being freed again (see [`still_ours`]). A
//! run stopped anyway leaves `NAME.freeing`, and the same `free` run again
//! resumes it the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aliquot_proto::error::{metadata, reason, retry_after};
use aliquot_proto::v1::{
    ErrorReason, Extent, FreeRequest, GetPoolRequest, ReadRequest, ReadTokensRequest,
    SyncTxgRequest,
};
use futures_util::StreamExt;
use serde::Serialize;
use telemetry::backoff::Backoff;
use tokio::time::Instant;
use units::format_bytes_short as short;

use crate::client::{self, Agents, Allocator, AllocatorArgs};
use crate::manifest::{Copy, Manifest, Record};
use crate::mover::ManifestArgs;

/// Extents per Free (and per journaled chunk).
const CHUNK: u64 = 1024;

#[derive(Clone, Debug, clap::Args)]
pub struct FreeArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(flatten)]
    pub manifests: ManifestArgs,
    /// Free every manifest of the default directory (without --manifest,
    /// this must be said).
    #[arg(long, env = "ALIQUOT_FREE_ALL", conflicts_with = "manifest")]
    pub all: bool,
    /// Print the report as JSON.
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
    /// Extents per Free request and journaled chunk (tests use few).
    #[arg(long, env = "ALIQUOT_FREE_CHUNK", default_value_t = CHUNK, hide = true,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub chunk: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct FreeReport {
    pub manifests: Vec<String>,
    pub blocks: u64,
    pub extents: u64,
    #[serde(serialize_with = "crate::status::as_string")]
    pub bytes: u64,
    #[serde(serialize_with = "crate::status::as_string")]
    pub synced_txg: u64,
    /// Manifests an earlier, interrupted run had begun to free.
    pub resumed: Vec<String>,
    /// Extents found freed already when a run resumed (or a Free's answer
    /// was lost): not freed again.
    pub already_free: u64,
}

/// The manifests `paths` name, each with its `.freeing` file: a manifest
/// given by name whose `.freeing` file exists instead (an earlier run
/// stopped part way), and in a directory every `*.jsonl.freeing`, are
/// resumed.
fn targets(paths: &[PathBuf], guid: u64) -> anyhow::Result<(Vec<Manifest>, Vec<Manifest>)> {
    let mut fresh_paths = Vec::new();
    let mut resumed = Vec::new();
    for p in paths {
        let freeing = freeing_path(p);
        if p.is_dir() {
            let mut fs: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && f.to_string_lossy().ends_with(".jsonl.freeing"))
                .collect();
            fs.sort();
            resumed.extend(fs);
            fresh_paths.push(p.clone());
        } else if !p.exists() && freeing.exists() {
            resumed.push(freeing);
        } else if p.to_string_lossy().ends_with(".freeing") {
            resumed.push(p.clone());
        } else {
            fresh_paths.push(p.clone());
        }
    }
    let fresh = crate::manifest::load_all(&fresh_paths, guid)?;
    let mut again = Vec::new();
    for f in resumed {
        let m = Manifest::load(&f)?;
        if m.header.pool_guid != guid {
            anyhow::bail!(
                "{} is of pool {:#x}, but the allocator serves pool {guid:#x}",
                f.display(),
                m.header.pool_guid
            );
        }
        again.push(m);
    }
    Ok((fresh, again))
}

fn freeing_path(p: &Path) -> PathBuf {
    PathBuf::from(format!("{}.freeing", p.display()))
}

pub async fn free(args: &FreeArgs) -> anyhow::Result<FreeReport> {
    let alloc = args.conn.connect().await?;
    if args.manifests.manifest.is_empty() && !args.all {
        return Err(crate::UsageError(format!(
            "free what? --manifest FILE (or a directory), or --all for every manifest in {}",
            crate::manifest::default_dir(&args.conn.tls.certs_dir).display()
        ))
        .into());
    }
    let f = Freer {
        alloc: alloc.clone(),
        agents: args.conn.agents()?,
        wait: args.conn.leader_wait.max(Duration::from_secs(5)),
        chunk: args.chunk.max(1) as usize,
        chunks_done: Default::default(),
    };
    let guid = f.pool().await?.guid;
    let paths = args.manifests.paths(&args.conn);
    let (fresh, resumed) = targets(&paths, guid)?;
    if fresh.is_empty() && resumed.is_empty() {
        anyhow::bail!(
            "no manifest in {}: nothing to free",
            crate::manifest::describe(&paths)
        );
    }
    if let Some(m) = fresh.iter().find(|m| !m.pending.is_empty()) {
        anyhow::bail!(
            "manifest {} has {} moves pending: `aliquotctl balancer execute --manifest {}` settles \
             them first (until then a block may be at either extent)",
            m.path().display(),
            m.pending.len(),
            m.path().display()
        );
    }
    let mut report = FreeReport::default();
    let mut work = Vec::new();
    for m in resumed {
        report.resumed.push(m.path().display().to_string());
        work.push(m);
    }
    for m in fresh {
        let path = m.path().to_path_buf();
        let freeing = freeing_path(&path);
        std::fs::rename(&path, &freeing)
            .map_err(|e| anyhow::anyhow!("rename {}: {e}", path.display()))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir).and_then(|d| d.sync_all())?;
        }
        work.push(Manifest::load(&freeing)?);
    }
    for mut m in work {
        let freeing = m.path().to_path_buf();
        let name = freeing
            .to_string_lossy()
            .trim_end_matches(".freeing")
            .to_string();
        let extents = m.extents();
        let (synced, skipped) = f.free_manifest(&mut m, &extents).await.map_err(|e| {
            e.context(format!(
                "free the blocks of {name} (now {}; part may be free: the same `aliquotctl \
                 free` run again resumes it, freeing nothing twice)",
                freeing.display()
            ))
        })?;
        std::fs::remove_file(&freeing)
            .map_err(|e| anyhow::anyhow!("remove {}: {e}", freeing.display()))?;
        report.manifests.push(name);
        report.blocks += m.blocks.len() as u64;
        report.extents += extents.len() as u64;
        report.bytes += extents.iter().map(|(_, c)| c.at.size).sum::<u64>();
        report.synced_txg = report.synced_txg.max(synced);
        report.already_free += skipped;
    }
    Ok(report)
}

/// What a Free came to.
enum Sent {
    /// Freed in `txg` of `generation`.
    Freed { txg: u64, generation: u64 },
    /// The answer was lost: it may have freed.
    Unknown,
}

/// What the sync of a Free's txg came to.
enum Synced {
    Yes(u64),
    /// The generation ended before that txg synced: the Free never happened.
    Lost,
    /// The generation ended and the allocator did not say how far it synced.
    Unknown,
}

struct Freer {
    alloc: Allocator,
    agents: Agents,
    /// How long an allocator that is away (a takeover) is waited for.
    wait: Duration,
    chunk: usize,
    /// Chunks freed so far (for the test-only crash point).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    chunks_done: std::sync::atomic::AtomicU64,
}

impl Freer {
    async fn pool(&self) -> anyhow::Result<aliquot_proto::v1::PoolStatus> {
        self.retrying(|mut c| async move { c.get_pool(GetPoolRequest {}).await })
            .await
            .map_err(|s| client::status_msg("get pool", &s))
    }

    /// Wait until the txg open now has synced, in whichever generation
    /// serves: every Free it accepted is then durable, and one a former
    /// generation accepted either synced there or was lost with it.
    async fn settle(&self) -> anyhow::Result<u64> {
        Ok(self
            .retrying(|mut c| async move { c.sync_txg(SyncTxgRequest::default()).await })
            .await
            .map_err(|s| client::status_msg("sync txg", &s))?
            .synced_txg)
    }

    /// Call `f` until it answers, repeating what the allocator refused
    /// as transient (a standby's NOT_LEADER, a takeover, RetryInfo) and a
    /// broken connection, for `self.wait`. For calls that change nothing
    /// (Free is not one).
    async fn retrying<T, F, Fut>(&self, f: F) -> Result<T, tonic::Status>
    where
        F: Fn(Allocator) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.wait;
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            match f(self.alloc.clone()).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if away(&s) && Instant::now() < deadline => {
                    let wait = retry_after(&s).unwrap_or_default();
                    tokio::time::sleep(wait.max(backoff.next_delay())).await;
                }
                Err(s) => return Err(s),
            }
        }
    }

    /// Free every extent of `m` not yet freed; (the last synced txg, how
    /// many were found free already).
    async fn free_manifest(
        &self,
        m: &mut Manifest,
        extents: &[(u64, Copy)],
    ) -> anyhow::Result<(u64, u64)> {
        let nonce = m.header.nonce;
        let mut synced = 0;
        let mut skipped = 0;
        // An earlier run's chunk whose Free may have taken effect.
        if m.free_sent > m.freed {
            let (from, to) = (m.freed as usize, (m.free_sent as usize).min(extents.len()));
            let (t, s) = self.free_chunk(&extents[from..to], nonce, false).await?;
            m.append(Record::Freed { to: to as u64 })?;
            (synced, skipped) = (t, s);
        }
        let mut at = m.freed as usize;
        while at < extents.len() {
            let to = (at + self.chunk).min(extents.len());
            m.append(Record::FreeSent { to: to as u64 })?;
            let (t, s) = self.free_chunk(&extents[at..to], nonce, true).await?;
            self.failpoint();
            m.append(Record::Freed { to: to as u64 })?;
            synced = synced.max(t);
            skipped += s;
            at = to;
        }
        if synced == 0 {
            synced = self.settle().await?;
        }
        Ok((synced, skipped))
    }

    /// Free one chunk until its txg synced. `certain`: every extent is
    /// still the manifest's (no Free of them was ever sent, or every one
    /// sent was refused or lost with its generation); otherwise each is
    /// looked at first. (The synced txg, how many were free already.)
    async fn free_chunk(
        &self,
        chunk: &[(u64, Copy)],
        nonce: u64,
        mut certain: bool,
    ) -> anyhow::Result<(u64, u64)> {
        let deadline = Instant::now() + self.wait;
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut todo: Vec<(u64, Copy)> = chunk.to_vec();
        let mut skipped = 0;
        loop {
            if !certain {
                // Frees of ours an allocator accepted are durable or lost
                // before the extents are looked at.
                self.settle().await?;
                let ours = self.still_ours(&todo, nonce).await?;
                skipped += (todo.len() - ours.len()) as u64;
                todo = ours;
                certain = true;
            }
            if todo.is_empty() {
                return Ok((0, skipped));
            }
            let (txg, generation) = match self.send_free(&todo, deadline).await? {
                Sent::Freed { txg, generation } => (txg, generation),
                Sent::Unknown => {
                    certain = false;
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            match self.sync(txg, generation, deadline).await? {
                Synced::Yes(t) => return Ok((t, skipped)),
                // Still all ours: send the same Free to the new generation.
                Synced::Lost => {}
                Synced::Unknown => certain = false,
            }
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "the allocator kept changing generation for {:?} (--leader-wait)",
                    self.wait
                );
            }
        }
    }

    /// One Free, repeated while refused as transient (it did nothing).
    async fn send_free(&self, todo: &[(u64, Copy)], deadline: Instant) -> anyhow::Result<Sent> {
        let extents: Vec<Extent> = todo.iter().map(|(_, c)| Extent::from(c.at)).collect();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            let req = FreeRequest {
                extents: extents.clone(),
            };
            match self.alloc.clone().free(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    return Ok(Sent::Freed {
                        txg: r.txg,
                        generation: r.generation,
                    });
                }
                // An answer without a reason: the call may have reached
                // the allocator and freed before the connection broke.
                Err(s) if reason(&s).is_none() && away(&s) && Instant::now() < deadline => {
                    return Ok(Sent::Unknown);
                }
                // Refused, with a reason: it freed nothing.
                Err(s) if away(&s) && Instant::now() < deadline => {
                    let wait = retry_after(&s).unwrap_or_default();
                    tokio::time::sleep(wait.max(backoff.next_delay())).await;
                }
                Err(s) => return Err(client::status_msg("free", &s)),
            }
        }
    }

    /// Wait for `txg` of `generation` to sync.
    async fn sync(&self, txg: u64, generation: u64, deadline: Instant) -> anyhow::Result<Synced> {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            match self
                .alloc
                .clone()
                .sync_txg(SyncTxgRequest { txg, generation })
                .await
            {
                Ok(r) => return Ok(Synced::Yes(r.into_inner().synced_txg)),
                // Another generation answers: how far the Free's synced.
                Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) => {
                    return Ok(
                        match metadata(&s)
                            .get("synced_txg")
                            .and_then(|t| t.parse::<u64>().ok())
                        {
                            Some(t) if t >= txg => Synced::Yes(t),
                            Some(_) => Synced::Lost,
                            None => Synced::Unknown,
                        },
                    );
                }
                Err(s) if away(&s) && Instant::now() < deadline => {
                    let wait = retry_after(&s).unwrap_or_default();
                    tokio::time::sleep(wait.max(backoff.next_delay())).await;
                }
                Err(s) => return Err(client::status_msg("sync the frees' txg", &s)),
            }
        }
    }

    /// The copies of `chunk` that are still the manifest's: exactly a
    /// committed extent of ours (the allocator grants a read token) that
    /// holds the block's pattern. Free space, a Free not yet synced, space
    /// given out again (another owner, other extents over it, or a new
    /// block's bytes in it) are not: freeing those would free someone
    /// else's block.
    async fn still_ours(
        &self,
        chunk: &[(u64, Copy)],
        nonce: u64,
    ) -> anyhow::Result<Vec<(u64, Copy)>> {
        let eps: BTreeMap<u32, String> = self
            .pool()
            .await?
            .vdevs
            .into_iter()
            .map(|v| (v.vdev, v.endpoint))
            .collect();
        let looks: Vec<anyhow::Result<Option<(u64, Copy)>>> = futures_util::stream::iter(chunk)
            .map(|&(b, c)| {
                let eps = &eps;
                async move { Ok(self.is_ours(b, c, nonce, eps).await?.then_some((b, c))) }
            })
            .buffered(16)
            .collect()
            .await;
        looks.into_iter().filter_map(Result::transpose).collect()
    }

    async fn is_ours(
        &self,
        block: u64,
        c: Copy,
        nonce: u64,
        eps: &BTreeMap<u32, String>,
    ) -> anyhow::Result<bool> {
        let e = Extent::from(c.at);
        let r = self
            .retrying(
                |mut a| async move { a.read_tokens(ReadTokensRequest { extents: vec![e] }).await },
            )
            .await;
        let r = match r {
            Ok(r) => r,
            // Not (or not only) a committed block of ours.
            Err(s)
                if matches!(
                    reason(&s),
                    Some(
                        ErrorReason::ReadTokenNotCommitted
                            | ErrorReason::ReadTokenNotExact
                            | ErrorReason::NotOwner
                    )
                ) =>
            {
                return Ok(false);
            }
            Err(s) => {
                return Err(client::status_msg(
                    &format!("read tokens for block {block} at {}", c.at),
                    &s,
                ));
            }
        };
        let at = r.locations.first().copied().unwrap_or(e);
        let ep = eps
            .get(&at.vdev)
            .ok_or_else(|| anyhow::anyhow!("vdev {} is not in the pool", at.vdev))?;
        let read = self
            .agents
            .get(ep)
            .await?
            .read(ReadRequest {
                offset: at.offset,
                size: c.len.min(at.size),
                token: r.tokens.first().cloned().unwrap_or_default(),
            })
            .await;
        match read {
            Ok(d) => {
                let d = d.into_inner().data;
                Ok(d.len() as u64 == c.len.min(at.size)
                    && crate::pattern::first_mismatch(&d, nonce, block).is_none())
            }
            // Written over by a newer allocation since the Free.
            Err(s) if reason(&s) == Some(ErrorReason::ReadTokenSuperseded) => Ok(false),
            Err(s) => Err(client::status_msg(
                &format!("read block {block} at {}", c.at),
                &s,
            )),
        }
    }
}

impl Freer {
    /// Test-only crash point (`ALIQUOT_FAILPOINT=free-after-synced:N`, with
    /// the `failpoints` feature): abort, as under kill -9, once the N-th
    /// chunk's Free synced and before it is journaled `freed`, leaving the
    /// `.freeing` file a rerun must resume without freeing that chunk twice.
    fn failpoint(&self) {
        #[cfg(feature = "failpoints")]
        {
            let n: Option<u64> = std::env::var("ALIQUOT_FAILPOINT")
                .ok()
                .and_then(|s| s.strip_prefix("free-after-synced:")?.parse().ok());
            let hits = self
                .chunks_done
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            if n == Some(hits) {
                eprintln!("failpoint: aborting after chunk {hits} synced");
                std::process::abort();
            }
        }
    }
}

/// The allocator is away or stands by: a takeover, a restart. A call the
/// connection broke under (the leader killed mid-call) fails UNKNOWN or
/// CANCELLED with no reason of Aliquot's (every refusal has one).
fn away(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
    ) || (reason(s).is_none() && matches!(s.code(), tonic::Code::Unknown | tonic::Code::Cancelled))
        || matches!(
            reason(s),
            Some(ErrorReason::NotLeader | ErrorReason::ShuttingDown)
        )
        || retry_after(s).is_some()
}

pub async fn run(args: FreeArgs) -> anyhow::Result<()> {
    let r = free(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let resumed = if r.resumed.is_empty() {
            String::new()
        } else {
            format!(
                " (resumed {} an earlier run began; {} extents were free already)",
                r.resumed.join(", "),
                r.already_free
            )
        };
        println!(
            "freed {} blocks ({} extents, {}) of {} manifests{resumed}; durable in txg {}, the \
             space is reusable after 2 more synced txgs; removed: {}",
            r.blocks,
            r.extents,
            short(r.bytes),
            r.manifests.len(),
            r.synced_txg,
            r.manifests.join(", ")
        );
    }
    Ok(())
}
