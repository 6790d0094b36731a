//! What a client must do when its allocator changes generation (a restart,
//! or another allocator takes the pool over): the new generation knows only
//! what was synced, so every block this client committed in an older
//! generation whose txg had not synced must be claimed back, inside the new
//! generation's claim window (its Allocate waits meanwhile, so nobody can
//! be given that space first). [`Claims`] keeps those blocks until their
//! txg is known synced, notices the change, and claims.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aliquot_proto::error::reason;
use aliquot_proto::v1::{ClaimRequest, ErrorReason, Extent, GetPoolRequest, SyncTxgRequest};
use telemetry::backoff::Backoff;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use crate::connect::Allocator;
use crate::error::{Error, Result};
use crate::retry::{Retry, retry_transient, transient};

/// A block's commit: the generation and txg it joined, its extents, and
/// the allocation that gave them (0: unknown).
#[derive(Clone, Debug)]
pub struct Committed {
    pub generation: u64,
    pub txg: u64,
    pub extents: Vec<Extent>,
    pub allocation_id: u64,
}

/// How long one claim waits out retryable refusals (an agent yet to report
/// in the new generation: at most the claim window, 10 s by default).
const CLAIM_WAIT: Duration = Duration::from_secs(30);

/// Bit where an allocation id's generation starts (the allocator numbers
/// each generation's allocations from `generation << 40`).
const ALLOCATION_ID_GENERATION_SHIFT: u32 = 40;

impl Committed {
    /// The allocation id a claim of this block names: its allocation's,
    /// while the block is of that allocation's generation, else 0 (the
    /// rule every client follows, stated with `ClaimRequest.allocation_ids`
    /// in `allocator.proto`).
    pub fn claim_id(&self) -> u64 {
        claim_id(self.allocation_id, self.generation)
    }
}

/// The allocation id a claim names for a block of `allocation_id` last
/// committed (or claimed) in `generation`: see [`Committed::claim_id`].
pub fn claim_id(allocation_id: u64, generation: u64) -> u64 {
    if allocation_id >> ALLOCATION_ID_GENERATION_SHIFT == generation {
        allocation_id
    } else {
        0
    }
}

type OnGeneration = Box<dyn Fn(u64, u64) + Send + Sync>;

/// The blocks committed and not yet known synced, and the claims they need
/// after an allocator restart (see the module comment).
pub struct Claims {
    alloc: Allocator,
    /// How long to wait for an allocator that is away.
    wait: Duration,
    /// The allocator's generation in the last reply (0 before any).
    generation: AtomicU64,
    /// Blocks committed, by the generation that committed them, not yet
    /// re-asserted in a later one: if that generation ended before their
    /// txg synced, they must be claimed in the next one's claim window,
    /// before its Allocate may hand their space to anyone (this client's
    /// own next blocks included).
    committed: std::sync::Mutex<Vec<Committed>>,
    /// Poked when the allocator was away (an error reaching it, or
    /// ALLOCATOR_RESTARTED): the watcher then probes it until it answers,
    /// and claims at once (see `claim_if_restarted`).
    away: tokio::sync::Notify,
    /// One restart check at a time.
    check: tokio::sync::Mutex<()>,
    /// Extents a late claim could not re-assert (their space was given out).
    lost: std::sync::Mutex<Vec<Extent>>,
    /// Allocations written and not yet committed (a batch's), by id: their
    /// generation and extents. If that generation ends, they are claimed
    /// in the next one's window like committed blocks (their data is on
    /// the agents), and then are the next generation's.
    written: std::sync::Mutex<HashMap<u64, (u64, Vec<Extent>)>>,
    /// Written allocations claimed so: id → (generation, txg).
    claimed: std::sync::Mutex<HashMap<u64, (u64, u64)>>,
    /// Extents claimed back after a generation change, in all.
    claimed_extents: AtomicU64,
    on_generation: Option<OnGeneration>,
}

