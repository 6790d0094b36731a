//! Txg sync cost against the number of changes per txg, and the allocation
//! rate while a sync is being written. Prints figures (no harness):
//!
//!   cargo bench -p aliquot-allocator --bench txg_sync
//!
//! Part 1, per size (1k, 10k, 100k changes): the pool side (`Pool::sync`,
//! under the pool mutex) and the store side (`SqliteStore::persist`: one
//! SQLite transaction, WAL, synchronous=FULL, outside the mutex), for a txg
//! of allocations and a txg freeing them again.
//! Part 2: the allocator in-process with the SQLite store; allocate+commit
//! (4 KiB) in a loop, alone and while a 100k-change txg is being synced.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aliquot_allocator::store::{Store, TxgRecord, VdevRecord};
use aliquot_allocator::{Config, SqliteStore};
use aliquot_proto::v1 as pb;
use metaslab::{AllocRequest, Pool, Submitted, Tunables};

const GIB: u64 = 1 << 30;

fn req() -> AllocRequest {
    metaslab::testing::data(4096, 1)
}

/// Allocate and commit `n` 4 KiB blocks in the open txg.
fn fill(pool: &mut Pool, n: usize) -> Vec<metaslab::Extent> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = match pool.submit(req()).expect("submit") {
            Submitted::Ready(t) => t,
            Submitted::Queued(_) => panic!("throttled with nothing in flight"),
        };
        let busy = pool.busy_with_dirty(pool.dirty_bytes(), 1 << 30);
        let a = pool.allocate(t, busy).expect("allocate");
        pool.commit(a.id).expect("commit");
        out.extend(a.extents);
    }
    out
}

async fn part1(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("pool.db"), "bench", None)
        .await
        .unwrap();
    store.create(7).await.unwrap();
    let mut pool = Pool::new(Tunables::default());
    let id = pool.add_vdev(metaslab::testing::disk(64 * GIB)).unwrap();
    let stats = pool.stats();
    let mut s = stats.vdevs[0].spec.clone();
    s.metaslab_shift = Some(stats.vdevs[0].metaslab_shift);
    let first = pool.sync();
    store
        .persist(&TxgRecord {
            sync: first,
            vdevs: vec![VdevRecord {
                id,
                guid: 1,
                name: "bench".into(),
                endpoint: "http://127.0.0.1:1".into(),
                spec: s,
            }],
            ..Default::default()
        })
        .await
        .unwrap();

    let extents = fill(&mut pool, n);
    let t = Instant::now();
    let sync = pool.sync();
    let pool_alloc = t.elapsed();
    assert_eq!(sync.changes.len(), n);
    let rec = TxgRecord {
        sync,
        vdevs: Vec::new(),
        ..Default::default()
    };
    let t = Instant::now();
    store.persist(&rec).await.unwrap();
    let store_alloc = t.elapsed();

    pool.free(&extents).unwrap();
    let t = Instant::now();
    let sync = pool.sync();
    let pool_free = t.elapsed();
    let rec = TxgRecord {
        sync,
        vdevs: Vec::new(),
        ..Default::default()
    };
    let t = Instant::now();
    store.persist(&rec).await.unwrap();
    let store_free = t.elapsed();
    store.close().await;
    let rate = |d: Duration| n as f64 / d.as_secs_f64();
    println!(
        "{n:>7} changes | alloc txg: Pool::sync {:>8.2} ms, persist {:>8.2} ms ({:>9.0} changes/s) | free txg: Pool::sync {:>8.2} ms, persist {:>8.2} ms ({:>9.0} changes/s)",
        pool_alloc.as_secs_f64() * 1e3,
        store_alloc.as_secs_f64() * 1e3,
        rate(store_alloc),
        pool_free.as_secs_f64() * 1e3,
        store_free.as_secs_f64() * 1e3,
        rate(store_free),
    );
}

/// Allocate+commit 4 KiB blocks in-process until `until` says stop;
/// returns (count, elapsed).
fn alloc_loop(
    shared: &Arc<aliquot_allocator::Shared>,
    mut until: impl FnMut(u64) -> bool,
) -> (u64, Duration) {
    let t = Instant::now();
    let mut n = 0u64;
    while !until(n) {
        let mut g = shared.lock();
        let t = match g.pool.submit(req()).expect("submit") {
            Submitted::Ready(t) => t,
            Submitted::Queued(_) => panic!("throttled"),
        };
        let busy = g.busy();
        let a = g.pool.allocate(t, busy).expect("allocate");
        g.pool.commit(a.id).expect("commit");
        n += 1;
    }
    (n, t.elapsed())
}

async fn part2() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        SqliteStore::open(&dir.path().join("pool.db"), "aliquot", None)
            .await
            .unwrap(),
    );
    let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
    c.zfs_txg_timeout = Duration::from_secs(600);
    c.txg_dirty_max = u64::MAX / 2;
    let running = aliquot_allocator::start(c, store.clone()).await.unwrap();
    let mut reg = pb::agent_registry_client::AgentRegistryClient::connect(running.url())
        .await
        .unwrap();
    reg.register(pb::RegisterRequest {
        endpoint: "http://127.0.0.1:1/bench".into(),
        device_guid: 1,
        name: "bench".into(),
        capacity: 256 * GIB,
        ashift: 12,
        rotational: false,
        children: 1,
        parity: 0,
        log: false,
        backend: "sim".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let shared = running.shared.clone();

    // Idle rate (the open txg grows; nothing syncs).
    let window = Duration::from_millis(500);
    let start = Instant::now();
    let (idle_n, idle_t) = alloc_loop(&shared, |_| start.elapsed() >= window);
    let open = shared.lock().pool.open_txg();
    shared.wait_synced(open).await.unwrap();

    // A big txg, then allocate while it is being synced.
    let big = 100_000usize;
    alloc_loop(&shared, |n| n as usize >= big);
    let txg = shared.lock().pool.open_txg();
    let s2 = shared.clone();
    let sync_start = Instant::now();
    let syncing = tokio::spawn(async move {
        s2.wait_synced(txg).await.unwrap();
        sync_start.elapsed()
    });
    // Measure on a blocking thread so the runtime's workers run the sync.
    let s3 = shared.clone();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d2 = done.clone();
    let during = tokio::task::spawn_blocking(move || {
        alloc_loop(&s3, |_| d2.load(std::sync::atomic::Ordering::Relaxed))
    });
    let sync_time = syncing.await.unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (during_n, during_t) = during.await.unwrap();
    let per_s = |n: u64, d: Duration| n as f64 / d.as_secs_f64();
    println!(
        "allocate+commit (4 KiB, in-process): idle {:>9.0}/s ({idle_n} in {:.0} ms)",
        per_s(idle_n, idle_t),
        idle_t.as_secs_f64() * 1e3
    );
    println!(
        "allocate+commit while a {big}-change txg syncs ({:.0} ms): {:>9.0}/s ({during_n} allocations went into the next txg)",
        sync_time.as_secs_f64() * 1e3,
        per_s(during_n, during_t),
    );
    running.shutdown().await.unwrap();
    store.close().await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "txg sync: pool side (under the mutex) and SQLite side (one transaction, outside it)"
        );
        for n in [1_000, 10_000, 100_000] {
            part1(n).await;
        }
        part2().await;
    });
}
