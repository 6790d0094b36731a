//! The allocator service: the pool's space maps and throttle behind gRPC.
//!
//! `Config` is the one clap struct (every flag also an `ALIQUOT_*` env var);
//! [`start`] validates, binds and serves in the background (tests use it on
//! port 0); [`run`] is what the binary (also `aliquotctl serve allocator`) calls:
//! start, print `LISTEN grpc <addr>`, serve until SIGINT/SIGTERM.
//! The policy lives in `crates/metaslab`; this crate waits, wakes and times.

pub mod admission;
pub mod balancer;
pub mod binding;
pub mod block_copies;
pub mod claim;
pub mod convert;
pub mod error;
pub mod extent_owners;
pub mod gen_space;
pub mod ha;
pub mod indirect;
pub mod leadership;
pub mod metrics_push;
pub mod migrate_cmd;
pub mod mover;
pub mod owner_map;
pub mod ownership;
pub mod pg_store;
pub mod read_grant;
pub mod rebalance;
pub mod recovery;
pub mod registry;
pub mod relocation;
pub mod service;
pub mod spacemap;
pub mod spacemap_log;
pub mod sql_store;
pub mod sqlite_store;
pub mod state;
pub mod store;
pub mod takeover;
pub mod txg;
pub mod verify_cmd;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aliquot_proto::v1::agent_registry_server::AgentRegistryServer;
use aliquot_proto::v1::allocator_server::AllocatorServer;
use metaslab::{Pool, ThrottlePolicy, Tunables};
use tokio::task::JoinHandle;

