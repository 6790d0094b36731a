//! Several allocators on one PostgreSQL store: exactly one leads
//! the pool, the others stand by. The process keeps one listener for its
//! whole life; each accepted connection goes to the server of the current
//! role. A standby answers every Allocator and AgentRegistry call with
//! UNAVAILABLE / `NOT_LEADER` naming the leader, reports health NOT_SERVING,
//! and polls the leadership row; when the leader's lease has expired it
//! takes the pool with the next generation, loads the store and serves. A
//! leader renews its lease every third of it; once replaced (a renewal or a
//! txg finds a newer generation) it stops serving at once and stands by
//! again. SIGTERM/SIGINT sync a last txg and hand the lease back, so a
//! standby takes over at its next poll instead of after the lease.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use telemetry::backoff::Backoff;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

use crate::error::Error;
use crate::leadership::Lease;
use crate::pg_store::{Leader, PgStore};
use crate::{Config, ConfigError, Running, ShutdownSignal};

type Conn = Result<aliquot_auth::listen::Conn, std::io::Error>;

/// Where the acceptor sends connections: the current role's server.
type Route = Arc<Mutex<mpsc::Sender<Conn>>>;

/// The binary's body with `--store postgres://…`.
pub async fn run(config: Config, url: String) -> anyhow::Result<()> {
    crate::validate(&config)?;
    let signals = ShutdownSignal::install();
    let lease = config.leader_lease;
    if lease < Duration::from_secs(1) {
        return Err(ConfigError(format!(
            "--leader-lease {lease:?}: at least 1s (renewed every third of it)"
        ))
        .into());
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("bind {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    let advertise = config.advertise.clone().unwrap_or_else(|| {
        let scheme = if config.tls.insecure { "http" } else { "https" };
        format!("{scheme}://{addr}")
    });
    let me = format!("{advertise} pid {}", std::process::id());
    let store =
        match PgStore::open_with_lease(&url, &config.pool, config.pool_guid, &me, lease).await {
            Ok(s) => Arc::new(s),
            Err(e @ crate::pg_store::OpenError::Url { .. })
            | Err(e @ crate::pg_store::OpenError::OtherPool { .. }) => {
                return Err(ConfigError(e.to_string()).into());
            }
            Err(e) => return Err(e.into()),
        };
    store.set_address(&advertise);
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN grpc {addr}")?;
        out.flush()?;
    }
    let (tx, _) = mpsc::channel(1);
    let route: Route = Arc::new(Mutex::new(tx));
    let acceptor = tokio::spawn(accept(
        crate::guarded_incoming(&config, listener)?,
        route.clone(),
    ));
    let r = serve_roles(&config, &store, addr, &route, lease, signals).await;
    acceptor.abort();
    store.close().await;
    r
}

/// Accept for the process's life; hand each connection to the current role.
async fn accept(mut incoming: ReceiverStream<Conn>, route: Route) {
    use tokio_stream::StreamExt;
    while let Some(c) = incoming.next().await {
        let tx = route.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let _ = tx.send(c).await;
    }
}

/// A fresh connection stream for the next role.
fn reroute(route: &Route) -> ReceiverStream<Conn> {
    let (tx, rx) = mpsc::channel(64);
    *route.lock().unwrap_or_else(|p| p.into_inner()) = tx;
    ReceiverStream::new(rx)
}

