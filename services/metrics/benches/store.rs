//! Store figures (prints, no harness): ingest rate of vdev samples into
//! SQLite, and History latency over a month of 1-second samples of 12 vdevs
//! as the store holds it at steady state (7 days raw, 1-minute aggregates
//! for the month), built directly in SQLite.
//!
//! `cargo bench -p aliquot-metrics --bench store`

use std::time::{Duration, Instant};

use aliquot_metrics::Store;
use aliquot_proto::v1::{HistoryRequest, PoolSnapshot, VdevHealth, VdevSample};

const VDEVS: u32 = 12;
const GIB: u64 = 1 << 30;

fn snapshot(t: i64) -> PoolSnapshot {
    PoolSnapshot {
        pool: "bench".into(),
        time_ms: t,
        txg: (t / 5000) as u64,
        vdevs: (0..VDEVS)
            .map(|v| VdevSample {
                vdev: v,
                name: format!("disk{v}"),
                capacity: 100 * GIB,
                allocated: (t as u64 % 1000 + u64::from(v)) * GIB / 20,
                free_fraction: 0.5,
                fragmentation: 12,
                aliquot: 1 << 20,
                queue_target: 8 << 20,
                queue_depth: u64::from(v) << 20,
                write_bytes_per_sec: 200.0 * 1048576.0,
                read_bytes_per_sec: 0.0,
                latency_p50_us: 120,
                latency_p99_us: 900,
                health: VdevHealth::Healthy as i32,
                offline: false,
            })
            .collect(),
        classes: vec![],
        events: vec![],
        dropped_snapshots: 0,
        synced_txg: 0,
    }
}

async fn ingest_rate(snaps_per_tx: usize, total_snaps: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("ingest.db")).await.unwrap();
    let snaps: Vec<_> = (0..total_snaps as i64)
        .map(|i| snapshot(1_700_000_000_000 + i * 1000))
        .collect();
    let t = Instant::now();
    let mut rows = 0;
    for chunk in snaps.chunks(snaps_per_tx) {
        rows += store.ingest(chunk).await.unwrap().rows;
    }
    let secs = t.elapsed().as_secs_f64();
    store.close().await;
    rows as f64 / secs
}

#[tokio::main]
async fn main() {
    println!(
        "== ingest (vdev samples/s into SQLite, WAL, synchronous=NORMAL, {VDEVS} vdevs per snapshot)"
    );
    for (per_tx, total) in [(1, 2000), (16, 8000), (256, 20_000)] {
        let r = ingest_rate(per_tx, total).await;
        println!(
            "  {per_tx:>4} snapshots ({:>5} rows) per transaction: {:>9.0} samples/s",
            per_tx * VDEVS as usize,
            r
        );
    }

    println!(
        "== history over a month of 1 s samples of {VDEVS} vdevs (7 d raw + 30 d of minute aggregates)"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("month.db");
    let store = Store::open(&path).await.unwrap();
    let day = 86_400_000i64;
    // A whole minute (1.8e12 ms is one).
    let now = 1_800_000_000_000i64;
    let first = now - 30 * day;
    let raw_from = now - 7 * day;
    // Seed the pool and vdev rows through the real ingest path.
    store.ingest(&[snapshot(first)]).await.unwrap();
    let w = store.writer();
    let t = Instant::now();
    sqlx::query("DELETE FROM vdev_samples")
        .execute(w)
        .await
        .unwrap();
    sqlx::query(
        "WITH RECURSIVE s(t) AS (SELECT ?1 UNION ALL SELECT t + 1000 FROM s WHERE t + 1000 < ?2), \
         v(v) AS (SELECT 0 UNION ALL SELECT v + 1 FROM v WHERE v + 1 < ?3) \
         INSERT INTO vdev_samples (pool_id, time_ms, vdev, txg, capacity, allocated, free_fraction, \
         fragmentation, aliquot, queue_target, queue_depth, write_bps, read_bps, latency_p50_us, \
         latency_p99_us, health) \
         SELECT 1, t, v, t / 5000, 107374182400, (t / 1000 % 1000 + v) * 53687091, 0.5, 12, 1048576, \
         8388608, v * 1048576, 209715200.0, 0.0, 120, 900, 1 FROM s, v",
    )
    .bind(raw_from)
    .bind(now)
    .bind(VDEVS as i64)
    .execute(w)
    .await
    .unwrap();
    let raw_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    sqlx::query(
        "WITH RECURSIVE m(m) AS (SELECT ?1 UNION ALL SELECT m + 60000 FROM m WHERE m + 60000 < ?2), \
         v(v) AS (SELECT 0 UNION ALL SELECT v + 1 FROM v WHERE v + 1 < ?3) \
         INSERT INTO vdev_minutes (pool_id, minute_ms, vdev, n, sum_time_ms, sum_used, sum_allocated, \
         sum_capacity, sum_write_bps, sum_read_bps, sum_queue_depth, sum_queue_target, sum_aliquot, \
         sum_fragmentation, n_fragmentation, max_latency_p99_us) \
         SELECT 1, m, v, 60, 60 * m + 1770000, 60 * (0.25 + v * 0.001), 60 * 26843545600.0, \
         60 * 107374182400.0, 60 * 209715200.0, 0, 60 * v * 1048576.0, 60 * 8388608.0, 60 * 1048576.0, \
         720, 60, 900 FROM m, v",
    )
    .bind(first)
    .bind(now - 60_000)
    .bind(VDEVS as i64)
    .execute(w)
    .await
    .unwrap();
    sqlx::query("UPDATE pools SET first_ms = ?, last_ms = ?, aggregated_until_ms = ?, pruned_until_ms = ? WHERE id = 1")
        .bind(first)
        .bind(now - 1000)
        .bind(now - 60_000)
        .bind(raw_from)
        .execute(w)
        .await
        .unwrap();
    let agg_secs = t.elapsed().as_secs_f64();
    let raw_rows = store.raw_rows().await.unwrap();
    println!(
        "  built {raw_rows} raw rows in {raw_secs:.1} s, {} minute rows in {agg_secs:.1} s; file {} MiB",
        30 * 1440 * VDEVS as i64,
        std::fs::metadata(&path).unwrap().len() >> 20
    );

    let cases: [(&str, Option<i64>, u32); 5] = [
        ("whole month, 1000 points", None, 1000),
        ("last 7 days, 1000 points", Some(now - 7 * day), 1000),
        ("last day, 1000 points", Some(now - day), 1000),
        ("last hour, 600 points (raw)", Some(now - 3_600_000), 600),
        (
            "last 10 min, 600 points (raw, 1 s)",
            Some(now - 600_000),
            600,
        ),
    ];
    for (name, since, max_points) in cases {
        let req = HistoryRequest {
            pool: "bench".into(),
            vdevs: vec![],
            since_ms: since,
            until_ms: Some(now),
            max_points,
        };
        let mut times = Vec::new();
        let mut points = 0;
        for _ in 0..7 {
            let t = Instant::now();
            let h = store.history(&req).await.unwrap();
            times.push(t.elapsed());
            points = h.series.iter().map(|s| s.points.len()).sum::<usize>();
        }
        times.sort();
        println!(
            "  {name:<36} median {:>8.1} ms  (min {:>7.1} ms, {points} points)",
            ms(times[times.len() / 2]),
            ms(times[0])
        );
    }
    store.close().await;
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
