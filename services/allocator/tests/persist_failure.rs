//! A txg the store cannot take is acknowledged to nobody, over real gRPC
//! and real stores. SQLite: the store's file system really full (a 3 MiB
//! tmpfs filled up): SyncTxg and `Commit{wait_synced}` stay parked, the
//! synced txg the allocator reports never passes what a fresh open of the
//! store file reads, GetPool, health and `/metrics` say so; once space
//! returns the txg persists by itself and the waiters are answered, and
//! after a restart every acknowledged block is in the store. PostgreSQL: a
//! COMMIT the server refuses is not reported persisted.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aliquot_allocator::sqlite_store;
use aliquot_allocator::{SqliteStore, Store};
use aliquot_proto::v1 as pb;
use common::*;
use integration_tests::Tmpfs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

const POOL: &str = "aliquot";

/// The synced txg a fresh open of the store file reads (a WAL reader sees
/// the last committed txg). None while the file system refuses even that.
async fn stored_txg(path: &Path) -> Option<u64> {
    match sqlite_store::read_only(path).await {
        Ok(Some((id, _))) => Some(id.synced_txg),
        _ => None,
    }
}

async fn health(ch: Channel) -> ServingStatus {
    let r = tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health check")
        .into_inner();
    ServingStatus::try_from(r.status).unwrap_or(ServingStatus::Unknown)
}

/// `GET /metrics`: the value of the sample named `name` (no labels).
async fn metric(addr: std::net::SocketAddr, name: &str) -> Option<f64> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut body))
        .await
        .ok()?
        .ok()?;
    body.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// One allocation committed without waiting; then a task asks SyncTxg for
/// its txg and sends `(extent, the synced txg answered)` when answered.
async fn commit_and_wait(
    h: &mut Harness,
    acks: &mpsc::UnboundedSender<(pb::Extent, u64)>,
) -> (pb::Extent, u64) {
    let a = h.allocate(128 << 10).await.expect("allocate");
    let r = h
        .alloc
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: a.generation,
        })
        .await
        .expect("commit")
        .into_inner();
    let (e, txg) = (a.extents[0], r.txg);
    let mut alloc = h.alloc.clone();
    let acks = acks.clone();
    tokio::spawn(async move {
        if let Ok(s) = alloc
            .sync_txg(pb::SyncTxgRequest {
                txg,
                generation: a.generation,
            })
            .await
        {
            let _ = acks.send((e, s.into_inner().synced_txg));
        }
    });
    (e, txg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_file_system_acknowledges_nothing_the_store_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&dir.path().join("fs"), "3m");
    let path = fs.0.join(sqlite_store::DB_FILE);
    let store = Arc::new(SqliteStore::open(&path, POOL, None).await.unwrap());
    let mut c = config();
    c.zfs_txg_timeout = Duration::from_millis(100);
    c.prometheus_listen = Some("127.0.0.1:0".parse().unwrap());
    let mut h = start_with(c, store.clone()).await;
    let prom = h.server.prometheus.expect("--prometheus-listen");
    let ch = Channel::from_shared(h.server.url()).unwrap().connect_lazy();
    h.add_vdev(11, 64 * GIB).await;

    // Blocks acknowledged durable: (extent, the synced txg that said so).
    let mut acked: Vec<(pb::Extent, u64)> = Vec::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    for _ in 0..4 {
        commit_and_wait(&mut h, &tx).await;
    }
    h.sync().await;
    assert_eq!(metric(prom, "aliquot_txg_persist_failing").await, Some(0.0));

    // The file system fills up under the store; commits go on.
    let ballast = fs.fill("ballast");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut after_failure = 0;
    let mut parked = Vec::new();
    loop {
        let c = commit_and_wait(&mut h, &tx).await;
        // What the allocator says is synced never passes the store.
        let st = h.pool().await;
        if let Some(stored) = stored_txg(&path).await {
            assert!(
                st.synced_txg <= stored,
                "GetPool says txg {} is synced; the store file holds txg {stored}",
                st.synced_txg
            );
        }
        while let Ok((e, s)) = rx.try_recv() {
            let stored = stored_txg(&path).await.unwrap_or(u64::MAX);
            assert!(
                s <= stored,
                "SyncTxg answered txg {s} synced; the store file holds txg {stored}"
            );
            acked.push((e, s));
        }
        if let Some(f) = &st.persist_failure {
            assert!(f.attempts >= 1 && f.txg > st.synced_txg, "{f:?}");
            assert!(!f.error.is_empty(), "{f:?}");
            parked.push(c);
            after_failure += 1;
            if after_failure >= 20 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no persist failure shown with the store's file system full"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Shown: health, metrics, and no waiter of the failing txgs answered.
    assert_eq!(health(ch.clone()).await, ServingStatus::NotServing);
    assert_eq!(metric(prom, "aliquot_txg_persist_failing").await, Some(1.0));
    let failures = metric(prom, "aliquot_txg_persist_failures_total")
        .await
        .unwrap_or(0.0);
    assert!(failures >= 1.0, "{failures}");
    let synced = h.pool().await.synced_txg;
    for (e, txg) in &parked {
        assert!(
            *txg > synced,
            "commit {e:?} of txg {txg} answered synced at {synced}"
        );
    }
    assert!(
        acked.iter().all(|(_, s)| *s <= synced),
        "a waiter was answered past txg {synced}"
    );

    // Space comes back: the txg persists by itself, the waiters are
    // answered, each with a txg the store has.
    std::fs::remove_file(&ballast).unwrap();
    let want = parked.last().unwrap().1;
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked
        .iter()
        .filter(|(e, _)| parked.iter().any(|p| p.0 == *e))
        .count()
        < parked.len()
    {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "the allocator never persisted again after space returned"
        );
        if let Ok(Some((e, s))) = tokio::time::timeout(left, rx.recv()).await {
            let stored = stored_txg(&path).await.expect("the store reads again");
            assert!(
                s <= stored,
                "SyncTxg answered txg {s}; the store holds {stored}"
            );
            acked.push((e, s));
        }
    }
    let st = h.pool().await;
    assert!(st.synced_txg >= want, "{} < {want}", st.synced_txg);
    assert!(st.persist_failure.is_none(), "{:?}", st.persist_failure);
    eventually("health SERVING again", Duration::from_secs(30), || {
        let ch = ch.clone();
        async move { health(ch).await == ServingStatus::Serving }
    })
    .await;
    assert_eq!(metric(prom, "aliquot_txg_persist_failing").await, Some(0.0));

    // After a restart every acknowledged block is in the store.
    h.server.shutdown().await.unwrap();
    store.close().await;
    let store = SqliteStore::open(&path, POOL, None).await.unwrap();
    let mut missing = Vec::new();
    for (e, _) in &acked {
        let m = metaslab::Extent {
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
        };
        if store.allocated_overlapping(m).await.unwrap() != [m] {
            missing.push(*e);
        }
    }
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged blocks missing after a restart: {missing:?}",
        missing.len(),
        acked.len()
    );
    assert!(acked.len() >= 24, "{}", acked.len());
    store.close().await;
}

