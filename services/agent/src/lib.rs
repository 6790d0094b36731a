//! `aliquot-agent`: one agent per vdev. It owns the device (a file, a block
//! device or a simulated device), does the data I/O that clients send it over
//! gRPC (`VdevAgent`: Write, Read, Flush, GetStats, SetTunables) through a
//! per-device queue that aggregates contiguous writes, and registers with the
//! allocator, reporting capacity, health, latency and queue depth every second.
//!
//! Library first: [`run`] is what `main.rs` (which `aliquotctl serve agent`
//! execs) calls; tests use [`Agent::open`] + [`serve`] on a port-0 listener.

pub mod agent;
pub mod backend;
pub mod config;
pub mod copy;
pub mod error;
pub mod fastwrite;
pub mod fence;
pub mod gate;
pub mod label;
pub mod measure;
pub mod payload;
pub mod queue;
pub mod registration;
pub mod service;
pub mod sim;
pub mod stats;
pub mod uberblock;

use std::future::Future;
use std::io::Write as _;
use std::time::Duration;

use aliquot_proto::v1::vdev_agent_server::VdevAgentServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::Server;

pub use agent::Agent;
pub use config::{BackendKind, Config};
pub use error::AgentError;

/// How long in-flight RPCs get to finish once shutdown is asked for.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// HTTP/2 flow control sized for 16 MiB writes, several in flight.
pub const STREAM_WINDOW: u32 = 16 << 20;
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Largest HTTP/2 frame (the protocol allows up to 16 MiB - 1).
pub const MAX_FRAME: u32 = 1 << 20;

/// Room for a 16 MiB write plus the message framing.
const MAX_MESSAGE: usize = (agent::MAX_IO as usize) + (64 << 10);

/// Validate, open the device, bind, print `LISTEN grpc <addr>`, serve until
/// SIGINT/SIGTERM, then flush the device and stop.
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Flag errors first, then "no certificates", before the device is opened.
    config.validate()?;
    config
        .tls
        .check()
        .map_err(|e| AgentError::Config(e.to_string()))?;
    let agent = Agent::open(&config)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind --listen {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN grpc {addr}")?;
        out.flush()?;
    }
    serve(agent, &config, listener, shutdown_signal()).await
}

