//! Balance history in SQLite, queries and SVG charts (`aliquot-metrics`).
//!
//! The allocator pushes a snapshot of its pool every few seconds (through
//! [`pusher::SnapshotPusher`]); this service stores it ([`store`]), answers
//! `History`/`Summary` over gRPC ([`service`]) and draws the charts over HTTP
//! ([`http`], [`charts`]) with a Prometheus `/metrics` ([`exposition`]).

#![forbid(unsafe_code)]

// The charts (a crate the CLI shares), under their old path.
pub use aliquot_charts as charts;
pub mod error;
pub mod exposition;
pub mod http;
pub mod pusher;
pub mod service;
pub mod store;

use aliquot_auth::listen::GuardedListener;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use aliquot_proto::v1::metrics_server::MetricsServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use error::MetricsError;
pub use pusher::SnapshotPusher;
pub use store::Store;

/// `aliquot-metrics` flags (each also an `ALIQUOT_*` variable).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "aliquot-metrics",
    version,
    about = "Aliquot balance history: SQLite store, History/Summary over gRPC, SVG charts over HTTP"
)]
pub struct Config {
    /// gRPC listen address.
    #[arg(long, env = "ALIQUOT_LISTEN", default_value = "127.0.0.1:7100")]
    pub listen: SocketAddr,
    /// HTTP listen address (charts, and Prometheus `/metrics`).
    #[arg(long, env = "ALIQUOT_HTTP_LISTEN", default_value = "127.0.0.1:7180")]
    pub http_listen: SocketAddr,
    /// SQLite database file (created if absent; a foreign file is refused).
    #[arg(long, env = "ALIQUOT_DB", default_value = "./aliquot-data/metrics.db")]
    pub db: PathBuf,
    /// How long raw samples are kept; older history stays as 1-minute aggregates.
    #[arg(long, env = "ALIQUOT_RETENTION", default_value = "7d", value_parser = units::duration_arg)]
    pub retention: Duration,
    /// How often aggregation and pruning run.
    #[arg(long, env = "ALIQUOT_MAINTENANCE_INTERVAL", default_value = "30s", value_parser = units::duration_arg)]
    pub maintenance_interval: Duration,
    /// Mutual TLS for the gRPC port: the pool CA and the metrics service's
    /// certificate (role metrics). The HTTP charts port is plaintext (keep
    /// it on loopback, the default, or behind a proxy).
    #[command(flatten)]
    pub tls: aliquot_auth::TlsArgs,
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Config {
    /// Checks that need no I/O; run before anything is opened or bound.
    pub fn validate(&self) -> Result<(), MetricsError> {
        if self.retention < Duration::from_secs(60) {
            return Err(MetricsError::Config(format!(
                "--retention {:?} is shorter than one minute (the aggregate resolution)",
                self.retention
            )));
        }
        if self.maintenance_interval.is_zero() {
            return Err(MetricsError::Config(
                "--maintenance-interval must be positive".into(),
            ));
        }
        self.tls
            .check()
            .map_err(|e| MetricsError::Config(e.to_string()))?;
        if self.db.as_os_str().is_empty() {
            return Err(MetricsError::Config("--db must name a file".into()));
        }
        Ok(())
    }
}

/// A running service (tests start it in-process).
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub store: Arc<Store>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl Running {
    /// Stop serving, wait for the servers and close the database.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.wait().await
    }

