//! gRPC clients for the allocator and the agents, all made by one connect
//! helper ([`channel`]): mutual TLS with the pool certificates (flags
//! `--ca/--cert/--key`, or the `--certs-dir` that `aliquotctl up` wrote),
//! plaintext only with `--insecure`. Every client carries
//! `telemetry::TraceInjector`, so a span opened here (e.g. `aliquotctl.write`)
//! is the parent of the allocator's and the agents' server spans.
//!
//! `Agents::write_pattern` is `VdevAgent.Write` with its own encoder: the
//! same `WriteRequest` on the wire, but the block's pattern is generated
//! straight into the request's encode buffer instead of into a buffer of its
//! own that prost then copies (a memory pass less per byte, on the client's
//! critical path).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use aliquot_auth::{ClientTls, ClientTlsArgs, Role};

use aliquot_proto::v1::WriteReply;
use aliquot_proto::v1::allocator_client::AllocatorClient;
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint};
use telemetry::{TraceInjector, TracedChannel};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

/// Largest message either side may send: a 16 MiB block plus framing.
pub const MAX_MESSAGE: usize = 17 * 1024 * 1024;

/// Where the allocator is and how to reach it: shared by every command
/// that talks to a pool.
#[derive(Clone, Debug, clap::Args)]
pub struct AllocatorArgs {
    /// The allocator's gRPC endpoint (the scheme follows the TLS mode:
    /// https with certificates, http with --insecure), or several separated
    /// by commas (allocators sharing a PostgreSQL store: calls go to the one
    /// that leads, following NOT_LEADER). Global: it may follow a
    /// subcommand (`vdev offline file0 --allocator URL`).
    #[arg(
        long,
        global = true,
        env = "ALIQUOT_ALLOCATOR",
        default_value = "http://127.0.0.1:7000"
    )]
    pub allocator: String,
    /// With several allocators, how long to wait for one to lead (a
    /// takeover under way) before the command fails.
    #[arg(long, global = true, env = "ALIQUOT_LEADER_WAIT", value_parser = units::duration_arg, default_value = "30s")]
    pub leader_wait: Duration,
    /// Reach every agent at this host (keeping the port it advertises):
    /// for a compose stack from the host, whose agents advertise names only
    /// the compose network resolves (`--agent-host 127.0.0.1`). Global,
    /// as --allocator: it may follow a subcommand (`balancer execute
    /// --agent-host 127.0.0.1`), where the errors that ask for it are.
    #[arg(long, global = true, env = "ALIQUOT_AGENT_HOST")]
    pub agent_host: Option<String>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

impl AllocatorArgs {
    /// Connect to the allocator with these flags' certificates.
    pub async fn connect(&self) -> anyhow::Result<Allocator> {
        allocator_waiting(&self.tls.resolve()?, &self.allocator, self.leader_wait).await
    }

    /// The agents, reached as these flags say.
    pub fn agents(&self) -> anyhow::Result<Agents> {
        let mut a = Agents::new(self.tls.resolve()?);
        a.host = self.agent_host.clone();
        Ok(a)
    }
}

/// `url` with its host replaced by `host` (scheme and port kept).
fn with_host(url: &str, host: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let port = rest
        .trim_end_matches('/')
        .rsplit_once(':')
        .map(|(_, p)| p)
        .unwrap_or("");
    if port.is_empty() {
        format!("{scheme}://{host}")
    } else {
        format!("{scheme}://{host}:{port}")
    }
}

pub type Allocator = AllocatorClient<
    tonic::service::interceptor::InterceptedService<crate::leader::LeaderChannel, TraceInjector>,
>;
pub type Agent = VdevAgentClient<TracedChannel>;

fn endpoint(tls: &ClientTls, url: &str, server: Role) -> anyhow::Result<Endpoint> {
    Ok(tls
        .endpoint(url, server)?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_adaptive_window(true)
        // A stopped server (SIGSTOP, a partition) keeps the TCP session:
        // unanswered pings end it within 3 s, and the call fails over to
        // another allocator instead of hanging.
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true))
}

