//! The connection flags every command that talks to a pool shares
//! (`--allocator`, `--leader-wait`, `--agent-host` and the TLS flags), and
//! thin wrappers that give the client library's connections and errors to
//! the commands as `anyhow` errors. The protocol itself (connecting,
//! following the leader, retries, reading) is `aliquot_client`'s.

use std::time::Duration;

use aliquot_auth::{ClientTls, ClientTlsArgs, Role};
use tonic::transport::Channel;

pub use aliquot_client::connect::{Agent, Agents, Allocator, MAX_MESSAGE};
pub use aliquot_client::error::Unresolvable;
pub use aliquot_client::retry::transient;

/// Where the allocator is and how to reach it: shared by every command
/// that talks to a pool.
#[derive(Clone, Debug, clap::Args)]
pub struct AllocatorArgs {
    /// The allocator's gRPC endpoint (the scheme follows the TLS mode:
    /// https with certificates, http with --insecure), or several separated
    /// by commas (allocators sharing a PostgreSQL store: calls go to the one
    /// that leads, following NOT_LEADER). Global: it may follow a
    /// subcommand (`vdev offline file0 --allocator URL`).
    #[arg(
        long,
        global = true,
        env = "ALIQUOT_ALLOCATOR",
        default_value = "http://127.0.0.1:7000"
    )]
    pub allocator: String,
    /// With several allocators, how long to wait for one to lead (a
    /// takeover under way) before the command fails.
    #[arg(long, global = true, env = "ALIQUOT_LEADER_WAIT", value_parser = units::duration_arg, default_value = "30s")]
    pub leader_wait: Duration,
    /// Reach every agent at this host (keeping the port it advertises):
    /// for a compose stack from the host, whose agents advertise names only
    /// the compose network resolves (`--agent-host 127.0.0.1`). Global,
    /// as --allocator: it may follow a subcommand (`balancer execute
    /// --agent-host 127.0.0.1`), where the errors that ask for it are.
    #[arg(long, global = true, env = "ALIQUOT_AGENT_HOST")]
    pub agent_host: Option<String>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

impl AllocatorArgs {
    /// Connect to the allocator with these flags' certificates.
    pub async fn connect(&self) -> anyhow::Result<Allocator> {
        allocator_waiting(&self.tls.resolve()?, &self.allocator, self.leader_wait).await
    }

    /// A [`aliquot_client::Config`] for these flags (the write options are
    /// the client's defaults).
    pub fn config(&self) -> anyhow::Result<aliquot_client::Config> {
        let mut c = aliquot_client::Config::new(self.allocator.clone(), self.tls.resolve()?);
        c.agent_host = self.agent_host.clone();
        c.leader_wait = self.leader_wait;
        Ok(c)
    }

    /// The agents, reached as these flags say.
    pub fn agents(&self) -> anyhow::Result<Agents> {
        Ok(Agents::new(self.tls.resolve()?, self.agent_host.clone()))
    }
}

/// The one connect helper (see `aliquot_client::connect::channel`).
pub async fn channel(tls: &ClientTls, url: &str, server: Role) -> anyhow::Result<Channel> {
    Ok(aliquot_client::connect::channel(tls, url, server).await?)
}

pub async fn allocator(tls: &ClientTls, url: &str) -> anyhow::Result<Allocator> {
    allocator_waiting(tls, url, Duration::from_secs(30)).await
}

/// `allocator`; given several, wait up to `leader_wait` for one to lead.
pub async fn allocator_waiting(
    tls: &ClientTls,
    url: &str,
    leader_wait: Duration,
) -> anyhow::Result<Allocator> {
    Ok(aliquot_client::connect::allocator(tls, url, leader_wait).await?)
}

/// `Status` → one line an operator can act on: code name and the server's words.
pub fn status_msg(what: &str, s: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(aliquot_client::error::status_line(what, s))
}

/// Read capabilities for committed extents, by `(vdev, offset)` (empty
/// tokens when the allocator signs none).
pub async fn read_tokens(
    alloc: &Allocator,
    extents: impl IntoIterator<Item = aliquot_proto::v1::Extent>,
) -> anyhow::Result<std::collections::HashMap<(u32, u64), Vec<u8>>> {
    Ok(aliquot_client::read::read_tokens(alloc, extents).await?)
}
