//! # aliquot-client
//!
//! The client side of an Aliquot pool's protocol, in one place: a [`Pool`]
//! handle allocates space from the allocator (which places each block's
//! copies by OpenZFS's metaslab policy and admits it through the class's
//! throttle), writes the data straight to the agents that own the vdevs,
//! and commits. It follows the leader across a takeover (`NOT_LEADER`, an
//! unreachable allocator), claims back what it committed when the
//! allocator restarts before the txg synced (`ALLOCATOR_RESTARTED`), renews
//! the leases of blocks waiting for their commit, and repeats calls only
//! for the reasons the proto marks retryable ([`retry_transient`]).
//!
//! ```no_run
//! use aliquot_client::{Config, Pool};
//! use aliquot_client::bytes::Bytes;
//! # async fn demo() -> aliquot_client::Result<()> {
//! // A pool `aliquotctl up` started here (its certificates in
//! // aliquot-data/certs).
//! let tls = aliquot_client::tls_from_certs_dir("aliquot-data/certs")?;
//! let pool = Pool::connect(Config::new("https://127.0.0.1:7000", tls)).await?;
//! let block = pool.put(&Bytes::from_static(b"hello, pool")).await?;
//! pool.sync().await?; // durable: agents flushed, its txg synced
//! assert_eq!(&pool.read(&block).await?[..], b"hello, pool");
//! pool.free(&[block]).await?;
//! # Ok(()) }
//! ```
//!
//! Many blocks: [`Pool::put_batch`] pipelines them under the throttle, at
//! most [`Config::in_flight`] between their Allocate and the end of their
//! writes; each reports itself written (`Written`) as soon as its copies
//! are on their agents, which ends its throttle reservation then, so a
//! batch larger than the class's throttle limit never waits on its own
//! reservations. The batch then commits together (one txg). A batch that
//! fails gives back everything it placed.
//!
//! Tracing: every call is made inside the caller's span, and the trace
//! context travels with it (per message on the allocation stream), so the
//! allocator's and the agents' spans for a block join the block's trace.

pub mod batch;
pub mod block;
pub mod claims;
pub mod connect;
pub mod data;
pub mod error;
pub mod leader;
pub mod leases;
pub mod ops;
pub mod read;
pub mod retry;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

pub use aliquot_auth::ClientTls;
pub use aliquot_proto::v1::{AllocationClass, Extent};
pub use block::{Block, BlockError, Observe, WriteOptions, Writer};
pub use claims::Claims;
pub use connect::{Agent, Agents, Allocator};
pub use data::BlockData;
pub use error::{Error, Result};
pub use leases::Leases;
pub use ops::Ops;
pub use prost::bytes;
pub use retry::{Retry, retry_transient, transient};

use aliquot_proto::v1::{FlushRequest, FreeRequest};
use prost::bytes::Bytes;
use tokio_util::task::AbortOnDropHandle;

/// Blocks a batch keeps between Allocate and the end of their writes, by
/// default.
pub const IN_FLIGHT: usize = 16;

/// How a [`Pool`] connects and writes.
#[derive(Clone, Debug)]
pub struct Config {
    /// The allocator's gRPC endpoint, or several separated by commas
    /// (allocators sharing a PostgreSQL store: calls go to the one that
    /// leads).
    pub allocator: String,
    /// Mutual TLS with the pool's certificates, or plaintext.
    pub tls: ClientTls,
    /// Reach every agent at this host instead of the one it advertises.
    pub agent_host: Option<String>,
    /// With several allocators, how long to wait for one to lead.
    pub leader_wait: Duration,
    /// Allocations and commits over one pipelined stream (true) or one
    /// unary call each.
    pub stream: bool,
    /// How each block is written.
    pub write: WriteOptions,
    /// Blocks of a batch between Allocate and the end of their writes.
    pub in_flight: usize,
}