/// The one connect helper: to a server of role `server` at `url`, now
/// (fails fast with an operator-readable message).
pub async fn channel(tls: &ClientTls, url: &str, server: Role) -> anyhow::Result<Channel> {
    let url = tls.url(url);
    if !tls.is_tls() && speaks_tls(&url).await {
        anyhow::bail!(
            "{url} speaks TLS and this client plaintext (--insecure): drop --insecure and give \
             the pool's certificates (--certs-dir, as `aliquotctl up` printed, or \
             --ca/--cert/--key)"
        );
    }
    endpoint(tls, &url, server)?.connect().await.map_err(|e| {
        let chain = error_chain(&e);
        // rustls reading a plaintext HTTP/2 answer where a TLS record
        // should be: the server is plaintext.
        if tls.is_tls() && chain.contains("InvalidContentType") {
            return anyhow::anyhow!(
                "cannot reach {url}: it speaks plaintext, not TLS (a pool started with \
                 --insecure): add --insecure"
            );
        }
        // rustls: the server's chain does not lead to our CA. The server
        // is up and speaks TLS: it is another pool's, or ours is not the
        // certificate directory it was made with.
        if let ClientTls::Mutual(files) = tls
            && chain.contains("UnknownIssuer")
        {
            return anyhow::anyhow!(
                "cannot reach {url}: the server's certificate is not signed by {}: another \
                 pool? give --certs-dir (the directory `aliquotctl up` printed for that pool)",
                files.ca.display()
            );
        }
        let hint = if tls.is_tls() {
            "is the pool up, and with TLS? a pool started with --insecure needs --insecure here"
        } else {
            "is the pool up? a pool started without --insecure needs its certificates, not --insecure"
        };
        anyhow::anyhow!("cannot reach {url}: {} ({hint})", error_chain(&e))
    })
}

/// Whether the server at `url` answers an HTTP/2 preface with a TLS record
/// (a TLS server's alert, content type 0x15): a plaintext client would
/// otherwise see "h2 protocol error" or "operation was canceled" on its
/// first call, depending on timing. Anything else (an h2 SETTINGS frame, no
/// answer, a refused connection) is left to the real connection.
async fn speaks_tls(url: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let hostport = url
        .split_once("://")
        .map_or(url, |(_, r)| r)
        .trim_end_matches('/');
    let t = Duration::from_secs(2);
    let Ok(Ok(mut s)) = tokio::time::timeout(t, tokio::net::TcpStream::connect(hostport)).await
    else {
        return false;
    };
    // The client preface and an empty SETTINGS frame.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    if s.write_all(&hello).await.is_err() {
        return false;
    }
    let mut first = [0u8; 2];
    matches!(
        tokio::time::timeout(t, s.read_exact(&mut first)).await,
        Ok(Ok(_)) if first == [0x15, 0x03]
    )
}

/// An agent whose advertised host does not resolve here: retrying cannot
/// help (a compose stack's agents advertise names only its network knows).
#[derive(Debug, thiserror::Error)]
#[error(
    "agent {url} advertises host {host:?}, which does not resolve here: from outside its \
     network (e.g. a compose stack from the host) give --agent-host 127.0.0.1 to reach the \
     agents' published ports"
)]
pub struct Unresolvable {
    pub url: String,
    pub host: String,
}

/// tonic's transport error says "transport error"; the cause (refused,
/// bad certificate) is in its sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

pub async fn allocator(tls: &ClientTls, url: &str) -> anyhow::Result<Allocator> {
    allocator_waiting(tls, url, Duration::from_secs(30)).await
}

