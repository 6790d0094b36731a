//! An in-process agent on a port-0 loopback listener, driven over real gRPC
//! (plaintext: `start`; over mutual TLS with a pool CA and token key:
//! `TlsAgent`).

#![allow(dead_code)]

use std::net::SocketAddr;

use aliquot_agent::{Agent, BackendKind, Config};
use aliquot_auth::{PoolCa, Role, TlsFiles, TokenSigner};
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{AgentStats, GetStatsRequest, ReadRequest, WriteRequest};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub struct Running {
    pub addr: SocketAddr,
    pub client: VdevAgentClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<()>>>,
}

pub fn file_config(path: &std::path::Path, capacity: u64) -> Config {
    let mut c = Config::new(BackendKind::File);
    c.path = Some(path.to_path_buf());
    c.capacity = Some(capacity);
    c
}

pub fn sim_config(capacity: u64) -> Config {
    let mut c = Config::new(BackendKind::Sim);
    c.capacity = Some(capacity);
    c
}

pub async fn start(cfg: Config) -> Running {
    let agent = Agent::open(&cfg).expect("open agent");
    start_agent(agent, cfg).await
}

pub async fn start_agent(agent: Agent, cfg: Config) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        aliquot_agent::serve(agent, &cfg, listener, async {
            let _ = rx.await;
        })
        .await
    });
    let client = VdevAgentClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the agent")
        .max_encoding_message_size(32 << 20)
        .max_decoding_message_size(32 << 20);
    Running {
        addr,
        client,
        stop: Some(tx),
        handle: Some(handle),
    }
}

impl Running {
    /// Graceful stop; returns once the device is flushed and closed.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle
            .take()
            .unwrap()
            .await
            .unwrap()
            .expect("agent stopped cleanly");
    }

    pub async fn write(&mut self, offset: u64, data: Vec<u8>) -> Result<u32, tonic::Status> {
        self.client
            .write(WriteRequest {
                offset,
                data: data.into(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().aggregated_ios)
    }

    pub async fn read(&mut self, offset: u64, size: u64) -> Result<Vec<u8>, tonic::Status> {
        self.client
            .read(ReadRequest {
                offset,
                size,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().data.to_vec())
    }

    pub async fn stats(&mut self) -> AgentStats {
        self.client
            .get_stats(GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
    }
}

/// Deterministic non-trivial bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An agent served over mutual TLS: a pool CA in a temporary directory with
/// the certificates asked for, the agent's own as "a0", and the allocator's
/// token key the agent verifies with.
pub struct TlsAgent {
    pub dir: tempfile::TempDir,
    pub agent: Agent,
    pub signer: TokenSigner,
    pub port: u16,
    stop: oneshot::Sender<()>,
    served: JoinHandle<anyhow::Result<()>>,
}

impl TlsAgent {
    /// A 64 MiB simulated device, not registered yet; `certs` are issued
    /// beside the agent's own.
    pub async fn start(certs: &[(Role, &str)]) -> TlsAgent {
        let dir = tempfile::tempdir().unwrap();
        let ca = PoolCa::init(dir.path(), "tank").unwrap();
        ca.issue(Role::Agent, "a0", &[]).unwrap();
        for (role, name) in certs {
            ca.issue(*role, name, &[]).unwrap();
        }
        let signer = TokenSigner::load(dir.path()).unwrap();
        let mut cfg = Config::new(BackendKind::Sim);
        cfg.capacity = Some(64 << 20);
        let files = TlsFiles::in_dir(dir.path(), Role::Agent, "a0");
        cfg.tls.tls_ca = Some(files.ca);
        cfg.tls.tls_cert = Some(files.cert);
        cfg.tls.tls_key = Some(files.key);
        cfg.token_key = Some(dir.path().to_path_buf());
        let agent = Agent::open(&cfg).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = {
            let agent = agent.clone();
            tokio::spawn(async move {
                aliquot_agent::serve(agent, &cfg, listener, async {
                    let _ = stopped.await;
                })
                .await
            })
        };
        TlsAgent {
            dir,
            agent,
            signer,
            port,
            stop,
            served,
        }
    }

    /// A channel to the agent with the certificate of `role`/`name`.
    pub async fn channel(&self, role: Role, name: &str) -> Channel {
        let files = TlsFiles::in_dir(self.dir.path(), role, name);
        Channel::from_shared(format!("https://127.0.0.1:{}", self.port))
            .unwrap()
            .tls_config(files.client_config(Role::Agent).unwrap())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// Stops serving; the server must end cleanly.
    pub async fn stop(self) {
        self.stop.send(()).unwrap();
        self.served.await.unwrap().unwrap();
    }
}

/// The pool, vdev and generation a `TlsAgent`'s tests sign tokens for, and
/// the extent they write.
pub const POOL: u64 = 0xa11c;
pub const VDEV: u32 = 4;
pub const GENERATION: u64 = 6;
pub const EXTENT: u64 = 1 << 20;
pub const SIZE: u64 = 64 << 10;

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A write capability of the extent for `allocation_id`, valid a minute.
pub fn grant_of(allocation_id: u64) -> aliquot_auth::WriteGrant {
    aliquot_auth::WriteGrant {
        pool_guid: POOL,
        generation: GENERATION,
        vdev: VDEV,
        offset: EXTENT,
        size: SIZE,
        allocation_id,
        expires_ms: now_ms() + 60_000,
    }
}

/// A write of `len` bytes of 0x5a at `offset`.
pub fn token_write(offset: u64, len: usize, token: Vec<u8>) -> WriteRequest {
    WriteRequest {
        offset,
        data: vec![0x5a; len].into(),
        token,
    }
}