// The data dir's one-owner lock (shared with `aliquotctl up`).
pub use aliquot_process::lock;
pub use error::Error;
pub use pg_store::PgStore;
pub use sqlite_store::SqliteStore;
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
    /// Also serve this process's gRPC metrics (calls by method and code,
    /// latency histograms) as Prometheus `/metrics` over HTTP on this
    /// address (port 0 picks one; see the `LISTEN prometheus` line).
    #[arg(long, env = "ALIQUOT_PROMETHEUS_LISTEN")]
    pub prometheus_listen: Option<SocketAddr>,
    /// Pool name.
    #[arg(long, env = "ALIQUOT_POOL", default_value = "aliquot")]
    pub pool: String,
    /// Where the durable store lives (`<data-dir>/pool.db`, SQLite).
    #[arg(
        long,
        env = "ALIQUOT_DATA_DIR",
        default_value = "./aliquot-data/allocator"
    )]
    pub data_dir: PathBuf,
    /// The pool's state in PostgreSQL instead of `--data-dir`'s SQLite file
    /// (`postgres://user:password@host:port/database`): several allocators
    /// may then share it, one leading and the others standing by (see
    /// --leader-lease). The database may hold several pools, by --pool.
    #[arg(long, env = "ALIQUOT_STORE", value_name = "URL")]
    pub store: Option<String>,
    /// With --store: how long a leader's lease lasts. The leader renews it
    /// every third of that; a standby takes the pool once it has expired.
    #[arg(long, env = "ALIQUOT_LEADER_LEASE", default_value = "5s", value_parser = units::duration_arg)]
    pub leader_lease: Duration,
    /// With --store: the URL clients and agents reach this allocator at,
    /// named by standbys as the leader's (default: the scheme and the
    /// listen address).
    #[arg(long, env = "ALIQUOT_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,
    /// Refuse a store whose pool guid is not this (decimal or 0x-hex); a
    /// fresh pool is created with it.
    #[arg(long, env = "ALIQUOT_POOL_GUID", value_parser = parse_guid)]
    pub pool_guid: Option<u64>,
    /// Close the open txg early once its committed allocations, claims and
    /// frees pass this many bytes (as OpenZFS syncs early on dirty data).
    /// Also the `zfs_dirty_data_max` of the perf-bias busy rule: the pool is
    /// busy past 45 % of it in the open and syncing txgs.
    #[arg(long, env = "ALIQUOT_TXG_DIRTY_MAX", default_value = "1GiB", value_parser = units::size_arg)]
    pub txg_dirty_max: u64,
    /// The allocator's mover (vdev removal) copies at most this many bytes
    /// a second (e.g. 64MiB/s; 0 pauses it). Also the run-time tunable
    /// `move_rate` (SetTunable), which a restart keeps.
    #[arg(long, env = "ALIQUOT_MOVE_RATE", default_value = "64MiB/s", value_parser = units::rate_arg)]
    pub move_rate: f64,
    /// Close the open txg after this long (OpenZFS zfs_txg_timeout).
    #[arg(long, env = "ALIQUOT_ZFS_TXG_TIMEOUT", default_value = "5s", value_parser = units::duration_arg)]
    pub zfs_txg_timeout: Duration,
    /// Default lease: an allocation not committed within it is aborted (and
    /// its space deferred like a free, so a late writer cannot land on a
    /// block given to someone else).
    #[arg(long, env = "ALIQUOT_LEASE", default_value = "30s", value_parser = units::duration_arg)]
    pub lease: Duration,
    /// The longest lease a client may ask for (Allocate lease_ms, RenewLease);
    /// longer requests are refused.
    #[arg(long, env = "ALIQUOT_MAX_LEASE", default_value = "5min", value_parser = units::duration_arg)]
    pub max_lease: Duration,
    /// The longest an allocation may stay in flight, however often its lease
    /// is renewed: RenewLease past it is refused (commit or abort by then).
    #[arg(long, env = "ALIQUOT_MAX_LEASE_LIFETIME", default_value = "10min", value_parser = units::duration_arg)]
    pub max_lease_lifetime: Duration,
    /// Bytes one client identity (certificate) may hold allocated and not yet
    /// committed; an Allocate past it is refused RESOURCE_EXHAUSTED, reason
    /// LEASE_QUOTA. 0: no limit. Needs mutual TLS (identities).
    #[arg(long, env = "ALIQUOT_MAX_LEASED_PER_CLIENT", default_value = "0", value_parser = units::size_arg)]
    pub max_leased_per_client: u64,
    /// After a restart, how long Claim is served before Allocate may place
    /// anything (clients re-assert what they wrote after the last synced txg,
    /// as ZFS claims its intent log at import). 0 disables it.
    #[arg(long, env = "ALIQUOT_CLAIM_WINDOW", default_value = "10s", value_parser = units::duration_arg)]
    pub claim_window: Duration,
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
    /// The write-token signing key (`token.key` from `aliquotctl certs
    /// init`, or the CA directory holding it): each extent of an Allocate
    /// reply then carries a token agents with `token.pub` check.
    #[arg(long, env = "ALIQUOT_TOKEN_KEY")]
    pub token_key: Option<PathBuf>,
    /// Accept a store older than what the devices' labels saw (like `zpool
    /// import -F`): TXG must be the store's synced txg. Every txg after it
    /// that a label recorded is lost; blocks committed in them are free
    /// again and may be overwritten. The allocator refuses such a store
    /// without this flag and names the txg to give here. The acceptance is
    /// kept in the store: later starts do not need the flag.
    #[arg(long, env = "ALIQUOT_REWIND_TO", value_name = "TXG")]
    pub rewind_to: Option<u64>,
    /// Under mutual TLS, a device new to the pool joins only when an
    /// operator admits it (`aliquotctl vdev add NAME`); until then it waits
    /// in `status` as pending. NAME[:SIZE] admits ahead the first device the
    /// agent certificate NAME registers, of at most SIZE bytes when given
    /// (repeatable; the env var takes a comma-separated list). Devices
    /// already in the pool re-register without it.
    #[arg(long = "admit-agent", env = "ALIQUOT_ADMIT_AGENTS", value_delimiter = ',',
          value_name = "NAME[:SIZE]", value_parser = admission::parse_admit)]
    pub admit_agents: Vec<(String, Option<u64>)>,

    /// Mutual TLS: the pool CA and the allocator's certificate (role allocator).
    #[command(flatten)]
    pub tls: aliquot_auth::TlsArgs,

    /// Threads that serve RPCs. Default: one per core. Where several
    /// servers share a machine, fewer wake each other less: `aliquotctl up`
    /// gives each of its servers cores / servers.
    #[arg(long, env = "ALIQUOT_WORKER_THREADS",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,

    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Config {
    /// The defaults, listening on `listen` (for tests and embedding).
    pub fn with_listen(listen: SocketAddr) -> Config {
        let mut c = <Config as clap::Parser>::parse_from(["aliquot-allocator", "--insecure"]);
        c.listen = listen;
        c
    }
}

