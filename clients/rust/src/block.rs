//! One block's way into the pool: Allocate (the allocator places its
//! copies and admits it through the class's throttle), write every copy to
//! its agent, Commit. A failed attempt is classified (write it again
//! elsewhere, wait for an allocator that is away, abandon an allocation a
//! hung agent may still write, or give up) and [`Writer::put`] repeats it
//! within the caller's budget. Committed blocks are handed to [`Claims`],
//! which claims them back if the allocator restarts before their txg syncs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aliquot_proto::v1::{
    AllocateReply, AllocateRequest, AllocationClass, CommitReply, Extent, WriteBatchRequest,
    WriteRequest,
};
use telemetry::backoff::Backoff;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::claims::{Claims, Committed};
use crate::connect::Agents;
use crate::data::{BlockData, DataWrite, DataWriter};
use crate::error::{Error, Result};
use crate::ops::Ops;
use crate::retry::{Retry, allocator_away, retry_block, retry_transient_seen, rewrite_elsewhere};

/// How blocks are written.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// DATA (throttled) or LOG (intent-log blocks, never throttled).
    pub class: AllocationClass,
    /// Copies of each block, each on a different vdev.
    pub copies: u32,
    /// Lease of each allocation (None: the allocator's).
    pub lease: Option<Duration>,
    /// Deadline of each agent write. A block whose write misses it is
    /// written again elsewhere (its allocation is left to the lease, not
    /// aborted: the late write may still land).
    pub timeout: Duration,
    /// Attempts per block (agent failures, expired leases, a vdev gone).
    pub attempts: u32,
    /// How long a block waits for an allocator that is away (restarting,
    /// a takeover, no vdev allocatable); not counted as attempts.
    pub allocator_wait: Duration,
    /// Agent writes per request: 1 sends a Write per copy; N > 1 gathers
    /// the copies queued for one agent into WriteBatch requests of up to N
    /// (for small blocks).
    pub agent_batch: u32,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            class: AllocationClass::Data,
            copies: 1,
            lease: None,
            timeout: Duration::from_secs(5),
            attempts: 5,
            allocator_wait: Duration::from_secs(60),
            agent_batch: 1,
        }
    }
}

/// A block in the pool: where its copies are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// The block's size (what was allocated; extents may be larger).
    pub len: u64,
    /// One extent per copy, each on its own vdev.
    pub extents: Vec<Extent>,
    /// The agent of each extent.
    pub endpoints: Vec<String>,
    /// The txg its commit joined, and the allocator generation of it.
    pub txg: u64,
    pub generation: u64,
    /// The allocation that placed it (a claim after an allocator restart
    /// names it: [`Block::claim_id`]).
    pub allocation_id: u64,
}

impl Block {
    /// The allocation id a claim of this block names after an allocator
    /// restart (0, checked by identity only, once the block was claimed
    /// into a later generation than its allocation's).
    pub fn claim_id(&self) -> u64 {
        crate::claims::claim_id(self.allocation_id, self.generation)
    }
}

/// What a load generator wants to know of each step (all optional).
pub trait Observe: Send {
    /// An Allocate answered after `took`.
    fn allocated(&mut self, _took: Duration, _reply: &AllocateReply) {}
    /// Every copy written, after `took`.
    fn wrote(&mut self, _took: Duration) {}
    /// The Commit answered after `took`.
    fn committed(&mut self, _took: Duration, _reply: &CommitReply) {}
    /// The block is written again (attempt failed: `why`).
    fn retried(&mut self, _why: &Error) {}
    /// An agent write missed its deadline.
    fn timed_out(&mut self) {}
}

/// Nothing observed.
impl Observe for () {}

/// Where [`Writer::put_then`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Then {
    Commit,
    Written,
}

/// How one attempt at a block failed.
#[derive(Debug)]
pub enum BlockError {
    /// Write it again with a new allocation.
    Retry(Error),
    /// The allocator is away: try again when it is back, without counting
    /// an attempt.
    Wait(Error),
    /// Write it again, but leave this allocation to its lease: a write that
    /// timed out may still land when the agent wakes, so its space must not
    /// be reusable before the allocator's lease expiry defers it.
    Abandon(Error),
    Fatal(Error),
}

impl BlockError {
    pub fn into_error(self) -> Error {
        match self {
            BlockError::Retry(e)
            | BlockError::Wait(e)
            | BlockError::Abandon(e)
            | BlockError::Fatal(e) => e,
        }
    }
}

impl From<Error> for BlockError {
    fn from(e: Error) -> Self {
        BlockError::Fatal(e)
    }
}

