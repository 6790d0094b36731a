//! A channel to whichever of several allocators leads the pool.
//! `--allocator a,b,c` names allocators sharing one PostgreSQL store: one
//! leads, the others stand by and answer UNAVAILABLE / `NOT_LEADER` naming
//! the leader. Each call goes to the allocator believed to lead; a call
//! refused with NOT_LEADER, or that cannot reach it, moves the belief (to
//! the leader named, else the next allocator) for the calls that follow.
//! A call refused with NOT_LEADER was not acted on (a standby refuses
//! before anything is done), so the channel sends it again, at once to the
//! leader named, else to the next allocator after a short pause, until one
//! answers as the leader or the leader wait ends: every command sees the
//! leader's answer, not a standby's refusal, across a takeover. Only a
//! call whose request is a stream (AllocateStream, Report) cannot be sent
//! again: it returns the refusal, and the caller's own rules (reopening its
//! stream, claiming after ALLOCATOR_RESTARTED) decide, exactly as for one
//! allocator restarting. A call that failed on the way (a connection reset
//! by an allocator restarting) may have been acted on: only the calls that
//! change nothing (GetPool, GetTunables, WatchPool) are sent again then;
//! the others return the error to their caller.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use aliquot_proto::error::reason;
use aliquot_proto::v1::ErrorReason;
use http_body_util::{BodyExt, Full};
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tonic::transport::Channel;
use tonic_types::StatusExt;
use tower::ServiceExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
pub struct LeaderChannel {
    inner: Arc<Inner>,
}

struct Inner {
    /// (url as given, channel), in the order given.
    allocators: Vec<(String, Channel)>,
    current: AtomicUsize,
    /// How long a call refused with NOT_LEADER is sent again.
    leader_wait: Duration,
}

/// Calls whose request is a stream of messages: never buffered, never
/// sent again (see the module docs).
fn streams_requests(path: &str) -> bool {
    use aliquot_proto::v1::{agent_registry_server, allocator_server};
    let method = |service: &str, m: &str| path.strip_prefix('/') == Some(&format!("{service}/{m}"));
    method(allocator_server::SERVICE_NAME, "AllocateStream")
        || method(agent_registry_server::SERVICE_NAME, "Report")
}

/// Calls that change nothing: sent again after a transport failure too.
fn reads_only(path: &str) -> bool {
    use aliquot_proto::v1::allocator_server::SERVICE_NAME;
    ["GetPool", "GetTunables", "WatchPool"]
        .iter()
        .any(|m| path.strip_prefix('/') == Some(&format!("{SERVICE_NAME}/{m}")))
}

impl LeaderChannel {
    /// The allocators, in the order given; a call refused with NOT_LEADER
    /// is sent again for up to `leader_wait`.
    pub fn new(allocators: Vec<(String, Channel)>, leader_wait: Duration) -> LeaderChannel {
        assert!(!allocators.is_empty(), "at least one allocator");
        LeaderChannel {
            inner: Arc::new(Inner {
                allocators,
                current: AtomicUsize::new(0),
                leader_wait,
            }),
        }
    }

    /// The URL calls go to now.
    pub fn current(&self) -> &str {
        &self.inner.allocators[self.inner.current.load(Ordering::Relaxed)].0
    }