fn parse_guid(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse::<u64>(),
    };
    match r {
        Ok(0) => Err("a pool guid is never 0".into()),
        Ok(g) => Ok(g),
        Err(e) => Err(format!("{s:?} is not a guid: {e}")),
    }
}

/// Bad configuration (exit code 2), as opposed to a runtime failure.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

/// A validated configuration.
struct Validated {
    tunables: Tunables,
    /// The log space map's flush bounds (`spacemap_log`), set by --tunable.
    log_tunables: spacemap_log::LogTunables,
    txg_timeout: Duration,
    /// `--move-rate` (bytes/s), or its tunable.
    move_rate: u64,
    /// Names given with --tunable: they win over values in the store.
    explicit: Vec<String>,
}

fn validate(c: &Config) -> Result<Validated, ConfigError> {
    let mut tunables = Tunables {
        throttle_policy: c.throttle_policy.into(),
        ..Tunables::default()
    };
    let mut txg_timeout = c.zfs_txg_timeout;
    let mut log_tunables = spacemap_log::LogTunables::default();
    let mut move_rate = c.move_rate as u64;
    let mut explicit = Vec::new();
    for t in &c.tunables {
        let Some((name, value)) = t.split_once('=') else {
            return Err(ConfigError(format!("--tunable {t:?}: expected NAME=VALUE")));
        };
        let (name, value) = (name.trim(), value.trim());
        explicit.push(name.to_string());
        if name == service::ZFS_TXG_TIMEOUT {
            txg_timeout = service::parse_txg_timeout(value)
                .map_err(|e| ConfigError(format!("--tunable {t}: {e}")))?;
        } else if log_tunables
            .set(name, value)
            .map_err(|e| ConfigError(format!("--tunable {t}: {e}")))?
        {
        } else if name == mover::MOVE_RATE {
            move_rate =
                mover::parse_rate(value).map_err(|e| ConfigError(format!("--tunable {t}: {e}")))?;
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
    nonzero("max-lease", c.max_lease)?;
    if c.lease > c.max_lease {
        return Err(ConfigError(format!(
            "--lease ({:?}) must not exceed --max-lease ({:?})",
            c.lease, c.max_lease
        )));
    }
    nonzero("snapshot-interval", c.snapshot_interval)?;
    nonzero("report-interval", c.report_interval)?;
    if c.txg_dirty_max == 0 {
        return Err(ConfigError("--txg-dirty-max must be above zero".into()));
    }
    c.tls.check().map_err(|e| ConfigError(e.to_string()))?;
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
        log_tunables,
        txg_timeout,
        move_rate,
        explicit,
    })
}

