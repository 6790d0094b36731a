//! Registration against a small fake AgentRegistry over real gRPC: register,
//! a report stream with one report per interval, and reconnection with
//! re-registration after the allocator goes away and comes back.

mod common;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aliquot_proto::v1::agent_registry_server::{AgentRegistry, AgentRegistryServer};
use aliquot_proto::v1::{AgentReport, RegisterReply, RegisterRequest, ReportAck, VdevHealth};
use common::{sim_config, start};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone)]
struct Fake {
    registers: Arc<Mutex<Vec<RegisterRequest>>>,
    reports: Arc<Mutex<Vec<AgentReport>>>,
    /// Turning true ends every open report stream (the allocator going away).
    gone: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl AgentRegistry for Fake {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        self.registers.lock().unwrap().push(req.into_inner());
        Ok(Response::new(RegisterReply {
            vdev: 7,
            pool_guid: 42,
            report_interval_ms: 200,
            ..Default::default()
        }))
    }

    type ReportStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<ReportAck, Status>> + Send + 'static>>;

    async fn report(
        &self,
        req: Request<Streaming<AgentReport>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        let mut inbound = req.into_inner();
        let reports = self.reports.clone();
        let mut gone = self.gone.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(r)) => {
                            reports.lock().unwrap().push(r);
                            let ack = ReportAck { health: VdevHealth::Healthy as i32, online: true, ..Default::default() };
                            if tx.send(Ok(ack)).await.is_err() {
                                return;
                            }
                        }
                        _ => return,
                    },
                    _ = async { let _ = gone.wait_for(|g| *g).await; } => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

struct FakeServer {
    fake: Fake,
    gone: watch::Sender<bool>,
    handle: tokio::task::JoinHandle<()>,
}

async fn fake_registry(addr: SocketAddr) -> FakeServer {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .expect("bind fake");
    let (gone_tx, gone_rx) = watch::channel(false);
    let fake = Fake {
        registers: Default::default(),
        reports: Default::default(),
        gone: gone_rx.clone(),
    };
    let svc = AgentRegistryServer::new(fake.clone());
    let mut stop = gone_rx;
    let handle = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async move {
                    let _ = stop.wait_for(|g| *g).await;
                },
            )
            .await
            .unwrap();
    });
    FakeServer {
        fake,
        gone: gone_tx,
        handle,
    }
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_reports_and_reconnects_after_the_allocator_returns() {
    // A free port for the fake allocator, which must come back on it.
    let registry_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let first = fake_registry(registry_addr).await;

    let mut cfg = sim_config(64 << 20);
    cfg.name = Some("fast-ssd".into());
    cfg.children = 3;
    cfg.parity = 1;
    cfg.allocator = format!("http://{registry_addr}");
    let mut agent = start(cfg).await;
    let guid = agent.stats().await.device_guid;

    wait_for("first registration and 3 reports", || {
        first.fake.reports.lock().unwrap().len() >= 3
    })
    .await;
    {
        let regs = first.fake.registers.lock().unwrap();
        assert_eq!(regs.len(), 1);
        let r = &regs[0];
        assert_eq!(r.device_guid, guid);
        assert_eq!(r.endpoint, format!("http://{}", agent.addr));
        assert_eq!(r.name, "fast-ssd");
        assert_eq!(r.backend, "sim");
        assert_eq!(r.capacity, (64 << 20) - (1 << 20));
        assert_eq!(r.ashift, 12);
        assert_eq!((r.children, r.parity, r.log), (3, 1, false));
        let reps = first.fake.reports.lock().unwrap();
        assert!(reps.iter().all(|r| r.vdev == 7 && r.capacity == (63 << 20)));
        assert!(reps.iter().all(|r| r.health == VdevHealth::Healthy as i32));
    }
    assert_eq!(agent.stats().await.vdev, Some(7), "the allocator's vdev id");

    // Writes show up in the following reports.
    agent.write(0, vec![1; 8192]).await.unwrap();
    wait_for("a report counting the write", || {
        first
            .fake
            .reports
            .lock()
            .unwrap()
            .last()
            .is_some_and(|r| r.bytes_written == 8192 && r.writes == 1 && r.device_writes == 1)
    })
    .await;

    // The allocator goes away: streams end, the server stops.
    let _ = first.gone.send(true);
    first.handle.await.unwrap();
    // Down for a while: the agent keeps retrying (with backoff) and stays up.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        agent.read(0, 8192).await.unwrap(),
        vec![1; 8192],
        "still serving"
    );

    let second = fake_registry(registry_addr).await;
    wait_for("re-registration and reports", || {
        !second.fake.registers.lock().unwrap().is_empty()
            && second.fake.reports.lock().unwrap().len() >= 2
    })
    .await;
    assert_eq!(second.fake.registers.lock().unwrap()[0].device_guid, guid);
    assert_eq!(first.fake.registers.lock().unwrap().len(), 1);

    agent.stop().await;
    let _ = second.gone.send(true);
    second.handle.await.unwrap();
}