impl Claims {
    /// Claims on `alloc`, waiting up to `wait` for it when it is away.
    pub fn new(alloc: Allocator, wait: Duration) -> Claims {
        Claims {
            alloc,
            wait,
            generation: AtomicU64::new(0),
            committed: Default::default(),
            away: tokio::sync::Notify::new(),
            check: Default::default(),
            lost: Default::default(),
            written: Default::default(),
            claimed: Default::default(),
            claimed_extents: AtomicU64::new(0),
            on_generation: None,
        }
    }

    /// Call `f(old, new)` when the allocator's generation changes (a
    /// command may want to say so).
    pub fn on_generation_change(mut self, f: impl Fn(u64, u64) + Send + Sync + 'static) -> Self {
        self.on_generation = Some(Box::new(f));
        self
    }

    /// The allocator's generation in the last reply seen (0: none yet).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Remember the generation of a reply.
    pub fn saw_generation(&self, generation: u64) {
        if generation == 0 {
            return;
        }
        let old = self.generation.swap(generation, Ordering::Relaxed);
        if old != 0 && old != generation {
            tracing::warn!(from = old, to = generation, "allocator generation changed");
            if let Some(f) = &self.on_generation {
                f(old, generation);
            }
        }
    }

    /// A block committed: kept until its txg is known synced.
    pub fn committed(&self, c: Committed) {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(c);
    }