/// `allocator`; given several, wait up to `leader_wait` for one to lead.
pub async fn allocator_waiting(
    tls: &ClientTls,
    url: &str,
    leader_wait: Duration,
) -> anyhow::Result<Allocator> {
    let urls: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let chans = match urls.as_slice() {
        [] => anyhow::bail!("--allocator: no URL given"),
        // One allocator: connect now, so a wrong URL fails with a reason.
        [one] => vec![(one.to_string(), channel(tls, one, Role::Allocator).await?)],
        // Several: any may be down (that is why there are several).
        several => several
            .iter()
            .map(|u| {
                let u = tls.url(u);
                Ok((
                    u.clone(),
                    endpoint(tls, &u, Role::Allocator)?.connect_lazy(),
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
    };
    let several = chans.len() > 1;
    let ch = crate::leader::LeaderChannel::new(chans);
    if several {
        ch.find_leader(leader_wait).await?;
    }
    Ok(AllocatorClient::with_interceptor(ch, TraceInjector)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

fn agent_client(ch: Channel) -> Agent {
    VdevAgentClient::with_interceptor(ch, TraceInjector)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// Agent channels by endpoint, connected lazily on first use and shared by
/// every worker (a tonic channel multiplexes its callers over HTTP/2).
#[derive(Clone)]
pub struct Agents {
    tls: ClientTls,
    /// `--agent-host`: connect here instead of the advertised host.
    host: Option<String>,
    inner: Arc<RwLock<HashMap<String, Channel>>>,
}

impl Agents {
    /// Agents reached with `tls` (each must present an agent certificate).
    pub fn new(tls: ClientTls) -> Agents {
        Agents {
            tls,
            host: None,
            inner: Default::default(),
        }
    }

    async fn channel(&self, url: &str) -> anyhow::Result<Channel> {
        if let Some(c) = self.inner.read().expect("agents lock").get(url) {
            return Ok(c.clone());
        }
        let target = match &self.host {
            Some(h) => with_host(url, h),
            None => url.to_string(),
        };
        // An advertised name this machine cannot resolve: asked of the
        // resolver itself, not read from a transport error's words.
        if self.host.is_none() {
            let hostport = url
                .split_once("://")
                .map_or(url, |(_, r)| r)
                .trim_end_matches('/');
            let host = hostport
                .rsplit_once(':')
                .map_or(hostport, |(h, _)| h)
                .trim_matches(|c| c == '[' || c == ']');
            if host.parse::<std::net::IpAddr>().is_err()
                && tokio::net::lookup_host(hostport).await.is_err()
            {
                return Err(Unresolvable {
                    url: url.to_string(),
                    host: host.to_string(),
                }
                .into());
            }
        }
        let c = channel(&self.tls, &target, Role::Agent).await?;
        let mut map = self.inner.write().expect("agents lock");
        Ok(map.entry(url.to_string()).or_insert(c).clone())
    }

    pub async fn get(&self, url: &str) -> anyhow::Result<Agent> {
        Ok(agent_client(self.channel(url).await?))
    }

    pub async fn pattern_writer(&self, url: &str) -> anyhow::Result<PatternWriter> {
        let ch = self.channel(url).await?;
        Ok(PatternWriter {
            grpc: tonic::client::Grpc::new(TracedChannel::new(ch, TraceInjector))
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        })
    }

    pub fn endpoints(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .read()
            .expect("agents lock")
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// `VdevAgent.Write` of pattern data (see the module comment).
pub struct PatternWriter {
    grpc: tonic::client::Grpc<TracedChannel>,
}

impl PatternWriter {
    /// `Write { offset, data }` where `data` is the first `len` bytes of
    /// block `block`'s pattern for run `nonce` (see [`crate::pattern`]).
    pub async fn write(&mut self, w: PatternWrite) -> Result<WriteReply, tonic::Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("agent connection: {e}")))?;
        let mut req = tonic::Request::new(w);
        req.extensions_mut()
            .insert(tonic::GrpcMethod::new("aliquot.v1.VdevAgent", "Write"));
        let path = PathAndQuery::from_static("/aliquot.v1.VdevAgent/Write");
        self.grpc
            .unary(req, path, PatternCodec)
            .await
            .map(tonic::Response::into_inner)
    }
}

/// A `WriteRequest` whose data is a block's pattern, generated as it is encoded.
#[derive(Clone, Debug)]
pub struct PatternWrite {
    pub offset: u64,
    pub len: usize,
    pub nonce: u64,
    pub block: u64,
    /// The extent's write token from the Allocate reply (empty: none given).
    pub token: Vec<u8>,
}

/// Encodes [`PatternWrite`] as `aliquot.v1.WriteRequest` (offset = 1,
/// data = 2, token = 3), decodes `WriteReply` with prost.
struct PatternCodec;

impl Codec for PatternCodec {
    type Encode = PatternWrite;
    type Decode = WriteReply;
    type Encoder = PatternEncoder;
    type Decoder = ReplyDecoder;
    fn encoder(&mut self) -> PatternEncoder {
        PatternEncoder
    }
    fn decoder(&mut self) -> ReplyDecoder {
        ReplyDecoder
    }
}

struct PatternEncoder;

impl Encoder for PatternEncoder {
    type Item = PatternWrite;
    type Error = tonic::Status;

    fn encode(&mut self, w: PatternWrite, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        // Room for both keys and varints too: one allocation, no regrowth.
        buf.reserve(w.len + w.token.len() + 32);
        if w.offset != 0 {
            encode_key(1, WireType::Varint, buf);
            encode_varint(w.offset, buf);
        }
        if w.len != 0 {
            encode_key(2, WireType::LengthDelimited, buf);
            encode_varint(w.len as u64, buf);
            crate::pattern::put(buf, w.len, w.nonce, w.block);
        }
        if !w.token.is_empty() {
            encode_key(3, WireType::LengthDelimited, buf);
            encode_varint(w.token.len() as u64, buf);
            prost::bytes::BufMut::put_slice(buf, &w.token);
        }
        Ok(())
    }
}

struct ReplyDecoder;

impl Decoder for ReplyDecoder {
    type Item = WriteReply;
    type Error = tonic::Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<WriteReply>, tonic::Status> {
        WriteReply::decode(buf)
            .map(Some)
            .map_err(|e| tonic::Status::internal(format!("cannot decode WriteReply: {e}")))
    }
}

/// `Status` → one line an operator can act on: code name and the server's words.
pub fn status_msg(what: &str, s: &tonic::Status) -> anyhow::Error {
    // A plaintext client speaking to a TLS server (or the reverse) sees the
    // connection drop mid-call, with nothing in the message to say why.
    // A plaintext client's HTTP/2 preface sent to a TLS server: the server
    // answers with a TLS alert, which h2 reads as a protocol error.
    if s.message().contains("h2 protocol error") {
        return anyhow::anyhow!(
            "{what}: the server speaks TLS and this client plaintext (--insecure): drop \
             --insecure and give the pool's certificates (--certs-dir, as `aliquotctl up` \
             printed, or --ca/--cert/--key)"
        );
    }
    let broken = matches!(s.code(), tonic::Code::Cancelled | tonic::Code::Unknown)
        && (s.message().contains("canceled") || s.message().contains("transport error"));
    let hint = if broken {
        " — the connection broke: is the server TLS and this client --insecure (or the \
         reverse)? a pool `aliquotctl up` started without --insecure needs its certificates"
    } else {
        ""
    };
    anyhow::anyhow!("{what}: {} ({:?}){hint}", s.message(), s.code())
}

/// Read capabilities for committed extents, by `(vdev, offset)` (empty
/// tokens when the allocator signs none): agents with the token key read
/// only what one covers (issue 25). Asked in chunks of 1024 extents.
pub async fn read_tokens(
    alloc: &Allocator,
    extents: impl IntoIterator<Item = aliquot_proto::v1::Extent>,
) -> anyhow::Result<std::collections::HashMap<(u32, u64), Vec<u8>>> {
    let extents: Vec<_> = extents.into_iter().collect();
    let mut out = std::collections::HashMap::with_capacity(extents.len());
    for chunk in extents.chunks(1024) {
        let r = alloc
            .clone()
            .read_tokens(aliquot_proto::v1::ReadTokensRequest {
                extents: chunk.to_vec(),
            })
            .await
            .map_err(|s| status_msg("read tokens", &s))?
            .into_inner();
        for (e, t) in chunk.iter().zip(r.tokens) {
            out.insert((e.vdev, e.offset), t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn agent_host_keeps_scheme_and_port() {
        assert_eq!(
            super::with_host("https://agent1:7001", "127.0.0.1"),
            "https://127.0.0.1:7001"
        );
        assert_eq!(super::with_host("agent1:7002", "h"), "http://h:7002");
    }
}
