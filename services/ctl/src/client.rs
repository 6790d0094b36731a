//! gRPC clients for the allocator and the agents. Every client carries
//! `telemetry::TraceInjector`, so a span opened here (e.g. `aliquotctl.write`)
//! is the parent of the allocator's and the agents' server spans.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use aliquot_proto::v1::allocator_client::AllocatorClient;
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use telemetry::{TraceInjector, TracedChannel};
use tonic::transport::{Channel, Endpoint};

/// Largest message either side may send: a 16 MiB block plus framing.
pub const MAX_MESSAGE: usize = 17 * 1024 * 1024;

/// Where the allocator is: shared by every command that talks to a pool.
#[derive(Clone, Debug, clap::Args)]
pub struct AllocatorArgs {
    /// The allocator's gRPC endpoint.
    #[arg(
        long,
        env = "ALIQUOT_ALLOCATOR",
        default_value = "http://127.0.0.1:7000"
    )]
    pub allocator: String,
}

pub type Allocator = AllocatorClient<TracedChannel>;
pub type Agent = VdevAgentClient<TracedChannel>;

fn endpoint(url: &str) -> anyhow::Result<Endpoint> {
    let url = if url.contains("://") {
        url.to_string()
    } else {
        format!("http://{url}")
    };
    Ok(Endpoint::from_shared(url.clone())
        .map_err(|e| anyhow::anyhow!("{url:?} is not a gRPC endpoint URL: {e}"))?
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_adaptive_window(true))
}

/// Connect now (fails fast with an operator-readable message).
pub async fn channel(url: &str) -> anyhow::Result<Channel> {
    endpoint(url)?.connect().await.map_err(|e| {
        anyhow::anyhow!("cannot reach {url}: {e} (is the pool up? try `aliquotctl up`)")
    })
}

pub async fn allocator(url: &str) -> anyhow::Result<Allocator> {
    let ch = channel(url).await?;
    Ok(AllocatorClient::with_interceptor(ch, TraceInjector)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

fn agent_client(ch: Channel) -> Agent {
    VdevAgentClient::with_interceptor(ch, TraceInjector)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// Agent clients by endpoint, connected lazily on first use and shared by
/// every worker (a tonic channel multiplexes its callers over HTTP/2).
#[derive(Clone, Default)]
pub struct Agents {
    inner: Arc<RwLock<HashMap<String, Agent>>>,
}

impl Agents {
    pub async fn get(&self, url: &str) -> anyhow::Result<Agent> {
        if let Some(c) = self.inner.read().expect("agents lock").get(url) {
            return Ok(c.clone());
        }
        let c = agent_client(channel(url).await?);
        let mut map = self.inner.write().expect("agents lock");
        Ok(map.entry(url.to_string()).or_insert(c).clone())
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

/// `Status` → one line an operator can act on: code name and the server's words.
pub fn status_msg(what: &str, s: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{what}: {} ({:?})", s.message(), s.code())
}
