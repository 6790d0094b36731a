//! A pool under mutual TLS for tests, as `aliquotctl up` makes one: a pool
//! CA with a certificate per member and per caller, an allocator that
//! signs tokens and admits its devices ahead (`--admit-agent`, the
//! operator's `vdev add` done at start), and file agents that check
//! tokens. Tests about owners, tokens and moves need callers with names
//! and roles; this is where they get them, in one way. The processes are
//! a [`FilePool`]'s, started the same way (`crate::pool`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aliquot_auth::{PoolCa, Role, TlsFiles};
use aliquot_proto::v1 as pb;
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::transport::Channel;

use crate::{FilePool, Security, args, tls_args};

/// The admin certificate the harness itself watches the pool with.
pub const HARNESS: &str = "harness";

/// A channel to `url` as the certificate `certs issue` wrote for `role`
/// `name`, checking that the server holds a `server` certificate.
pub fn tls_channel(url: &str, certs: &Path, role: Role, name: &str, server: Role) -> Channel {
    let f = TlsFiles::in_dir(certs, role, name);
    Channel::from_shared(url.to_string())
        .expect("url")
        .tls_config(f.client_config(server).expect("client TLS config"))
        .expect("TLS config")
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

/// What a `SecurePool` is made of.
pub struct SecurePoolSpec<'a> {
    /// The pool's name (in its CA and certificates).
    pub pool: &'a str,
    /// File agents as (name, capacity), e.g. ("d0", "64MiB"); each is
    /// admitted ahead and registers before `start` returns.
    pub agents: &'a [(&'a str, &'a str)],
    /// Callers to issue certificates for, besides the allocator's and the
    /// agents': e.g. (Role::Client, "alice"), (Role::Admin, "op").
    pub callers: &'a [(Role, &'a str)],
    /// Allocator flags beyond the defaults (which they replace when they
    /// name the same flag).
    pub allocator_flags: &'a [String],
}

/// A running pool under mutual TLS (see the module's text): a
/// [`FilePool`] whose members speak TLS (its fields and helpers through
/// `Deref`), with the CA's directory at hand.
pub struct SecurePool {
    pub pool: FilePool,
    /// The pool CA's directory: every certificate, and the token key.
    pub certs: PathBuf,
}

impl std::ops::Deref for SecurePool {
    type Target = FilePool;
    fn deref(&self) -> &FilePool {
        &self.pool
    }
}

impl std::ops::DerefMut for SecurePool {
    fn deref_mut(&mut self) -> &mut FilePool {
        &mut self.pool
    }
}

impl SecurePool {
    /// Starts the allocator (reports every 200 ms, no claim window) and
    /// the agents in `dir`, and waits until every agent has registered and
    /// reported. The operator's certificate is issued too (for the `ctl`
    /// helpers).
    pub async fn start(dir: &Path, spec: SecurePoolSpec<'_>) -> SecurePool {
        let certs = dir.join("certs");
        let ca = PoolCa::init(&certs, spec.pool).expect("pool CA");
        let members = spec
            .agents
            .iter()
            .map(|(name, _)| (Role::Agent, *name))
            .chain([
                (Role::Allocator, "allocator"),
                (Role::Admin, HARNESS),
                (Role::Admin, aliquot_auth::client::OPERATOR),
            ]);
        for (role, name) in members.chain(spec.callers.iter().copied()) {
            ca.ensure_issued(role, name, &[])
                .expect("issue a certificate");
        }
        let mut a = args!["--pool", spec.pool, "--token-key", certs.display()];
        for (name, _) in spec.agents {
            a.extend(args!["--admit-agent", name]);
        }
        a.extend(tls_args(&certs, Role::Allocator, "allocator"));
        a.extend(spec.allocator_flags.iter().cloned());
        let pool = FilePool::start_as(
            dir,
            Security::Tls(&certs),
            &[
                ("--report-interval", "200ms".into()),
                ("--claim-window", "0s".into()),
            ],
            &a,
        );
        let mut pool = SecurePool { pool, certs };
        for (name, capacity) in spec.agents {
            let p = pool.start_agent(name, capacity, &[]);
            pool.agents.push(p);
        }
        pool.wait_reported(spec.agents.len()).await;
        pool
    }

    /// Waits until `n` vdevs are listed and each has reported.
    pub async fn wait_reported(&self, n: usize) -> pb::PoolStatus {
        let mut op = self.allocator(Role::Admin, HARNESS);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(p) = op.get_pool(pb::GetPoolRequest {}).await {
                let p = p.into_inner();
                if p.vdevs.len() == n && p.vdevs.iter().all(|v| v.last_report.is_some()) {
                    return p;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{n} vdevs did not register and report; allocator log:\n{}",
                self.alloc.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A channel to `url` as `role` `name`, to a `server`.
    pub fn channel(&self, url: &str, role: Role, name: &str, server: Role) -> Channel {
        tls_channel(url, &self.certs, role, name, server)
    }

    /// The allocator's client as `role` `name`.
    pub fn allocator(&self, role: Role, name: &str) -> AllocatorClient<Channel> {
        AllocatorClient::new(self.channel(&self.url, role, name, Role::Allocator))
    }

    /// The agent at `endpoint`'s client as `role` `name`.
    pub fn agent(&self, endpoint: &str, role: Role, name: &str) -> VdevAgentClient<Channel> {
        VdevAgentClient::new(self.channel(endpoint, role, name, Role::Agent))
    }

    /// The `https://` URL of agent `i`.
    pub fn agent_url(&self, i: usize) -> String {
        format!("https://127.0.0.1:{}", self.agents[i].addr("grpc").port())
    }
}