/// A running allocator (in-process).
pub struct Running {
    pub addr: SocketAddr,
    /// Where `/metrics` is served, with --prometheus-listen.
    pub prometheus: Option<SocketAddr>,
    pub shared: Arc<Shared>,
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
        self.shared.stop.send_replace(true);
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
    validate(&config)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("bind {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    let incoming = guarded_incoming(&config, listener)?;
    start_serving(config, store, addr, incoming, None).await
}

/// Connections on `listener` under the connection caps, TLS finished (when
/// on) by `aliquot_auth::listen`, nodelay set (without it, Nagle and delayed
/// ACKs add ~40 ms to small RPCs).
pub(crate) fn guarded_incoming(
    config: &Config,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<
    tokio_stream::wrappers::ReceiverStream<std::io::Result<aliquot_auth::listen::Conn>>,
> {
    let tls = match config.tls.server_mode("allocator")? {
        Some(files) => Some(files.rustls_server_config()?),
        None => None,
    };
    Ok(
        aliquot_auth::listen::GuardedListener::new(listener, config.tls.listen_limits())
            .incoming(tls),
    )
}

/// [`start`] on connections that arrive on `incoming` (bound at `addr`),
/// leading under `lease` when the store is shared (`crate::ha`).
pub(crate) async fn start_serving<I>(
    config: Config,
    store: Arc<dyn Store>,
    addr: SocketAddr,
    incoming: I,
    lease: Option<Arc<leadership::Lease>>,
) -> anyhow::Result<Running>
where
    I: futures_util::Stream<Item = Result<aliquot_auth::listen::Conn, std::io::Error>>
        + Send
        + 'static,
{
    let mut v = validate(&config)?;
    store.set_log_tunables(v.log_tunables);
    let mut owners = extent_owners::ExtentOwners::default();
    let mut mappings = indirect::IndirectMap::default();
    let mut state_digest = 0;
    let (pool, guid, synced) = match store.load().await? {
        Some(p) => {
            if let Some(want) = config.pool_guid
                && want != p.pool_guid
            {
                return Err(ConfigError(format!(
                    "the store holds pool guid {:#x}, not the expected --pool-guid {want:#x}",
                    p.pool_guid
                ))
                .into());
            }
            restore_tunables(&mut v, &p.tunables);
            let pool = recovery::rebuild(v.tunables.clone(), &p).map_err(|e| {
                anyhow::anyhow!(
                    "refusing to start: the store is inconsistent: {e} (nothing was changed; \
                     inspect it with `aliquotctl verify`)"
                )
            })?;
            tracing::info!(
                synced_txg = p.synced_txg,
                vdevs = p.vdevs.len(),
                extents = p.allocated.len(),
                "pool recovered from the store"
            );
            owners = extent_owners::ExtentOwners::restore(p.owner_identities, p.owner_runs);
            mappings = indirect::IndirectMap::from_sorted(p.mappings).map_err(|e| {
                anyhow::anyhow!("refusing to start: the store's indirect mapping: {e}")
            })?;
            state_digest = p.state_digest;
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
            let g = config
                .pool_guid
                .unwrap_or_else(|| rand::random::<u64>() | 1);
            store.create(g).await?;
            g
        }
    };
    let settings = state::ServiceSettings {
        pool_name: config.pool.clone(),
        default_lease: config.lease,
        report_interval: config.report_interval,
        txg_timeout_us: AtomicU64::new(v.txg_timeout.as_micros() as u64),
        txg_dirty_max: config.txg_dirty_max,
        max_lease: config.max_lease,
        max_lease_lifetime: config.max_lease_lifetime,
        max_leased_per_client: config.max_leased_per_client,
        token_signer: match &config.token_key {
            Some(p) => Some(
                aliquot_auth::TokenSigner::load(p)
                    .map_err(|e| ConfigError(format!("--token-key: {e}")))?,
            ),
            None => {
                tracing::warn!("no --token-key: Allocate replies carry no write tokens");
                None
            }
        },
    };
    if let Some(t) = config.rewind_to
        && t != synced
    {
        return Err(ConfigError(format!(
            "--rewind-to {t}: the store's synced txg is {synced}; give --rewind-to {synced} to              accept it (or restore a newer store and start without the flag)"
        ))
        .into());
    }
    let generation = store.open_generation().await?;
    let history = store.generation_history().await?;
    let rewind_generation = if config.rewind_to.is_some() {
        store.set_rewind_generation(generation).await?;
        tracing::warn!(
            synced_txg = synced,
            generation,
            "--rewind-to: serving the store at its synced txg; whatever a device's label \
             recorded after it is lost (named as each device registers)"
        );
        generation
    } else {
        store.rewind_generation().await?
    };
    // A restarted pool (one the store already held) opens with a claim
    // window; a new one has nothing to claim, nor has one whose previous
    // leader handed it over cleanly (its last txg synced).
    let clean = store.handed_over_cleanly();
    let restarted = guid.is_some() && !clean;
    if guid.is_some() && clean {
        tracing::info!(
            generation,
            "the previous leader handed over cleanly: no claim window"
        );
    }
    let fencing = state::Fencing {
        generation,
        synced_at_open: synced,
        claim_window_until: (restarted && !config.claim_window.is_zero())
            .then(|| Instant::now() + config.claim_window),
        history,
        rewind_generation,
    };
    if restarted {
        tracing::info!(generation, synced_txg = synced, claim_window = ?config.claim_window,
            "claim window open: Claim is served; Allocate is served on every vdev whose agent \
             names what the older generation wrote there");
    }
    let shared = Shared::new(pool, settings, pool_guid, fencing, store, synced);
    if let Some(l) = lease {
        let _ = shared.lease.set(l);
    }
    // Agents are told which allocations ended only when there are tokens.
    shared.lock().revoke_tokens = shared.settings.token_signer.is_some();
    shared.mover.set_rate(v.move_rate);
    // The mover asks agents to copy as the allocator (its certificate).
    shared.mover.set_tls(config.tls.files().into());
    *shared
        .synced_state
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = (synced, state_digest);
    // A new pool, or one without a vdev whose label could object, syncs at
    // once; a restarted one waits for a device's label (`Shared::labels_vouched`).
    let vouched = guid
        .as_ref()
        .is_none_or(|(_, vdevs)| vdevs.iter().all(|r| shared.lock().pool.is_removed(r.id)));
    shared.labels_vouched.send_replace(vouched);
    if let Some((_, vdevs)) = guid {
        // Known vdevs come back silent and unallocatable until their agents
        // report: an agent learns the new generation from its RegisterReply
        // before it sends its first report, so a report proves that it will
        // refuse the previous generation's tokens. Allocating before that
        // would let a late write of the old generation land on an extent
        // already given to a client of this one.
        let now = Instant::now();
        let mut g = shared.lock();
        g.extent_owners = std::mem::take(&mut owners);
        g.indirect = std::mem::take(&mut mappings);
        for r in vdevs {
            g.by_guid.insert(r.guid, r.id);
            // A removed vdev keeps its guid (its device cannot rejoin
            // unnoticed) but nothing else.
            if g.pool.is_removed(r.id) {
                continue;
            }
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
                    silent: true,
                    generation_acked: false,
                    reported_health: metaslab::Health::Healthy,
                    stalled_reports: 0,
                    stalled: false,
                    // Until its agent says otherwise: the vdev's own size.
                    device_capacity: r.spec.capacity,
                    window_out: false,
                },
            );
            let _ = g.pool.set_health(r.id, metaslab::Health::Unavailable);
        }
    }

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<AllocatorServer<service::AllocatorService>>()
        .await;
    health_reporter
        .set_serving::<AgentRegistryServer<registry::RegistryService>>()
        .await;
    // Reflection (v1 and v1alpha) lists only what this binary serves.
    let (reflection, reflection_v1alpha) =
        aliquot_proto::reflection::services(&["aliquot.v1.Allocator", "aliquot.v1.AgentRegistry"])?;

