//! The SQLite file itself: what is refused (and left byte-for-byte alone),
//! what is reopened, and retention's 1-minute aggregates.

mod common;

use std::path::Path;
use std::time::Duration;

use aliquot_metrics::{MetricsError, Store};
use aliquot_proto::v1::HistoryRequest;
use common::*;
use sqlx::Connection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

fn noise(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

async fn refused(path: &Path) -> String {
    match Store::open(path).await {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(e @ MetricsError::Refused { .. }) => {
            assert!(e.is_config());
            e.to_string()
        }
        Err(e) => panic!("wrong error: {e}"),
    }
}

async fn raw_sqlite(path: &Path) -> SqliteConnection {
    SqliteConnection::connect_with(
        &SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true),
    )
    .await
    .unwrap()
}

fn siblings(path: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn random_bytes_are_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.db");
    let bytes = noise(70_000, 0x9e37_79b9_7f4a_7c15);
    std::fs::write(&path, &bytes).unwrap();
    let msg = refused(&path).await;
    assert!(msg.contains("not an SQLite database"), "{msg}");
    assert!(msg.contains("junk.db"), "{msg}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(siblings(&path), ["junk.db"]);

    // A valid header over garbage: corrupt, also refused and untouched.
    let path = dir.path().join("corrupt.db");
    let mut bytes = b"SQLite format 3\0".to_vec();
    bytes.extend(noise(8192, 42));
    std::fs::write(&path, &bytes).unwrap();
    let msg = refused(&path).await;
    assert!(
        msg.contains("corrupt") || msg.contains("cannot open"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[tokio::test]
async fn foreign_sqlite_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    // Some other application's database.
    let path = dir.path().join("shop.db");
    let mut c = raw_sqlite(&path).await;
    sqlx::query("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        .execute(&mut c)
        .await
        .unwrap();
    sqlx::query("INSERT INTO customers (name) VALUES ('ada')")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let msg = refused(&path).await;
    assert!(
        msg.contains("foreign") && msg.contains("customers"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes);

    // Another sqlx application's database (a migrations table, other tables).
    let path = dir.path().join("other-sqlx.db");
    let mut c = raw_sqlite(&path).await;
    for sql in [
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL, \
         installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, success BOOLEAN NOT NULL, \
         checksum BLOB NOT NULL, execution_time BIGINT NOT NULL)",
        "INSERT INTO _sqlx_migrations VALUES (1, 'init', CURRENT_TIMESTAMP, 1, x'00', 1)",
        "CREATE TABLE extents (vdev INTEGER, offset INTEGER)",
    ] {
        sqlx::query(sql).execute(&mut c).await.unwrap();
    }
    c.close().await.unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let msg = refused(&path).await;
    assert!(msg.contains("foreign") && msg.contains("extents"), "{msg}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[tokio::test]
async fn newer_schema_is_refused_untouched_and_ours_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub").join("metrics.db");
    // Fresh file (and its directory) just work; data survives a reopen.
    let store = Store::open(&path).await.unwrap();
    store
        .ingest(&[snap("tank", T0, &[0.25, 0.5])])
        .await
        .unwrap();
    store.close().await;
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut raw_sqlite(&path).await)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let store = Store::open(&path).await.unwrap();
    let h = store
        .history(&HistoryRequest {
            pool: "tank".into(),
            max_points: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(h.series.len(), 2);
    assert!((h.series[1].points[0].used_fraction - 0.5).abs() < 1e-9);
    store.close().await;

    // A later binary migrated it to version 2.
    let mut c = raw_sqlite(&path).await;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (2, 'from the future', 1, x'0102', 1)",
    )
    .execute(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let msg = refused(&path).await;
    assert!(msg.contains("newer") && msg.contains("version 2"), "{msg}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);

    // The service refuses it before binding, with exit code 2.
    let err = aliquot_metrics::start(&config(&path, &[]))
        .await
        .err()
        .unwrap();
    assert_eq!(aliquot_metrics::exit_code(&err), 2);
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[tokio::test]
async fn retention_keeps_minute_aggregates() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("m.db")).await.unwrap();
    // Three hours of 1 s snapshots of 2 vdevs, minus a gap at minutes 20..25;
    // used fraction grows linearly.
    let used = |i: usize, s: i64| 0.1 + i as f64 * 0.1 + s as f64 * 1e-5;
    let snaps: Vec<_> = (0..3 * 3600)
        .filter(|s| !(20 * 60..25 * 60).contains(s))
        .map(|s| snap("tank", T0 + s * 1000, &[used(0, s), used(1, s)]))
        .collect();
    for chunk in snaps.chunks(1000) {
        store.ingest(chunk).await.unwrap();
    }
    let end = T0 + 3 * 3600 * 1000;
    let before = store.raw_rows().await.unwrap();
    assert_eq!(before, snaps.len() as i64 * 2);

    let st = store
        .maintain(end, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(st.minutes_aggregated, 2 * 174, "{st:?}");
    let after = store.raw_rows().await.unwrap();
    assert_eq!(after, 3600 * 2, "only the last hour stays raw");
    // vdev rows, plus one snapshot row and one class row per pruned snapshot.
    assert_eq!(
        st.rows_pruned as i64,
        before - after + 2 * (snaps.len() as i64 - 3600)
    );

    // The whole range, one point per minute: older minutes come from the
    // aggregates, with the same averages raw samples would give.
    let h = store
        .history(&HistoryRequest {
            pool: "tank".into(),
            max_points: 180,
            ..Default::default()
        })
        .await
        .unwrap();
    for (i, s) in h.series.iter().enumerate() {
        assert_eq!(s.points.len(), 175, "minutes without the 5-minute gap");
        assert!((s.points[0].time_ms - (T0 + 29_500)).abs() <= 500);
        for p in &s.points {
            let secs = (p.time_ms - T0) as f64 / 1000.0;
            let want = ((used(i, 0) + secs * 1e-5) * GIB as f64) / GIB as f64;
            assert!(
                (p.used_fraction - want).abs() < 1e-6,
                "{} vs {want}",
                p.used_fraction
            );
            assert_eq!(p.queue_depth, (i as u64 + 1) << 20);
            assert_eq!(p.latency_p99_us, 900 + i as u64);
        }
    }
    // Fine buckets over pruned time fall back to the minute aggregates.
    let h = store
        .history(&HistoryRequest {
            pool: "tank".into(),
            since_ms: Some(T0),
            until_ms: Some(T0 + 600_000 - 1),
            max_points: 600,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(h.series[0].points.len(), 10);

    // A late snapshot (a pusher's backlog) in the aggregated gap is counted.
    store
        .ingest(&[snap("tank", T0 + 21 * 60_000 + 5000, &[0.9, 0.9])])
        .await
        .unwrap();
    let h = store
        .history(&HistoryRequest {
            pool: "tank".into(),
            since_ms: Some(T0 + 20 * 60_000),
            until_ms: Some(T0 + 25 * 60_000 - 1),
            max_points: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(h.series[0].points.len(), 1);
    assert!((h.series[0].points[0].used_fraction - 0.9).abs() < 1e-6);
    // Maintenance again does not count anything twice.
    store
        .maintain(end + 120_000, Duration::from_secs(3600))
        .await
        .unwrap();
    let h2 = store
        .history(&HistoryRequest {
            pool: "tank".into(),
            since_ms: Some(T0 + 20 * 60_000),
            until_ms: Some(T0 + 25 * 60_000 - 1),
            max_points: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(h, h2);
    store.close().await;
}