/// The synced txg of pool `POOL` in the PostgreSQL store, as a new
/// connection reads it (what is committed).
async fn pg_synced(url: &str) -> u64 {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
    let s: i64 = sqlx::query_scalar("SELECT synced_txg FROM pools WHERE name = $1")
        .bind(POOL)
        .fetch_one(&mut c)
        .await
        .expect("synced_txg");
    let _ = c.close().await;
    s as u64
}

async fn pg_exec(url: &str, sql: &'static str) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::raw_sql(sql).execute(&mut c).await.expect(sql);
    let _ = c.close().await;
}

/// A COMMIT PostgreSQL refuses (a deferred constraint trigger the test
/// installs raises at commit) is not reported persisted: SyncTxg waits,
/// GetPool shows the failure and never a synced txg past the store's; once
/// the trigger is gone the txg persists by itself and the waiters are
/// answered with txgs the store has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_postgres_refuses_is_not_reported_persisted() {
    let pg = integration_tests::postgres::Postgres::start();
    let url = pg.url();
    let store = Arc::new(
        aliquot_allocator::pg_store::PgStore::open(&url, POOL, None, "test")
            .await
            .expect("open the PostgreSQL store"),
    );
    store
        .try_acquire(Duration::from_secs(3600))
        .await
        .expect("leadership")
        .expect("the only allocator leads");
    let mut c = config();
    c.pool = POOL.into();
    c.zfs_txg_timeout = Duration::from_millis(100);
    let mut h = start_with(c, store.clone()).await;
    h.add_vdev(11, 64 * GIB).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut acked = Vec::new();
    for _ in 0..4 {
        commit_and_wait(&mut h, &tx).await;
    }
    h.sync().await;

    pg_exec(
        &url,
        "CREATE FUNCTION refuse_commit() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the test refuses this commit'; END $$;
         CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER UPDATE ON pools
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_commit();",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut parked = Vec::new();
    loop {
        let c = commit_and_wait(&mut h, &tx).await;
        let st = h.pool().await;
        let stored = pg_synced(&url).await;
        assert!(
            st.synced_txg <= stored,
            "GetPool says txg {} is synced; the store holds txg {stored}",
            st.synced_txg
        );
        while let Ok((e, s)) = rx.try_recv() {
            let stored = pg_synced(&url).await;
            assert!(
                s <= stored,
                "SyncTxg answered txg {s}; the store holds {stored}"
            );
            acked.push((e, s));
        }
        if let Some(f) = &st.persist_failure {
            assert!(f.error.contains("the test refuses this commit"), "{f:?}");
            parked.push(c);
            if parked.len() >= 10 && f.attempts >= 3 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "no persist failure shown");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let synced = h.pool().await.synced_txg;
    assert!(parked.iter().all(|(_, t)| *t > synced));

    pg_exec(
        &url,
        "DROP TRIGGER refuse_at_commit ON pools; DROP FUNCTION refuse_commit();",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked
        .iter()
        .filter(|(e, _)| parked.iter().any(|p| p.0 == *e))
        .count()
        < parked.len()
    {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "the allocator never persisted again");
        if let Ok(Some((e, s))) = tokio::time::timeout(left, rx.recv()).await {
            let stored = pg_synced(&url).await;
            assert!(
                s <= stored,
                "SyncTxg answered txg {s}; the store holds {stored}"
            );
            acked.push((e, s));
        }
    }
    assert!(h.pool().await.persist_failure.is_none());
    for (e, _) in &acked {
        let m = metaslab::Extent {
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
        };
        assert_eq!(
            store.allocated_overlapping(m).await.unwrap(),
            [m],
            "acknowledged block {e:?} is not in the store"
        );
    }
    h.server.shutdown().await.unwrap();
    store.close().await;
}