    let mut background = vec![
        tokio::spawn(txg::run(shared.clone())),
        tokio::spawn(housekeeping(shared.clone())),
        tokio::spawn(mover::run(shared.clone())),
    ];
    if let Some(url) = &config.metrics {
        // Pushed over mutual TLS with the allocator's own certificate: the
        // metrics service takes snapshots from the allocator role only.
        background.push(tokio::spawn(metrics_push::run(
            shared.clone(),
            url.clone(),
            config.tls.files().into(),
            config.snapshot_interval,
        )));
    }

    let rpc = Arc::new(telemetry::rpc_metrics::RpcMetrics::default());
    // Per-vdev space counters and the txg persist gauge on /metrics.
    rpc.txg_persist_known();
    shared.lock().rpc = Some(rpc.clone());
    background.push(tokio::spawn(persist_health(
        shared.clone(),
        health_reporter.clone(),
    )));
    let bindings = Arc::new(binding::AgentBindings::from_store(
        shared.store.agent_bindings().await?,
    ));
    let alloc_svc = service::AllocatorService {
        shared: shared.clone(),
        rpc: rpc.clone(),
        bindings: bindings.clone(),
    };
    let reg_svc = registry::RegistryService {
        shared: shared.clone(),
        bindings,
        admit: Arc::new(admission::AdmitList::new(config.admit_agents.clone())),
    };
    let stop = shared.clone();
    let builder = tonic::transport::Server::builder();
    // Mutual TLS (finished by the listener: `guarded_incoming`), or
    // plaintext only when --insecure was given (logged).
    let roles = match config.tls.server_mode("allocator")? {
        Some(files) => {
            tracing::info!(ca = %files.ca.display(), cert = %files.cert.display(), "mutual TLS: callers need a pool certificate");
            aliquot_auth::RoleLayer::enforce()
        }
        None => aliquot_auth::RoleLayer::insecure(),
    };
    let prometheus = match config.prometheus_listen {
        Some(a) => Some(
            telemetry::rpc_metrics::serve(a, rpc.clone(), |l| {
                aliquot_auth::listen::GuardedListener::new(l, config.tls.listen_limits())
            })
            .await
            .map_err(|e| anyhow::anyhow!("cannot bind --prometheus-listen {a}: {e}"))?,
        ),
        None => None,
    };
    let server = tokio::spawn(
        builder
            .trace_fn(telemetry::server_span)
            // Outside the role check, so refused calls are counted too.
            .layer(telemetry::rpc_metrics::RpcMetricsLayer(rpc))
            .layer(roles)
            .add_service(health_service)
            .add_service(reflection)
            .add_service(reflection_v1alpha)
            .add_service(AllocatorServer::new(alloc_svc))
            .add_service(AgentRegistryServer::new(reg_svc))
            .serve_with_incoming_shutdown(incoming, async move { stop.stopping().await }),
    );
    tracing::info!(%addr, pool = %config.pool, guid = pool_guid, policy = ?config.throttle_policy,
        txg_timeout_ms = v.txg_timeout.as_millis() as u64, "allocator serving");
    Ok(Running {
        addr,
        prometheus,
        shared,
        server,
        background,
    })
}

