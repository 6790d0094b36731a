//! The Write fast path: a tower layer in front of the tonic
//! router that takes unary `/aliquot.v1.VdevAgent/Write` calls off the wire
//! itself. The body's HTTP/2 frames are collected as received, the
//! `WriteRequest` is parsed over them ([`parse`]) and the payload goes to the
//! I/O queue as slices of those frames, so the device write (`pwritev`) reads
//! the bytes where the socket read put them. tonic would first copy every
//! byte into its decode buffer (growing it by reallocation): that copy was a
//! fifth of the agent's CPU per MiB.
//!
//! Every check stays: the layer sits inside the role check, the write goes
//! through [`Agent::write_with_token`] (token, range, registration), and its
//! errors become a `Status` by the same `From<AgentError>` as the tonic
//! handler's. Whatever the parser does not take (compression, a message
//! over the size limit, a malformed one, request trailers, a body error) is
//! replayed to tonic frame by frame, so tonic gives its own answer.
//! `--no-fast-write` turns the layer into a pass-through.
//!
//! Memory is bounded: before a body is read past its
//! gRPC length prefix, the whole message's bytes are reserved from the
//! connection's budget (`aliquot_auth::listen::PeerInfo::budget`) and the
//! agent's (`--max-buffered`), all or nothing, so that streams waiting for
//! room hold none of it (their data waits in HTTP/2 flow control); the body
//! must arrive within `--body-timeout`, or the stream is reset and what it
//! held is freed. The reservation is held until the write is done. Calls
//! whose body tonic decodes itself (WriteBatch, a compressed Write, every
//! Write with `--no-fast-write`) are read here the same way first, then
//! replayed to tonic, so no body escapes the budgets.

pub mod parse;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use aliquot_proto::v1::WriteReply;
use http_body::{Body as HttpBody, Frame};
use prost::Message;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tower::Layer;
use tracing::Instrument;

use aliquot_auth::listen::Budget;
use tokio::sync::OwnedSemaphorePermit;

use crate::agent::Agent;
use crate::payload::Payload;

/// The one method the layer takes.
pub const WRITE_PATH: &str = "/aliquot.v1.VdevAgent/Write";

/// gRPC's message prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// What bounds the bodies the layer buffers.
#[derive(Clone, Debug)]
pub struct BodyLimits {
    /// Bytes of bodies buffered by the whole agent.
    pub total: Budget,
    /// From the request's start to its body's end.
    pub timeout: Duration,
}

#[derive(Clone)]
pub struct FastWriteLayer {
    /// None: pass everything through (`--no-fast-write`).
    agent: Option<Agent>,
    /// The tonic service's `max_decoding_message_size`: larger messages go
    /// to tonic, which refuses them.
    max_message: usize,
    limits: BodyLimits,
}

impl FastWriteLayer {
    pub fn new(agent: Agent, max_message: usize, limits: BodyLimits) -> FastWriteLayer {
        FastWriteLayer {
            agent: Some(agent),
            max_message,
            limits,
        }
    }

    pub fn disabled(limits: BodyLimits) -> FastWriteLayer {
        FastWriteLayer {
            agent: None,
            max_message: 0,
            limits,
        }
    }
}

impl<S> Layer<S> for FastWriteLayer {
    type Service = FastWrite<S>;
    fn layer(&self, inner: S) -> FastWrite<S> {
        FastWrite {
            inner,
            agent: self.agent.clone(),
            max_message: self.max_message,
            limits: self.limits.clone(),
        }
    }
}

#[derive(Clone)]
pub struct FastWrite<S> {
    inner: S,
    agent: Option<Agent>,
    max_message: usize,
    limits: BodyLimits,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<http::Request<Body>> for FastWrite<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // A Write the parser takes, or a body tonic will decode whole (a
        // WriteBatch, a compressed Write, any Write with --no-fast-write):
        // either way read under the budgets and the body timeout first.
        let agent = match &self.agent {
            Some(a) if takes(&req) => Some(a.clone()),
            _ if buffered(&req) => None,
            _ => return Box::pin(self.inner.call(req)),
        };
        // The ready service is used later, after the body is read: take it
        // and leave a clone for the next call (tower's rule).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limit = self.max_message.saturating_add(PREFIX);
        let budgets = Budgets {
            connection: req
                .extensions()
                .get::<aliquot_auth::listen::PeerInfo>()
                .map(|p| p.budget.clone()),
            total: self.limits.total.clone(),
        };
        let timeout = self.limits.timeout;
        Box::pin(async move {
            let (parts, mut body) = req.into_parts();
            let Ok(collected) =
                tokio::time::timeout(timeout, collect(&mut body, limit, &budgets)).await
            else {
                // Dropping the body resets the stream: the sender stops and
                // what was buffered is freed.
                tracing::warn!(
                    timeout_ms = timeout.as_millis() as u64,
                    "write body too slow; stream reset"
                );
                return Ok(Status::from(crate::error::AgentError::BodyTimeout(timeout)).into_http());
            };
            if let Some(agent) = agent
                && collected.is_whole()
                && let Some(w) = parse::parse(&collected.data)
            {
                let done = write(agent, w).await;
                drop(collected.held);
                return Ok(done);
            }
            // Held until tonic has decoded and served it.
            let mut collected = collected;
            let held = std::mem::take(&mut collected.held);
            let replay = collected.into_replay(body);
            let done = inner
                .call(http::Request::from_parts(parts, Body::new(replay)))
                .await;
            drop(held);
            done
        })
    }
}