impl Config {
    /// The defaults, for the allocator(s) at `allocator`.
    pub fn new(allocator: impl Into<String>, tls: ClientTls) -> Config {
        Config {
            allocator: allocator.into(),
            tls,
            agent_host: None,
            leader_wait: Duration::from_secs(30),
            stream: true,
            write: WriteOptions::default(),
            in_flight: IN_FLIGHT,
        }
    }
}

/// Mutual TLS with the certificates `aliquotctl up` (or `aliquotctl certs`)
/// wrote in `dir`: its CA and the operator's certificate.
pub fn tls_from_certs_dir(dir: impl Into<std::path::PathBuf>) -> Result<ClientTls> {
    Ok(aliquot_auth::ClientTlsArgs {
        certs_dir: dir.into(),
        ..Default::default()
    }
    .resolve()?)
}

/// A connected pool (see the crate's documentation). Cheap to share behind
/// an `Arc`; every method takes `&self`.
pub struct Pool {
    alloc: Allocator,
    writer: Arc<Writer>,
    leases: Leases,
    in_flight: usize,
    _watch: AbortOnDropHandle<()>,
}

impl Pool {
    /// Connect to the allocator (waiting for a leader among several) and
    /// open the allocation stream; agents are connected on first use.
    pub async fn connect(cfg: Config) -> Result<Pool> {
        let alloc = connect::allocator(&cfg.tls, &cfg.allocator, cfg.leader_wait).await?;
        let agents = Agents::new(cfg.tls.clone(), cfg.agent_host.clone());
        let ops = if cfg.stream {
            Ops::stream(alloc.clone()).await
        } else {
            Ops::unary(alloc.clone())
        };
        let claims = Arc::new(Claims::new(alloc.clone(), cfg.write.allocator_wait));
        let watch = claims.watch();
        Ok(Pool {
            leases: Leases::start(alloc.clone()),
            writer: Arc::new(Writer::new(ops, agents, claims, cfg.write)),
            alloc,
            in_flight: cfg.in_flight.max(1),
            _watch: watch,
        })
    }

    /// The allocator's client (calls go to the leader).
    pub fn allocator(&self) -> &Allocator {
        &self.alloc
    }

    /// The agents' clients.
    pub fn agents(&self) -> &Agents {
        &self.writer.agents
    }

    /// The block writer, for callers that drive each step themselves.
    pub fn writer(&self) -> &Arc<Writer> {
        &self.writer
    }

    /// Allocate a block of `size` bytes (one attempt; an allocator away
    /// is an error here, [`Pool::put`] waits for it).
    pub async fn allocate(&self, size: u64) -> Result<aliquot_proto::v1::AllocateReply> {
        self.writer
            .allocate(size, None, &mut ())
            .await
            .map_err(BlockError::into_error)
    }

    /// Write `data` to every extent of `allocation` (aborted on failure).
    pub async fn write<D: BlockData>(
        &self,
        allocation: &aliquot_proto::v1::AllocateReply,
        data: &D,
    ) -> Result<()> {
        self.writer
            .write(allocation, data, &mut ())
            .await
            .map_err(BlockError::into_error)
    }

    /// Commit a written allocation: the block is the pool's from its txg.
    pub async fn commit(&self, allocation: &aliquot_proto::v1::AllocateReply) -> Result<Block> {
        let c = self
            .writer
            .commit(allocation, &mut ())
            .await
            .map_err(BlockError::into_error)?;
        Ok(Block {
            len: allocation.psize,
            extents: allocation.extents.clone(),
            endpoints: allocation.endpoints.clone(),
            txg: c.txg,
            generation: allocation.generation,
            allocation_id: allocation.allocation_id,
        })
    }

    /// Give an allocation back before its commit (not one of a generation
    /// that ended: its id may name another client's allocation now).
    pub async fn abort(&self, allocation: &aliquot_proto::v1::AllocateReply) {
        if allocation.generation == self.writer.claims.generation() {
            self.writer.ops.abort(vec![allocation.allocation_id]).await
        }
    }