async fn serve_roles(
    config: &Config,
    store: &Arc<PgStore>,
    addr: SocketAddr,
    route: &Route,
    lease: Duration,
    mut signals: ShutdownSignal,
) -> anyhow::Result<()> {
    // Poll often enough that a handover (lease cleared) is taken quickly.
    // The shared backoff with min = max = poll only jitters each pause
    // within [poll/2, poll]: standbys started together spread their polls,
    // and none waits longer than poll, so takeover stays within lease + poll.
    let poll = (lease / 10).clamp(Duration::from_millis(100), Duration::from_millis(500));
    let mut poll_pause = Backoff::new(poll, poll);
    let mut hold_until = Instant::now();
    loop {
        // Standing by.
        let standby = Standby::serve(config, reroute(route))?;
        tracing::info!(pool = %config.pool, "standing by");
        let generation = loop {
            let sent = Instant::now();
            tokio::select! {
                _ = signals.recv() => {
                    standby.stop().await;
                    return Ok(());
                }
                r = async {
                    if Instant::now() < hold_until {
                        Ok(None)
                    } else {
                        store.try_acquire(lease).await
                    }
                } => match r {
                    Ok(Some(g)) => break (g, sent),
                    Ok(None) => match store.stand_by().await {
                        Ok(l) => standby.set_leader(l),
                        Err(e) => tracing::warn!(error = %e, "cannot read the leadership"),
                    },
                    Err(e) => tracing::warn!(error = %e, "cannot read the leadership"),
                },
            }
            tokio::select! {
                _ = signals.recv() => {
                    standby.stop().await;
                    return Ok(());
                }
                _ = tokio::time::sleep(poll_pause.next_delay()) => {}
            }
        };
        let (generation, sent) = generation;
        let address = store.address();
        let lease_state = Arc::new(Lease::new(generation, &address, lease, sent));
        standby.stop().await;
        tracing::info!(generation, pool = %config.pool, "took the leadership: loading the store");
        let running = match crate::start_serving(
            config.clone(),
            store.clone(),
            addr,
            reroute(route),
            Some(lease_state.clone()),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                // Give the pool to another allocator rather than hold it.
                let _ = store.release(false).await;
                return Err(e);
            }
        };
        let renewer = tokio::spawn(renew(store.clone(), lease_state.clone()));
        tokio::select! {
            _ = signals.recv() => {
                renewer.abort();
                tracing::info!("shutting down: a last txg, then the lease is handed back");
                let shared = running.shared.clone();
                let quiet = shared.claim_window_remaining().is_zero();
                let r = running.shutdown().await;
                let clean = quiet && r.is_ok() && shared.nothing_unsynced();
                if !lease_state.is_deposed()
                    && let Err(e) = store.release(clean).await
                {
                    tracing::warn!(error = %e, "could not hand the lease back; it expires on its own");
                }
                return r;
            }
            _ = lease_state.deposed() => {
                renewer.abort();
                running.abandon().await;
            }
            _ = lease_state.step_down_requested() => {
                renewer.abort();
                tracing::info!(generation, "stepping down: a last txg, then the lease is handed back");
                // Clean when the last txg synced and no claim of an older
                // generation may still come: the next leader then opens no
                // claim window.
                let shared = running.shared.clone();
                let quiet = shared.claim_window_remaining().is_zero();
                let synced = match running.shutdown().await {
                    Ok(()) => shared.nothing_unsynced(),
                    Err(e) => {
                        tracing::warn!(error = %e, "the last txg before stepping down");
                        false
                    }
                };
                if let Err(e) = store.release(quiet && synced).await {
                    tracing::warn!(error = %e, "could not hand the lease back; it expires on its own");
                }
                // Let a standby (polling every `poll`) take it before this
                // one tries again.
                hold_until = Instant::now() + 2 * poll;
            }
        }
    }
}

/// Renew every third of the lease. A renewal that fails to reach the
/// database is retried; the local deadline runs out meanwhile and every
/// call is refused until one succeeds. A renewal the database refuses
/// (another generation leads) deposes this allocator.
async fn renew(store: Arc<PgStore>, lease: Arc<Lease>) {
    let every = lease.duration() / 3;
    loop {
        tokio::time::sleep(every).await;
        let sent = Instant::now();
        match tokio::time::timeout(every, store.renew(lease.duration())).await {
            Ok(Ok(true)) => {
                lease.extend(sent);
                if let Ok(s) = store.standbys().await {
                    lease.set_standbys(s);
                }
            }
            Ok(Ok(false)) => {
                let leader = store.leader().await.map(|l| l.address).unwrap_or_default();
                lease.depose(&leader, "the lease was taken by another allocator");
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, left_ms = lease.left().as_millis() as u64, "lease renewal failed")
            }
            Err(_) => tracing::warn!(
                left_ms = lease.left().as_millis() as u64,
                "lease renewal timed out"
            ),
        }
    }
}