/// Serve `agent` on `listener` until `shutdown` resolves; registers with the
/// allocator if the config names one. Flushes and stops the device at the end.
pub async fn serve(
    agent: Agent,
    config: &Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    let endpoint = config.advertise.clone().unwrap_or_else(|| {
        if addr.ip().is_unspecified() {
            tracing::warn!(%addr, "listening on a wildcard address without --advertise: the allocator will be told an unroutable endpoint");
        }
        // tonic speaks TLS to https:// URLs only.
        let scheme = if config.tls.files().is_some() { "https" } else { "http" };
        format!("{scheme}://{addr}")
    });
    tracing::info!(%addr, endpoint = %endpoint, "serving vdev agent");

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    {
        // The latency percentiles cover the last report interval.
        let agent = agent.clone();
        let mut stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => agent.rotate_interval(),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }));
    }
    // Notified when the allocator says this vdev was removed: stop serving.
    let removed = std::sync::Arc::new(tokio::sync::Notify::new());
    // Why the pool refuses this device, while it does (health NOT_SERVING).
    let refused = std::sync::Arc::new(watch::Sender::new(None::<String>));
    if config.registers() {
        tasks.push(tokio::spawn(registration::run(
            agent.clone(),
            config.allocators(),
            endpoint,
            config.tls.files(),
            stop_rx.clone(),
            removed.clone(),
            refused.clone(),
        )));
    } else {
        tracing::info!("--allocator none: not registering");
    }

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<VdevAgentServer<service::VdevAgentService>>()
        .await;
    {
        // A device the pool refuses is not healthy, whatever its own state:
        // the server as a whole and the VdevAgent service say NOT_SERVING
        // until a registration succeeds.
        let mut rx = refused.subscribe();
        let mut stop = stop_rx.clone();
        let reporter = health_reporter.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let status = if rx.borrow_and_update().is_some() {
                    tonic_health::ServingStatus::NotServing
                } else {
                    tonic_health::ServingStatus::Serving
                };
                for name in ["", "aliquot.v1.VdevAgent"] {
                    reporter.set_service_status(name, status).await;
                }
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }));
    }
    // Reflection (v1 and v1alpha) lists only what this binary serves.
    let (reflection, reflection_v1alpha) =
        aliquot_proto::reflection::services(&["aliquot.v1.VdevAgent"])?;
    let svc = VdevAgentServer::new(service::VdevAgentService::new(
        agent.clone(),
        crate::copy::Copier::new(config.tls.files()),
    ))
    .max_decoding_message_size(MAX_MESSAGE)
    .max_encoding_message_size(MAX_MESSAGE);

    // Graceful stop, bounded: an idle client that never closes its
    // connection must not keep the agent (and its device) alive.
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let was_removed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shutdown = {
        let (removed, was_removed) = (removed.clone(), was_removed.clone());
        async move {
            tokio::select! {
                _ = shutdown => {}
                _ = removed.notified() => {
                    was_removed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            let _ = signalled_tx.send(());
        }
    };
    // Mutual TLS, or plaintext only when --insecure was given (logged).
    // Writers give up on a stalled agent stream by stream (their deadline
    // resets each one); when a stopped agent resumes, that backlog of resets
    // must not count as an attack (h2's default of 20 pending-accept resets
    // answers ENHANCE_YOUR_CALM and the writer's whole connection fails:
    // seen after a SIGSTOP under load).
    // Every call (tonic's decoding of a body included) ends within this;
    // the fast write path bounds its bodies by --body-timeout itself.
    let builder = Server::builder()
        .http2_max_pending_accept_reset_streams(Some(4096))
        .max_concurrent_streams(Some(config.max_streams))
        .timeout(config.body_timeout.saturating_mul(4));
    let mut limits = config.tls.listen_limits();
    limits.connection_buffer = config.connection_buffer as usize;
    let mut tls = None;
    let roles = match config.tls.server_mode("agent")? {
        Some(files) => {
            tls = Some(files.rustls_server_config()?);
            tracing::info!(ca = %files.ca.display(), cert = %files.cert.display(), "mutual TLS: callers need a pool certificate");
            aliquot_auth::RoleLayer::enforce()
        }
        None => aliquot_auth::RoleLayer::insecure(),
    };
    if agent.gate().enforcing() {
        tracing::info!("write tokens required (--token-key)");
    } else {
        tracing::warn!(
            unchecked_writes = config.unchecked_writes,
            "no --token-key: writes are not checked against the allocator's write tokens"
        );
    }
    let body_limits = fastwrite::BodyLimits {
        total: aliquot_auth::listen::Budget::new(config.max_buffered as usize),
        timeout: config.body_timeout,
    };
    tokio::spawn(give_back_idle_memory(body_limits.total.clone()));
    let fast_write = if config.no_fast_write {
        tracing::info!("--no-fast-write: unary Writes are decoded by tonic");
        fastwrite::FastWriteLayer::disabled(body_limits)
    } else {
        fastwrite::FastWriteLayer::new(agent.clone(), MAX_MESSAGE, body_limits)
    };
    let rpc = std::sync::Arc::new(telemetry::rpc_metrics::RpcMetrics::default());
    if let Some(a) = config.prometheus_listen {
        let bound = telemetry::rpc_metrics::serve(a, rpc.clone(), |l| {
            aliquot_auth::listen::GuardedListener::new(l, limits.clone())
        })
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind --prometheus-listen {a}: {e}"))?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN prometheus {bound}")?;
        out.flush()?;
    }
    let server = builder
        .trace_fn(telemetry::server_span)
        // Outside the role check, so refused calls are counted too.
        .layer(telemetry::rpc_metrics::RpcMetricsLayer(rpc))
        // Writes are large: HTTP/2's default 64 KiB windows and 16 KiB frames
        // would make every 1 MiB write wait on many window updates.
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .layer(roles)
        // Inside the role check: a Write it takes was authorized first.
        .layer(fast_write)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(svc)
        // Connections capped and TLS finished by our listener (nodelay too).
        .serve_with_incoming_shutdown(
            aliquot_auth::listen::GuardedListener::new(listener, limits).incoming(tls),
            shutdown,
        );
    let served = tokio::select! {
        r = server => r,
        _ = async {
            match signalled_rx.await {
                Ok(()) => tokio::time::sleep(SHUTDOWN_GRACE).await,
                Err(_) => std::future::pending().await,
            }
        } => {
            tracing::warn!(grace_ms = SHUTDOWN_GRACE.as_millis() as u64, "connections still open after the grace period; stopping anyway");
            Ok(())
        }
    };

    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    let flushed = agent.flush().await;
    agent.shutdown().await;
    served?;
    flushed?;
    if was_removed.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(AgentError::Removed.into());
    }
    tracing::info!("vdev agent stopped");
    Ok(())
}

// The runtime and malloc set-up every binary shares (the agent's main, and
// benches that run an agent in process).
pub use aliquot_process::{runtime, tune_allocator};

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is
/// called, not when the future is first polled: the server may answer calls
/// (and print LISTEN) before it polls its shutdown future, and a SIGTERM in
/// between would otherwise kill the process without flushing the device.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown signal received");
    }
}

/// Memory returns when the streams end: freed request
/// bodies go back to glibc's arenas, which keep them; once the body budget
/// has been in use and is idle again, hand the free pages back to the
/// kernel (`malloc_trim`). Checked every second; a no-op while idle.
async fn give_back_idle_memory(total: aliquot_auth::listen::Budget) {
    let mut used = false;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let idle = total.bytes.available_permits() == total.size;
        if !idle {
            used = true;
        } else if used {
            used = false;
            // SAFETY: malloc_trim only releases free memory of the allocator.
            #[cfg(target_env = "gnu")]
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }
}
