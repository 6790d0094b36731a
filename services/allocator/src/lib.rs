//! The allocator service: the pool's space maps and throttle behind gRPC.
//!
//! `Config` is the one clap struct (every flag also an `ALIQUOT_*` env var);
//! [`start`] validates, binds and serves in the background (tests use it on
//! port 0); [`run`] is what the binary and `aliquotctl serve allocator` call:
//! start, print `LISTEN grpc <addr>`, serve until SIGINT/SIGTERM.
//! The policy lives in `crates/metaslab`; this crate waits, wakes and times.

pub mod convert;
pub mod error;
pub mod registry;
pub mod service;
pub mod state;
pub mod store;
pub mod txg;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aliquot_proto::v1::agent_registry_server::AgentRegistryServer;
use aliquot_proto::v1::allocator_server::AllocatorServer;
use metaslab::{Pool, ThrottlePolicy, Tunables};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use error::Error;
pub use state::Shared;
pub use store::{MemStore, Store};

/// How the unified throttle is replaced, if at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ThrottlePolicyArg {
    Unified,
    Legacy,
    Off,
}

impl From<ThrottlePolicyArg> for ThrottlePolicy {
    fn from(p: ThrottlePolicyArg) -> ThrottlePolicy {
        match p {
            ThrottlePolicyArg::Unified => ThrottlePolicy::Unified,
            ThrottlePolicyArg::Legacy => ThrottlePolicy::Legacy,
            ThrottlePolicyArg::Off => ThrottlePolicy::Off,
        }
    }
}

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "aliquot-allocator",
    version,
    about = "Aliquot's allocator: space maps, throttle and txg clock of one pool"
)]
pub struct Config {
    /// gRPC listen address (port 0 picks a free port; see the LISTEN line).
    #[arg(long, env = "ALIQUOT_LISTEN", default_value = "127.0.0.1:7000")]
    pub listen: SocketAddr,
    /// Pool name.
    #[arg(long, env = "ALIQUOT_POOL", default_value = "aliquot")]
    pub pool: String,
    /// Where the durable store will live (the SQLite store is the next
    /// issue; this build keeps txgs in memory).
    #[arg(
        long,
        env = "ALIQUOT_DATA_DIR",
        default_value = "./aliquot-data/allocator"
    )]
    pub data_dir: PathBuf,
    /// Close the open txg after this long (OpenZFS zfs_txg_timeout).
    #[arg(long, env = "ALIQUOT_ZFS_TXG_TIMEOUT", default_value = "5s", value_parser = units::duration_arg)]
    pub zfs_txg_timeout: Duration,
    /// Default lease: an allocation not committed within it is aborted.
    #[arg(long, env = "ALIQUOT_LEASE", default_value = "30s", value_parser = units::duration_arg)]
    pub lease: Duration,
    /// Admission throttle policy.
    #[arg(long, env = "ALIQUOT_THROTTLE_POLICY", value_enum, default_value_t = ThrottlePolicyArg::Unified)]
    pub throttle_policy: ThrottlePolicyArg,
    /// A policy tunable, NAME=VALUE with OpenZFS's names (repeatable; the env
    /// var takes a comma-separated list).
    #[arg(long = "tunable", env = "ALIQUOT_TUNABLES", value_delimiter = ',')]
    pub tunables: Vec<String>,
    /// The metrics service to push balance snapshots to.
    #[arg(long, env = "ALIQUOT_METRICS")]
    pub metrics: Option<String>,
    /// How often a balance snapshot is pushed to --metrics.
    #[arg(long, env = "ALIQUOT_SNAPSHOT_INTERVAL", default_value = "1s", value_parser = units::duration_arg)]
    pub snapshot_interval: Duration,
    /// How often agents report; a vdev silent for 3 intervals is unavailable.
    #[arg(long, env = "ALIQUOT_REPORT_INTERVAL", default_value = "1s", value_parser = units::duration_arg)]
    pub report_interval: Duration,
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Config {
    /// The defaults, listening on `listen` (for tests and embedding).
    pub fn with_listen(listen: SocketAddr) -> Config {
        let mut c = <Config as clap::Parser>::parse_from(["aliquot-allocator"]);
        c.listen = listen;
        c
    }
}

/// Bad configuration (exit code 2), as opposed to a runtime failure.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

/// A validated configuration.
struct Validated {
    tunables: Tunables,
    txg_timeout: Duration,
}

fn validate(c: &Config) -> Result<Validated, ConfigError> {
    let mut tunables = Tunables {
        throttle_policy: c.throttle_policy.into(),
        ..Tunables::default()
    };
    let mut txg_timeout = c.zfs_txg_timeout;
    for t in &c.tunables {
        let Some((name, value)) = t.split_once('=') else {
            return Err(ConfigError(format!("--tunable {t:?}: expected NAME=VALUE")));
        };
        let (name, value) = (name.trim(), value.trim());
        if name == service::ZFS_TXG_TIMEOUT {
            txg_timeout = service::parse_txg_timeout(value)
                .map_err(|e| ConfigError(format!("--tunable {t}: {e}")))?;
        } else {
            tunables
                .set(name, value)
                .map_err(|e| ConfigError(format!("--tunable {t}: {e}")))?;
        }
    }
    let nonzero = |name: &str, d: Duration| {
        if d.is_zero() {
            Err(ConfigError(format!("--{name} must be above zero")))
        } else {
            Ok(())
        }
    };
    nonzero("zfs-txg-timeout", txg_timeout)?;
    nonzero("lease", c.lease)?;
    nonzero("snapshot-interval", c.snapshot_interval)?;
    nonzero("report-interval", c.report_interval)?;
    if c.pool.trim().is_empty() {
        return Err(ConfigError("--pool must not be empty".into()));
    }
    if let Some(m) = &c.metrics
        && m.parse::<tonic::transport::Uri>().is_err()
    {
        return Err(ConfigError(format!("--metrics {m:?} is not a URL")));
    }
    Ok(Validated {
        tunables,
        txg_timeout,
    })
}

