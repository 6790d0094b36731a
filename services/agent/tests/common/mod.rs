//! An in-process agent on a port-0 loopback listener, driven over real gRPC.

#![allow(dead_code)]

use std::net::SocketAddr;

use aliquot_agent::{Agent, BackendKind, Config};
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
