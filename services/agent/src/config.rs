//! The agent's configuration: one clap struct, every flag also an
//! `ALIQUOT_*` environment variable, validated before anything is opened or
//! bound.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::AgentError;

/// OpenZFS `zfs_vdev_aggregation_limit` (rotational devices).
pub const AGGREGATION_LIMIT_ROTATIONAL: u64 = 1 << 20;
/// OpenZFS `zfs_vdev_aggregation_limit_non_rotating`.
pub const AGGREGATION_LIMIT_NON_ROTATING: u64 = 128 << 10;
/// OpenZFS caps any aggregation limit at `SPA_MAXBLOCKSIZE` (16 MiB).
pub const AGGREGATION_LIMIT_MAX: u64 = 16 << 20;
/// OpenZFS `zio_taskq_batch_pct` default.
pub const ZIO_TASKQ_BATCH_PCT_DEFAULT: u32 = 80;
/// --direct-min-size's default: 1 MiB writes (the CLI's block) go direct,
/// 4 KiB ones never (measured in the `data_path` bench).
pub const DIRECT_MIN_SIZE_DEFAULT: u64 = 256 << 10;

/// Which large writes to a buffered file bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DirectLargeWrites {
    /// Only writes into never-written ranges (holes).
    Holes,
    /// Every large aligned write.
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// A regular file (created or extended to --capacity) or a block device.
    File,
    /// A simulated device in real time, its data in memory.
    Sim,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::File => "file",
            BackendKind::Sim => "sim",
        }
    }
}

/// `aliquot-agent`: serves one vdev over gRPC and reports it to the allocator.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "aliquot-agent", version, about)]
pub struct Config {
    /// Address the VdevAgent gRPC server binds (port 0 = any free port).
    #[arg(long, env = "ALIQUOT_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Also serve this process's gRPC metrics (calls by method and code,
    /// latency histograms) as Prometheus `/metrics` over HTTP on this
    /// address (port 0 picks one; see the `LISTEN prometheus` line).
    #[arg(long, env = "ALIQUOT_PROMETHEUS_LISTEN")]
    pub prometheus_listen: Option<SocketAddr>,

    /// URL the allocator and clients use to reach this agent
    /// (default: http://<bound address>).
    #[arg(long, env = "ALIQUOT_ADVERTISE")]
    pub advertise: Option<String>,

