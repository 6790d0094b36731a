//! aliquotctl: the operator's tool for an Aliquot pool. It starts a local
//! pool of real processes (`up`, `demo`), shows the pool as `zpool list -v`
//! would (`status`), drives the write path end to end (`write`), changes
//! tunables and vdev states, and embeds every service (`serve`) so one
//! binary is enough to run the whole system.

pub mod admin;
pub mod allocators;
pub mod balancer;
pub mod certs;
pub mod client;
pub mod demo;
pub mod free;
pub mod health;
pub mod history;
pub mod leader;
pub mod local;
pub mod manifest;
pub mod mover;
pub mod names;
pub mod pattern;
pub mod serve;
pub mod status;
pub mod verify;
pub mod write;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "aliquotctl",
    version,
    about = "Operate an Aliquot pool: OpenZFS's allocation policy as a control plane",
    long_about = "Operate an Aliquot pool: OpenZFS's allocation policy as a control plane.\n\n\
        Start with `aliquotctl demo`, or `aliquotctl up` in one terminal and\n\
        `aliquotctl status` / `aliquotctl write --total 1GiB --verify` in another.\n\
        Every flag can also be given as an ALIQUOT_* environment variable."
)]
pub struct Cli {
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
    #[command(subcommand)]
    pub command: Cmd,
}

// Parsed once per process: the size of the largest variant (a service's
// whole config) costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run one service in this process (what `up` starts as children).
    #[command(subcommand)]
    Serve(serve::ServeCmd),
    /// Start a local pool: allocator, metrics and file (and sim) agents, until Ctrl-C.
    Up(local::PoolArgs),
    /// The pool, its classes and vdevs, like `zpool list -v`.
    Status(status::StatusArgs),
    /// Load generator: allocate, write real data to the agents, commit.
    Write(write::WriteArgs),
    /// List or set the allocator's tunables.
    Tunables(admin::TunablesArgs),
    /// A vdev by name or id: offline (not allocatable), online, drain, remove, expand.
    Vdev(admin::VdevArgs),
    /// Free every block the manifests list (default: every run `write`
    /// recorded in aliquot-data/manifests) and remove them.
    Free(free::FreeArgs),
    /// Balance history from the metrics service (table or SVG).
    History(history::Args),
    /// Start a local pool, fill half of it, show status and the balance chart, stop.
    Demo(demo::DemoArgs),
    /// gRPC health probe of a service (exit 0 when SERVING), for health checks.
    Health(health::HealthArgs),
    /// Allocators sharing a PostgreSQL store: `status` (leader, standbys,
    /// lease), `step-down` (hand the pool to a standby now).
    Allocator(allocators::AllocatorCmdArgs),
    /// Check the allocator's store (stopped or running pool), like `zdb -b`.
    Verify(verify::VerifyArgs),
    /// The pool CA: `certs init`, `certs issue --role ROLE NAME`.
    Certs(certs::CertsArgs),
    /// How balanced the pool is and how to rebalance it: `eval`, `plan`, `execute --manifest`
    /// (the mover), `status`, `verify --manifest`.
    Balancer(balancer::BalancerArgs),
}

impl Cli {
    /// `service.name` for telemetry: the embedded service's own for `serve`.
    pub fn service_name(&self) -> &'static str {
        match &self.command {
            Cmd::Serve(s) => s.service_name(),
            _ => "aliquotctl",
        }
    }

    /// The runtime's network threads: a served agent's or allocator's
    /// `--worker-threads`; tokio's default (one per core) otherwise.
    pub fn worker_threads(&self) -> Option<u16> {
        match &self.command {
            Cmd::Serve(serve::ServeCmd::Agent(c)) => c.worker_threads,
            Cmd::Serve(serve::ServeCmd::Allocator(c)) => c.worker_threads,
            _ => None,
        }
    }

    /// The telemetry flags that apply: for `serve`, the service's own, but
    /// `aliquotctl --log-format json serve X` is honoured too (either place
    /// asking for JSON gets JSON).
    pub fn telemetry_args(&self) -> telemetry::TelemetryArgs {
        match &self.command {
            Cmd::Serve(s) => {
                let mut t = s.telemetry().clone();
                if self.telemetry.log_format != telemetry::LogFormat::default() {
                    t.log_format = self.telemetry.log_format;
                }
                t
            }
            _ => self.telemetry.clone(),
        }
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Cmd::Serve(s) => serve::run(s).await,
        Cmd::Up(a) => local::up(a).await,
        Cmd::Status(a) => status::run(a).await,
        Cmd::Write(a) => write::run(a).await,
        Cmd::Tunables(a) => admin::tunables(a).await,
        Cmd::Vdev(a) => admin::vdev(a).await,
        Cmd::History(a) => history::run(a).await,
        Cmd::Demo(a) => demo::run(a).await,
        Cmd::Health(a) => health::run(a).await,
        Cmd::Verify(a) => verify::run(a).await,
        Cmd::Allocator(a) => allocators::run(a).await,
        Cmd::Certs(a) => certs::run(a),
        Cmd::Balancer(a) => balancer::run(a).await,
        Cmd::Free(a) => free::run(a).await,
    }
}

/// A command used wrongly (exit code 2), as opposed to a failure (1).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

#[cfg(test)]
mod tests {
    /// Every command's flags are consistent (clap checks names, globals,
    /// conflicts and requires across the whole tree).
    #[test]
    fn cli_is_well_formed() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }

    /// `--agent-host` where the errors that ask for it are: after the
    /// subcommand.
    #[test]
    fn agent_host_follows_any_subcommand() {
        use clap::Parser;
        for argv in [
            &[
                "aliquotctl",
                "balancer",
                "execute",
                "--agent-host",
                "127.0.0.1",
            ][..],
            &[
                "aliquotctl",
                "balancer",
                "verify",
                "--agent-host",
                "127.0.0.1",
            ],
            &["aliquotctl", "write", "--agent-host", "127.0.0.1"],
        ] {
            super::Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        }
    }
}
