//! A local pool as child processes: `aliquotctl up` and `demo`. Each child
//! is a service binary (`aliquot-metrics`, `aliquot-allocator`,
//! `aliquot-agent`, found by [`crate::binaries::find`]), in its own process
//! group (so a terminal's Ctrl-C reaches only us and we
//! stop the children in order: agents, allocator, metrics), with its stdin
//! a pipe from us: if we die without stopping them, they see EOF and shut
//! themselves down. Addresses come from the children's `LISTEN` lines.
//!
//! Secure by default: the pool CA and a certificate per service live in
//! `<data-dir>/certs` (made at the first start, reused after), every child
//! serves mutual TLS and checks write tokens, and the operator's
//! `admin-operator` certificate there is what `aliquotctl status` & co. use
//! by default. `--insecure` starts everything in plaintext instead.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use aliquot_proto::v1::{GetPoolRequest, PoolStatus, VdevHealth};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{ChildStdin, Command};
use tokio::sync::{mpsc, watch};

use aliquot_process::SUPERVISED_ENV;

use crate::client;

/// How long `up --ha` waits for a leader after it restarted an allocator:
/// a lease (5 s by default) and a takeover, with room to spare.
const LEADER_KNOWN_WITHIN: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, clap::Args)]
pub struct PoolArgs {
    /// Where devices, databases and logs go.
    #[arg(long, env = "ALIQUOT_DATA_DIR", default_value = "./aliquot-data")]
    pub data_dir: PathBuf,
    /// Pool name.
    #[arg(long, env = "ALIQUOT_POOL", default_value = "aliquot")]
    pub pool: String,
    /// Sizes of the file agents (sparse files), comma-separated.
    #[arg(long, env = "ALIQUOT_AGENTS", value_delimiter = ',', value_parser = units::size_arg,
          default_value = "1GiB,2GiB,4GiB")]
    pub agents: Vec<u64>,
    /// A simulated agent, KIND:SIZE:BANDWIDTH[:LATENCY] with KIND hdd or ssd,
    /// e.g. hdd:4GiB:150MiB/s or ssd:2GiB:1GiB/s:100us (repeatable).
    #[arg(long, env = "ALIQUOT_SIM", value_delimiter = ',', value_parser = parse_sim)]
    pub sim: Vec<SimSpec>,
    /// Do not start the metrics service.
    #[arg(long, env = "ALIQUOT_NO_METRICS")]
    pub no_metrics: bool,
    /// Always use ephemeral ports (by default the well-known ones when free).
    #[arg(long, env = "ALIQUOT_EPHEMERAL")]
    pub ephemeral: bool,
    /// Allocator address, used when free (else an ephemeral port).
    #[arg(
        long,
        env = "ALIQUOT_ALLOCATOR_LISTEN",
        default_value = "127.0.0.1:7000"
    )]
    pub allocator_listen: SocketAddr,
    /// High availability on this machine: a PostgreSQL server of the pool's
    /// own (initdb in DATA_DIR/postgres on first use, run as an
    /// unprivileged user when started as root) and two allocators sharing
    /// it, one leading and one standing by; agents and clients are given
    /// both. Needs Debian's `postgresql` package (initdb, postgres).
    #[arg(long, env = "ALIQUOT_HA")]
    pub ha: bool,
    /// With --ha: the PostgreSQL port, used when free.
    #[arg(long, env = "ALIQUOT_POSTGRES_PORT", default_value_t = 7432)]
    pub postgres_port: u16,
    /// Metrics gRPC address, used when free.
    #[arg(long, env = "ALIQUOT_METRICS_LISTEN", default_value = "127.0.0.1:7100")]
    pub metrics_listen: SocketAddr,
    /// Metrics HTTP (charts) address, used when free.
    #[arg(
        long,
        env = "ALIQUOT_METRICS_HTTP_LISTEN",
        default_value = "127.0.0.1:7180"
    )]
    pub metrics_http_listen: SocketAddr,
    /// Serve the allocator's and each agent's gRPC metrics as Prometheus
    /// `/metrics` on this address, a port each (`up` prints them): an IP
    /// (e.g. 127.0.0.1: ephemeral ports, new at each start) or IP:PORT, a
    /// base port (the allocator on PORT, the standby of --ha on PORT+1,
    /// then each agent in order on the next ones: the same every start, for
    /// a static scrape config). The metrics service's pool gauges are on
    /// its charts port.
    #[arg(long, env = "ALIQUOT_PROMETHEUS_LISTEN", value_parser = parse_prometheus_listen)]
    pub prometheus_listen: Option<SocketAddr>,
    /// Allocator tunable NAME=VALUE (repeatable), e.g. metaslab_perf_bias=0.
    #[arg(long, env = "ALIQUOT_TUNABLE", value_delimiter = ',')]
    pub tunable: Vec<String>,
    /// Allocator txg interval (default: the allocator's, 5s).
    #[arg(long, env = "ALIQUOT_ZFS_TXG_TIMEOUT")]
    pub zfs_txg_timeout: Option<String>,
    /// Allocator throttle policy: unified, legacy or off.
    #[arg(long, env = "ALIQUOT_THROTTLE_POLICY")]
    pub throttle_policy: Option<String>,
    /// How often the allocator sends a balance snapshot to metrics.
    #[arg(long, env = "ALIQUOT_SNAPSHOT_INTERVAL", default_value = "1s")]
    pub snapshot_interval: String,
    /// Plaintext gRPC, no certificates, no write tokens: anyone who reaches
    /// the ports may call anything. By default `up` makes a pool CA and
    /// certificates in <data-dir>/certs and starts everything with mutual TLS.
    #[arg(long, env = "ALIQUOT_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
}

/// Where `up` keeps the pool CA and certificates.
pub fn certs_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("certs")
}

#[derive(Clone, Debug, PartialEq)]
pub struct SimSpec {
    pub rotational: bool,
    pub capacity: u64,
    pub bandwidth: f64,
    pub latency: Duration,
}