    /// The allocator's URL, or several separated by commas (allocators
    /// sharing one PostgreSQL store: the agent registers with whichever
    /// leads, following NOT_LEADER); "none" runs the agent without
    /// registering.
    #[arg(
        long,
        env = "ALIQUOT_ALLOCATOR",
        default_value = "http://127.0.0.1:7000"
    )]
    pub allocator: String,

    /// Vdev name (default: the file name, or "sim").
    #[arg(long, env = "ALIQUOT_NAME")]
    pub name: Option<String>,

    /// Device backend.
    #[arg(long, env = "ALIQUOT_BACKEND", value_enum, default_value_t = BackendKind::File)]
    pub backend: BackendKind,

    /// File or block device (file backend).
    #[arg(long, env = "ALIQUOT_PATH")]
    pub path: Option<PathBuf>,

    /// Device size including the 1 MiB label area, e.g. 4GiB. Required for a
    /// new file and for sim; an existing labelled file keeps its own.
    #[arg(long, env = "ALIQUOT_CAPACITY", value_parser = units::size_arg)]
    pub capacity: Option<u64>,

    /// Data I/O with O_DIRECT (file backend): bypasses the page cache (no
    /// copy into it, no writeback later); Flush still fdatasyncs, so the
    /// durability contract is the same. Needs a filesystem or block device
    /// that supports it. The default for block devices (with --ashift 12 or
    /// more; --buffered turns it off). On regular files only large writes
    /// into new space go direct by default (--direct-min-size,
    /// --direct-large-writes), since small writes would wait for the disk
    /// one by one.
    #[arg(long, env = "ALIQUOT_DIRECT", value_parser = clap::builder::BoolishValueParser::new(), conflicts_with = "buffered")]
    pub direct: bool,

    /// Data I/O through the page cache even on a block device (where
    /// O_DIRECT is the default), and every write on a file (where large
    /// writes into new space go direct by default).
    #[arg(long, env = "ALIQUOT_BUFFERED", value_parser = clap::builder::BoolishValueParser::new())]
    pub buffered: bool,

    /// On a buffered file, writes of at least this size (4 KiB-aligned;
    /// default 256KiB) may go through O_DIRECT, smaller ones always use the
    /// page cache: which large ones, --direct-large-writes says. Reads and
    /// Flush (fdatasync) are unchanged. Falls back to buffered if the
    /// filesystem refuses O_DIRECT; --buffered keeps every write buffered.
    #[arg(long, env = "ALIQUOT_DIRECT_MIN_SIZE", value_parser = units::size_arg,
          conflicts_with_all = ["direct", "buffered"])]
    pub direct_min_size: Option<u64>,

    /// Which writes of --direct-min-size or more go O_DIRECT on a buffered
    /// file. `holes` (the default): those into ranges the file has never
    /// held data in (new space, found with SEEK_DATA), which no page cache
    /// holds, so the copy into it and the writeback after it are pure cost;
    /// overwrites stay buffered, where the pages are often cached already.
    /// `all`: every large write.
    #[arg(long, env = "ALIQUOT_DIRECT_LARGE_WRITES", value_enum, default_value_t = DirectLargeWrites::Holes,
          conflicts_with_all = ["direct", "buffered"])]
    pub direct_large_writes: DirectLargeWrites,

    /// Serve unary Writes through tonic's decoder instead of the fast path
    /// (which writes the payload from the received HTTP/2 frames without
    /// copying it). For A/B measurements and as a way out; replies and
    /// refusals are the same either way.
    #[arg(long, env = "ALIQUOT_NO_FAST_WRITE", hide = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub no_fast_write: bool,

    /// log2 of the device's sector size: offsets and lengths are multiples of 1 << ashift.
    #[arg(long, env = "ALIQUOT_ASHIFT", default_value_t = 12)]
    pub ashift: u32,

    /// The device is rotational (an HDD): larger default aggregation.
    #[arg(long, env = "ALIQUOT_ROTATIONAL", value_parser = clap::builder::BoolishValueParser::new())]
    pub rotational: bool,

    /// Data + parity children of this vdev (1 = a plain device).
    #[arg(long, env = "ALIQUOT_CHILDREN", default_value_t = 1)]
    pub children: u32,

    /// Parity children (raidz level).
    #[arg(long, env = "ALIQUOT_PARITY", default_value_t = 0)]
    pub parity: u32,

    /// A dedicated log (SLOG) vdev.
    #[arg(long, env = "ALIQUOT_LOG", value_parser = clap::builder::BoolishValueParser::new())]
    pub log: bool,

    /// Simulated bandwidth, e.g. 150MiB/s (sim backend; default unlimited).
    #[arg(long, env = "ALIQUOT_BANDWIDTH", value_parser = units::rate_arg)]
    pub bandwidth: Option<f64>,

    /// Simulated per-I/O latency, e.g. 100us or 8ms (sim backend; default 0).
    #[arg(long, env = "ALIQUOT_LATENCY", value_parser = units::duration_arg)]
    pub latency: Option<Duration>,

    /// Device guid of a sim device (default: random at each start). File
    /// devices keep theirs in the label.
    #[arg(long, env = "ALIQUOT_GUID")]
    pub guid: Option<u64>,

    /// Largest merged write in bytes, 0 = no aggregation, at most 16MiB
    /// (default 1MiB rotational, 128KiB otherwise).
    #[arg(long, env = "ALIQUOT_ZFS_VDEV_AGGREGATION_LIMIT", value_parser = units::size_arg)]
    pub zfs_vdev_aggregation_limit: Option<u64>,

    /// I/O worker threads as a percentage of --taskq-cpus (at least one
    /// worker): floor(cpus * pct / 100), at least 1.
    #[arg(long, env = "ALIQUOT_ZIO_TASKQ_BATCH_PCT", default_value_t = ZIO_TASKQ_BATCH_PCT_DEFAULT)]
    pub zio_taskq_batch_pct: u32,

    /// The CPU count zio_taskq_batch_pct is a percentage of (default: this
    /// machine's cores). On a small box every percentage gives one worker;
    /// a larger count models a bigger host's taskq (e.g. 64: 80 % is 51
    /// workers, 5 % is 3).
    #[arg(long, env = "ALIQUOT_TASKQ_CPUS", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub taskq_cpus: Option<u32>,

    /// Mutual TLS: the pool CA and this agent's certificate (role agent).
    #[command(flatten)]
    pub tls: aliquot_auth::TlsArgs,

    /// The allocator's write-token public key (`token.pub`, or the CA
    /// directory holding it): every write must then carry a valid token.
    #[arg(long, env = "ALIQUOT_TOKEN_KEY")]
    pub token_key: Option<PathBuf>,

    /// With mutual TLS, serve writes without checking write tokens: any
    /// client certificate may then write anywhere on the device. Without
    /// this flag an agent with TLS refuses to start without --token-key.
    #[arg(long, env = "ALIQUOT_UNCHECKED_WRITES", conflicts_with = "token_key",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub unchecked_writes: bool,

    /// A write's request body must arrive within this time of its start,
    /// or its stream is reset and its buffers freed (a slow or stalled
    /// sender cannot pin memory).
    #[arg(long, env = "ALIQUOT_BODY_TIMEOUT", default_value = "30s", value_parser = units::duration_arg)]
    pub body_timeout: Duration,

    /// Bytes of write bodies the agent buffers at once, over all
    /// connections; further writes wait (in HTTP/2 flow control) for room.
    #[arg(long, env = "ALIQUOT_MAX_BUFFERED", default_value = "512MiB", value_parser = units::size_arg)]
    pub max_buffered: u64,

    /// Bytes of write bodies one connection may hold buffered at once.
    #[arg(long, env = "ALIQUOT_CONNECTION_BUFFER", default_value = "128MiB", value_parser = units::size_arg)]
    pub connection_buffer: u64,

    /// Concurrent HTTP/2 streams (calls) per connection; a client's further
    /// calls wait for one to end.
    #[arg(long, env = "ALIQUOT_MAX_STREAMS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_streams: u32,

    /// Threads that serve the network (HTTP/2, TLS) for this process;
    /// device I/O has its own (--zio-taskq-batch-pct). Default: one per
    /// core. Where several servers share a machine, fewer wake each other
    /// less: `aliquotctl up` gives each of its servers cores / servers.
    #[arg(long, env = "ALIQUOT_WORKER_THREADS",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,

    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