/// A running allocator (in-process).
pub struct Running {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<JoinHandle<()>>,
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop serving: parked requests get Unavailable, a last txg is synced.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shared.shutting_down.store(true, Ordering::Relaxed);
        self.shared.lock().drop_waiters();
        let _ = self.shutdown.send(true);
        let served = self.server.await;
        for h in self.background {
            let _ = h.await;
        }
        served??;
        Ok(())
    }
}

/// Validate, rebuild the pool from `store`, bind and serve in the background.
pub async fn start(config: Config, store: Arc<dyn Store>) -> anyhow::Result<Running> {
    let v = validate(&config)?;
    let (pool, guid, synced) = match store.load().await? {
        Some(p) => {
            let vdevs = p.vdevs.iter().map(|r| (r.id, r.spec.clone())).collect();
            let pool = Pool::restore(v.tunables, vdevs, &p.allocated, p.synced_txg)
                .map_err(|e| anyhow::anyhow!("store is inconsistent: {e}"))?;
            (pool, Some((p.pool_guid, p.vdevs)), p.synced_txg)
        }
        None => {
            let pool = Pool::new(v.tunables);
            let synced = pool.open_txg().saturating_sub(1);
            (pool, None, synced)
        }
    };
    let pool_guid = match &guid {
        Some((g, _)) => *g,
        None => {
            let g = rand::random::<u64>() | 1;
            store.create(g).await?;
            g
        }
    };
    let settings = state::ServiceSettings {
        pool_name: config.pool.clone(),
        default_lease: config.lease,
        report_interval: config.report_interval,
        txg_timeout_us: AtomicU64::new(v.txg_timeout.as_micros() as u64),
    };
    let shared = Shared::new(pool, settings, pool_guid, store, synced);
    if let Some((_, vdevs)) = guid {
        // Known vdevs come back silent until their agents report.
        let now = Instant::now();
        let mut g = shared.lock();
        for r in vdevs {
            g.by_guid.insert(r.guid, r.id);
            g.vdevs.insert(
                r.id,
                state::VdevInfo {
                    guid: r.guid,
                    name: r.name,
                    endpoint: r.endpoint,
                    backend: String::new(),
                    last_report: None,
                    last_seen: now,
                    prev_report: None,
                    last_report_at: None,
                    silent: false,
                    reported_health: metaslab::Health::Healthy,
                },
            );
        }
    }

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("bind {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<AllocatorServer<service::AllocatorService>>()
        .await;
    health_reporter
        .set_serving::<AgentRegistryServer<registry::RegistryService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(aliquot_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut background = vec![
        tokio::spawn(txg::run(shared.clone(), shutdown_rx.clone())),
        tokio::spawn(housekeeping(shared.clone(), shutdown_rx.clone())),
    ];
    if let Some(url) = &config.metrics {
        background.push(tokio::spawn(metrics_push::run(
            shared.clone(),
            url.clone(),
            config.snapshot_interval,
            shutdown_rx.clone(),
        )));
    }

    let alloc_svc = service::AllocatorService {
        shared: shared.clone(),
    };
    let reg_svc = registry::RegistryService {
        shared: shared.clone(),
    };
    let mut rx = shutdown_rx;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .trace_fn(telemetry::server_span)
            .add_service(health_service)
            .add_service(reflection)
            .add_service(AllocatorServer::new(alloc_svc))
            .add_service(AgentRegistryServer::new(reg_svc))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                },
            ),
    );
    tracing::info!(%addr, pool = %config.pool, guid = pool_guid, policy = ?config.throttle_policy,
        txg_timeout_ms = v.txg_timeout.as_millis() as u64, "allocator serving");
    Ok(Running {
        addr,
        shared,
        shutdown: shutdown_tx,
        server,
        background,
    })
}

/// Leases and liveness, checked every 50 ms.
async fn housekeeping(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let now = Instant::now();
        let expired = shared.lock().expire_leases(now);
        if !expired.is_empty() {
            tracing::info!(
                count = expired.len(),
                first = expired[0],
                "leases expired: allocations aborted"
            );
        }
        registry::check_liveness(&shared, now);
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = ctrl_c => {}
            _ = async {
                match term.as_mut() {
                    Some(t) => { t.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The binary's body: start, print the LISTEN line, serve until a signal.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let running = start(config, Arc::new(MemStore::new())).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN grpc {}", running.addr)?;
        out.flush()?;
    }
    shutdown_signal().await;
    tracing::info!("shutting down");
    running.shutdown().await
}

pub mod metrics_push;