/// `--prometheus-listen`: an IP (port 0: ephemeral) or IP:PORT (a base).
pub fn parse_prometheus_listen(s: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, 0));
    }
    s.parse::<SocketAddr>()
        .map_err(|_| format!("{s:?}: an IP address (e.g. 127.0.0.1) or IP:PORT (a base port)"))
}

/// The `n`th Prometheus listener's address from `--prometheus-listen`
/// `base`: ephemeral when no port was given, else the base port plus `n`.
fn prometheus_addr(base: SocketAddr, n: u16) -> SocketAddr {
    match base.port() {
        0 => base,
        p => SocketAddr::new(base.ip(), p.saturating_add(n)),
    }
}

pub fn parse_sim(s: &str) -> Result<SimSpec, String> {
    let parts: Vec<&str> = s.split(':').collect();
    if !(3..=4).contains(&parts.len()) {
        return Err(format!(
            "{s:?}: expected KIND:SIZE:BANDWIDTH[:LATENCY], e.g. hdd:4GiB:150MiB/s"
        ));
    }
    let rotational = match parts[0] {
        "hdd" => true,
        "ssd" => false,
        k => return Err(format!("{s:?}: kind {k:?} is not hdd or ssd")),
    };
    let capacity = units::size_arg(parts[1])?;
    let bandwidth = units::rate_arg(parts[2])?;
    if bandwidth <= 0.0 {
        return Err(format!("{s:?}: bandwidth must be positive"));
    }
    // Typical access times when none is given: a seek for disks, a flash read.
    let latency = match parts.get(3) {
        Some(l) => units::duration_arg(l)?,
        None if rotational => Duration::from_millis(4),
        None => Duration::from_micros(80),
    };
    Ok(SimSpec {
        rotational,
        capacity,
        bandwidth,
        latency,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Agent,
    Allocator,
    Metrics,
}

impl Role {
    fn binary(self) -> &'static str {
        match self {
            Role::Agent => crate::binaries::AGENT,
            Role::Allocator => crate::binaries::ALLOCATOR,
            Role::Metrics => crate::binaries::METRICS,
        }
    }
}

struct Child {
    name: String,
    role: Role,
    pid: i32,
    log: PathBuf,
    status: watch::Receiver<Option<ExitStatus>>,
    // Held open: the child stops itself when this pipe closes.
    _stdin: Option<ChildStdin>,
}

/// An agent of the local pool, as started.
#[derive(Clone, Debug)]
pub struct AgentInfo {
    pub name: String,
    pub kind: String,
    pub capacity: u64,
    pub path: Option<PathBuf>,
    pub url: String,
}

/// A running local pool; [`LocalPool::stop`] ends it.
pub struct LocalPool {
    children: Vec<Child>,
    pub data_dir: PathBuf,
    pub pool: String,
    pub allocator_url: String,
    pub allocator_addr: SocketAddr,
    pub metrics_url: Option<String>,
    pub metrics_http: Option<SocketAddr>,
    pub agents: Vec<AgentInfo>,
    /// File agents not started because the store says their vdev was
    /// removed from the pool: (name, device file).
    pub skipped: Vec<(String, PathBuf)>,
    /// With --prometheus-listen: (child, its /metrics address).
    pub prometheus: Vec<(String, SocketAddr)>,
    /// How clients reach this pool: the operator's certificate, or plaintext.
    pub tls: aliquot_auth::ClientTls,
    deaths: mpsc::UnboundedReceiver<(String, ExitStatus)>,
    deaths_tx: mpsc::UnboundedSender<(String, ExitStatus)>,
    /// With --ha: the pool's PostgreSQL server and its URL.
    pub postgres: Option<(local_postgres::Postgres, String)>,
    /// With --ha: each allocator's flags, its listen address pinned to the
    /// one it bound, to start it again (as a standby) after it exits.
    ha_allocators: Vec<(String, Vec<String>)>,
    /// `--worker-threads` for every server it starts (see
    /// [`servers_worker_threads`]); None: the operator set
    /// ALIQUOT_WORKER_THREADS, which the children inherit.
    worker_threads: Option<u16>,
    /// Held while the pool runs (see `DataDirLock`).
    _lock: aliquot_process::lock::DataDirLock,
}

/// Network threads per server when `servers` servers share this machine:
/// its cores divided among them, at least one. Every server of a local
/// pool on one runtime thread per core wakes the others' threads for
/// nothing: on 2 cores (3 agents and the allocator), one thread each cost
/// the agents 0.86x and the allocator 0.83x their CPU per MiB at 1.06x the
/// throughput, plaintext, and the agents 0.92x under mutual TLS (the
/// `data_path` bench).
fn servers_worker_threads(servers: usize) -> u16 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / servers.max(1)).clamp(1, u16::MAX as usize) as u16
}

/// The address to pass: the well-known one if we can bind it now, else port 0.
fn pick(addr: SocketAddr, ephemeral: bool) -> SocketAddr {
    if !ephemeral && TcpListener::bind(addr).is_ok() {
        addr
    } else {
        SocketAddr::new(addr.ip(), 0)
    }
}

