//! A channel to whichever of several allocators leads the pool (issue 26).
//! `--allocator a,b,c` names allocators sharing one PostgreSQL store: one
//! leads, the others stand by and answer UNAVAILABLE / `NOT_LEADER` naming
//! the leader. Each call goes to the allocator believed to lead; a call
//! refused with NOT_LEADER, or that cannot reach it, moves the belief (to
//! the leader named, else the next allocator) for the calls that follow.
//! The refused call itself returns its error, so the caller's own retry
//! rules (the write's `--allocator-wait`, reopening its stream, claiming
//! after ALLOCATOR_RESTARTED) decide what to do, exactly as for one
//! allocator restarting.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::body::Body;
use tonic::codegen::{Service, http};
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
}

impl LeaderChannel {
    pub fn new(allocators: Vec<(String, Channel)>) -> LeaderChannel {
        assert!(!allocators.is_empty(), "at least one allocator");
        LeaderChannel {
            inner: Arc::new(Inner {
                allocators,
                current: AtomicUsize::new(0),
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
    /// say of the lease, instead of failing on the first refusal.
    pub async fn find_leader(&self, wait: Duration) -> anyhow::Result<()> {
        use aliquot_proto::v1::GetPoolRequest;
        use aliquot_proto::v1::allocator_client::AllocatorClient;
        let t0 = Instant::now();
        let mut last_said = Instant::now() - Duration::from_secs(60);
        let mut waited = false;
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
                        .filter(|e| e.reason == "NOT_LEADER")
                });
                match (s, info) {
                    // It answered, as the leader or with a refusal of its
                    // own (which the command then shows).
                    (None, _) => {
                        self.inner.current.store(i, Ordering::Release);
                        if waited {
                            eprintln!(
                                "aliquotctl: {url} leads ({:.1} s later)",
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
                anyhow::bail!("{msg}; gave up after --leader-wait {wait:?}");
            }
            if last_said.elapsed() >= Duration::from_secs(1) {
                eprintln!("aliquotctl: {msg}; waiting");
                last_said = Instant::now();
            }
            waited = true;
            tokio::time::sleep(Duration::from_millis(250)).await;
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
    (info.reason == "NOT_LEADER").then(|| {
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
        let idx = inner.current.load(Ordering::Acquire);
        let ch = inner.allocators[idx].1.clone();
        Box::pin(async move {
            match ch.oneshot(req).await {
                Ok(resp) => {
                    if let Some(leader) = not_leader(resp.headers()) {
                        inner.move_from(idx, leader.as_deref());
                    }
                    Ok(resp)
                }
                Err(e) => {
                    if inner.allocators.len() > 1 {
                        inner.move_from(idx, None);
                    }
                    Err(e.into())
                }
            }
        })
    }
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
        let s = tonic::Status::with_error_details(
            tonic::Code::Unavailable,
            "standby",
            tonic_types::ErrorDetails::with_error_info(
                "NOT_LEADER",
                "aliquot.v1",
                [("leader".to_string(), "http://b:7000".to_string())],
            ),
        );
        let resp: http::Response<Body> = s.into_http();
        assert_eq!(
            not_leader(resp.headers()),
            Some(Some("http://b:7000".into()))
        );
        let other: http::Response<Body> = tonic::Status::unavailable("down").into_http();
        assert_eq!(not_leader(other.headers()), None);
    }
}
