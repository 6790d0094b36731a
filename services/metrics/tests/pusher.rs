//! The allocator-side pusher against a real service: while metrics is down
//! pushes never wait and the overflow is counted; when it comes up the
//! backlog arrives, oldest dropped first, with the drop count recorded.

mod common;

use std::time::{Duration, Instant};

use aliquot_metrics::SnapshotPusher;
use aliquot_proto::v1::{HistoryRequest, SummaryRequest};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_survives_an_outage_and_overflow_is_counted() {
    // A port nobody listens on yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let pusher = SnapshotPusher::spawn(format!("http://127.0.0.1:{port}"), 50);

    let t = Instant::now();
    for s in 0..80 {
        pusher.push(snap("tank", T0 + s * 1000, &[0.1, 0.2]));
    }
    // 80 pushes against a dead endpoint: no connect attempt is waited for.
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(pusher.dropped(), 30);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!pusher.is_connected());
    assert_eq!(pusher.sent(), 0);
    assert_eq!(pusher.pending(), 50);
    assert_eq!(pusher.dropped(), 30);
    assert!(!pusher.flush(Duration::from_millis(100)).await);

    // Metrics comes up on that port: the backlog is delivered.
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let mut cfg = config(&dir.path().join("m.db"), &[]);
    cfg.listen = listen.parse().unwrap();
    let svc = aliquot_metrics::start(&cfg).await.unwrap();
    assert!(
        pusher.flush(Duration::from_secs(20)).await,
        "backlog not sent"
    );
    assert_eq!(
        (pusher.sent(), pusher.pending(), pusher.dropped()),
        (50, 0, 30)
    );
    assert!(pusher.is_connected());

    let mut c = client(&svc).await;
    let h = c
        .history(HistoryRequest {
            pool: "tank".into(),
            max_points: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let times: Vec<i64> = h.series[0].points.iter().map(|p| p.time_ms).collect();
    let want: Vec<i64> = (30..80).map(|s| T0 + s * 1000).collect();
    assert_eq!(
        times, want,
        "the 30 oldest were dropped, the rest arrived in order"
    );
    let sum = c
        .summary(SummaryRequest {
            pool: "tank".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sum.pools[0].dropped_snapshots, 30);

    // Live pushes keep flowing.
    pusher.push(snap("tank", T0 + 80_000, &[0.1, 0.2]));
    assert!(pusher.flush(Duration::from_secs(10)).await);
    assert_eq!(pusher.sent(), 51);
    assert_eq!(pusher.shutdown(Duration::from_secs(1)).await, 0);
    drop(c);
    svc.shutdown().await.unwrap();
}
