//! How allocations and commits reach the allocator: one unary RPC each, or
//! pipelined over an `AllocateStream` (requests matched to replies by id;
//! more blocks per second from one connection). A stream the allocator
//! ended (killed, restarted, a takeover) is opened again by the next call;
//! the calls in flight on it fail as UNAVAILABLE, which callers treat as
//! the allocator being away.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use aliquot_proto::v1::stream_reply::Result as StreamResult;
use aliquot_proto::v1::stream_request::Op;
use aliquot_proto::v1::{
    AbortRequest, AllocateReply, AllocateRequest, CommitReply, CommitRequest, StreamReply,
    StreamRequest, WrittenRequest,
};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::connect::Allocator;
use crate::error::{Error, Result};

/// Allocate/Written/Commit/Abort, unary or over a pipelined stream.
#[derive(Clone)]
pub enum Ops {
    /// One RPC per call (the trace context travels per call).
    Unary(Allocator),
    /// One AllocateStream, shared by every caller holding a clone.
    Stream(Arc<ReStream>),
}

impl Ops {
    /// Unary calls on `alloc`.
    pub fn unary(alloc: Allocator) -> Ops {
        Ops::Unary(alloc)
    }

    /// A stream on `alloc`, opened now (or by the first call, when the
    /// allocator is away at the start).
    pub async fn stream(alloc: Allocator) -> Ops {
        Ops::Stream(Arc::new(ReStream::open(alloc).await))
    }

    pub async fn allocate(&self, req: AllocateRequest) -> Result<AllocateReply, tonic::Status> {
        match self {
            Ops::Unary(c) => Ok(c.clone().allocate(req).await?.into_inner()),
            // A span of the block's own trace for its stream message: the
            // stream itself belongs to whoever opened it.
            Ops::Stream(s) => match s
                .call(Op::Allocate(req))
                .instrument(tracing::info_span!(
                    "aliquot.stream.allocate",
                    otel.kind = "client"
                ))
                .await?
            {
                StreamResult::Allocate(a) => Ok(a),
                _ => Err(wrong_kind()),
            },
        }
    }

    /// Commit `ids` of allocator generation `generation`.
    pub async fn commit(
        &self,
        ids: Vec<u64>,
        generation: u64,
        wait_synced: bool,
    ) -> Result<CommitReply, tonic::Status> {
        let req = CommitRequest {
            allocation_ids: ids,
            wait_synced,
            generation,
        };
        match self {
            Ops::Unary(c) => Ok(c.clone().commit(req).await?.into_inner()),
            Ops::Stream(s) => match s
                .call(Op::Commit(req))
                .instrument(tracing::info_span!(
                    "aliquot.stream.commit",
                    otel.kind = "client"
                ))
                .await?
            {
                StreamResult::Commit(r) => Ok(r),
                _ => Err(wrong_kind()),
            },
        }
    }

    /// Tell the allocator every copy of `ids` is written: their throttle
    /// reservation ends now, not at Commit.
    pub async fn written(&self, ids: Vec<u64>, generation: u64) -> Result<(), tonic::Status> {
        let req = WrittenRequest {
            allocation_ids: ids,
            generation,
        };
        match self {
            Ops::Unary(c) => c.clone().written(req).await.map(|_| ()),
            Ops::Stream(s) => s.call(Op::Written(req)).await.map(|_| ()),
        }
    }

    /// Give `ids` back now (best effort: what cannot be aborted expires
    /// with its lease). One id refused (committed, expired) refuses a whole
    /// request: then each is asked on its own.
    pub async fn abort(&self, ids: Vec<u64>) {
        let several = ids.len() > 1;
        if self.abort_these(ids.clone()).await.is_err() && several {
            for id in ids {
                let _ = self.abort_these(vec![id]).await;
            }
        }
    }

    async fn abort_these(&self, ids: Vec<u64>) -> Result<(), tonic::Status> {
        let req = AbortRequest {
            allocation_ids: ids,
        };
        match self {
            Ops::Unary(c) => c.clone().abort(req).await.map(|_| ()),
            Ops::Stream(s) => s.call(Op::Abort(req)).await.map(|_| ()),
        }
    }
}

fn wrong_kind() -> tonic::Status {
    tonic::Status::internal("allocate stream: reply of the wrong kind")
}

/// An AllocateStream that is opened again after the allocator went away.
pub struct ReStream {
    alloc: Allocator,
    cur: tokio::sync::Mutex<Arc<StreamOps>>,
}

impl ReStream {
    async fn open(alloc: Allocator) -> ReStream {
        // An allocator away at the start (restarting, or a takeover under
        // way) is waited for like one lost later: the first call reopens.
        let s = match StreamOps::open(alloc.clone()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "allocate stream: the allocator is away; calls wait for it");
                StreamOps::closed()
            }
        };
        ReStream {
            alloc,
            cur: tokio::sync::Mutex::new(Arc::new(s)),
        }
    }

    async fn call(&self, op: Op) -> Result<StreamResult, tonic::Status> {
        let s = {
            let mut g = self.cur.lock().await;
            if g.closed.load(Ordering::Relaxed) {
                let fresh = StreamOps::open(self.alloc.clone())
                    .await
                    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                *g = Arc::new(fresh);
            }
            g.clone()
        };
        s.call(op).await
    }
}

type Pending = Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<StreamReply>>>>;

struct StreamOps {
    tx: mpsc::Sender<StreamRequest>,
    pending: Pending,
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

    async fn open(mut c: Allocator) -> Result<StreamOps> {
        let (tx, rx) = mpsc::channel::<StreamRequest>(1024);
        let mut replies = c
            .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| Error::status("allocate stream", s))?
            .into_inner();
        let pending: Pending = Default::default();
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
            Some(StreamResult::Error(e)) => Err(aliquot_proto::error::from_stream_error(e)),
            Some(r) => Ok(r),
            None => Err(tonic::Status::internal("empty stream reply")),
        }
    }
}