impl Config {
    /// A config with every default, for tests and embedding.
    pub fn new(backend: BackendKind) -> Config {
        Config {
            listen: "127.0.0.1:0".parse().expect("literal address"),
            prometheus_listen: None,
            advertise: None,
            allocator: "none".into(),
            name: None,
            backend,
            path: None,
            capacity: None,
            direct: false,
            buffered: false,
            direct_min_size: None,
            direct_large_writes: DirectLargeWrites::Holes,
            no_fast_write: false,
            ashift: 12,
            rotational: false,
            children: 1,
            parity: 0,
            log: false,
            bandwidth: None,
            latency: None,
            guid: None,
            zfs_vdev_aggregation_limit: None,
            zio_taskq_batch_pct: ZIO_TASKQ_BATCH_PCT_DEFAULT,
            taskq_cpus: None,
            // Code-built configs (tests, embedding) serve plaintext on
            // loopback unless given files; the CLI has no such default.
            tls: aliquot_auth::TlsArgs::insecure(),
            token_key: None,
            unchecked_writes: false,
            body_timeout: Duration::from_secs(30),
            max_buffered: 512 << 20,
            connection_buffer: 128 << 20,
            max_streams: 64,
            worker_threads: None,
            telemetry: Default::default(),
        }
    }

    /// Checks everything that can be checked without touching the device.
    pub fn validate(&self) -> Result<(), AgentError> {
        let bad = |m: String| Err(AgentError::Config(m));
        // TLS authenticates clients, but without tokens any client
        // certificate could overwrite any block; say so rather than warn.
        if self.tls.files().is_some() && self.token_key.is_none() && !self.unchecked_writes {
            return bad(
                "mutual TLS without --token-key: any client certificate could write anywhere on \
                 this device. Give --token-key (the allocator's token.pub, or the pool's CA \
                 directory), or --unchecked-writes to serve writes unchecked"
                    .into(),
            );
        }
        if !(9..=16).contains(&self.ashift) {
            return bad(format!("--ashift {} is out of range 9..=16", self.ashift));
        }
        if self.children == 0 {
            return bad("--children must be at least 1".into());
        }
        if self.parity > 3 || (self.parity > 0 && self.parity >= self.children) {
            return bad(format!(
                "--parity {} needs parity <= 3 and fewer parity than --children {}",
                self.parity, self.children
            ));
        }
        validate_aggregation_limit(self.aggregation_limit()).map_err(AgentError::Config)?;
        validate_batch_pct(self.zio_taskq_batch_pct).map_err(AgentError::Config)?;
        match self.backend {
            BackendKind::File => {
                if self.path.is_none() {
                    return bad("--backend file needs --path FILE_OR_DEVICE".into());
                }
                if self.bandwidth.is_some() || self.latency.is_some() {
                    return bad("--bandwidth and --latency apply to --backend sim only".into());
                }
                if self.direct && self.buffered {
                    return bad("--direct and --buffered contradict each other: give one".into());
                }
                if self.direct_min_size.is_some() && (self.direct || self.buffered) {
                    return bad(
                        "--direct-min-size sends large writes direct and keeps the rest \
                         buffered: give it alone, without --direct or --buffered"
                            .into(),
                    );
                }
                if self.direct && self.ashift < 12 {
                    return bad(format!(
                        "--direct needs --ashift 12 or more (O_DIRECT I/O is 4 KiB-aligned), not {}",
                        self.ashift
                    ));
                }
                if self.guid.is_some() {
                    return bad(
                        "--guid applies to --backend sim only (a file keeps its guid in its label)"
                            .into(),
                    );
                }
            }
            BackendKind::Sim => {
                if self.path.is_some() {
                    return bad("--path applies to --backend file only".into());
                }
                if self.direct || self.buffered || self.direct_min_size.is_some() {
                    return bad(
                        "--direct, --buffered and --direct-min-size apply to --backend file only"
                            .into(),
                    );
                }
                let Some(cap) = self.capacity else {
                    return bad("--backend sim needs --capacity SIZE".into());
                };
                if cap < crate::label::LABEL_SIZE + (1 << self.ashift) {
                    return bad(format!(
                        "--capacity {} leaves no room after the {} label",
                        units::format_bytes(cap),
                        units::format_bytes(crate::label::LABEL_SIZE)
                    ));
                }
                if let Some(bw) = self.bandwidth
                    && !(bw.is_finite() && bw > 0.0)
                {
                    return bad(format!("--bandwidth {bw} must be a positive rate"));
                }
            }
        }
        if let Some(a) = &self.advertise
            && !(a.starts_with("http://") || a.starts_with("https://"))
        {
            return bad(format!(
                "--advertise {a} must be an http:// or https:// URL"
            ));
        }
        if !self.registers() {
            return Ok(());
        }
        for a in self.allocators() {
            if !(a.starts_with("http://") || a.starts_with("https://")) {
                return bad(format!(
                    "--allocator {a} must be an http:// or https:// URL (or \"none\")"
                ));
            }
        }
        Ok(())
    }