/// Tunables set at run time come back from the store, except those given
/// with --tunable at this start (the operator's latest word).
fn restore_tunables(v: &mut Validated, stored: &[(String, String)]) {
    for (name, value) in stored {
        if v.explicit.iter().any(|n| n == name) {
            tracing::info!(name = %name, stored = %value, "tunable from --tunable overrides the stored value");
            continue;
        }
        let r = if name == service::ZFS_TXG_TIMEOUT {
            service::parse_txg_timeout(value)
                .map(|d| v.txg_timeout = d)
                .map_err(|e| e.to_string())
        } else if name == mover::MOVE_RATE {
            mover::parse_rate(value)
                .map(|r| v.move_rate = r)
                .map_err(|e| e.to_string())
        } else {
            v.tunables.set(name, value).map_err(|e| e.to_string())
        };
        match r {
            Ok(()) => {
                tracing::info!(name = %name, value = %value, "tunable restored from the store")
            }
            Err(e) => tracing::warn!(name = %name, value = %value, error = %e,
                "stored tunable not applied"),
        }
    }
}

/// gRPC health follows the store: NOT_SERVING (the server and the
/// Allocator service) while it refuses a txg, SERVING again once it took it.
async fn persist_health(shared: Arc<Shared>, health: tonic_health::server::HealthReporter) {
    let mut failure = shared.persist_failure.subscribe();
    loop {
        let status = match failure.borrow_and_update().is_some() {
            true => tonic_health::ServingStatus::NotServing,
            false => tonic_health::ServingStatus::Serving,
        };
        for service in ["", "aliquot.v1.Allocator"] {
            health.set_service_status(service, status).await;
        }
        tokio::select! {
            r = failure.changed() => if r.is_err() { return },
            _ = shared.stopping() => return,
        }
    }
}

