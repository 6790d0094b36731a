//! aliquotctl: the operator's tool for an Aliquot pool. It starts a local
//! pool of real processes (`up`, `demo`), shows the pool as `zpool list -v`
//! would (`status`), drives the write path end to end (`write`), changes
//! tunables and vdev states. It is a client: it links no server, and runs
//! the service binaries (`aliquot-allocator`, `aliquot-agent`,
//! `aliquot-metrics`, found beside it or on PATH) for `up`, `demo`, `serve`
//! and `verify`, `migrate-store`.

pub mod admin;
pub mod allocators;
pub mod balancer;
pub mod binaries;
pub mod certs;
pub mod client;
pub mod demo;
pub mod evacuation;
pub mod free;
pub mod health;
pub mod history;
pub mod local;
pub mod manifest;
pub mod migrate;
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

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Run one service: exec its binary (aliquot-agent, aliquot-allocator,
    /// aliquot-metrics) with the arguments given.
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
    /// Move a stopped pool from its SQLite store into PostgreSQL (for `--store`, HA).
    #[command(long_about = aliquot_process::migrate_args::LONG_ABOUT)]
    MigrateStore(aliquot_process::migrate_args::MigrateArgs),
    /// The pool CA: `certs init`, `certs issue --role ROLE NAME`.
    Certs(certs::CertsArgs),
    /// How balanced the pool is and how to rebalance it: `eval`, `plan`, `execute --manifest`
    /// (the mover), `status`, `verify --manifest`.
    Balancer(balancer::BalancerArgs),
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Cmd::Serve(s) => Err(serve::exec(
            &s,
            cli.telemetry.log_format == telemetry::LogFormat::Json,
        )),
        Cmd::Up(a) => local::up(a).await,
        Cmd::Status(a) => status::run(a).await,
        Cmd::Write(a) => write::run(a).await,
        Cmd::Tunables(a) => admin::tunables(a).await,
        Cmd::Vdev(a) => admin::vdev(a).await,
        Cmd::History(a) => history::run(a).await,
        Cmd::Demo(a) => demo::run(a).await,
        Cmd::Health(a) => health::run(a).await,
        Cmd::Verify(a) => verify::run(a).await,
        Cmd::MigrateStore(a) => migrate::run(a).await,
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

/// A failure that is bad usage or configuration (exit code 2).
pub fn is_usage_error(e: &anyhow::Error) -> bool {
    e.downcast_ref::<UsageError>().is_some()
}

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
