//! Connections to a pool: the allocator (one, or several sharing a
//! PostgreSQL store, reached through [`LeaderChannel`]) and the agents, all
//! made by one connect helper ([`channel`]): mutual TLS with the pool's
//! certificates, plaintext only when asked for. Every client carries
//! `telemetry::TraceInjector`, so a span opened by the caller is the parent
//! of the allocator's and the agents' server spans.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use aliquot_auth::{ClientTls, Role};
use aliquot_proto::v1::allocator_client::AllocatorClient;
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use telemetry::{TraceInjector, TracedChannel};
use tonic::transport::{Channel, Endpoint};

use crate::error::{Error, Result, Unresolvable};
use crate::leader::LeaderChannel;

/// Largest message either side may send: a 16 MiB block plus framing.
pub const MAX_MESSAGE: usize = 17 * 1024 * 1024;

/// The allocator's client: calls go to the allocator that leads.
pub type Allocator =
    AllocatorClient<tonic::service::interceptor::InterceptedService<LeaderChannel, TraceInjector>>;
/// An agent's client.
pub type Agent = VdevAgentClient<TracedChannel>;

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

fn endpoint(tls: &ClientTls, url: &str, server: Role) -> Result<Endpoint> {
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
pub async fn channel(tls: &ClientTls, url: &str, server: Role) -> Result<Channel> {
    let url = tls.url(url);
    if !tls.is_tls() && speaks_tls(&url).await {
        return Err(Error::Connect(format!(
            "{url} speaks TLS and this client plaintext (--insecure): drop --insecure and give \
             the pool's certificates (--certs-dir, as `aliquotctl up` printed, or \
             --ca/--cert/--key)"
        )));
    }
    endpoint(tls, &url, server)?.connect().await.map_err(|e| {
        let chain = error_chain(&e);
        // rustls reading a plaintext HTTP/2 answer where a TLS record
        // should be: the server is plaintext.
        if tls.is_tls() && chain.contains("InvalidContentType") {
            return Error::Connect(format!(
                "cannot reach {url}: it speaks plaintext, not TLS (a pool started with \
                 --insecure): add --insecure"
            ));
        }
        // rustls: the server's chain does not lead to our CA. The server
        // is up and speaks TLS: it is another pool's, or ours is not the
        // certificate directory it was made with.
        if let ClientTls::Mutual(files) = tls
            && chain.contains("UnknownIssuer")
        {
            return Error::Connect(format!(
                "cannot reach {url}: the server's certificate is not signed by {}: another \
                 pool? give --certs-dir (the directory `aliquotctl up` printed for that pool)",
                files.ca.display()
            ));
        }
        let hint = if tls.is_tls() {
            "is the pool up, and with TLS? a pool started with --insecure needs --insecure here"
        } else {
            "is the pool up? a pool started without --insecure needs its certificates, not --insecure"
        };
        Error::Connect(format!("cannot reach {url}: {chain} ({hint})"))
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

/// The allocator at `urls` (comma-separated: several allocators sharing a
/// PostgreSQL store); given several, wait up to `leader_wait` for one to
/// lead. One allocator is connected now, so a wrong URL fails with a reason.
pub async fn allocator(tls: &ClientTls, urls: &str, leader_wait: Duration) -> Result<Allocator> {
    let urls: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let chans = match urls.as_slice() {
        [] => return Err(Error::Connect("no allocator URL given".into())),
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
            .collect::<Result<Vec<_>>>()?,
    };
    let several = chans.len() > 1;
    let ch = LeaderChannel::new(chans, leader_wait);
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
/// every task (a tonic channel multiplexes its callers over HTTP/2).
#[derive(Clone)]
pub struct Agents {
    tls: ClientTls,
    /// Connect here instead of the advertised host (`--agent-host`).
    host: Option<String>,
    inner: Arc<RwLock<HashMap<String, Channel>>>,
}

impl Agents {
    /// Agents reached with `tls` (each must present an agent certificate),
    /// at `host` instead of the host they advertise when given (for a
    /// compose stack reached from outside its network).
    pub fn new(tls: ClientTls, host: Option<String>) -> Agents {
        Agents {
            tls,
            host,
            inner: Default::default(),
        }
    }

    /// The channel to the agent at `url`, connected on first use.
    pub async fn channel(&self, url: &str) -> Result<Channel> {
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

    /// The agent at `url`'s client.
    pub async fn get(&self, url: &str) -> Result<Agent> {
        Ok(agent_client(self.channel(url).await?))
    }

    /// Every agent connected so far, sorted.
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