/// A unary Write the parser may take: POST, gRPC protobuf, uncompressed
/// (no `grpc-encoding`: tonic decides what a compressed one gets).
fn takes(req: &http::Request<Body>) -> bool {
    req.uri().path() == WRITE_PATH
        && req.method() == http::Method::POST
        && !req.headers().contains_key("grpc-encoding")
        && matches!(
            req.headers()
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
            Some(b"application/grpc" | b"application/grpc+proto")
        )
}

/// Where a body's bytes are reserved: its connection's budget (absent for
/// a connection not accepted by `aliquot_auth::listen`) and the agent's.
struct Budgets {
    connection: Option<Budget>,
    total: Budget,
}

impl Budgets {
    /// `n` bytes from both, each all at once (waiting for room; the
    /// caller's timeout bounds the wait).
    async fn reserve(&self, n: usize) -> Vec<OwnedSemaphorePermit> {
        let mut held = Vec::with_capacity(2);
        for b in self.connection.iter().chain(std::iter::once(&self.total)) {
            held.extend(b.reserve(n).await);
        }
        held
    }
}

/// The agent's calls with large bodies that tonic decodes: read (and
/// bounded) here before tonic buffers them.
fn buffered(req: &http::Request<Body>) -> bool {
    matches!(
        req.uri().path(),
        WRITE_PATH | "/aliquot.v1.VdevAgent/WriteBatch"
    ) && req.method() == http::Method::POST
}

/// What was read of a request body.
struct Collected {
    /// Data frames in order.
    data: Vec<Bytes>,
    /// Why reading stopped before the end, if it did.
    stop: Option<Stop>,
    /// The bytes reserved for it, given back on drop.
    held: Vec<OwnedSemaphorePermit>,
}

enum Stop {
    /// More than one message's worth: the rest is still in the body.
    TooLarge,
    /// Request trailers (not sent by gRPC clients; tonic decides).
    Trailers(http::HeaderMap),
    /// The body failed (reset stream): tonic sees the same error.
    Failed(Status),
}

impl Collected {
    fn is_whole(&self) -> bool {
        self.stop.is_none()
    }

    /// The frames read so far, then whatever stopped the read, then the
    /// unread rest of `body`: the body tonic would have seen.
    fn into_replay(self, body: Body) -> Replay {
        let mut frames: VecDeque<Frame<Bytes>> = self.data.into_iter().map(Frame::data).collect();
        let mut error = None;
        let mut rest = None;
        match self.stop {
            None => {}
            Some(Stop::TooLarge) => rest = Some(body),
            Some(Stop::Trailers(t)) => {
                frames.push_back(Frame::trailers(t));
                rest = Some(body);
            }
            Some(Stop::Failed(e)) => error = Some(e),
        }
        Replay {
            frames,
            error,
            rest,
        }
    }
}

/// Read `body` to its end, or until more than `limit` bytes, trailers or an
/// error.
async fn collect(body: &mut Body, limit: usize, budgets: &Budgets) -> Collected {
    let mut data: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    let mut held = Vec::new();
    let mut reserved = false;
    loop {
        if !reserved && len >= PREFIX {
            // The message's length is known: reserve it (bounded by the
            // limit: a larger one goes to tonic, which refuses it).
            held = budgets
                .reserve(message_len(&data).min(limit) + PREFIX)
                .await;
            reserved = true;
        }
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
        let stop = match frame {
            None => None,
            Some(Err(e)) => Some(Stop::Failed(e)),
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => {
                    len += d.len();
                    data.push(d);
                    if len > limit {
                        Some(Stop::TooLarge)
                    } else {
                        continue;
                    }
                }
                Err(f) => match f.into_trailers() {
                    Ok(t) => Some(Stop::Trailers(t)),
                    // An unknown frame kind: skipped, as tonic's decoder does.
                    Err(_) => continue,
                },
            },
        };
        return Collected { data, stop, held };
    }
}

/// The gRPC message length from the first `PREFIX` bytes of `frames`.
fn message_len(frames: &[Bytes]) -> usize {
    let mut prefix = [0u8; PREFIX];
    for (n, b) in frames
        .iter()
        .flat_map(|f| f.iter())
        .take(PREFIX)
        .enumerate()
    {
        prefix[n] = *b;
    }
    u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize
}

