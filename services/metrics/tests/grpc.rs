//! The Metrics gRPC service over loopback on a real SQLite file: ingest,
//! History (order, downsampling, filters), Summary on a constructed history,
//! and bad queries.

mod common;

use aliquot_proto::v1::{HistoryRequest, SnapshotBatch, SummaryRequest};
use common::*;
use tonic::Code;

fn req(pool: &str, max_points: u32) -> HistoryRequest {
    HistoryRequest {
        pool: pool.into(),
        vdevs: vec![],
        since_ms: None,
        until_ms: None,
        max_points,
    }
}

/// vdev i's used fraction at time t (seconds from T0): linear, so the
/// average over any bucket equals the value at the bucket's average time.
fn used_at(i: usize, secs: f64) -> f64 {
    0.01 * (i as f64 + 1.0) + secs * 0.0001 * (i as f64 + 1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_then_history_in_order_and_downsampled() {
    let dir = tempfile::tempdir().unwrap();
    let svc = start(&dir.path().join("m.db")).await;
    let mut c = client(&svc).await;

    // 600 one-second snapshots of 3 vdevs: half streamed, half batched.
    let snaps: Vec<_> = (0..600)
        .map(|s| {
            let used: Vec<f64> = (0..3).map(|i| used_at(i, s as f64)).collect();
            snap("tank", T0 + s * 1000, &used)
        })
        .collect();
    let streamed = c
        .record_snapshots(tokio_stream::iter(snaps[..300].to_vec()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((streamed.snapshots, streamed.rows), (300, 900));
    let batched = c
        .record_batch(SnapshotBatch {
            snapshots: snaps[300..].to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((batched.snapshots, batched.rows), (300, 900));

    // Full resolution: every sample, oldest first, values as sent.
    let full = c.history(req("tank", 1000)).await.unwrap().into_inner();
    assert_eq!(full.series.len(), 3);
    for (i, s) in full.series.iter().enumerate() {
        assert_eq!(s.vdev, i as u32);
        assert_eq!(s.name, format!("disk{i}"));
        assert_eq!(s.points.len(), 600);
        for (k, p) in s.points.iter().enumerate() {
            assert_eq!(p.time_ms, T0 + k as i64 * 1000);
            let want = (used_at(i, k as f64) * GIB as f64) as u64 as f64 / GIB as f64;
            assert!((p.used_fraction - want).abs() < 1e-9, "vdev {i} point {k}");
            assert_eq!(p.capacity, GIB);
            assert_eq!(p.queue_depth, (i as u64 + 1) << 20);
            assert_eq!(p.fragmentation, 10 + i as i32);
            assert_eq!(p.latency_p99_us, 900 + i as u64);
        }
    }

    // Downsampled: at most max_points, strictly increasing time, and each
    // point the average of its bucket (linear data: value at average time).
    for max_points in [1u32, 7, 50, 599] {
        let h = c
            .history(req("tank", max_points))
            .await
            .unwrap()
            .into_inner();
        for (i, s) in h.series.iter().enumerate() {
            assert!(!s.points.is_empty());
            assert!(
                s.points.len() <= max_points as usize,
                "{} > {max_points}",
                s.points.len()
            );
            assert!(s.points.len() * 2 >= max_points as usize, "too few points");
            assert!(s.points.windows(2).all(|w| w[0].time_ms < w[1].time_ms));
            for p in &s.points {
                let secs = (p.time_ms - T0) as f64 / 1000.0;
                assert!((p.used_fraction - used_at(i, secs)).abs() < 1e-6);
                assert!((p.write_bytes_per_sec - MIB).abs() < 1e-6);
            }
        }
    }

    // Filters: one vdev, a time window.
    let mut one = req("tank", 100);
    one.vdevs = vec![1];
    one.since_ms = Some(T0 + 100_000);
    one.until_ms = Some(T0 + 199_000);
    let h = c.history(one).await.unwrap().into_inner();
    assert_eq!(h.series.len(), 1);
    assert_eq!(h.series[0].vdev, 1);
    assert_eq!(h.series[0].points.len(), 100);
    assert_eq!(h.series[0].points[0].time_ms, T0 + 100_000);
    assert_eq!(h.series[0].points[99].time_ms, T0 + 199_000);

    drop(c);
    svc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summary_of_a_constructed_history() {
    let dir = tempfile::tempdir().unwrap();
    let svc = start(&dir.path().join("m.db")).await;
    let mut c = client(&svc).await;

    // Two vdevs at 30 % and 31 % for 60 s; at 60 s vdev 2 joins empty
    // (spread 31 %), then the spread shrinks linearly to 0 over 100 s.
    let mut snaps = Vec::new();
    for s in 0..60 {
        snaps.push(snap("p", T0 + s * 1000, &[0.30, 0.31]));
    }
    for s in 60..=200 {
        let x = ((s - 60) as f64 / 100.0).min(1.0);
        let mut sn = snap("p", T0 + s * 1000, &[0.31, 0.31, 0.31 * x]);
        if s == 60 {
            sn.events.push(event(T0 + 60_000, "vdev_add", 2));
        }
        snaps.push(sn);
    }
    // Out of order on the wire: the store sorts each pool's snapshots.
    snaps.reverse();
    c.record_batch(SnapshotBatch { snapshots: snaps })
        .await
        .unwrap();

    let before = aliquot_metrics::service::now_ms();
    let r = c
        .summary(SummaryRequest { pool: "p".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.pools.len(), 1);
    let p = &r.pools[0];
    assert_eq!(p.pool, "p");
    assert_eq!(p.vdevs, 3);
    assert_eq!(p.samples, 60 * 2 + 141 * 3);
    assert_eq!((p.first_ms, p.last_ms), (T0, T0 + 200_000));
    assert!(p.current_spread < 1e-6, "current {}", p.current_spread);
    assert!(
        (p.worst_spread - 0.31).abs() < 1e-3,
        "worst {}",
        p.worst_spread
    );
    assert_eq!(p.last_vdev_add_ms, Some(T0 + 60_000));
    // 0.31 * (1 - x/100) < 0.05 first at x = 84 s.
    assert_eq!(p.rebalance_ms, Some(84_000));
    let since = p.since_last_vdev_add_ms.unwrap();
    assert!(since >= before - (T0 + 60_000) - 1000 && since <= before - (T0 + 60_000) + 5000);
    // 1 MiB/s per vdev: 59 s x 2 vdevs, then 140 s x 3 (the add snapshot's
    // interval is integrated with its 3 vdevs).
    let want = (59.0 * 2.0 + 141.0 * 3.0) * MIB;
    assert!(
        (p.total_written_bytes as f64 - want).abs() < 2.0 * MIB,
        "written {} want {want}",
        p.total_written_bytes
    );

    // Before rebalancing finishes, rebalance_ms is absent.
    let mut snaps = Vec::new();
    let mut sn = snap("q", T0, &[0.5, 0.0]);
    sn.events.push(event(T0, "vdev_add", 1));
    snaps.push(sn);
    snaps.push(snap("q", T0 + 1000, &[0.5, 0.2]));
    c.record_batch(SnapshotBatch { snapshots: snaps })
        .await
        .unwrap();
    let all = c
        .summary(SummaryRequest {
            pool: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = all.pools.iter().map(|p| p.pool.as_str()).collect();
    assert_eq!(names, ["p", "q"]);
    assert_eq!(all.pools[1].rebalance_ms, None);
    assert!((all.pools[1].current_spread - 0.3).abs() < 1e-3);

    // History carries the event.
    let h = c.history(req("p", 10)).await.unwrap().into_inner();
    assert_eq!(h.events.len(), 1);
    assert_eq!(
        (h.events[0].kind.as_str(), h.events[0].vdev),
        ("vdev_add", 2)
    );

    drop(c);
    svc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_queries_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let svc = start(&dir.path().join("m.db")).await;
    let mut c = client(&svc).await;
    c.record_batch(SnapshotBatch {
        snapshots: vec![snap("tank", T0, &[0.1, 0.2])],
    })
    .await
    .unwrap();

    use aliquot_proto::error::{metadata, reason, retry_after};
    use aliquot_proto::v1::ErrorReason;
    let code = |r: Result<tonic::Response<_>, tonic::Status>| match r {
        Ok::<tonic::Response<aliquot_proto::v1::HistoryReply>, _>(_) => panic!("accepted"),
        Err(s) => s,
    };
    // Each refusal carries the one table's reason (ErrorInfo) and the values
    // involved; none of these is worth repeating (no RetryInfo).
    let refused = |s: &tonic::Status, k: Code, r: ErrorReason, values: &[(&str, &str)]| {
        assert_eq!(s.code(), k, "{s:?}");
        assert_eq!(reason(s), Some(r), "{s:?}");
        let m = metadata(s);
        for (key, v) in values {
            assert_eq!(m.get(*key).map(String::as_str), Some(*v), "{key} of {s:?}");
        }
        assert_eq!(retry_after(s), None, "{s:?}");
    };
    let s = code(c.history(req("tank", 0)).await);
    refused(
        &s,
        Code::InvalidArgument,
        ErrorReason::InvalidArgument,
        &[("field", "max_points")],
    );
    assert!(s.message().contains("max_points"), "{s:?}");

    let mut r = req("tank", 10);
    r.since_ms = Some(T0 + 10);
    r.until_ms = Some(T0);
    let s = code(c.history(r).await);
    refused(
        &s,
        Code::InvalidArgument,
        ErrorReason::InvalidArgument,
        &[("field", "since_ms")],
    );
    assert!(s.message().contains("since"), "{s:?}");

    let s = code(c.history(req("nosuchpool", 10)).await);
    refused(
        &s,
        Code::NotFound,
        ErrorReason::NotFound,
        &[("pool", "nosuchpool")],
    );
    assert!(s.message().contains("nosuchpool"), "{s:?}");

    let mut r = req("tank", 10);
    r.vdevs = vec![7];
    let s = code(c.history(r).await);
    refused(
        &s,
        Code::NotFound,
        ErrorReason::NotFound,
        &[("pool", "tank"), ("vdev", "7")],
    );

    let s = c
        .summary(SummaryRequest {
            pool: "nosuchpool".into(),
        })
        .await
        .unwrap_err();
    refused(
        &s,
        Code::NotFound,
        ErrorReason::NotFound,
        &[("pool", "nosuchpool")],
    );

    let s = c
        .record_batch(SnapshotBatch {
            snapshots: vec![snap("", T0, &[0.1])],
        })
        .await
        .unwrap_err();
    refused(
        &s,
        Code::InvalidArgument,
        ErrorReason::InvalidArgument,
        &[("field", "pool")],
    );

    drop(c);
    svc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let dir = tempfile::tempdir().unwrap();
    let svc = start(&dir.path().join("m.db")).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", svc.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut h = HealthClient::new(channel);
    let r = h
        .check(HealthCheckRequest {
            service: "aliquot.v1.Metrics".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status, ServingStatus::Serving as i32);
    svc.shutdown().await.unwrap();
}