    /// The allocator URLs of --allocator, in order.
    pub fn allocators(&self) -> Vec<String> {
        self.allocator
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Whether the agent registers with an allocator at all.
    pub fn registers(&self) -> bool {
        !(self.allocator.is_empty() || self.allocator.eq_ignore_ascii_case("none"))
    }

    /// The configured aggregation limit, or OpenZFS's default for the medium.
    pub fn aggregation_limit(&self) -> u64 {
        self.zfs_vdev_aggregation_limit
            .unwrap_or(if self.rotational {
                AGGREGATION_LIMIT_ROTATIONAL
            } else {
                AGGREGATION_LIMIT_NON_ROTATING
            })
    }
}

pub fn validate_aggregation_limit(v: u64) -> Result<(), String> {
    if v > AGGREGATION_LIMIT_MAX {
        Err(format!(
            "zfs_vdev_aggregation_limit {v} exceeds the maximum {AGGREGATION_LIMIT_MAX} (16 MiB); 0 disables aggregation"
        ))
    } else {
        Ok(())
    }
}

pub fn validate_batch_pct(v: u32) -> Result<(), String> {
    if (1..=100).contains(&v) {
        Ok(())
    } else {
        Err(format!("zio_taskq_batch_pct {v} is out of range 1..=100"))
    }
}

/// I/O workers for `pct` % of `cpus` (None: this machine's cores), as
/// OpenZFS sizes a batch taskq (`spa_taskqs_init` passes
/// `zio_taskq_batch_pct` with `TASKQ_THREADS_CPU_PCT`; the SPL's
/// `taskq_create` takes that percentage of the online CPUs, rounding down,
/// at least one thread). The floor is the same: one worker, the least that
/// can make progress. OpenZFS counts CPUs it has; `--taskq-cpus` lets a
/// small machine stand in for a big host, where the percentage matters.
pub fn workers_for_pct(pct: u32, cpus: Option<u32>) -> usize {
    let cpus = cpus.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |c| c as usize,
    );
    (cpus * pct as usize / 100).max(1)
}