/// The write itself, with the same span and reply as the tonic handler.
async fn write(agent: Agent, w: parse::ParsedWrite) -> http::Response<Body> {
    let bytes = w.data_len() as u64;
    let span = tracing::info_span!(
        "write",
        vdev = agent.vdev(),
        offset = w.offset,
        len = bytes,
        aggregated_ios = tracing::field::Empty,
    );
    async move {
        agent.count_fast_write();
        let payload = Payload::from_parts(w.data);
        match agent.write_with_token(&w.token, w.offset, payload).await {
            Ok(aggregated_ios) => {
                tracing::Span::current().record("aggregated_ios", aggregated_ios);
                reply(&WriteReply {
                    bytes,
                    aggregated_ios,
                })
            }
            Err(e) => Status::from(e).into_http(),
        }
    }
    .instrument(span)
    .await
}

/// A unary gRPC reply: one uncompressed message, then `grpc-status: 0`.
fn reply(msg: &WriteReply) -> http::Response<Body> {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(PREFIX + len);
    buf.push(0);
    buf.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(&mut buf)
        .expect("a Vec grows to hold any message");
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let mut resp = http::Response::new(Body::new(Replay::frames([
        Frame::data(Bytes::from(buf)),
        Frame::trailers(trailers),
    ])));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// A body of frames known in advance, then an error, then the rest of
/// another body (each part optional): a request given back to tonic (the
/// frames already read, the error that stopped the read, the unread rest)
/// and the fast path's reply (one message, then the trailers).
struct Replay {
    frames: VecDeque<Frame<Bytes>>,
    error: Option<Status>,
    rest: Option<Body>,
}

impl Replay {
    fn frames(frames: impl IntoIterator<Item = Frame<Bytes>>) -> Replay {
        Replay {
            frames: frames.into_iter().collect(),
            error: None,
            rest: None,
        }
    }
}

impl HttpBody for Replay {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if let Some(f) = this.frames.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        if let Some(e) = this.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match &mut this.rest {
            Some(b) => Pin::new(b).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(HttpBody::is_end_stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn drain(mut b: Body) -> (Vec<u8>, Option<http::HeaderMap>, Option<Status>) {
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut b).poll_frame(cx)).await {
            match f {
                Ok(f) => match f.into_data() {
                    Ok(d) => data.extend_from_slice(&d),
                    Err(f) => trailers = f.into_trailers().ok(),
                },
                Err(e) => return (data, trailers, Some(e)),
            }
        }
        (data, trailers, None)
    }

    #[tokio::test]
    async fn a_replay_gives_back_every_byte_then_the_rest() {
        let rest = Body::new(Replay::frames([Frame::data(Bytes::from_static(b"tail"))]));
        let c = Collected {
            data: vec![Bytes::from_static(b"he"), Bytes::from_static(b"llo ")],
            stop: Some(Stop::TooLarge),
            held: Vec::new(),
        };
        let (data, _, err) = drain(Body::new(c.into_replay(rest))).await;
        assert_eq!(data, b"hello tail");
        assert!(err.is_none());
    }

    #[tokio::test]
    async fn a_replay_repeats_the_error_after_the_data() {
        let c = Collected {
            data: vec![Bytes::from_static(b"abc")],
            stop: Some(Stop::Failed(Status::cancelled("reset"))),
            held: Vec::new(),
        };
        let (data, _, err) = drain(Body::new(c.into_replay(Body::empty()))).await;
        assert_eq!(data, b"abc");
        assert_eq!(err.unwrap().code(), tonic::Code::Cancelled);
    }

    #[tokio::test]
    async fn collect_stops_past_the_limit_and_keeps_the_rest() {
        let mut body = Body::new(Replay::frames([
            Frame::data(Bytes::from(vec![7u8; 100])),
            Frame::trailers(http::HeaderMap::new()),
        ]));
        let budgets = Budgets {
            connection: None,
            total: Budget::new(1 << 20),
        };
        let c = collect(&mut body, 10, &budgets).await;
        assert!(matches!(c.stop, Some(Stop::TooLarge)));
        let (data, trailers, _) = drain(Body::new(c.into_replay(body))).await;
        assert_eq!(data.len(), 100);
        assert!(trailers.is_some());
    }

    #[tokio::test]
    async fn the_reply_is_one_framed_message_and_status_ok() {
        let msg = WriteReply {
            bytes: 4096,
            aggregated_ios: 3,
        };
        let resp = reply(&msg);
        assert_eq!(
            resp.headers()[http::header::CONTENT_TYPE],
            "application/grpc"
        );
        let (data, trailers, _) = drain(resp.into_body()).await;
        assert_eq!(data[0], 0);
        let len = u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize;
        assert_eq!(len, data.len() - 5);
        assert_eq!(WriteReply::decode(&data[5..]).unwrap(), msg);
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }
}
