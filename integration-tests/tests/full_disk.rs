//! A device that fills up, across real processes and a really full file system:
//! one agent's device file lives on a 40 MiB tmpfs. A write of 160 MiB over
//! two 256 MiB vdevs fills it; the agent reports ENOSPC, the allocator stops
//! placing anything there (health UNAVAILABLE), and `aliquotctl write`
//! writes the refused blocks elsewhere and finishes, every block verified.
//! When the file system grows again the vdev takes allocations again.
//!
//! The metrics service's store on a full file system too: it acknowledges
//! nothing it did not store, says so (health, `/metrics`), and stores again
//! once there is room.
//!
//! Mounting a tmpfs needs root (CAP_SYS_ADMIN), which the project's test
//! machines have; the test fails, saying so, where it is missing.

use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, Tmpfs, args, ctl, ok_stdout};
use pb::allocator_client::AllocatorClient;

async fn health_of(c: &mut AllocatorClient<tonic::transport::Channel>, name: &str) -> i32 {
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    st.vdevs
        .iter()
        .find(|v| v.name == name)
        .map(|v| v.health)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_agent_disk_takes_no_allocations_and_the_write_goes_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let small = Tmpfs::mount(&dir.path().join("small"), "40M");
    let mut pool =
        FilePool::start_with_default_timings(dir.path(), &args!["--report-interval", "200ms"]);
    let roomy = dir.path().join("roomy.img");
    pool.add_file_agent("full", &small.0.join("full.img"), "256MiB", &[]);
    pool.add_file_agent("roomy", &roomy, "256MiB", &[]);
    let url = pool.url.clone();
    let mut c = AllocatorClient::new(
        tonic::transport::Channel::from_shared(url.clone())
            .unwrap()
            .connect_lazy(),
    );

    let out = ctl(&args![
        "write",
        "--allocator",
        url,
        "--total",
        "160MiB",
        "--block-size",
        "1MiB",
        "--concurrency",
        "8",
        "--verify",
        "--no-progress"
    ]);
    let text = ok_stdout(&out, "aliquotctl write onto a pool with a full agent disk");
    assert!(text.contains("verified: 160 blocks"), "{text}");
    // The full vdev is unavailable while its file system has no room.
    let h = health_of(&mut c, "full").await;
    if h != pb::VdevHealth::Unavailable as i32 {
        eprintln!(
            "agent log:\n{}\nallocator log:\n{}",
            pool.agents[0].log_tail(),
            pool.alloc.log_tail()
        );
    }
    assert_eq!(
        health_of(&mut c, "full").await,
        pb::VdevHealth::Unavailable as i32,
        "the full vdev must not take allocations"
    );
    for _ in 0..20 {
        let a = c
            .allocate(pb::AllocateRequest {
                class: pb::AllocationClass::Data as i32,
                size: 1 << 20,
                copies: 1,
                lease_ms: 0,
                max_size: 0,
                affinity_key: None,
            })
            .await
            .expect("allocate")
            .into_inner();
        assert!(
            a.endpoints.iter().all(|e| *e == pool.agents[1].url("grpc")),
            "placed on the full vdev: {:?}",
            a.extents
        );
        c.abort(pb::AbortRequest {
            allocation_ids: vec![a.allocation_id],
        })
        .await
        .unwrap();
    }
    // Room again: the agent says so at its next report, and the vdev takes
    // allocations again.
    small.resize("200M");
    let deadline = Instant::now() + Duration::from_secs(10);
    while health_of(&mut c, "full").await != pb::VdevHealth::Healthy as i32 {
        assert!(Instant::now() < deadline, "the vdev never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(pool);
}

/// A snapshot of pool `full` at `t` ms with 8 vdevs.
fn snapshot(t: i64) -> pb::PoolSnapshot {
    pb::PoolSnapshot {
        pool: "full".into(),
        time_ms: t,
        txg: t as u64,
        vdevs: (0..8)
            .map(|v| pb::VdevSample {
                vdev: v,
                name: format!("file{v}"),
                capacity: 1 << 30,
                allocated: (t as u64 % 1000) << 16,
                free_fraction: 0.5,
                health: pb::VdevHealth::Healthy as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Fill the file system of `dir` with a file of zeros until ENOSPC.
fn writable_gauge(http: std::net::SocketAddr) -> Option<f64> {
    let o = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .arg(format!("http://{http}/metrics"))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("aliquot_metrics_store_writable "))
        .and_then(|v| v.trim().parse().ok())
}

/// The metrics service's database on a 4 MiB tmpfs, filled up: batches it
/// cannot store are refused (UNAVAILABLE, as the allocator's pusher
/// retries them), never acknowledged; health says NOT_SERVING and
/// `/metrics` `aliquot_metrics_store_writable 0` meanwhile. Once the space
/// returns the same batches are stored, and what is stored (across a
/// restart too) is exactly what was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_metrics_disk_acknowledges_nothing_it_did_not_store() {
    use pb::metrics_client::MetricsClient;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let dir = tempfile::tempdir().unwrap();
    let small = Tmpfs::mount(&dir.path().join("small"), "4M");
    let db = small.0.join("metrics.db");
    // Its log outside the full file system.
    let mut met = integration_tests::Proc::start(
        "metrics",
        &integration_tests::bin("aliquot-metrics"),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--db",
            db.display()
        ],
        &[],
        &["grpc", "http"],
        dir.path(),
    )
    .expect("start metrics");
    let ch = integration_tests::lazy_channel(&met.url("grpc"));
    let mut c = MetricsClient::new(ch.clone());
    let mut health = HealthClient::new(ch);
    let mut t: i64 = 1_700_000_000_000;
    let mut batch = || {
        let b: Vec<pb::PoolSnapshot> = (0..32)
            .map(|_| {
                t += 1000;
                snapshot(t)
            })
            .collect();
        pb::SnapshotBatch { snapshots: b }
    };
    // Vdev sample rows acknowledged (Summary's `samples` counts them).
    let mut acked: u64 = 0;
    // Room: stored and acknowledged.
    for _ in 0..4 {
        let r = c.record_batch(batch()).await.expect("batch with room");
        acked += r.into_inner().rows;
    }
    let filler = small.fill("filler");
    // Full: sooner or later (SQLite's pages in hand run out) refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    let refused = loop {
        let b = batch();
        match c.record_batch(b.clone()).await {
            Ok(r) => acked += r.into_inner().rows,
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                assert!(
                    s.message().contains("nothing of this request was stored"),
                    "{s:?}"
                );
                break b;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the store never refused a batch on a full file system"
        );
    };
    // Health and /metrics say so.
    let h = health
        .check(HealthCheckRequest {
            service: "aliquot.v1.Metrics".into(),
        })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(h.status, ServingStatus::NotServing as i32);
    assert_eq!(writable_gauge(met.addr("http")), Some(0.0));
    // Later batches: whatever is acknowledged must be stored (the
    // connection a full disk broke is never reused to acknowledge what it
    // cannot keep); the refused ones are held, as the allocator does.
    let mut held = vec![refused];
    for _ in 0..3 {
        let b = batch();
        match c.record_batch(b.clone()).await {
            Ok(r) => acked += r.into_inner().rows,
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                held.push(b);
            }
        }
    }

    // Room again: the batches held back (as the allocator resends them)
    // are stored, and the store says it writes.
    std::fs::remove_file(&filler).unwrap();
    for b in held {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match c.record_batch(b.clone()).await {
                Ok(r) => {
                    acked += r.into_inner().rows;
                    break;
                }
                Err(s) => assert!(
                    Instant::now() < deadline,
                    "never stored again after the space returned: {s:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let h = health
        .check(HealthCheckRequest {
            service: "aliquot.v1.Metrics".into(),
        })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(h.status, ServingStatus::Serving as i32);
    assert_eq!(writable_gauge(met.addr("http")), Some(1.0));

    let stored = |s: pb::SummaryReply| s.pools.first().map_or(0, |p| p.samples);
    let s = c
        .summary(pb::SummaryRequest {
            pool: "full".into(),
        })
        .await
        .expect("summary")
        .into_inner();
    assert_eq!(stored(s), acked, "stored vs acknowledged");
    // And after a clean shutdown.
    met.kill();
    met.restart().expect("restart metrics");
    let mut c = MetricsClient::new(integration_tests::lazy_channel(&met.url("grpc")));
    let s = c
        .summary(pb::SummaryRequest {
            pool: "full".into(),
        })
        .await
        .expect("summary after restart")
        .into_inner();
    assert_eq!(stored(s), acked, "stored vs acknowledged, after a restart");
    drop(met);
    drop(small);
}