/// Writes blocks: shared by every task writing to one pool.
pub struct Writer {
    pub ops: Ops,
    pub agents: Agents,
    pub claims: Arc<Claims>,
    pub opts: WriteOptions,
    /// `agent_batch` > 1: each agent's batcher, started on first use
    /// (shared with writers made by [`Writer::with_ops`]).
    batchers: Arc<std::sync::Mutex<HashMap<String, Batcher>>>,
}

impl Writer {
    pub fn new(ops: Ops, agents: Agents, claims: Arc<Claims>, opts: WriteOptions) -> Writer {
        Writer {
            ops,
            agents,
            claims,
            opts,
            batchers: Default::default(),
        }
    }

    /// The same writer (agents, claims, options, agent batchers) over
    /// other allocator calls: e.g. one allocation stream per group of
    /// tasks, so no one HTTP/2 stream becomes the bottleneck.
    pub fn with_ops(&self, ops: Ops) -> Writer {
        Writer {
            ops,
            agents: self.agents.clone(),
            claims: self.claims.clone(),
            opts: self.opts.clone(),
            batchers: self.batchers.clone(),
        }
    }

    fn lease_ms(&self) -> u32 {
        self.opts
            .lease
            .map(|d| d.as_millis().clamp(1, u32::MAX as u128) as u32)
            .unwrap_or(0)
    }

    /// Write `data` as one committed block, repeating failed attempts
    /// (within `attempts`) and waiting for an allocator that is away
    /// (within `allocator_wait`). `affinity_key`: blocks of one object
    /// keep one allocator (OpenZFS's spa_select_allocator).
    pub async fn put<D: BlockData>(
        &self,
        data: &D,
        affinity_key: Option<u64>,
        obs: &mut impl Observe,
    ) -> Result<Block> {
        let (reply, c) = self.put_then(data, affinity_key, obs, Then::Commit).await?;
        Ok(Block {
            len: data.len(),
            extents: reply.extents,
            endpoints: reply.endpoints,
            txg: c.map_or(0, |c| c.txg),
            generation: reply.generation,
            allocation_id: reply.allocation_id,
        })
    }