    /// Every txg up to `txg` of `generation` synced: its blocks need no
    /// claim any more.
    pub fn synced(&self, generation: u64, txg: u64) {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|c| c.generation != generation || c.txg > txg);
    }

    /// Allocation `id` of `generation` is written and waits for its
    /// Commit: claim it if its generation ends first.
    pub fn hold_written(&self, id: u64, generation: u64, extents: Vec<Extent>) {
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (generation, extents));
    }

    /// Written allocations committed, aborted, or given up.
    pub fn forget_written(&self, ids: &[u64]) {
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            w.remove(id);
        }
    }

    /// Whether written allocation `id` was claimed in a later generation
    /// (its commit then is that claim): that generation and txg.
    pub fn take_claimed(&self, id: u64) -> Option<(u64, u64)> {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
    }

    /// Every extent committed and not yet known synced, and the
    /// allocation id a claim of each names (`Committed::claim_id`).
    pub fn unsynced(&self) -> (Vec<Extent>, Vec<u64>) {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flat_map(|c| c.extents.iter().map(|e| (*e, c.claim_id())))
            .unzip()
    }

    /// Extents claimed back after allocator generation changes, in all
    /// (committed blocks and written allocations alike).
    pub fn claimed_extents(&self) -> u64 {
        self.claimed_extents.load(Ordering::Relaxed)
    }

    pub(crate) fn add_claimed(&self, n: u64) {
        self.claimed_extents.fetch_add(n, Ordering::Relaxed);
    }

    /// The allocator was away: the watcher looks for a restart.
    pub fn away(&self) {
        self.away.notify_one();
    }

    /// Extents that could not be claimed back (their blocks are lost).
    pub fn lost(&self) -> Vec<Extent> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Fails with [`Error::Lost`] if any block was lost to a restart.
    pub fn check_lost(&self) -> Result<()> {
        let lost = self.lost();
        if lost.is_empty() {
            Ok(())
        } else {
            Err(Error::Lost(lost))
        }
    }

    fn lose(&self, extents: impl Iterator<Item = Extent>) {
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(extents);
    }

    /// Start the restart watcher: each time the allocator was away, probe
    /// it (from 100 ms apart, backing off to at most 400 ms, for up to the
    /// wait) until it answers, and claim at once: GetPool is served during
    /// the claim window while Allocate waits, so the claims land before
    /// anyone can be given the space. The cap stays well inside the claim
    /// window (seconds) so a probe always falls within it. Stops when the
    /// returned handle is dropped.
    pub fn watch(self: &Arc<Self>) -> AbortOnDropHandle<()> {
        let me = self.clone();
        AbortOnDropHandle::new(tokio::spawn(
            async move {
                loop {
                    me.away.notified().await;
                    let since = Instant::now();
                    let mut backoff =
                        Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
                    while !me.claim_if_restarted().await && since.elapsed() < me.wait {
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
            .in_current_span(),
        ))
    }

    /// If the allocator came back in a new generation, re-assert every
    /// block committed in an older one. Inside the new generation's claim
    /// window (its Allocate waits meanwhile) that is a Claim of each (those
    /// that did sync claim as no-ops). After the window the space of an
    /// unsynced block may already be someone else's — even ours, in the
    /// very same shape, which a Claim would take for a no-op — so then the
    /// allocator is asked which of the older generation's txgs synced
    /// (SyncTxg names the last), and the blocks of later txgs are lost.
    /// False: the allocator did not answer.
    pub async fn claim_if_restarted(&self) -> bool {
        let _one = self.check.lock().await;
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
        let written: Vec<(u64, Vec<Extent>)> = {
            let mut g = self.written.lock().unwrap_or_else(|p| p.into_inner());
            let old: Vec<u64> = g
                .iter()
                .filter(|(_, (generation, _))| *generation != now)
                .map(|(id, _)| *id)
                .collect();
            old.into_iter()
                .filter_map(|id| g.remove(&id).map(|(_, e)| (id, e)))
                .collect()
        };
        if !written.is_empty() && st.claim_window_remaining_ms > 0 {
            self.claim_written(&mut c, written).await;
        }
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
                let ids: Vec<u64> = chunk
                    .iter()
                    .flat_map(|b| std::iter::repeat_n(b.claim_id(), b.extents.len()))
                    .collect();
                let n = extents.len();
                match claim_each(&mut c, extents, ids).await {
                    Ok(c) if c.refused.is_empty() => {
                        self.claimed_extents.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Ok(Claimed { refused, .. }) => {
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
                        aliquot_proto::error::metadata(&s)
                            .get("synced_txg")
                            .and_then(|t| t.parse().ok())
                            .unwrap_or(0)
                    }
                    Err(_) => {
                        retry.extend(blocks);
                        continue;
                    }
                };
                let lost: Vec<Committed> = blocks.into_iter().filter(|b| b.txg > synced).collect();
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

    /// Claim written allocations of an ended generation (inside the new
    /// one's window): each claimed whole is the new generation's, as if
    /// committed in the claim's txg; of the others (an extent refused, or
    /// no answer) what was claimed is freed, and their writer writes them
    /// again when its Commit is refused.
    async fn claim_written(&self, c: &mut Allocator, written: Vec<(u64, Vec<Extent>)>) {
        let extents: Vec<Extent> = written
            .iter()
            .flat_map(|(_, e)| e.iter().copied())
            .collect();
        let ids: Vec<u64> = written
            .iter()
            .flat_map(|(id, e)| std::iter::repeat_n(*id, e.len()))
            .collect();
        let r = match claim_each(c, extents, ids).await {
            Ok(r) => r,
            Err(s) => {
                tracing::warn!(error = %s, "claiming written allocations; they are written again");
                return;
            }
        };
        let refused: std::collections::HashSet<(u32, u64)> =
            r.refused.iter().map(|(e, _)| (e.vdev, e.offset)).collect();
        let n: usize = written.iter().map(|(_, e)| e.len()).sum();
        self.claimed_extents
            .fetch_add((n - refused.len()) as u64, Ordering::Relaxed);
        let mut give_back = Vec::new();
        for (id, extents) in written {
            if extents
                .iter()
                .all(|e| !refused.contains(&(e.vdev, e.offset)))
            {
                self.claimed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, (r.generation, r.txg));
                self.committed(Committed {
                    generation: r.generation,
                    txg: r.txg,
                    extents,
                    allocation_id: id,
                });
            } else {
                give_back.extend(
                    extents
                        .into_iter()
                        .filter(|e| !refused.contains(&(e.vdev, e.offset))),
                );
            }
        }
        if !give_back.is_empty() {
            let _ = c
                .free(aliquot_proto::v1::FreeRequest { extents: give_back })
                .await;
        }
    }

    /// Sync the txg holding everything committed so far. If the allocator
    /// restarted before that txg synced (ALLOCATOR_RESTARTED), claim every
    /// extent of `extents` (those that did sync are allocated exactly so
    /// and claim as no-ops) and sync again in the new generation. An
    /// outage is waited out for the claims' wait; restarts are counted
    /// apart, so that waiting does not use up the claims of the restart it
    /// ends in. Returns the synced txg.
    ///
    /// `allocation_ids`: the allocation id a claim of each extent names
    /// (`claim_id`), one per extent; the allocator refuses a claim whose
    /// allocation did not write the bytes last, so two writers sharing one
    /// identity cannot both claim one extent.
    pub async fn sync_or_claim(&self, extents: &[Extent], allocation_ids: &[u64]) -> Result<u64> {
        if extents.len() != allocation_ids.len() {
            return Err(Error::Protocol(format!(
                "sync_or_claim: {} extents but {} allocation ids",
                extents.len(),
                allocation_ids.len()
            )));
        }
        let mut c = self.alloc.clone();
        let mut restarts = 0;
        let policy =
            Retry::within(self.wait).delays(Duration::from_millis(250), Duration::from_secs(1));
        loop {
            let generation = self.generation();
            let r = retry_transient(&policy, || {
                let mut c = c.clone();
                async move { c.sync_txg(SyncTxgRequest { txg: 0, generation }).await }
            })
            .await;
            match r {
                Ok(r) => {
                    let txg = r.into_inner().synced_txg;
                    self.synced(generation, txg);
                    return Ok(txg);
                }
                Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) && restarts < 2 => {
                    restarts += 1;
                    tracing::warn!(
                        extents = extents.len(),
                        "allocator restarted before the txg synced: claiming what was written"
                    );
                    let mut new_gen = 0;
                    let mut lost: Vec<(Extent, String)> = Vec::new();
                    for (chunk, ids) in extents.chunks(1024).zip(allocation_ids.chunks(1024)) {
                        let r = claim_each(&mut c, chunk.to_vec(), ids.to_vec())
                            .await
                            .map_err(|s| Error::status("claim after an allocator restart", s))?;
                        lost.extend(r.refused);
                        new_gen = r.generation;
                    }
                    // Their space may be someone else's now: whoever
                    // records what was written must leave them out.
                    self.lose(lost.iter().map(|(e, _)| *e));
                    if let Some((e, why)) = lost.first() {
                        return Err(Error::Protocol(format!(
                            "claim after an allocator restart: {} extents were refused (their \
                             blocks are lost; the others were claimed); first: {}:{}+{} ({why})",
                            lost.len(),
                            e.vdev,
                            e.offset,
                            e.size,
                        )));
                    }
                    self.saw_generation(new_gen);
                }
                Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) => {
                    return Err(Error::status("sync txg: the allocator kept restarting", s));
                }
                Err(s) => return Err(Error::status("sync txg", s)),
            }
        }
    }
}

/// What a per-extent Claim answered.
pub struct Claimed {
    /// The extents refused, with why (their blocks may be another's now).
    pub refused: Vec<(Extent, String)>,
    /// The generation that answered, and the txg of what it claimed.
    pub generation: u64,
    pub txg: u64,
}

/// Claim `extents`, each answered on its own, each for the allocation
/// of the same index in `allocation_ids` (0 or none: unknown, checked by
/// identity only, which cannot tell apart writers sharing one identity).
pub async fn claim_each(
    c: &mut Allocator,
    extents: Vec<Extent>,
    allocation_ids: Vec<u64>,
) -> Result<Claimed, tonic::Status> {
    let req = ClaimRequest {
        extents,
        per_extent: true,
        allocation_ids,
    };
    // A claim is answered the same when repeated; the allocator asks for a
    // retry while a vdev's agent has yet to report its older writes.
    let r = retry_transient(&Retry::within(CLAIM_WAIT), || {
        let mut c = c.clone();
        let req = req.clone();
        async move { c.claim(req).await }
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
    Ok(Claimed {
        refused,
        generation: r.generation,
        txg: r.txg,
    })
}
