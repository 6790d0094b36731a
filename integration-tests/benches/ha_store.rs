//! The PostgreSQL store against the SQLite one. Prints figures
//! (no harness); starts its own PostgreSQL on a private port:
//!
//!   cargo bench -p integration-tests --bench ha_store
//!
//! Part 1: one txg's persist (`Store::persist`, the whole transaction) of
//! 1k, 10k and 100k allocations and of the txg freeing them, SQLite (WAL,
//! synchronous=FULL, checkpointed) vs PostgreSQL (the txg fenced by its
//! leadership row), interleaved, medians of `ALIQUOT_BENCH_ROUNDS` (5).
//! PostgreSQL runs with fsync on, as a pool's own server does, so both
//! stores' figures include the disk flush.
//! Part 2: startup at `ALIQUOT_BENCH_EXTENTS` (comma list, default
//! 1000000) gapped 4 KiB extents: SQLite open + load + rebuild, against
//! what a standby does once the lease expired (open, take the leadership,
//! load, rebuild) — the takeover's cost beyond the lease.
//! Part 3: Allocate+Commit through a whole allocator (in-process, real gRPC
//! on loopback, 4 fake vdevs), on each store, interleaved: 8 unary clients
//! for `ALIQUOT_BENCH_SECS` (3) each, commits acknowledged when the txg is
//! in the open txg (`wait_synced` false) and when it is durable (true: each
//! pair waits for a txg persist, so the store's commit latency shows).

use std::time::{Duration, Instant};

use aliquot_allocator::SqliteStore;
use aliquot_allocator::pg_store::PgStore;
use aliquot_allocator::recovery;
use aliquot_allocator::store::{Store, TxgRecord, VdevRecord};
use integration_tests::postgres::Postgres;
use metaslab::{Extent, SpaceChange, SpaceChangeKind, Tunables, TxgSync, VdevRole, VdevSpec};

const GIB: u64 = 1 << 30;
const BLOCK: u64 = 4096;
const STRIDE: u64 = 2 * BLOCK;

fn vdev() -> VdevRecord {
    let tunables = Tunables::default();
    let capacity = 1024 * GIB;
    VdevRecord {
        id: 0,
        guid: 1,
        name: "bench".into(),
        endpoint: "http://127.0.0.1:1".into(),
        spec: VdevSpec {
            capacity,
            ashift: 12,
            children: 1,
            parity: 0,
            rotational: false,
            role: VdevRole::Normal,
            metaslab_shift: Some(metaslab::vdev::metaslab_shift(capacity, &tunables)),
        },
    }
}