impl LocalPool {
    /// Start metrics, the allocator and every agent, and wait until every
    /// agent has registered. On failure everything started is stopped.
    pub async fn start(args: &PoolArgs) -> anyhow::Result<LocalPool> {
        if args.agents.is_empty() && args.sim.is_empty() {
            anyhow::bail!("no agents: give --agents SIZES and/or --sim SPEC");
        }
        for t in &args.tunable {
            if !t.contains('=') {
                anyhow::bail!("--tunable {t:?}: expected NAME=VALUE");
            }
        }
        // One `up` per data dir: a second one on a running pool would start
        // a second allocator and metrics service on the same files.
        let lock = aliquot_process::lock::DataDirLock::acquire_named(
            &args.data_dir,
            "up.lock",
            "aliquotctl up",
        )?;
        let logs = args.data_dir.join("logs");
        std::fs::create_dir_all(&logs)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", logs.display()))?;
        std::fs::create_dir_all(args.data_dir.join("vdevs"))?;
        let tls = if args.insecure {
            aliquot_auth::ClientTls::Insecure
        } else {
            let certs = certs_dir(&args.data_dir);
            let ca = aliquot_auth::PoolCa::open_or_init(&certs, &args.pool)
                .map_err(|e| anyhow::anyhow!("pool CA in {}: {e}", certs.display()))?;
            let op = aliquot_auth::client::OPERATOR;
            ca.ensure_issued(aliquot_auth::Role::Admin, op, &[])?;
            aliquot_auth::ClientTls::Mutual(aliquot_auth::TlsFiles::in_dir(
                &certs,
                aliquot_auth::Role::Admin,
                op,
            ))
        };
        let (deaths_tx, deaths) = mpsc::unbounded_channel();
        let mut pool = LocalPool {
            children: Vec::new(),
            data_dir: args.data_dir.clone(),
            pool: args.pool.clone(),
            allocator_url: String::new(),
            allocator_addr: args.allocator_listen,
            metrics_url: None,
            metrics_http: None,
            agents: Vec::new(),
            skipped: Vec::new(),
            prometheus: Vec::new(),
            tls,
            deaths,
            deaths_tx,
            postgres: None,
            ha_allocators: Vec::new(),
            worker_threads: std::env::var_os("ALIQUOT_WORKER_THREADS")
                .is_none()
                .then(|| {
                    servers_worker_threads(
                        args.agents.len() + args.sim.len() + if args.ha { 2 } else { 1 },
                    )
                }),
            _lock: lock,
        };
        match pool.start_all(args).await {
            Ok(()) => Ok(pool),
            Err(e) => {
                pool.stop().await;
                Err(e)
            }
        }
    }

