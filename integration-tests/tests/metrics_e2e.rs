//! Metrics across real processes: `aliquot-metrics`, an allocator pushing
//! snapshots every 200 ms, sim agents, and a write workload. The SQLite file
//! ends up with samples for every vdev; killing metrics in the middle of the
//! writes neither fails nor slows them, and after a restart the buffered
//! backlog arrives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args, metrics_service};
use pb::allocator_client::AllocatorClient;
use pb::metrics_client::MetricsClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::transport::Channel;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn allocatable(c: &mut AllocatorClient<Channel>, n: usize) -> pb::PoolStatus {
    let start = Instant::now();
    loop {
        let s = c
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        let ready = s
            .classes
            .iter()
            .find(|c| c.name == "normal")
            .map_or(0, |c| c.groups.iter().filter(|g| g.allocatable).count());
        if ready >= n {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{n} vdevs never allocatable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One write: (when it finished, how long it took, whether it succeeded).
type Log = Arc<Mutex<Vec<(Instant, Duration, bool)>>>;

/// Allocate, write to the agent, commit, in a loop until `stop`.
fn writer(
    c: AllocatorClient<Channel>,
    log: Log,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut c = c;
        let mut agents: HashMap<String, VdevAgentClient<Channel>> = HashMap::new();
        let payload = vec![0x5au8; 256 << 10];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let t = Instant::now();
            let ok = async {
                let a = c
                    .allocate(pb::AllocateRequest {
                        class: pb::AllocationClass::Data as i32,
                        size: payload.len() as u64,
                        copies: 1,
                        lease_ms: 0,
                        max_size: 0,
                        affinity_key: None,
                    })
                    .await
                    .ok()?
                    .into_inner();
                let (e, ep) = (a.extents.first()?, a.endpoints.first()?);
                if !agents.contains_key(ep) {
                    agents.insert(ep.clone(), VdevAgentClient::connect(ep.clone()).await.ok()?);
                }
                let mut data = payload.clone();
                data.resize(e.size as usize, 0);
                agents[ep]
                    .clone()
                    .write(pb::WriteRequest {
                        offset: e.offset,
                        data: data.into(),
                        ..Default::default()
                    })
                    .await
                    .ok()?;
                c.commit(pb::CommitRequest {
                    allocation_ids: vec![a.allocation_id],
                    wait_synced: false,
                    generation: a.generation,
                })
                .await
                .ok()?;
                Some(())
            }
            .await
            .is_some();
            log.lock().unwrap().push((Instant::now(), t.elapsed(), ok));
        }
    })
}

/// (ops, failures, median latency) of the writes finished in [from, to).
fn phase(log: &Log, from: Instant, to: Instant) -> (usize, usize, Duration) {
    let l = log.lock().unwrap();
    let mut lat: Vec<Duration> = l
        .iter()
        .filter(|e| e.0 >= from && e.0 < to)
        .map(|e| e.1)
        .collect();
    let failed = l.iter().filter(|e| e.0 >= from && e.0 < to && !e.2).count();
    lat.sort();
    let median = lat.get(lat.len() / 2).copied().unwrap_or_default();
    (lat.len(), failed, median)
}

async fn history(url: &str, pool: &str) -> Option<pb::HistoryReply> {
    let mut m = MetricsClient::connect(url.to_string()).await.ok()?;
    m.history(pb::HistoryRequest {
        pool: pool.into(),
        vdevs: vec![],
        since_ms: None,
        until_ms: None,
        max_points: 10_000,
    })
    .await
    .ok()
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_for_every_vdev_and_a_metrics_outage_costs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut met = metrics_service(dir.path());
    // Pin the port so a restart comes back where the allocator pushes.
    met.set_arg("--listen", &met.addr("grpc").to_string());
    let mut pool = FilePool::start_with_default_timings(
        dir.path(),
        &args!["--metrics", met.url("grpc"), "--snapshot-interval", "200ms"],
    );
    for (name, guid) in [("sim0", 31), ("sim1", 32), ("sim2", 33)] {
        pool.add_sim_agent(name, guid, &args!["--capacity", "4GiB"]);
    }
    let mut c = AllocatorClient::connect(pool.url.clone()).await.unwrap();
    let status = allocatable(&mut c, 3).await;
    let pool = status.name.clone();
    let vdevs: Vec<u32> = status.vdevs.iter().map(|v| v.vdev).collect();
    assert_eq!(vdevs.len(), 3);

    let log: Log = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..4)
        .map(|_| writer(c.clone(), log.clone(), stop.clone()))
        .collect();

    // Phase A: metrics up.
    let a0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Phase B: metrics SIGKILLed in the middle of the writes.
    let b0 = Instant::now();
    met.kill9();
    let killed_ms = now_ms();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let restarted_ms = now_ms();
    let c0 = Instant::now();
    met.restart().expect("restart metrics");
    // Phase C: metrics back.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let end = Instant::now();

    let (na, fa, ma) = phase(&log, a0, b0);
    let (nb, fb, mb) = phase(&log, b0, c0);
    let (nc, fc, mc) = phase(&log, c0, end);
    println!(
        "writes: up {na} (median {ma:?}), metrics down {nb} (median {mb:?}), back {nc} (median {mc:?})"
    );
    assert_eq!((fa, fb, fc), (0, 0, 0), "writes failed");
    assert!(na > 10 && nb > 10, "too few writes to compare: {na} {nb}");
    // Generous bounds (a busy 2-core machine), yet far from what a push
    // waiting on a dead endpoint (1 s connect timeouts) would cost.
    assert!(
        mb <= ma * 4 + Duration::from_millis(20),
        "writes slowed: {ma:?} -> {mb:?}"
    );
    assert!(
        nb * 10 >= na * 3,
        "throughput fell: {na} -> {nb} ops in 2 s"
    );

    // The backlog buffered while metrics was down arrives after the restart.
    let url = met.url("grpc");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = history(&url, &pool).await;
        let covered = h.as_ref().is_some_and(|h| {
            h.series.len() == 3
                && h.series.iter().all(|s| {
                    s.points
                        .iter()
                        .any(|p| p.time_ms > killed_ms + 300 && p.time_ms < restarted_ms - 300)
                })
        });
        if covered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "outage snapshots never arrived; metrics log:\n{}",
            met.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The SQLite file itself: samples for every vdev, in time order.
    met.kill();
    let store = aliquot_metrics::Store::open(&dir.path().join("metrics.db"))
        .await
        .unwrap();
    assert!(store.raw_rows().await.unwrap() >= 3 * 20);
    let h = store
        .history(&pb::HistoryRequest {
            pool: pool.clone(),
            max_points: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let got: Vec<u32> = h.series.iter().map(|s| s.vdev).collect();
    assert_eq!(got, vdevs);
    for s in &h.series {
        assert!(
            s.points.len() >= 20,
            "vdev {} has {} points",
            s.vdev,
            s.points.len()
        );
        assert!(s.points.windows(2).all(|w| w[0].time_ms < w[1].time_ms));
        assert!(
            s.points.last().unwrap().allocated > 0,
            "vdev {} saw no writes",
            s.vdev
        );
        assert!(s.points.iter().all(|p| p.capacity > 0));
    }
    store.close().await;
}
