//! The I/O queue over real gRPC: aggregation of contiguous queued writes (and
//! none with a limit of 0), run-time tunables, and the sim's bandwidth.

mod common;

use std::time::{Duration, Instant};

use aliquot_proto::v1::{AgentTunables, FlushRequest};
use common::{Running, pattern, sim_config, start};
use tonic::Code;

const MIB: u64 = 1 << 20;
const BLOCK: usize = 64 << 10;

/// Send `n` contiguous 64 KiB writes starting at `base` all at once (in a
/// scrambled order), returning each reply's aggregated_ios.
async fn burst(a: &Running, base: u64, n: u64, seed: u64) -> Vec<u32> {
    let mut order: Vec<u64> = (0..n).collect();
    order.sort_by_key(|i| (i * 7 + 3) % n); // not in offset order
    let tasks: Vec<_> = order
        .into_iter()
        .map(|i| {
            let mut c = a.client.clone();
            tokio::spawn(async move {
                c.write(aliquot_proto::v1::WriteRequest {
                    offset: base + i * BLOCK as u64,
                    data: pattern(BLOCK, seed + i).into(),
                    ..Default::default()
                })
                .await
                .expect("write")
                .into_inner()
                .aggregated_ios
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregation_merges_contiguous_queued_writes_and_limit_zero_does_not() {
    // One I/O worker and a slow head, so writes queue up behind the first.
    let mut cfg = sim_config(256 * MIB);
    cfg.latency = Some(Duration::from_millis(100));
    cfg.zio_taskq_batch_pct = 1;
    cfg.zfs_vdev_aggregation_limit = Some(MIB);
    let mut a = start(cfg).await;

    let agg = burst(&a, 0, 16, 100).await;
    let s = a.stats().await;
    assert_eq!(s.writes, 16);
    assert!(
        s.device_writes < s.writes,
        "queued contiguous writes merge: {} device writes for {} writes",
        s.device_writes,
        s.writes
    );
    assert!(agg.iter().any(|&n| n > 1), "{agg:?}");
    assert!(
        agg.iter().all(|&n| n as u64 * BLOCK as u64 <= MIB),
        "within the limit: {agg:?}"
    );
    // Merging kept every block where it belongs.
    let back = a.read(0, 16 * BLOCK as u64).await.unwrap();
    for i in 0..16 {
        assert_eq!(
            &back[i * BLOCK..(i + 1) * BLOCK],
            &pattern(BLOCK, 100 + i as u64)[..],
            "block {i}"
        );
    }

    let t = a
        .client
        .set_tunables(AgentTunables {
            zfs_vdev_aggregation_limit: Some(0),
            zio_taskq_batch_pct: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t.zfs_vdev_aggregation_limit, Some(0));
    let agg = burst(&a, 32 * BLOCK as u64, 8, 200).await;
    let s2 = a.stats().await;
    assert_eq!(s2.writes - s.writes, 8);
    assert_eq!(
        s2.device_writes - s.device_writes,
        8,
        "limit 0: no aggregation"
    );
    assert!(agg.iter().all(|&n| n == 1), "{agg:?}");
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_tunables_validates_and_applies_all_or_nothing() {
    let mut a = start(sim_config(64 * MIB)).await;
    let t0 = a.stats().await.tunables.unwrap();
    assert_eq!(
        t0.zfs_vdev_aggregation_limit,
        Some(128 << 10),
        "non-rotational default"
    );
    assert_eq!(t0.zio_taskq_batch_pct, Some(80));

    let bad = [
        (Some((16 << 20) + 1), None, "zfs_vdev_aggregation_limit"),
        (None, Some(0), "zio_taskq_batch_pct"),
        (None, Some(101), "zio_taskq_batch_pct"),
        // One valid field does not go through when the other is refused.
        (Some(4096), Some(500), "zio_taskq_batch_pct"),
    ];
    for (limit, pct, needle) in bad {
        let st = a
            .client
            .set_tunables(AgentTunables {
                zfs_vdev_aggregation_limit: limit,
                zio_taskq_batch_pct: pct,
            })
            .await
            .expect_err("refused");
        assert_eq!(st.code(), Code::InvalidArgument);
        assert!(st.message().contains(needle), "{}", st.message());
    }
    assert_eq!(a.stats().await.tunables.unwrap(), t0, "nothing applied");

    let t = a
        .client
        .set_tunables(AgentTunables {
            zfs_vdev_aggregation_limit: Some(16 << 20),
            zio_taskq_batch_pct: Some(5),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t.zfs_vdev_aggregation_limit, Some(16 << 20));
    assert_eq!(t.zio_taskq_batch_pct, Some(5));
    // Unset fields are left alone.
    let t = a
        .client
        .set_tunables(AgentTunables::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t.zio_taskq_batch_pct, Some(5));
    assert_eq!(a.stats().await.tunables.unwrap(), t);
    // The shrunken pool still does I/O.
    a.write(0, pattern(4096, 1)).await.unwrap();
    assert_eq!(a.read(0, 4096).await.unwrap(), pattern(4096, 1));
    a.stop().await;

    let mut hdd = sim_config(64 * MIB);
    hdd.rotational = true;
    let mut h = start(hdd).await;
    let s = h.stats().await;
    assert!(s.rotational);
    assert_eq!(
        s.tunables.unwrap().zfs_vdev_aggregation_limit,
        Some(MIB),
        "rotational default"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_bandwidth_is_roughly_honoured() {
    let mut cfg = sim_config(256 * MIB);
    cfg.bandwidth = Some(64.0 * MIB as f64);
    let mut a = start(cfg).await;
    let t = Instant::now();
    for i in 0..8u64 {
        a.write(i * MIB, pattern(MIB as usize, i)).await.unwrap();
    }
    a.client.flush(FlushRequest {}).await.unwrap();
    let elapsed = t.elapsed();
    // 8 MiB at 64 MiB/s is 125 ms of head time at least.
    assert!(
        elapsed >= Duration::from_millis(120),
        "8 MiB at 64 MiB/s took only {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
    let s = a.stats().await;
    assert_eq!(s.bytes_written, 8 * MIB);
    assert!(
        s.latency_p50_us >= 15_000,
        "each 1 MiB write takes ~16 ms: {s:?}"
    );
    assert_eq!(s.queue_depth_ios, 0);
    a.stop().await;
}