#[cfg(test)]
mod taskq_tests {
    use super::workers_for_pct;

    #[test]
    fn pct_maps_to_workers_with_a_floor_of_one() {
        assert_eq!(workers_for_pct(80, Some(64)), 51);
        assert_eq!(workers_for_pct(5, Some(64)), 3);
        assert_eq!(workers_for_pct(100, Some(64)), 64);
        // A 2-core box: every percentage below 100 is one worker.
        assert_eq!(workers_for_pct(80, Some(2)), 1);
        assert_eq!(workers_for_pct(5, Some(2)), 1);
        assert_eq!(workers_for_pct(1, Some(1)), 1);
        assert!(workers_for_pct(100, None) >= 1);
    }
}

#[cfg(test)]
mod validate_tests {
    use super::*;

    fn file_cfg() -> Config {
        let mut cfg = Config::new(BackendKind::File);
        cfg.path = Some("/nonexistent/dev".into());
        cfg
    }

    /// The three I/O modes exclude each other, even when set from code or
    /// the environment rather than the command line (where clap refuses
    /// them too); nothing is opened before the refusal.
    #[test]
    fn io_modes_that_contradict_are_refused_by_name() {
        let refusal = |cfg: &Config| match cfg.validate() {
            Err(AgentError::Config(m)) => m,
            other => panic!("expected a config refusal, got {other:?}"),
        };
        let mut cfg = file_cfg();
        cfg.direct_min_size = Some(256 << 10);
        cfg.validate().unwrap();
        cfg.buffered = true;
        assert!(refusal(&cfg).contains("--direct-min-size"));
        cfg.buffered = false;
        cfg.direct = true;
        assert!(refusal(&cfg).contains("without --direct or --buffered"));
        cfg.direct_min_size = None;
        cfg.buffered = true;
        assert!(refusal(&cfg).contains("contradict"));
        let mut sim = Config::new(BackendKind::Sim);
        sim.capacity = Some(64 << 20);
        sim.direct_min_size = Some(1 << 20);
        assert!(refusal(&sim).contains("--backend file only"));
    }
}