    /// Allocate, write and commit `data` as one block, repeating failed
    /// attempts and waiting for an allocator that is away.
    pub async fn put<D: BlockData>(&self, data: &D) -> Result<Block> {
        self.writer.put(data, None, &mut ()).await
    }

    /// Read a block back (its first copy that answers), exactly its
    /// length.
    pub async fn read(&self, block: &Block) -> Result<Bytes> {
        let grants = read::read_grants(&self.alloc, block.extents.iter().copied()).await?;
        let mut endpoints = None;
        let mut last = None;
        for (e, ep) in block.extents.iter().zip(&block.endpoints) {
            let g = grants.get(&(e.vdev, e.offset));
            let (at, token) = g.map_or((*e, Vec::new()), |g| (g.location, g.token.clone()));
            // A block the allocator moved keeping its address: read its
            // new extent from that vdev's agent.
            let ep = if at != *e {
                if endpoints.is_none() {
                    endpoints = Some(read::endpoints(&self.alloc).await?);
                }
                endpoints
                    .as_ref()
                    .and_then(|m| m.get(&at.vdev))
                    .cloned()
                    .unwrap_or_else(|| ep.clone())
            } else {
                ep.clone()
            };
            let deadline = self.writer.opts.timeout.max(Duration::from_secs(30));
            match read::read_extent(&self.alloc, self.agents(), &ep, at, token, deadline).await {
                Ok(mut data) => {
                    data.truncate(block.len as usize);
                    return Ok(data);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Protocol("a block without extents".into())))
    }

    /// Free blocks (their space is reusable once two more txgs synced).
    pub async fn free(&self, blocks: &[Block]) -> Result<()> {
        let extents: Vec<Extent> = blocks.iter().flat_map(|b| b.extents.clone()).collect();
        for chunk in extents.chunks(1024) {
            retry_transient(&Retry::within(self.writer.opts.allocator_wait), || {
                let mut c = self.alloc.clone();
                let extents = chunk.to_vec();
                async move { c.free(FreeRequest { extents }).await }
            })
            .await
            .map_err(|s| Error::status("free", s))?;
        }
        Ok(())
    }

    /// Make everything written so far durable: flush every agent written
    /// to, then wait for the txg of the last commit to sync (claiming back
    /// what an allocator restart lost meanwhile). Returns the synced txg.
    pub async fn sync(&self) -> Result<u64> {
        flush_agents(
            self.agents(),
            self.agents().endpoints(),
            self.writer.opts.timeout,
        )
        .await?;
        // A restart seen only now: claim before the sync.
        self.writer.claims.claim_if_restarted().await;
        self.writer.claims.check_lost()?;
        let (extents, ids) = self.writer.claims.unsynced();
        let txg = self.writer.claims.sync_or_claim(&extents, &ids).await?;
        self.writer.claims.check_lost()?;
        Ok(txg)
    }
}

/// Flush the agents at `endpoints` (each within `timeout`, at least 30 s):
/// what they acknowledged is on stable storage.
pub async fn flush_agents(
    agents: &Agents,
    endpoints: impl IntoIterator<Item = String>,
    timeout: Duration,
) -> Result<()> {
    let eps: BTreeSet<String> = endpoints.into_iter().collect();
    let deadline = timeout.max(Duration::from_secs(30));
    let flushes = eps.into_iter().map(|ep| async move {
        let mut c = agents.get(&ep).await?;
        tokio::time::timeout(deadline, c.flush(FlushRequest {}))
            .await
            .map_err(|_| Error::Timeout(format!("flush {ep}"), deadline))?
            .map_err(|s| Error::status(format!("flush {ep}"), s))?;
        Ok::<(), Error>(())
    });
    for r in futures_util::future::join_all(flushes).await {
        r?;
    }
    Ok(())
}