    async fn start_all(&mut self, args: &PoolArgs) -> anyhow::Result<()> {
        let dir = &args.data_dir;
        if !args.no_metrics {
            let l = pick(args.metrics_listen, args.ephemeral);
            let h = pick(args.metrics_http_listen, args.ephemeral);
            let mut margs: Vec<String> = vec![
                "--listen".into(),
                l.to_string(),
                "--http-listen".into(),
                h.to_string(),
                "--db".into(),
                dir.join("metrics.db").display().to_string(),
            ];
            margs.extend(self.security_flags(aliquot_auth::Role::Metrics, "metrics")?);
            let a = self
                .spawn("metrics", Role::Metrics, &margs, &["grpc", "http"])
                .await?;
            self.metrics_url = Some(format!("{}://{}", self.scheme(), a[0]));
            self.metrics_http = Some(a[1]);
        }
        let l = pick(args.allocator_listen, args.ephemeral);
        let mut aargs: Vec<String> = vec![
            "--listen".into(),
            l.to_string(),
            "--pool".into(),
            args.pool.clone(),
            "--data-dir".into(),
            dir.join("allocator").display().to_string(),
        ];
        if let Some(m) = &self.metrics_url {
            aargs.extend(["--metrics".into(), m.clone()]);
            aargs.extend(["--snapshot-interval".into(), args.snapshot_interval.clone()]);
        }
        if let Some(t) = &args.zfs_txg_timeout {
            aargs.extend(["--zfs-txg-timeout".into(), t.clone()]);
        }
        if let Some(t) = &args.throttle_policy {
            aargs.extend(["--throttle-policy".into(), t.clone()]);
        }
        for t in &args.tunable {
            aargs.extend(["--tunable".into(), t.clone()]);
        }
        // OpenZFS sets an embedded log metaslab aside only on vdevs of more
        // than zfs_embedded_slog_min_ms (64) metaslabs, i.e. above ~32 GiB at
        // its default 16 to 200 per vdev. A local pool's GiB-sized files would
        // get none, so unless told otherwise ask for 128 metaslabs a vdev
        // (never below OpenZFS's 16 MiB): every vdev of 1.1 GiB or more gets
        // one. `up` names those that do not (see `embedded_log_notes`).
        if !args.tunable.iter().any(|t| {
            t.starts_with("zfs_vdev_min_ms_count=") || t.starts_with("zfs_embedded_slog_min_ms=")
        }) {
            aargs.extend([
                "--tunable".into(),
                format!("zfs_vdev_min_ms_count={LOCAL_MIN_MS_COUNT}"),
            ]);
        }
        // `up` is the operator of the agents it starts: their devices join
        // the pool without a `vdev add` each (names as given below).
        if self.tls.is_tls() {
            let (mut nh, mut ns) = (0, 0);
            let sims = args.sim.iter().map(|s| {
                let n = if s.rotational { &mut nh } else { &mut ns };
                *n += 1;
                let kind = if s.rotational { "hdd" } else { "ssd" };
                (format!("{kind}{}", *n - 1), s.capacity)
            });
            let files = args
                .agents
                .iter()
                .enumerate()
                .map(|(i, c)| (format!("file{i}"), *c));
            for (name, cap) in files.chain(sims).collect::<Vec<_>>() {
                aargs.extend(["--admit-agent".into(), format!("{name}:{cap}")]);
            }
        }
        aargs.extend(self.security_flags(aliquot_auth::Role::Allocator, "allocator")?);
        // Listener n of --prometheus-listen: 0 the allocator, 1 the --ha
        // standby, then the agents (1 + i without --ha, 2 + i with).
        let prom_at = |n: u16| -> Vec<String> {
            args.prometheus_listen
                .map(|base| {
                    vec![
                        "--prometheus-listen".into(),
                        prometheus_addr(base, n).to_string(),
                    ]
                })
                .unwrap_or_default()
        };
        let prom = prom_at(0);
        let kinds: &[&str] = if prom.is_empty() {
            &["grpc"]
        } else {
            &["grpc", "prometheus"]
        };
        aargs.extend(prom.iter().cloned());
        if args.ha {
            // 0 (ephemeral, or the port is taken): a free one, picked
            // again if another process takes it before PostgreSQL binds.
            let port = pick(
                SocketAddr::from(([127, 0, 0, 1], args.postgres_port)),
                args.ephemeral,
            )
            .port();
            let pgdir = dir.join("postgres");
            let pg = tokio::task::spawn_blocking(move || {
                local_postgres::Postgres::start_in(&pgdir, port)
            })
            .await?
            .map_err(|e| anyhow::anyhow!("--ha: the pool's PostgreSQL: {e}"))?;
            let url = pg.url();
            aargs.extend(["--store".into(), url.clone()]);
            self.postgres = Some((pg, url));
        }
        let a = self
            .spawn("allocator", Role::Allocator, &aargs, kinds)
            .await?;
        if let Some(p) = a.get(1) {
            self.prometheus.push(("allocator".into(), *p));
        }
        self.allocator_addr = a[0];
        self.allocator_url = format!("{}://{}", self.scheme(), a[0]);
        if args.ha {
            let pin = |args: &[String], addr: SocketAddr| {
                let mut v = args.to_vec();
                if let Some(i) = v.iter().position(|a| a == "--listen") {
                    v[i + 1] = addr.to_string();
                }
                v
            };
            self.ha_allocators
                .push(("allocator".into(), pin(&aargs, a[0])));
            // The standby: the same flags on another port.
            let mut bargs = pin(&aargs, SocketAddr::from(([127, 0, 0, 1], 0)));
            if let Some(i) = bargs.iter().position(|a| a == "--prometheus-listen") {
                bargs[i + 1] = prom_at(1)[1].clone();
            }
            let b = self
                .spawn("allocator-b", Role::Allocator, &bargs, kinds)
                .await?;
            if let Some(p) = b.get(1) {
                self.prometheus.push(("allocator-b".into(), *p));
            }
            self.ha_allocators
                .push(("allocator-b".into(), pin(&bargs, b[0])));
            self.allocator_url = format!("{},{}://{}", self.allocator_url, self.scheme(), b[0]);
        }

        // Agents report their own addresses.
        // (name, kind, capacity, path, backend flags, Prometheus listener)
        type Spec = (String, String, u64, Option<PathBuf>, Vec<String>, u16);
        let first_agent: u16 = if args.ha { 2 } else { 1 };
        let mut specs: Vec<Spec> = Vec::new();
        let removed = self.removed_vdevs().await;
        for (i, cap) in args.agents.iter().enumerate() {
            let name = format!("file{i}");
            let path = dir.join("vdevs").join(format!("{name}.img"));
            // Its device file still carries the removed vdev's label: the
            // allocator would refuse it (VDEV_REMOVED), so do not start it.
            if removed.contains(&name) && path.exists() {
                self.skipped.push((name, path));
                continue;
            }
            let extra = vec![
                "--backend".into(),
                "file".into(),
                "--path".into(),
                path.display().to_string(),
            ];
            let n = first_agent.saturating_add(i as u16);
            specs.push((name, "file".into(), *cap, Some(path), extra, n));
        }
        let (mut nh, mut ns) = (0, 0);
        for (j, s) in args.sim.iter().enumerate() {
            let prom_n = first_agent.saturating_add((args.agents.len() + j) as u16);
            let kind = if s.rotational { "hdd" } else { "ssd" };
            let n = if s.rotational { &mut nh } else { &mut ns };
            let name = format!("{kind}{n}");
            *n += 1;
            let mut extra = vec![
                "--backend".into(),
                "sim".into(),
                "--bandwidth".into(),
                format!("{}", s.bandwidth as u64),
                "--latency".into(),
                format!("{}us", s.latency.as_micros()),
            ];
            if s.rotational {
                extra.push("--rotational".into());
            }
            specs.push((name, format!("sim {kind}"), s.capacity, None, extra, prom_n));
        }
        let mut starts = Vec::new();
        for (name, kind, cap, path, extra, prom_n) in specs {
            let mut fa: Vec<String> = vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--allocator".into(),
                self.allocator_url.clone(),
                "--name".into(),
                name.clone(),
                "--capacity".into(),
                cap.to_string(),
            ];
            fa.extend(extra);
            fa.extend(prom_at(prom_n));
            fa.extend(self.security_flags(aliquot_auth::Role::Agent, &name)?);
            starts.push((name, kind, cap, path, fa));
        }
        // One at a time, each registered before the next starts: the
        // allocator numbers vdevs in registration order, so ids follow the
        // order given (file0 is vdev 0). It costs a registration round trip
        // per agent at start.
        for (name, kind, cap, path, fa) in starts {
            let (child, addrs) = self.spawn_child(&name, Role::Agent, &fa, kinds).await?;
            self.children.push(child);
            if let Some(p) = addrs.get(1) {
                self.prometheus.push((name.clone(), *p));
            }
            self.agents.push(AgentInfo {
                name,
                kind,
                capacity: cap,
                path,
                url: format!("{}://{}", self.scheme(), addrs[0]),
            });
            self.wait_registered(Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    /// Names of the vdevs the pool's store says were removed (`vdev
    /// remove`) and that no vdev in the pool has taken since, read
    /// read-only (`aliquot-allocator verify`); nothing when the store is new
    /// or cannot be read (then the allocator's refusal, shown at once, says
    /// why an agent left).
    async fn removed_vdevs(&self) -> Vec<String> {
        let args: Vec<String> = match &self.postgres {
            Some(_) => vec!["--pool".into(), self.pool.clone()],
            None => vec![
                "--data-dir".into(),
                self.data_dir.join("allocator").display().to_string(),
            ],
        };
        let report = match crate::verify::store_report(
            &args,
            self.postgres.as_ref().map(|(_, u)| u.as_str()),
        )
        .await
        {
            Ok(crate::verify::Stored::Pool(r)) => r,
            Ok(crate::verify::Stored::Empty(_)) => return Vec::new(),
            Err(e) => {
                eprintln!("aliquotctl: cannot read which vdevs were removed from the store: {e}");
                return Vec::new();
            }
        };
        let mut names: Vec<String> = report
            .vdevs
            .iter()
            .filter(|v| v.removed)
            .map(|v| v.name.clone())
            .collect();
        names.retain(|n| !report.vdevs.iter().any(|v| &v.name == n && !v.removed));
        names
    }

    /// A child's security flags: its own certificate (issued on first use)
    /// and the write-token key, or `--insecure`.
    fn security_flags(&self, role: aliquot_auth::Role, name: &str) -> anyhow::Result<Vec<String>> {
        if !self.tls.is_tls() {
            return Ok(vec!["--insecure".into()]);
        }
        let certs = certs_dir(&self.data_dir);
        let issued = aliquot_auth::PoolCa::open(&certs)?.ensure_issued(role, name, &[])?;
        let mut v: Vec<String> = vec![
            "--tls-ca".into(),
            certs.join(aliquot_auth::ca::CA_CERT).display().to_string(),
            "--tls-cert".into(),
            issued.cert.display().to_string(),
            "--tls-key".into(),
            issued.key.display().to_string(),
        ];
        // The allocator signs write tokens with token.key, agents check them
        // with token.pub: both found in the CA directory.
        if matches!(
            role,
            aliquot_auth::Role::Allocator | aliquot_auth::Role::Agent
        ) {
            v.extend(["--token-key".into(), certs.display().to_string()]);
        }
        Ok(v)
    }

    /// `http://` or `https://` for this pool's URLs.
    fn scheme(&self) -> &'static str {
        if self.tls.is_tls() { "https" } else { "http" }
    }

    async fn spawn(
        &mut self,
        name: &str,
        role: Role,
        args: &[String],
        kinds: &[&str],
    ) -> anyhow::Result<Vec<SocketAddr>> {
        let (child, addrs) = self.spawn_child(name, role, args, kinds).await?;
        self.children.push(child);
        Ok(addrs)
    }

    /// Start `role`'s binary with ARGS, return once it printed a LISTEN
    /// line for each of `kinds` (addresses in that order).
    async fn spawn_child(
        &self,
        name: &str,
        role: Role,
        args: &[String],
        kinds: &[&str],
    ) -> anyhow::Result<(Child, Vec<SocketAddr>)> {
        let exe = crate::binaries::find(role.binary())?;
        let log = self.data_dir.join("logs").join(format!("{name}.log"));
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", log.display()))?;
        // Logs append across runs; this line marks where this run starts, so
        // a death is explained by this run's lines, never an earlier one's.
        {
            use std::io::Write as _;
            let mut f = &logf;
            let _ = writeln!(
                f,
                "{RUN_MARK} {name} at unix {} s (aliquotctl pid {}) ===",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                std::process::id()
            );
        }
        let mut cmd = Command::new(&exe);
        // Our flags decide the child's security; an inherited variable of
        // the other mode would only make clap refuse the mix.
        if self.tls.is_tls() {
            cmd.env_remove("ALIQUOT_INSECURE");
        } else {
            for v in ["ALIQUOT_TLS_CA", "ALIQUOT_TLS_CERT", "ALIQUOT_TLS_KEY"] {
                cmd.env_remove(v);
            }
        }
        if let Some(n) = self.worker_threads {
            cmd.env("ALIQUOT_WORKER_THREADS", n.to_string());
        }
        cmd.args(args)
            .env(SUPERVISED_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(logf))
            .process_group(0)
            .kill_on_drop(false);
        tracing::debug!(child = name, args = ?args, "starting");
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {} for {name}: {e}", exe.display()))?;
        let pid = child.id().map(|p| p as i32).unwrap_or(-1);
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, status) = watch::channel(None);
        let deaths = self.deaths_tx.clone();
        let n = name.to_string();
        tokio::spawn(async move {
            if let Ok(st) = child.wait().await {
                let _ = tx.send(Some(st));
                let _ = deaths.send((n, st));
            }
        });
        let c = Child {
            name: name.to_string(),
            role,
            pid,
            log: log.clone(),
            status,
            _stdin: stdin,
        };
        // LISTEN lines, then keep draining stdout so the child never blocks on it.
        let (ltx, mut lrx) = mpsc::unbounded_channel::<(String, SocketAddr)>();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut it = line.split_whitespace();
                if it.next() == Some("LISTEN")
                    && let (Some(k), Some(a)) = (it.next(), it.next())
                    && let Ok(a) = a.parse()
                {
                    let _ = ltx.send((k.to_string(), a));
                }
            }
        });
        let mut found: Vec<Option<SocketAddr>> = vec![None; kinds.len()];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut st = c.status.clone();
        while found.iter().any(Option::is_none) {
            tokio::select! {
                m = lrx.recv() => match m {
                    Some((k, a)) => {
                        if let Some(i) = kinds.iter().position(|x| *x == k) {
                            found[i] = Some(a);
                        }
                    }
                    None => {
                        // stdout closed: the child is exiting; report why.
                        let mut st2 = c.status.clone();
                        let _ = tokio::time::timeout(Duration::from_secs(5), st2.wait_for(|s| s.is_some())).await.is_ok();
                        anyhow::bail!("{name} exited before listening; {}", tail_note(&log));
                    }
                },
                _ = st.wait_for(|s| s.is_some()) => {
                    anyhow::bail!("{name} exited before listening; {}", tail_note(&log));
                }
                _ = tokio::time::sleep_until(deadline) => {
                    signal(pid, libc::SIGKILL);
                    anyhow::bail!("{name} did not listen within 60 s; {}", tail_note(&log));
                }
            }
        }
        Ok((
            c,
            found.into_iter().map(|a| a.expect("all found")).collect(),
        ))
    }

    /// Until every agent's vdev is in the pool, healthy, with its
    /// metaslabs synced in (not "allocatable": a full pool restarts too).
    async fn wait_registered(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        // Past this, an agent still out of the pool is shown on the
        // terminal at once with its log, rather than after the deadline.
        let slow = Instant::now() + SLOW_JOIN;
        let mut told: Vec<String> = Vec::new();
        let mut c = client::allocator(&self.tls, &self.allocator_url).await?;
        loop {
            if let Some(dead) = self.children.iter().find(|c| c.status.borrow().is_some()) {
                anyhow::bail!(
                    "{} exited while the pool was starting; {}",
                    dead.name,
                    tail_note(&dead.log)
                );
            }
            let st = c
                .get_pool(GetPoolRequest {})
                .await
                .ok()
                .map(|r| r.into_inner());
            let missing: Vec<String> = self
                .agents
                .iter()
                .filter_map(|a| match st.as_ref().map(|st| registered(st, &a.name)) {
                    Some(Ready::Yes) => None,
                    Some(Ready::Unhealthy(h)) => Some(format!("{} (registered, {h})", a.name)),
                    _ => Some(a.name.clone()),
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() > slow {
                for a in &self.agents {
                    let Some(m) = missing
                        .iter()
                        .find(|m| *m == &a.name || m.starts_with(&format!("{} (", a.name)))
                    else {
                        continue;
                    };
                    if told.contains(&a.name) {
                        continue;
                    }
                    told.push(a.name.clone());
                    let log = self.log_of(&a.name).map(tail_note).unwrap_or_default();
                    eprintln!(
                        "aliquotctl: {m} has not joined the pool after {} s (waiting up to {} s); {log}",
                        SLOW_JOIN.as_secs(),
                        within.as_secs()
                    );
                }
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "agents {} did not come up in the pool within {} s; see {}",
                    missing.join(", "),
                    within.as_secs(),
                    self.data_dir.join("logs").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A line for each normal vdev without an embedded log metaslab, saying
    /// why (too few metaslabs) and what would give it one.
    /// A `write --total` that fits this pool: the largest power of two
    /// (at least 1 MiB, at most 1 GiB) no more than half of what data may
    /// use (the normal class's free space less the slop reserve).
    pub async fn suggested_total(&self) -> anyhow::Result<u64> {
        let mut c = client::allocator(&self.tls, &self.allocator_url).await?;
        let st = c
            .get_pool(GetPoolRequest {})
            .await
            .map_err(|s| client::status_msg("get pool", &s))?
            .into_inner();
        let usable = st
            .classes
            .iter()
            .find(|c| c.name == "normal")
            .map_or(0, |c| c.space.saturating_sub(c.alloc))
            .saturating_sub(st.slop_space);
        Ok(fitting_total(usable))
    }

    pub async fn embedded_log_notes(&self) -> anyhow::Result<Vec<String>> {
        let mut c = client::allocator(&self.tls, &self.allocator_url).await?;
        let st = c
            .get_pool(GetPoolRequest {})
            .await
            .map_err(|s| client::status_msg("get pool", &s))?
            .into_inner();
        let tun = c
            .get_tunables(aliquot_proto::v1::GetTunablesRequest {})
            .await
            .map_err(|s| client::status_msg("get tunables", &s))?
            .into_inner();
        let min_ms = tun
            .tunables
            .iter()
            .find(|t| t.name == "zfs_embedded_slog_min_ms")
            .map_or("64".to_string(), |t| t.value.clone());
        Ok(st
            .vdevs
            .iter()
            .filter(|v| v.class == "normal" && v.embedded_log_metaslab.is_none())
            .map(|v| {
                format!(
                    "note: {} has no embedded log metaslab: {} metaslabs of {}, and OpenZFS \
                     sets one aside only above zfs_embedded_slog_min_ms={min_ms} \
                     (a larger vdev, or --tunable zfs_embedded_slog_min_ms=N, gives it one)",
                    crate::names::vdev_label(v.vdev, &v.name),
                    v.metaslab_count,
                    units::format_bytes(v.metaslab_size),
                )
            })
            .collect())
    }

    /// The next child that exited on its own: (name, status).
    pub async fn next_exit(&mut self) -> Option<(String, ExitStatus)> {
        self.deaths.recv().await
    }

    /// With --ha, start an allocator that exited again, on its address: it
    /// stands by (the other leads). False without --ha.
    pub async fn restart_ha_allocator(&mut self, name: &str) -> anyhow::Result<bool> {
        let Some((_, args)) = self.ha_allocators.iter().find(|(n, _)| n == name).cloned() else {
            return Ok(false);
        };
        self.children.retain(|c| c.name != name);
        self.spawn(name, Role::Allocator, &args, &["grpc"]).await?;
        Ok(true)
    }

    pub fn is_allocator(&self, name: &str) -> bool {
        self.children
            .iter()
            .any(|c| c.name == name && c.role == Role::Allocator)
    }

    pub fn log_of(&self, name: &str) -> Option<&Path> {
        self.children
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.log.as_path())
    }

    /// SIGTERM agents, then the allocator, then metrics; SIGKILL whatever
    /// has not exited 10 s later. Returns the names that needed SIGKILL.
    pub async fn stop(&mut self) -> Vec<String> {
        let mut killed = Vec::new();
        for role in [Role::Agent, Role::Allocator, Role::Metrics] {
            let group: Vec<&mut Child> = self
                .children
                .iter_mut()
                .filter(|c| c.role == role)
                .collect();
            for c in &group {
                if c.status.borrow().is_none() {
                    signal(c.pid, libc::SIGTERM);
                }
            }
            for c in group {
                let mut st = c.status.clone();
                let done =
                    tokio::time::timeout(Duration::from_secs(10), st.wait_for(|s| s.is_some()))
                        .await
                        .is_ok();
                if !done {
                    signal(c.pid, libc::SIGKILL);
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), st.wait_for(|s| s.is_some()))
                            .await
                            .is_ok();
                    killed.push(c.name.clone());
                }
                c._stdin = None;
            }
        }
        self.children.clear();
        // The allocators are gone: the database can stop (fast shutdown).
        if let Some((pg, _)) = self.postgres.take() {
            let _ = tokio::task::spawn_blocking(move || drop(pg)).await;
        }
        killed
    }

    /// The human summary `up` prints.
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "pool {} is up; data, databases and logs in {}",
            self.pool,
            self.data_dir.display()
        );
        match &self.tls {
            aliquot_auth::ClientTls::Mutual(f) => {
                let _ = writeln!(
                    s,
                    "  mutual TLS: pool CA and certificates in {} (clients use {})",
                    certs_dir(&self.data_dir).display(),
                    f.cert.display()
                );
            }
            aliquot_auth::ClientTls::Insecure => {
                let _ = writeln!(
                    s,
                    "  INSECURE: plaintext gRPC, no certificates, no write tokens"
                );
            }
        }
        let _ = writeln!(s, "  allocator  {}", self.allocator_url);
        if let Some((_, url)) = &self.postgres {
            let _ = writeln!(
                s,
                "  store      {url} (two allocators: one leads, one stands by; \
                 `aliquotctl allocator status --allocator {}`)",
                self.allocator_url
            );
        }
        if let (Some(m), Some(h)) = (&self.metrics_url, self.metrics_http) {
            let _ = writeln!(
                s,
                "  metrics    {m}   charts http://{h}/   Prometheus http://{h}/metrics"
            );
        }
        for (name, a) in &self.prometheus {
            let _ = writeln!(s, "  prometheus {name:<11} http://{a}/metrics");
        }
        for (name, path) in &self.skipped {
            let _ = writeln!(
                s,
                "  skipped    {name:<6} removed from the pool (aliquotctl vdev remove): not \
                 started; its device file {} is no longer the pool's",
                path.display()
            );
        }
        for a in &self.agents {
            let _ = writeln!(
                s,
                "  agent      {:<6} {:>8}  {:<8} {}{}",
                a.name,
                units::format_bytes_short(a.capacity),
                a.kind,
                a.url,
                a.path
                    .as_ref()
                    .map(|p| format!("  {}", p.display()))
                    .unwrap_or_default()
            );
        }
        s
    }
}

