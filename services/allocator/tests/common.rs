//! Shared helpers: an allocator in-process on port 0, and fake vdevs
//! registered through AgentRegistry by a real gRPC client (no agent).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::{Config, MemStore, Running, Store};
use aliquot_proto::v1 as pb;
use pb::agent_registry_client::AgentRegistryClient;
use pb::allocator_client::AllocatorClient;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

pub struct Harness {
    pub server: Running,
    pub alloc: AllocatorClient<Channel>,
    pub registry: AgentRegistryClient<Channel>,
}

pub fn config() -> Config {
    let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
    // Long enough that only the tests decide when txgs close and vdevs go
    // silent, unless a test sets its own.
    c.zfs_txg_timeout = Duration::from_secs(600);
    c.report_interval = Duration::from_secs(600);
    c
}

pub async fn start(c: Config) -> Harness {
    start_with(c, Arc::new(MemStore::new())).await
}

pub async fn start_with(c: Config, store: Arc<dyn Store>) -> Harness {
    let server = aliquot_allocator::start(c, store).await.expect("start");
    let ch = Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .expect("connect");
    Harness {
        server,
        alloc: AllocatorClient::new(ch.clone()),
        registry: AgentRegistryClient::new(ch),
    }
}

pub fn register_req(guid: u64, capacity: u64) -> pb::RegisterRequest {
    pb::RegisterRequest {
        endpoint: format!("http://127.0.0.1:1/fake-{guid}"),
        device_guid: guid,
        name: format!("fake{guid}"),
        capacity,
        ashift: 12,
        rotational: false,
        children: 1,
        parity: 0,
        log: false,
        backend: "sim".into(),
        ..Default::default()
    }
}

impl Harness {
    pub async fn add_vdev(&mut self, guid: u64, capacity: u64) -> u32 {
        self.registry
            .register(register_req(guid, capacity))
            .await
            .expect("register")
            .into_inner()
            .vdev
    }

    /// A known device's agent comes back after a restart: it registers
    /// again and reports once (a vdev loaded from the store is allocatable
    /// only after its agent has reported in the new generation).
    pub async fn rejoin(&mut self, guid: u64, capacity: u64) -> u32 {
        let vdev = self.add_vdev(guid, capacity).await;
        let report = pb::AgentReport {
            vdev,
            capacity,
            health: pb::VdevHealth::Healthy as i32,
            ..Default::default()
        };
        let mut acks = self
            .registry
            .report(tokio_stream::iter([report]))
            .await
            .expect("report stream")
            .into_inner();
        acks.message().await.expect("report ack").expect("an ack");
        vdev
    }

    /// An AllocateStream: the sender of its requests (`depth` buffered)
    /// and its replies.
    pub async fn stream(
        &mut self,
        depth: usize,
    ) -> (
        mpsc::Sender<pb::StreamRequest>,
        tonic::Streaming<pb::StreamReply>,
    ) {
        let (tx, rx) = mpsc::channel(depth);
        let replies = self
            .alloc
            .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        (tx, replies)
    }

    pub async fn pool(&mut self) -> pb::PoolStatus {
        self.alloc
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn normal(&mut self) -> pb::ClassStatus {
        self.pool()
            .await
            .classes
            .into_iter()
            .find(|c| c.name == "normal")
            .expect("normal class")
    }

    pub async fn allocate(&mut self, size: u64) -> Result<pb::AllocateReply, tonic::Status> {
        self.alloc
            .allocate(data(size))
            .await
            .map(|r| r.into_inner())
    }

    pub async fn commit(&mut self, ids: Vec<u64>) -> Result<pb::CommitReply, tonic::Status> {
        let generation = self.pool().await.generation;
        self.alloc
            .commit(pb::CommitRequest {
                allocation_ids: ids,
                wait_synced: false,
                generation,
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn sync(&mut self) -> u64 {
        self.alloc
            .sync_txg(pb::SyncTxgRequest {
                txg: 0,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .synced_txg
    }

    /// Hold uncommitted allocations of `size` until the throttle is full:
    /// the next data allocation will wait.
    pub async fn fill_throttle(&mut self, size: u64) -> Vec<u64> {
        let mut held = Vec::new();
        loop {
            let c = self.normal().await;
            assert!(c.throttle_enabled, "throttle must be enabled");
            if c.reserved > c.alloc_max {
                return held;
            }
            let a = tokio::time::timeout(Duration::from_secs(5), self.allocate(size))
                .await
                .expect("not full yet: must be admitted")
                .expect("allocate");
            held.push(a.allocation_id);
            assert!(held.len() < 10_000, "throttle never filled");
        }
    }
}

pub fn data(size: u64) -> pb::AllocateRequest {
    pb::AllocateRequest {
        class: pb::AllocationClass::Data as i32,
        size,
        copies: 1,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    }
}

/// Keep a report stream open for `vdev`, one report per `every`, until the
/// returned task is aborted.
pub fn reporter(
    registry: &AgentRegistryClient<Channel>,
    vdev: u32,
    capacity: u64,
    every: Duration,
) -> JoinHandle<()> {
    let mut registry = registry.clone();
    tokio::spawn(async move {
        let (tx, rx) = mpsc::channel(4);
        let feed = tokio::spawn(async move {
            loop {
                let r = pb::AgentReport {
                    vdev,
                    capacity,
                    health: pb::VdevHealth::Healthy as i32,
                    ..Default::default()
                };
                if tx.send(r).await.is_err() {
                    return;
                }
                tokio::time::sleep(every).await;
            }
        });
        struct AbortOnDrop(JoinHandle<()>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let _feed = AbortOnDrop(feed);
        let mut acks = registry
            .report(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("report stream")
            .into_inner();
        while let Ok(Some(_)) = acks.message().await {}
    })
}

/// Waits until `want` requests wait in the normal class's throttle.
pub async fn wait_waiting(alloc: &AllocatorClient<Channel>, want: u32) {
    eventually("waiter queued", Duration::from_secs(5), || {
        let mut p = alloc.clone();
        async move {
            let s = p
                .get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner();
            s.classes
                .iter()
                .any(|c| c.name == "normal" && c.waiting == want)
        }
    })
    .await;
}

pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within {limit:?}");
}