    async fn wait(self) -> anyhow::Result<()> {
        let mut first_err = None;
        for t in self.tasks {
            match t.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(e) if e.is_cancelled() => {}
                Err(e) => {
                    first_err.get_or_insert(anyhow::anyhow!("server task: {e}"));
                }
            }
        }
        self.store.close().await;
        first_err.map_or(Ok(()), Err)
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Validate, open the store, bind both listeners and serve in the background.
pub async fn start(config: &Config) -> anyhow::Result<Running> {
    config.validate()?;
    let store = Arc::new(Store::open(&config.db).await?);
    let grpc = TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {} (gRPC): {e}", config.listen))?;
    let http = TcpListener::bind(config.http_listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {} (HTTP): {e}", config.http_listen))?;
    let grpc_addr = grpc.local_addr()?;
    let http_addr = http.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);

    let rpc = Arc::new(exposition::RpcMetrics::default());
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<MetricsServer<service::MetricsService>>()
        .await;
    // Reflection (v1 and v1alpha) lists only what this binary serves.
    let (reflection, reflection_v1alpha) =
        aliquot_proto::reflection::services(&["aliquot.v1.Metrics"])?;
    let metrics = MetricsServer::new(service::MetricsService::new(store.clone()))
        .max_decoding_message_size(64 << 20);
    // Mutual TLS, or plaintext only when --insecure was given (logged).
    // Only the allocator role may record; pool members may read.
    let builder = tonic::transport::Server::builder();
    let mut tls = None;
    let roles = match config.tls.server_mode("metrics")? {
        Some(files) => {
            // The handshake runs in our listener: bounded in time and number.
            tls = Some(files.rustls_server_config()?);
            tracing::info!(ca = %files.ca.display(), cert = %files.cert.display(), "mutual TLS: callers need a pool certificate");
            aliquot_auth::RoleLayer::enforce()
        }
        None => aliquot_auth::RoleLayer::insecure(),
    };
    let grpc_incoming = GuardedListener::new(grpc, config.tls.listen_limits()).incoming(tls);
    let http = GuardedListener::new(http, config.tls.listen_limits());
    let grpc_task = tokio::spawn({
        let rx = stop_rx.clone();
        let rpc = rpc.clone();
        async move {
            builder
                .trace_fn(telemetry::server_span)
                .layer(exposition::RpcMetricsLayer(rpc))
                .layer(roles)
                .add_service(health_service)
                .add_service(reflection)
                .add_service(reflection_v1alpha)
                .add_service(metrics)
                .serve_with_incoming_shutdown(grpc_incoming, stopped(rx))
                .await
                .map_err(|e| anyhow::anyhow!("gRPC server: {e}"))
        }
    });
    let http_task = tokio::spawn({
        let rx = stop_rx.clone();
        let app = http::router(store.clone(), rpc.clone());
        async move {
            axum::serve(http, app)
                .with_graceful_shutdown(stopped(rx))
                .await
                .map_err(|e| anyhow::anyhow!("HTTP server: {e}"))
        }
    });
    // Health follows the store: NOT_SERVING while it cannot write (what a
    // load balancer or a probe should see), SERVING again once it does.
    let health_task = tokio::spawn({
        let rx = stop_rx.clone();
        let mut writable = store.writable();
        async move {
            let stop = stopped(rx);
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => return Ok(()),
                    changed = writable.changed() => if changed.is_err() { return Ok(()) },
                }
                let ok = *writable.borrow_and_update();
                let status = if ok {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                health.set_service_status("", status).await;
                if ok {
                    health
                        .set_serving::<MetricsServer<service::MetricsService>>()
                        .await;
                } else {
                    health
                        .set_not_serving::<MetricsServer<service::MetricsService>>()
                        .await;
                }
            }
        }
    });
    let maint_task = tokio::spawn({
        let rx = stop_rx.clone();
        let store = store.clone();
        let every = config.maintenance_interval;
        let retention = config.retention;
        async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let stop = stopped(rx);
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => return Ok(()),
                    _ = tick.tick() => {}
                }
                match store.maintain(service::now_ms(), retention).await {
                    Ok(s) if s.rows_pruned > 0 || s.minutes_aggregated > 0 => tracing::info!(
                        minutes_aggregated = s.minutes_aggregated,
                        rows_pruned = s.rows_pruned,
                        "retention pass"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "retention pass failed, will retry"),
                }
            }
        }
    });
    tracing::info!(grpc = %grpc_addr, http = %http_addr, db = %config.db.display(), retention = ?config.retention, "metrics serving");
    Ok(Running {
        grpc_addr,
        http_addr,
        store,
        stop,
        tasks: vec![grpc_task, http_task, maint_task, health_task],
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Serve until SIGINT/SIGTERM: prints `LISTEN grpc <addr>` and
/// `LISTEN http <addr>` on stdout once bound.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let running = start(&config).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN grpc {}", running.grpc_addr)?;
        writeln!(out, "LISTEN http {}", running.http_addr)?;
        out.flush()?;
    }
    shutdown_signal().await;
    tracing::info!("shutting down");
    running.shutdown().await
}

/// Exit code for an error `run` returned: 2 for configuration (flags, a
/// refused database), 1 otherwise.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    match err.downcast_ref::<MetricsError>() {
        Some(e) if e.is_config() => 2,
        _ => 1,
    }
}