/// Leases and liveness, checked every 50 ms.
async fn housekeeping(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.stopping() => return,
        }
        let now = Instant::now();
        let expired = shared.lock().expire_leases(now);
        shared.owners.expire(&expired);
        if !expired.is_empty() {
            tracing::info!(
                count = expired.len(),
                first = expired[0],
                "leases expired: allocations aborted"
            );
        }
        registry::check_liveness(&shared, now);
        takeover::check_window(&shared, now);
    }
}

/// SIGINT and SIGTERM, caught from the moment `install` returns (a signal
/// sent right after the LISTEN line must not kill the process unhandled).
pub struct ShutdownSignal {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl ShutdownSignal {
    pub fn install() -> ShutdownSignal {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            ShutdownSignal {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        ShutdownSignal {}
    }

    /// Resolves at the next SIGINT or SIGTERM.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        {
            async fn one(s: &mut Option<tokio::signal::unix::Signal>) {
                match s.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                _ = one(&mut self.term) => {}
                _ = one(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    ShutdownSignal::install().recv().await
}

/// The binary's body: start, print the LISTEN line, serve until a signal.
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Refuse bad flags before touching the store.
    validate(&config)?;
    if let Some(url) = &config.store {
        if !pg_store::is_postgres_url(url) {
            return Err(ConfigError(format!(
                "--store {}: expected a postgres:// URL (the SQLite store is --data-dir)",
                pg_store::redact(url)
            ))
            .into());
        }
        return ha::run(config.clone(), url.clone()).await;
    }
    let mut signals = ShutdownSignal::install();
    // One owner per store, for this process's lifetime (released by the
    // kernel however it ends).
    let _lock = lock::DataDirLock::acquire(&config.data_dir)?;
    let path = config.data_dir.join(sqlite_store::DB_FILE);
    let store = match SqliteStore::open(&path, &config.pool, config.pool_guid).await {
        Ok(s) => Arc::new(s),
        Err(e @ sqlite_store::OpenError::OtherPool { .. }) => {
            return Err(ConfigError(e.to_string()).into());
        }
        Err(e) => return Err(e.into()),
    };
    let running = match start(config, store.clone()).await {
        Ok(r) => r,
        Err(e) => {
            store.close().await;
            return Err(e);
        }
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTEN grpc {}", running.addr)?;
        if let Some(p) = running.prometheus {
            writeln!(out, "LISTEN prometheus {p}")?;
        }
        out.flush()?;
    }
    signals.recv().await;
    tracing::info!("shutting down");
    let shared = running.shared.clone();
    let quiet = shared.claim_window_remaining().is_zero();
    let r = running.shutdown().await;
    // As a PostgreSQL leader handing over: a shutdown whose last txg synced
    // with nothing dirty and no claim window open leaves nothing to claim,
    // and the next start opens no claim window.
    if quiet && r.is_ok() && shared.nothing_unsynced() {
        match store.hand_over_cleanly(shared.fencing.generation).await {
            Ok(()) => {
                tracing::info!("clean shutdown recorded: the next start opens no claim window")
            }
            Err(e) => tracing::warn!(error = %e, "could not record the clean shutdown"),
        }
    }
    store.close().await;
    r
}