    /// Start with the allocator that leads now, so a command's first call
    /// is not spent on a standby: each is asked GetPool in turn (briefly)
    /// and the first that answers as the leader is taken. While none does
    /// (a takeover under way: the leader stopped or cut off, its lease not
    /// yet ended), wait up to `wait`, saying on stderr what the standbys
    /// say of the lease (an operator waiting wants to know why), instead
    /// of failing on the first refusal.
    pub async fn find_leader(&self, wait: Duration) -> crate::Result<()> {
        use aliquot_proto::v1::GetPoolRequest;
        use aliquot_proto::v1::allocator_client::AllocatorClient;
        let t0 = Instant::now();
        let mut last_said = Instant::now() - Duration::from_secs(60);
        let mut waited = false;
        // Every client of a pool that lost its leader polls at once: jitter
        // spreads them; capped so a new leader is seen within ~a second.
        let mut poll = telemetry::backoff::Backoff::new(
            Duration::from_millis(100),
            Duration::from_millis(1000),
        );
        loop {
            // The live lease a standby names, and what the others said.
            let mut holder: Option<(String, u64)> = None;
            let mut others = Vec::new();
            for (i, (url, ch)) in self.inner.allocators.iter().enumerate() {
                let mut c = AllocatorClient::new(ch.clone());
                let r = tokio::time::timeout(Duration::from_secs(2), c.get_pool(GetPoolRequest {}))
                    .await;
                let s = match r {
                    Err(_) => {
                        others.push(format!("{url}: no answer in 2 s"));
                        continue;
                    }
                    Ok(Ok(_)) => None,
                    Ok(Err(s)) => Some(s),
                };
                let info = s.as_ref().and_then(|s| {
                    s.get_details_error_info()
                        .filter(|_| reason(s) == Some(ErrorReason::NotLeader))
                });
                match (s, info) {
                    // It answered, as the leader or with a refusal of its
                    // own (which the command then shows).
                    (None, _) => {
                        self.inner.current.store(i, Ordering::Release);
                        if waited {
                            eprintln!(
                                "aliquot: {url} leads ({:.1} s later)",
                                t0.elapsed().as_secs_f64()
                            );
                        }
                        return Ok(());
                    }
                    (Some(_), Some(info)) => {
                        let leader = info.metadata.get("leader").cloned().unwrap_or_default();
                        let left: u64 = info
                            .metadata
                            .get("lease_left_ms")
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0);
                        if !leader.is_empty()
                            && left > 0
                            && holder.as_ref().is_none_or(|(_, m)| left > *m)
                        {
                            holder = Some((leader, left));
                        }
                        others.push(format!("{url}: does not lead"));
                    }
                    (Some(s), None) if s.code() == tonic::Code::Unavailable => {
                        others.push(format!("{url}: {}", s.message()));
                    }
                    (Some(_), None) => {
                        self.inner.current.store(i, Ordering::Release);
                        return Ok(());
                    }
                }
            }
            let msg = match &holder {
                Some((l, ms)) => format!(
                    "no leader answers yet: {l} holds the lease, which ends in {} s",
                    ms.div_ceil(1000)
                ),
                None => format!("no leader answers yet ({})", others.join("; ")),
            };
            if t0.elapsed() >= wait {
                return Err(crate::Error::Connect(format!(
                    "{msg}; gave up after --leader-wait {wait:?}"
                )));
            }
            if last_said.elapsed() >= Duration::from_secs(1) {
                eprintln!("aliquot: {msg}; waiting");
                last_said = Instant::now();
            }
            waited = true;
            tokio::time::sleep(poll.next_delay()).await;
        }
    }
}

impl Inner {
    /// Move the belief away from `from` (if nobody moved it already): to
    /// the named leader when it is one of ours, else to the next one.
    fn move_from(&self, from: usize, leader: Option<&str>) {
        let n = self.allocators.len();
        let to = leader
            .and_then(|l| {
                self.allocators
                    .iter()
                    .position(|(u, _)| same_endpoint(u, l))
            })
            .unwrap_or((from + 1) % n);
        if to != from
            && self
                .current
                .compare_exchange(from, to, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            tracing::debug!(
                from = %self.allocators[from].0,
                to = %self.allocators[to].0,
                "following the pool's leader"
            );
        }
    }
}

/// `http://h:p` and `https://h:p/` name the same allocator.
fn same_endpoint(a: &str, b: &str) -> bool {
    let strip = |s: &str| {
        s.split_once("://")
            .map_or(s, |(_, r)| r)
            .trim_end_matches('/')
            .to_string()
    };
    strip(a) == strip(b)
}