    /// [`Writer::put`] up to `then`: committed, or written and reported
    /// so (its Commit left to the caller).
    pub(crate) async fn put_then<D: BlockData>(
        &self,
        data: &D,
        affinity_key: Option<u64>,
        obs: &mut impl Observe,
        then: Then,
    ) -> Result<(AllocateReply, Option<CommitReply>)> {
        let a = &self.opts;
        let mut attempt = 1;
        let mut waiting_since: Option<Instant> = None;
        // Separate schedules: waiting out an absent allocator does not
        // count as, nor lengthen the pause of, a write attempt. Its pause
        // stays short (≤ 250 ms): a handover takes well under a second, and
        // a 1 s cap left writers idle up to a second after the new leader
        // served (writers' longest gap after a step-down: 2.1 s).
        let mut wait_backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(250));
        let mut retry_backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
        loop {
            let r = async {
                let reply = self.allocate_and_write(data, affinity_key, obs).await?;
                let c = match then {
                    Then::Commit => Some(self.commit(&reply, obs).await?),
                    Then::Written => {
                        self.written(&reply).await?;
                        None
                    }
                };
                Ok::<_, BlockError>((reply, c))
            }
            .await;
            match r {
                Ok(r) => return Ok(r),
                Err(BlockError::Wait(why))
                    if waiting_since.get_or_insert_with(Instant::now).elapsed()
                        < a.allocator_wait =>
                {
                    let waited = waiting_since.map_or(Duration::ZERO, |t| t.elapsed());
                    if waited < Duration::from_millis(200) {
                        tracing::info!(%why, "waiting for the allocator");
                    }
                    self.claims.away();
                    tokio::time::sleep(wait_backoff.next_delay()).await;
                }
                Err(BlockError::Wait(e)) => {
                    return Err(Error::Connect(format!(
                        "the allocator did not place the block within --allocator-wait {:?}: {e}",
                        a.allocator_wait
                    )));
                }
                Err(BlockError::Retry(why)) | Err(BlockError::Abandon(why))
                    if attempt < a.attempts =>
                {
                    tracing::info!(attempt, %why, "writing the block again");
                    obs.retried(&why);
                    attempt += 1;
                    tokio::time::sleep(retry_backoff.next_delay()).await;
                }
                Err(e) => return Err(e.into_error()),
            }
        }
    }

    /// Tell the allocator every copy of `reply` is written: its throttle
    /// reservation ends now. Retry-safe (a repeat is a no-op). An
    /// allocation its generation's end or its lease took: write it again.
    pub async fn written(&self, reply: &AllocateReply) -> Result<(), BlockError> {
        let policy = Retry::within(self.opts.allocator_wait)
            .delays(Duration::from_millis(200), Duration::from_millis(1600));
        let r = retry_transient_seen(
            &policy,
            |_| self.claims.away(),
            || {
                self.ops
                    .written(vec![reply.allocation_id], reply.generation)
            },
        )
        .await;
        match r {
            Ok(()) => Ok(()),
            Err(s) => match self.refused("written", s) {
                e @ BlockError::Fatal(_) => {
                    self.abort(reply).await;
                    Err(e)
                }
                e => Err(e),
            },
        }
    }

    /// Give an allocation back now, unless its generation ended: an ended
    /// generation's ids may name another client's allocations in the new
    /// one (and its own ended with it).
    async fn abort(&self, reply: &AllocateReply) {
        if reply.generation == self.claims.generation() {
            self.ops.abort(vec![reply.allocation_id]).await;
        }
    }

    /// A Written or Commit refused for good (after the retries of
    /// transient failures): an allocation its generation's end or its
    /// lease took is written again (and an allocator restart looked for).
    fn refused(&self, what: &str, s: tonic::Status) -> BlockError {
        if aliquot_proto::error::reason(&s)
            == Some(aliquot_proto::v1::ErrorReason::AllocatorRestarted)
        {
            self.claims.away();
        }
        let again = retry_block(&s);
        let e = Error::status(what, s);
        if again {
            BlockError::Retry(e)
        } else {
            BlockError::Fatal(e)
        }
    }

    /// One attempt's first half: Allocate, then write every copy. On
    /// success the allocation is written and not committed (its lease
    /// runs); on failure it is aborted, or left to its lease when an agent
    /// may still write it late.
    pub async fn allocate_and_write<D: BlockData>(
        &self,
        data: &D,
        affinity_key: Option<u64>,
        obs: &mut impl Observe,
    ) -> Result<AllocateReply, BlockError> {
        let reply = self.allocate(data.len(), affinity_key, obs).await?;
        self.write(&reply, data, obs).await?;
        Ok(reply)
    }

    /// Allocate `size` bytes (`copies` extents) of the options' class.
    pub async fn allocate(
        &self,
        size: u64,
        affinity_key: Option<u64>,
        obs: &mut impl Observe,
    ) -> Result<AllocateReply, BlockError> {
        let t0 = Instant::now();
        let reply = self
            .ops
            .allocate(AllocateRequest {
                class: self.opts.class as i32,
                size,
                copies: self.opts.copies,
                lease_ms: self.lease_ms(),
                max_size: 0,
                affinity_key,
            })
            .await
            .map_err(|s| {
                let away = allocator_away(&s);
                let e = Error::status("allocate", s);
                // The allocator is away or restarting, or no vdev is
                // placeable right now: wait for it.
                if away {
                    BlockError::Wait(e)
                } else {
                    BlockError::Fatal(e)
                }
            })?;
        self.claims.saw_generation(reply.generation);
        obs.allocated(t0.elapsed(), &reply);
        tracing::Span::current().record("allocation", reply.allocation_id);
        if reply.extents.len() != reply.endpoints.len() || reply.extents.is_empty() {
            self.abort(&reply).await;
            return Err(BlockError::Fatal(Error::Protocol(format!(
                "allocate: the reply has {} extents but {} endpoints",
                reply.extents.len(),
                reply.endpoints.len()
            ))));
        }
        Ok(reply)
    }

    /// Write every copy of `data` to the extents of `reply`. On failure
    /// the allocation is aborted, or left to its lease when an agent may
    /// still write it late.
    pub async fn write<D: BlockData>(
        &self,
        reply: &AllocateReply,
        data: &D,
        obs: &mut impl Observe,
    ) -> Result<(), BlockError> {
        let t1 = Instant::now();
        let results = futures_util::future::join_all(
            reply
                .extents
                .iter()
                .zip(&reply.endpoints)
                .enumerate()
                .map(|(i, (e, ep))| {
                    let token = reply.tokens.get(i).cloned().unwrap_or_default();
                    self.write_copy(data, *e, ep, token)
                }),
        )
        .await;
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
                // Aborting would make the space reusable at once, and the
                // hung agent may still apply the write when it resumes (the
                // request may be in its socket buffers): another client's
                // block would be overwritten. The lease expiry defers the
                // space instead.
                obs.timed_out();
                return Err(e);
            }
            Some(e) => {
                // The agents answered (with an error): nothing is in
                // flight, give the space back now rather than at the lease.
                self.abort(reply).await;
                return Err(e);
            }
        }
        obs.wrote(t1.elapsed());
        Ok(())
    }

    /// Write one copy of `data` to extent `e` on the agent at `ep`.
    async fn write_copy<D: BlockData>(
        &self,
        data: &D,
        e: Extent,
        ep: &str,
        token: Vec<u8>,
    ) -> Result<(), BlockError> {
        let what = || format!("write to vdev {} at {}", e.vdev, e.offset);
        let deadline = self.opts.timeout;
        let w = DataWrite {
            offset: e.offset,
            len: e.size as usize,
            data: data.clone(),
            token,
        };
        let r = tokio::time::timeout(deadline, async {
            let sent = if self.opts.agent_batch > 1 {
                // Batched: the bytes are materialised (the batch is
                // encoded by prost, not by the data codec).
                self.batcher(ep)
                    .write(WriteRequest {
                        offset: w.offset,
                        data: w.data.to_bytes(w.len),
                        token: w.token,
                    })
                    .await
            } else {
                let ch = self.agents.channel(ep).await.map_err(|e| match e {
                    Error::Unresolvable(_) => BlockError::Fatal(e),
                    e => BlockError::Retry(e),
                })?;
                DataWriter::new(ch).write(w).await.map(|_| ())
            };
            sent.map_err(|s| {
                let again = rewrite_elsewhere(&s);
                let e = Error::status(what(), s);
                if again {
                    BlockError::Retry(e)
                } else {
                    BlockError::Fatal(e)
                }
            })
        })
        .await;
        match r {
            Ok(r) => r,
            // A hung agent: this block goes elsewhere.
            Err(_) => Err(BlockError::Abandon(Error::Timeout(what(), deadline))),
        }
    }

    /// Commit one written allocation. Commit is retry-safe (a repeat
    /// answers the first txg): an allocator away is waited for (within
    /// `allocator_wait`); once it is back in a new generation, the Commit
    /// answers ALLOCATOR_RESTARTED and the block is written again.
    pub async fn commit(
        &self,
        reply: &AllocateReply,
        obs: &mut impl Observe,
    ) -> Result<CommitReply, BlockError> {
        let t2 = Instant::now();
        let policy = Retry::within(self.opts.allocator_wait)
            .delays(Duration::from_millis(200), Duration::from_millis(1600));
        let r = retry_transient_seen(
            &policy,
            |_| self.claims.away(),
            || {
                self.ops
                    .commit(vec![reply.allocation_id], reply.generation, false)
            },
        )
        .await;
        let c = r.map_err(|s| self.refused("commit", s))?;
        obs.committed(t2.elapsed(), &c);
        tracing::Span::current().record("txg", c.txg);
        self.claims.committed(Committed {
            generation: reply.generation,
            txg: c.txg,
            extents: reply.extents.clone(),
            allocation_id: reply.allocation_id,
        });
        Ok(c)
    }

    /// The batcher of agent `ep`.
    fn batcher(&self, ep: &str) -> Batcher {
        let mut m = self.batchers.lock().expect("batchers lock");
        m.entry(ep.to_string())
            .or_insert_with(|| {
                Batcher::start(
                    self.agents.clone(),
                    ep.to_string(),
                    self.opts.agent_batch as usize,
                )
            })
            .clone()
    }
}

/// WriteBatch requests in flight per agent: while they are out, the next
/// batch fills.
const BATCHES_IN_FLIGHT: usize = 4;

type BatchItem = (WriteRequest, oneshot::Sender<Result<(), tonic::Status>>);

/// One agent's write batcher: tasks hand it their writes, a task sends
/// whatever is queued (up to N) as one WriteBatch, without waiting for
/// more (batches form while earlier ones are in flight). The agent refuses
/// a batch whole if any of its writes is refused; each block of a refused
/// batch is then handled as if its own write failed.
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
                                .write_batch(WriteBatchRequest { writes })
                                .await
                                .map(|_| ()),
                            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
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

    async fn write(&self, w: WriteRequest) -> Result<(), tonic::Status> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send((w, done))
            .await
            .map_err(|_| tonic::Status::unavailable("write batcher stopped"))?;
        wait.await
            .unwrap_or_else(|_| Err(tonic::Status::unavailable("write batcher stopped")))
    }
}