impl Running {
    /// Stop at once without a last txg (another allocator leads: nothing
    /// more may be persisted); parked callers hear NOT_LEADER.
    pub async fn abandon(self) {
        self.shared
            .shutting_down
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.shared.lock().drop_waiters();
        self.shared.stop.send_replace(true);
        for h in &self.background {
            h.abort();
        }
        let mut server = self.server;
        if tokio::time::timeout(Duration::from_secs(2), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
    }
}

/// The standby's server: health NOT_SERVING and NOT_LEADER for every call.
struct Standby {
    stop: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    /// Who leads, as the last poll read it (and when): what NOT_LEADER names.
    leader: Arc<Mutex<(Leader, Instant)>>,
}

impl Standby {
    fn serve(config: &Config, incoming: ReceiverStream<Conn>) -> anyhow::Result<Standby> {
        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        let builder = tonic::transport::Server::builder();
        // TLS is finished by the acceptor (`crate::guarded_incoming`).
        let roles = match config.tls.server_mode("allocator")? {
            Some(_) => aliquot_auth::RoleLayer::enforce(),
            None => aliquot_auth::RoleLayer::insecure(),
        };
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let hint = NotLeader {
            leader: Arc::new(Mutex::new((Leader::default(), Instant::now()))),
        };
        let leader = hint.leader.clone();
        let server = tokio::spawn(async move {
            health_reporter
                .set_service_status(
                    "aliquot.v1.Allocator",
                    tonic_health::ServingStatus::NotServing,
                )
                .await;
            health_reporter
                .set_service_status(
                    "aliquot.v1.AgentRegistry",
                    tonic_health::ServingStatus::NotServing,
                )
                .await;
            builder
                .layer(roles)
                .add_service(health_service)
                .add_service(Named::<AllocatorName>::new(hint.clone()))
                .add_service(Named::<RegistryName>::new(hint))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        Ok(Standby {
            stop,
            server,
            leader,
        })
    }

    fn set_leader(&self, l: Leader) {
        *self.leader.lock().unwrap_or_else(|p| p.into_inner()) = (l, Instant::now());
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        let mut server = self.server;
        // Report streams of agents that still hold a connection here end
        // with it; they reconnect to whoever leads.
        if tokio::time::timeout(Duration::from_secs(1), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
    }
}

/// Answers any call with NOT_LEADER and the leader's address, as the
/// standby's last poll read it (no database round trip per call).
#[derive(Clone)]
struct NotLeader {
    leader: Arc<Mutex<(Leader, Instant)>>,
}

impl NotLeader {
    fn status(&self) -> tonic::Status {
        let (leader, read) = self
            .leader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        // Named only while its lease (as read) has not run out since.
        let left = Duration::from_millis(leader.lease_left_ms).saturating_sub(read.elapsed());
        let live = !left.is_zero();
        Error::NotLeader {
            why: "a standby".into(),
            leader: if live { leader.address } else { String::new() },
            generation: leader.generation,
            lease_left_ms: left.as_millis() as u64,
        }
        .into()
    }
}

trait ServiceName: Send + Sync + 'static {
    const NAME: &'static str;
}
struct AllocatorName;
impl ServiceName for AllocatorName {
    const NAME: &'static str = "aliquot.v1.Allocator";
}
struct RegistryName;
impl ServiceName for RegistryName {
    const NAME: &'static str = "aliquot.v1.AgentRegistry";
}

/// [`NotLeader`] under one gRPC service name.
struct Named<N> {
    inner: NotLeader,
    _name: std::marker::PhantomData<fn() -> N>,
}

impl<N> Named<N> {
    fn new(inner: NotLeader) -> Self {
        Named {
            inner,
            _name: std::marker::PhantomData,
        }
    }
}

impl<N> Clone for Named<N> {
    fn clone(&self) -> Self {
        Named::new(self.inner.clone())
    }
}

impl<N: ServiceName> NamedService for Named<N> {
    const NAME: &'static str = N::NAME;
}

impl<N, B> Service<http::Request<B>> for Named<N>
where
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<B>) -> Self::Future {
        let status = self.inner.status();
        Box::pin(async move { Ok(status.into_http()) })
    }
}