/// Txg `txg` allocating (or freeing) extents `first .. first + n`.
fn record(txg: u64, first: u64, n: u64, kind: SpaceChangeKind) -> TxgRecord {
    TxgRecord {
        sync: TxgSync {
            txg,
            changes: (first..first + n)
                .map(|k| SpaceChange {
                    kind,
                    extent: Extent {
                        vdev: 0,
                        offset: k * STRIDE,
                        size: BLOCK,
                    },
                })
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn fresh_sqlite(dir: &std::path::Path, name: &str) -> SqliteStore {
    let s = SqliteStore::open(&dir.join(format!("{name}.db")), name, None)
        .await
        .unwrap();
    s.create(7).await.unwrap();
    s.open_generation().await.unwrap();
    s
}

async fn fresh_pg(url: &str, name: &str) -> PgStore {
    let s = PgStore::open(url, name, None, "bench").await.unwrap();
    s.try_acquire(Duration::from_secs(600))
        .await
        .unwrap()
        .expect("leads");
    s.create(7).await.unwrap();
    s
}

/// Persist the vdev, then `n` allocations in txgs of at most 10^6.
async fn fill(s: &dyn Store, n: u64) -> u64 {
    s.persist(&TxgRecord {
        sync: TxgSync {
            txg: 1,
            ..Default::default()
        },
        vdevs: vec![vdev()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut txg = 1;
    let mut done = 0;
    while done < n {
        let k = (n - done).min(1_000_000);
        txg += 1;
        s.persist(&record(txg, done, k, SpaceChangeKind::Alloc))
            .await
            .unwrap();
        done += k;
    }
    txg
}

async fn timed_pair(s: &dyn Store, n: u64) -> (Duration, Duration) {
    let t = Instant::now();
    s.persist(&record(2, 0, n, SpaceChangeKind::Alloc))
        .await
        .unwrap();
    let alloc = t.elapsed();
    let t = Instant::now();
    s.persist(&record(3, 0, n, SpaceChangeKind::Free))
        .await
        .unwrap();
    (alloc, t.elapsed())
}

/// Allocate+Commit pairs per second of 8 clients on `store` for `secs`.
async fn pairs_per_sec(store: std::sync::Arc<dyn Store>, durable: bool, secs: u64) -> f64 {
    use aliquot_proto::v1 as pb;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut c = aliquot_allocator::Config::with_listen("127.0.0.1:0".parse().unwrap());
    c.report_interval = Duration::from_secs(3600);
    c.claim_window = Duration::ZERO;
    let server = aliquot_allocator::start(c, store).await.expect("allocator");
    let ch = tonic::transport::Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reg = pb::agent_registry_client::AgentRegistryClient::new(ch.clone());
    for guid in 1..=4u64 {
        reg.register(pb::RegisterRequest {
            endpoint: format!("http://127.0.0.1:1/fake-{guid}"),
            device_guid: guid,
            name: format!("fake{guid}"),
            capacity: 4 << 40,
            ashift: 12,
            children: 1,
            backend: "sim".into(),
            ..Default::default()
        })
        .await
        .expect("register");
    }
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let done = std::sync::Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut a = pb::allocator_client::AllocatorClient::new(ch.clone());
        let (stop, done) = (stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = a
                    .allocate(integration_tests::data_request(BLOCK))
                    .await
                    .expect("allocate")
                    .into_inner();
                a.commit(pb::CommitRequest {
                    allocation_ids: vec![r.allocation_id],
                    wait_synced: durable,
                    generation: r.generation,
                })
                .await
                .expect("commit");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let rate = done.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64();
    server.shutdown().await.unwrap();
    rate
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pg = Postgres::start_durable();
    let url = pg.url();
    let rounds: usize = std::env::var("ALIQUOT_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir = tempfile::tempdir().unwrap();
    rt.block_on(async {
        println!("part 1: one txg's persist, medians of {rounds} interleaved rounds");
        println!(
            "{:>8} | {:>12} {:>12} | {:>12} {:>12} | {:>8} {:>8}",
            "changes", "sqlite alloc", "pg alloc", "sqlite free", "pg free", "pg/sq a", "pg/sq f"
        );
        for n in [1_000u64, 10_000, 100_000] {
            let (mut sa, mut sf, mut pa, mut pf) = (vec![], vec![], vec![], vec![]);
            for r in 0..rounds {
                let name = format!("p1-{n}-{r}");
                let s = fresh_sqlite(dir.path(), &name).await;
                fill(&s, 0).await;
                let (a, f) = timed_pair(&s, n).await;
                sa.push(a);
                sf.push(f);
                s.close().await;
                let p = fresh_pg(&url, &name).await;
                fill(&p, 0).await;
                let (a, f) = timed_pair(&p, n).await;
                pa.push(a);
                pf.push(f);
                p.close().await;
            }
            let (sa, sf, pa, pf) = (median(sa), median(sf), median(pa), median(pf));
            println!(
                "{n:>8} | {:>9.1} ms {:>9.1} ms | {:>9.1} ms {:>9.1} ms | {:>7.2}x {:>7.2}x",
                sa.as_secs_f64() * 1e3,
                pa.as_secs_f64() * 1e3,
                sf.as_secs_f64() * 1e3,
                pf.as_secs_f64() * 1e3,
                pa.as_secs_f64() / sa.as_secs_f64(),
                pf.as_secs_f64() / sf.as_secs_f64()
            );
        }

        let sizes: Vec<u64> = std::env::var("ALIQUOT_BENCH_EXTENTS")
            .unwrap_or_else(|_| "1000000".into())
            .split(',')
            .filter_map(|v| v.trim().replace('_', "").parse().ok())
            .collect();
        println!("part 2: startup (SQLite) and takeover (PostgreSQL: open, lead, load, rebuild)");
        for n in sizes {
            let name = format!("p2-{n}");
            let s = fresh_sqlite(dir.path(), &name).await;
            fill(&s, n).await;
            s.close().await;
            let p = fresh_pg(&url, &name).await;
            fill(&p, n).await;
            p.release(false).await.unwrap();
            p.close().await;
            let (mut st, mut pt) = (vec![], vec![]);
            for r in 0..3 {
                let t = Instant::now();
                let s = SqliteStore::open(&dir.path().join(format!("{name}.db")), &name, None)
                    .await
                    .unwrap();
                let loaded = s.load().await.unwrap().expect("pool");
                let pool = recovery::rebuild(Tunables::default(), &loaded).expect("consistent");
                st.push(t.elapsed());
                drop((pool, loaded));
                s.close().await;
                let t = Instant::now();
                let p = PgStore::open(&url, &name, None, &format!("standby-{r}"))
                    .await
                    .unwrap();
                p.try_acquire(Duration::from_secs(600))
                    .await
                    .unwrap()
                    .expect("the lease was released");
                let loaded = p.load().await.unwrap().expect("pool");
                let pool = recovery::rebuild(Tunables::default(), &loaded).expect("consistent");
                pt.push(t.elapsed());
                drop((pool, loaded));
                p.release(false).await.unwrap();
                p.close().await;
            }
            let (st, pt) = (median(st), median(pt));
            println!(
                "{n:>9} extents | sqlite startup {:>6.2} s | postgres takeover {:>6.2} s | {:.2}x",
                st.as_secs_f64(),
                pt.as_secs_f64(),
                pt.as_secs_f64() / st.as_secs_f64()
            );
        }

        let secs: u64 = std::env::var("ALIQUOT_BENCH_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3);
        println!(
            "part 3: Allocate+Commit pairs/s, 8 unary clients, {secs} s per run, medians of {rounds}"
        );
        for durable in [false, true] {
            let (mut sq, mut pgr) = (vec![], vec![]);
            for r in 0..rounds {
                let name = format!("p3-{durable}-{r}");
                let s = SqliteStore::open(&dir.path().join(format!("{name}.db")), &name, None)
                    .await
                    .unwrap();
                sq.push(pairs_per_sec(std::sync::Arc::new(s), durable, secs).await);
                let p = PgStore::open(&url, &name, None, "bench").await.unwrap();
                p.try_acquire(Duration::from_secs(600))
                    .await
                    .unwrap()
                    .expect("leads");
                pgr.push(pairs_per_sec(std::sync::Arc::new(p), durable, secs).await);
            }
            let med = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (sq, pgr) = (med(sq), med(pgr));
            println!(
                "commit {:<20} | sqlite {sq:>9.0} pairs/s | postgres {pgr:>9.0} pairs/s | {:.2}x",
                if durable { "wait_synced (durable)" } else { "into the open txg" },
                pgr / sq
            );
        }
    });
}