/// The leader a trailers-only NOT_LEADER response names, if it is one.
fn not_leader(headers: &http::HeaderMap) -> Option<Option<String>> {
    let status = tonic::Status::from_header_map(headers)?;
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    let info = status.get_details_error_info()?;
    (reason(&status) == Some(ErrorReason::NotLeader)).then(|| {
        info.metadata
            .get("leader")
            .filter(|l| !l.is_empty())
            .cloned()
    })
}

impl Service<http::Request<Body>> for LeaderChannel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call readies the channel it picks (a Channel buffers).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            if inner.allocators.len() == 1 || streams_requests(req.uri().path()) {
                let idx = inner.current.load(Ordering::Acquire);
                return inner.send(idx, req).await;
            }
            // Kept, to be sent again after a NOT_LEADER.
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let t0 = Instant::now();
            // Between rounds of standbys that name no leader (a takeover
            // under way): short, as a handover takes well under a second.
            let mut pause = telemetry::backoff::Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(250),
            );
            let reads = reads_only(parts.uri.path());
            loop {
                let idx = inner.current.load(Ordering::Acquire);
                let resp = match inner.send(idx, again(&parts, body.clone())?).await {
                    Ok(resp) => resp,
                    Err(e) if reads && t0.elapsed() < inner.leader_wait => {
                        tracing::debug!(
                            allocator = %inner.allocators[idx].0,
                            error = %e,
                            "a read failed on the way: sending it again"
                        );
                        tokio::time::sleep(pause.next_delay()).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let Some(named) = not_leader(resp.headers()) else {
                    return Ok(resp);
                };
                if t0.elapsed() >= inner.leader_wait {
                    return Ok(resp);
                }
                // Sent at once to a leader it named; else after a pause.
                let next = inner.current.load(Ordering::Acquire);
                let to_named = named.is_some_and(|l| same_endpoint(&inner.allocators[next].0, &l));
                if !to_named || next == idx {
                    tokio::time::sleep(pause.next_delay()).await;
                }
                tracing::debug!(
                    from = %inner.allocators[idx].0,
                    to = %inner.allocators[next].0,
                    "a standby refused the call: sending it again"
                );
            }
        })
    }
}

impl Inner {
    /// Send `req` to allocator `idx`; a NOT_LEADER answer, or no answer,
    /// moves the belief for the calls that follow.
    async fn send(
        &self,
        idx: usize,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let ch = self.allocators[idx].1.clone();
        match ch.oneshot(req).await {
            Ok(resp) => {
                if let Some(leader) = not_leader(resp.headers()) {
                    self.move_from(idx, leader.as_deref());
                }
                Ok(resp)
            }
            Err(e) => {
                if self.allocators.len() > 1 {
                    self.move_from(idx, None);
                }
                Err(e.into())
            }
        }
    }
}

/// The request of `parts` with `body`, to send again.
fn again(parts: &http::request::Parts, body: Bytes) -> Result<http::Request<Body>, BoxError> {
    let mut b = http::Request::builder()
        .method(parts.method.clone())
        .uri(parts.uri.clone())
        .version(parts.version);
    if let Some(h) = b.headers_mut() {
        *h = parts.headers.clone();
    }
    Ok(b.body(Body::new(Full::new(body)))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_compare_without_scheme_or_slash() {
        assert!(same_endpoint(
            "http://127.0.0.1:7000",
            "https://127.0.0.1:7000/"
        ));
        assert!(!same_endpoint(
            "http://127.0.0.1:7000",
            "http://127.0.0.1:7001"
        ));
    }

    #[test]
    fn a_not_leader_status_names_its_leader() {
        let s =
            aliquot_proto::error::Refusal::new(tonic::Code::Unavailable, ErrorReason::NotLeader)
                .with("leader", "http://b:7000")
                .status("standby");
        let resp: http::Response<Body> = s.into_http();
        assert_eq!(
            not_leader(resp.headers()),
            Some(Some("http://b:7000".into()))
        );
        let other: http::Response<Body> = tonic::Status::unavailable("down").into_http();
        assert_eq!(not_leader(other.headers()), None);
    }
}