enum Ready {
    Yes,
    No,
    Unhealthy(String),
}

fn registered(st: &PoolStatus, name: &str) -> Ready {
    let Some(v) = st.vdevs.iter().find(|v| v.name == name) else {
        return Ready::No;
    };
    if v.health != VdevHealth::Healthy as i32 {
        let h = VdevHealth::try_from(v.health)
            .map(|h| {
                h.as_str_name()
                    .trim_start_matches("VDEV_HEALTH_")
                    .to_lowercase()
            })
            .unwrap_or_else(|_| "unknown health".into());
        return Ready::Unhealthy(h);
    }
    // Its metaslabs were synced in (OpenZFS's ms_new rule): the group has
    // space. Not "allocatable": a full vdev never is, and a full pool must
    // restart.
    let synced_in = st
        .classes
        .iter()
        .flat_map(|c| &c.groups)
        .any(|g| g.vdev == v.vdev && g.capacity > 0);
    if synced_in { Ready::Yes } else { Ready::No }
}

fn signal(pid: i32, sig: libc::c_int) {
    if pid > 0 {
        // SAFETY: kill(2) has no memory-safety preconditions; pid is our child's.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// How long an agent may take to join before `up` shows why it has not.
const SLOW_JOIN: Duration = Duration::from_secs(5);

/// Metaslabs per vdev `up` asks for (`zfs_vdev_min_ms_count`), so that
/// its vdevs have more than `zfs_embedded_slog_min_ms` (64).
pub const LOCAL_MIN_MS_COUNT: u64 = 128;

/// Starts each run's part of a child's log (see `spawn_child`).
const RUN_MARK: &str = "=== aliquotctl up: starting";

/// The last lines of a child's log, from this run only.
fn tail_note(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let run = match s.rfind(RUN_MARK) {
        Some(i) => s[i..].split_once('\n').map_or("", |(_, rest)| rest),
        None => &s[..],
    };
    let lines: Vec<&str> = run.lines().collect();
    let tail = lines[lines.len().saturating_sub(15)..].join("\n");
    if tail.is_empty() {
        format!("its log {} says nothing for this run", log.display())
    } else {
        format!("last lines of {}:\n{tail}", log.display())
    }
}

/// `aliquotctl up`: start, print where everything is, supervise until
/// Ctrl-C or SIGTERM.
pub async fn up(args: PoolArgs) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal as unix_signal};
    // Listen for signals before starting anything, so none is lost.
    let mut term = unix_signal(SignalKind::terminate())?;
    let mut int = unix_signal(SignalKind::interrupt())?;
    let start = LocalPool::start(&args);
    let mut pool = tokio::select! {
        p = start => p?,
        _ = term.recv() => anyhow::bail!("interrupted while starting (children stopped)"),
        _ = int.recv() => anyhow::bail!("interrupted while starting (children stopped)"),
    };
    print!("{}", pool.describe());
    match pool.embedded_log_notes().await {
        Ok(notes) => notes.iter().for_each(|n| println!("{n}")),
        Err(e) => eprintln!("aliquotctl: cannot check the embedded log metaslabs: {e}"),
    }
    let mut hint = if pool.allocator_addr.to_string() == "127.0.0.1:7000" {
        String::new()
    } else {
        format!(" --allocator {}", pool.allocator_url)
    };
    if !pool.tls.is_tls() {
        hint.push_str(" --insecure");
    } else {
        // Clients look in ./aliquot-data/certs unless told otherwise.
        let certs = certs_dir(&pool.data_dir);
        let plain = certs.strip_prefix(".").unwrap_or(&certs);
        if plain != Path::new("aliquot-data/certs") {
            hint.push_str(&format!(" --certs-dir {}", certs.display()));
        }
    }
    let total = pool.suggested_total().await.unwrap_or(64 << 20);
    println!(
        "try: aliquotctl status{hint}   aliquotctl write{hint} --total {}MiB --verify",
        total >> 20
    );
    println!("Ctrl-C stops the pool.");
    // Machine-readable, last, once everything is ready (tests wait for these).
    println!("LISTEN grpc {}", pool.allocator_addr);
    if let Some(h) = pool.metrics_http {
        println!("LISTEN http {h}");
    }
    {
        use std::io::Write;
        std::io::stdout().flush()?;
    }
    let mut failed = None;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            Some((name, st)) = pool.next_exit() => {
                let log = pool.log_of(&name).map(tail_note).unwrap_or_default();
                if log.contains("this vdev was removed from the pool") {
                    // `vdev remove`: the agent stops by design; the pool goes on.
                    eprintln!(
                        "aliquotctl: {name} stopped: its vdev was removed from the pool \
                         (aliquotctl vdev remove); the other children keep running"
                    );
                    continue;
                }
                eprintln!("aliquotctl: {name} exited ({st}); {log}");
                if pool.is_allocator(&name) {
                    match pool.restart_ha_allocator(&name).await {
                        Ok(true) => {
                            eprintln!("aliquotctl: {name} started again (--ha); asking who leads");
                            // Whichever leads now (the restarted one may
                            // take the pool back before the other does):
                            // said once an allocator answers as the leader
                            // (the client's leader channel waits for one, and
                            // sends the call again if the one it found loses
                            // the lease before answering).
                            let (tls, urls) = (pool.tls.clone(), pool.allocator_url.clone());
                            tokio::spawn(async move {
                                let leader = async {
                                    let mut c =
                                        client::allocator_waiting(&tls, &urls, LEADER_KNOWN_WITHIN)
                                            .await?;
                                    let st = c.get_pool(GetPoolRequest {}).await?;
                                    anyhow::Ok(st.into_inner())
                                };
                                match leader.await {
                                    Ok(st) => eprintln!(
                                        "aliquotctl: {} leads (generation {})",
                                        st.leadership.unwrap_or_default().leader,
                                        st.generation
                                    ),
                                    Err(e) => eprintln!(
                                        "aliquotctl: who leads after the restart is not known \
                                         (waited up to {} s): {e:#}",
                                        LEADER_KNOWN_WITHIN.as_secs()
                                    ),
                                }
                            });
                            continue;
                        }
                        Ok(false) => {}
                        Err(e) => eprintln!("aliquotctl: cannot start {name} again: {e:#}"),
                    }
                    eprintln!("aliquotctl: the allocator is gone; stopping the pool");
                    failed = Some(name);
                    break;
                }
            }
        }
    }
    eprintln!("aliquotctl: stopping the pool");
    let killed = pool.stop().await;
    if !killed.is_empty() {
        eprintln!("aliquotctl: had to SIGKILL {}", killed.join(", "));
    }
    eprintln!("aliquotctl: pool stopped");
    match failed {
        Some(n) => anyhow::bail!("{n} exited unexpectedly"),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_death_is_explained_by_this_runs_log_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("file0.log");
        std::fs::write(
            &log,
            format!(
                "{RUN_MARK} file0 at unix 1 s (aliquotctl pid 1) ===\nold failure: disk on fire\n\
                 {RUN_MARK} file0 at unix 2 s (aliquotctl pid 2) ===\nnew failure: bad flag\n"
            ),
        )
        .unwrap();
        let note = tail_note(&log);
        assert!(note.contains("new failure: bad flag"), "{note}");
        assert!(!note.contains("disk on fire"), "{note}");
        std::fs::write(&log, format!("old\n{RUN_MARK} file0 ===\n")).unwrap();
        assert!(tail_note(&log).contains("says nothing for this run"));
    }

    use super::*;

    #[test]
    fn prometheus_listen_is_an_ip_or_a_base_port() {
        let ip = parse_prometheus_listen("127.0.0.1").unwrap();
        assert_eq!(ip.port(), 0);
        assert_eq!(prometheus_addr(ip, 3), ip, "no port: ephemeral for all");
        let base = parse_prometheus_listen("127.0.0.1:9100").unwrap();
        assert_eq!(prometheus_addr(base, 0).to_string(), "127.0.0.1:9100");
        assert_eq!(prometheus_addr(base, 3).to_string(), "127.0.0.1:9103");
        assert!(parse_prometheus_listen("localhost").is_err());
    }

    #[test]
    fn sim_specs() {
        let s = parse_sim("hdd:4GiB:150MiB/s").unwrap();
        assert!(s.rotational);
        assert_eq!(s.capacity, 4 << 30);
        assert_eq!(s.bandwidth, 150.0 * 1048576.0);
        assert_eq!(s.latency, Duration::from_millis(4));
        let s = parse_sim("ssd:2GiB:1GiB/s:100us").unwrap();
        assert!(!s.rotational);
        assert_eq!(s.latency, Duration::from_micros(100));
        assert!(
            parse_sim("tape:1GiB:1MiB/s")
                .unwrap_err()
                .contains("hdd or ssd")
        );
        assert!(parse_sim("hdd:4GiB").is_err());
        assert!(parse_sim("hdd:lots:1MiB/s").is_err());
    }
}

/// The `--total` `up` suggests for `usable` bytes of data space: the
/// largest power of two at most half of it, within 1 MiB ..= 1 GiB.
pub fn fitting_total(usable: u64) -> u64 {
    let half = (usable / 2).max(1 << 20);
    (1u64 << (63 - half.leading_zeros())).min(1 << 30)
}

#[cfg(test)]
mod total_tests {
    #[test]
    fn the_suggested_total_fits_the_pool() {
        const MIB: u64 = 1 << 20;
        // 512 MiB pool: slop 128 MiB, 384 MiB usable.
        assert_eq!(super::fitting_total(384 * MIB), 128 * MIB);
        // up's default 7 GiB pool.
        assert_eq!(super::fitting_total(6 * 1024 * MIB), 1024 * MIB);
        assert_eq!(super::fitting_total(0), MIB);
    }
}
