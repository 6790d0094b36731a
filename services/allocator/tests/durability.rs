//! Durability in-process, over real gRPC and real SQLite files: what a synced
//! txg holds survives a restart, stores that cannot be trusted are refused
//! and left byte-for-byte untouched, run-time tunables persist, the dirty
//! bound closes txgs, allocation goes on while a sync is being written, and
//! a free is never reusable before the txg that freed it is durable.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::spacemap::Chunk;
use aliquot_allocator::sqlite_store::{self, OpenError};
use aliquot_allocator::store::{Evacuation, Persisted, StoreError, TxgRecord, VdevRecord};
use aliquot_allocator::{Config, MemStore, SqliteStore, Store};
use aliquot_proto::v1 as pb;
use common::*;
use futures_util::future::BoxFuture;
use sqlx::Connection;
use tokio::sync::watch;
use tonic::Code;

const POOL: &str = "aliquot";

fn db_path(dir: &Path) -> PathBuf {
    dir.join(sqlite_store::DB_FILE)
}

async fn open(path: &Path) -> Arc<SqliteStore> {
    Arc::new(
        SqliteStore::open(path, POOL, None)
            .await
            .expect("open store"),
    )
}

fn ext(e: &pb::Extent) -> pb::Extent {
    *e
}

/// A vdev as a txg record adds it to the store (no agent behind it).
fn vdev_record(id: u32, capacity: u64, metaslab_shift: u8) -> VdevRecord {
    VdevRecord {
        id,
        guid: 9 + u64::from(id),
        name: format!("v{id}"),
        endpoint: "http://127.0.0.1:1".into(),
        spec: metaslab::VdevSpec {
            metaslab_shift: Some(metaslab_shift),
            ..metaslab::testing::disk(capacity)
        },
    }
}

async fn claim(h: &mut Harness, extents: Vec<pb::Extent>) -> Result<u64, tonic::Status> {
    h.alloc
        .claim(pb::ClaimRequest {
            extents,
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .map(|r| r.into_inner().txg)
}

async fn alloc_commit(h: &mut Harness, size: u64, wait_synced: bool) -> (pb::Extent, u64) {
    let a = h.allocate(size).await.expect("allocate");
    let c = h
        .alloc
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced,
            generation: a.generation,
        })
        .await
        .expect("commit")
        .into_inner();
    (ext(&a.extents[0]), c.txg)
}

fn vdev_alloc(s: &pb::PoolStatus) -> Vec<(u32, u64)> {
    s.vdevs.iter().map(|v| (v.vdev, v.alloc)).collect()
}

/// A pool in `dir` with two vdevs, synced extents, a freed one, and a
/// committed-but-unsynced one; shut down cleanly. Returns (kept, freed).
async fn populated(dir: &Path) -> (Vec<pb::Extent>, Vec<pb::Extent>) {
    let store = open(&db_path(dir)).await;
    // Every metaslab flushed each txg: the tests below edit the chunks.
    let mut c = config();
    c.tunables.push("zfs_min_metaslabs_to_flush=1000000".into());
    let mut h = start_with(c, store.clone()).await;
    h.add_vdev(11, 2 * GIB).await;
    h.add_vdev(12, 2 * GIB).await;
    let mut kept = Vec::new();
    for _ in 0..20 {
        kept.push(alloc_commit(&mut h, 128 << 10, false).await.0);
    }
    let freed: Vec<pb::Extent> = kept.drain(..5).collect();
    h.sync().await;
    h.alloc
        .free(pb::FreeRequest {
            extents: freed.clone(),
        })
        .await
        .unwrap();
    h.sync().await;
    h.server.shutdown().await.unwrap();
    store.close().await;
    (kept, freed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_state_survives_restart_and_claims_follow_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    let v0 = h.add_vdev(11, 2 * GIB).await;
    let v1 = h.add_vdev(12, 2 * GIB).await;
    let mut synced = Vec::new();
    for _ in 0..30 {
        synced.push(alloc_commit(&mut h, 64 << 10, false).await.0);
    }
    let freed: Vec<pb::Extent> = synced.drain(..10).collect();
    // A wait_synced commit covers everything committed before it.
    let (last, txg) = alloc_commit(&mut h, 64 << 10, true).await;
    synced.push(last);
    assert!(h.pool().await.synced_txg >= txg);
    h.alloc
        .free(pb::FreeRequest {
            extents: freed.clone(),
        })
        .await
        .unwrap();
    h.sync().await;
    let before = h.pool().await;
    let guid = before.guid;
    // Not durable: committed after the last sync, lost with the process.
    let (unsynced, _) = alloc_commit(&mut h, 64 << 10, false).await;
    // A crash at the store level: close the store under the running server
    // (nothing more can land) and abandon the server without its shutdown.
    store.close().await;
    drop(h);

    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    let after = h.pool().await;
    assert_eq!(after.guid, guid, "pool identity survives");
    assert_eq!(after.synced_txg, before.synced_txg);
    // `alloc` counts deferred frees; after a restart they are simply free.
    let freed_bytes: u64 = freed.iter().map(|e| e.size).sum();
    let want: Vec<(u32, u64)> = vdev_alloc(&before)
        .into_iter()
        .map(|(v, a)| {
            let f: u64 = freed.iter().filter(|e| e.vdev == v).map(|e| e.size).sum();
            (v, a - f)
        })
        .collect();
    assert!(freed_bytes > 0);
    assert_eq!(vdev_alloc(&after), want);
    let by_guid: Vec<(u64, u32)> = after.vdevs.iter().map(|v| (v.guid, v.vdev)).collect();
    assert_eq!(by_guid, vec![(11, v0), (12, v1)]);

    // Until their agents report in this generation, the loaded vdevs take
    // no allocation (a stopped agent would still honour the old tokens).
    let e = h.allocate(MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("no vdev is allocatable"), "{e}");
    // Re-registration by device guid gives the old vdev id back.
    assert_eq!(h.rejoin(11, 2 * GIB).await, v0);
    // A different device at a known (silent or live) endpoint is refused.
    let mut thief = register_req(99, 2 * GIB);
    thief.endpoint = register_req(12, 0).endpoint;
    let e = h.registry.register(thief).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("vdev 1"), "{e}");

    // Synced extents are still theirs: claiming them succeeds and changes
    // nothing; the unsynced one's space is free again (claimable).
    claim(&mut h, synced.clone())
        .await
        .expect("synced extents are theirs");
    claim(&mut h, vec![unsynced])
        .await
        .expect("the unsynced extent's space is free again");
    // Freed (durably) space is free: claiming it works too.
    claim(&mut h, freed[..2].to_vec())
        .await
        .expect("freed space");
    // A claim that is partly free and partly allocated names the
    // allocated part: claim the last 8 KiB of vdev 0, then the last 16 KiB.
    let vd = after.vdevs.iter().find(|v| v.vdev == v0).unwrap();
    let end = vd.metaslab_size * vd.metaslab_count as u64;
    let tail = pb::Extent {
        vdev: v0,
        offset: end - 8192,
        size: 8192,
    };
    claim(&mut h, vec![tail]).await.expect("free tail");
    let wider = pb::Extent {
        vdev: v0,
        offset: end - 16384,
        size: 16384,
    };
    let e = claim(&mut h, vec![wider]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains(&format!("{v0}:{:#x}", end - 8192)),
        "names the conflicting extent: {e}"
    );
    // Freed but still deferred: not free yet, a conflict.
    let (d, _) = alloc_commit(&mut h, 64 << 10, false).await;
    h.alloc
        .free(pb::FreeRequest { extents: vec![d] })
        .await
        .unwrap();
    let e = claim(&mut h, vec![d]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    // An in-flight allocation is not "theirs" to claim.
    let a = h.allocate(64 << 10).await.unwrap();
    let e = claim(&mut h, vec![a.extents[0]]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    h.server.shutdown().await.unwrap();
    store.close().await;

    // The same state read-only, as `aliquotctl verify` does.
    let (id, p) = sqlite_store::read_only(&path).await.unwrap().unwrap();
    assert_eq!(id.guid, guid);
    let report = aliquot_allocator::recovery::verify(&p).expect("verify passes");
    assert_eq!(report.vdevs.len(), 2);
}

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

async fn refused(path: &Path, pool: &str, guid: Option<u64>) -> OpenError {
    match SqliteStore::open(path, pool, guid).await {
        Ok(_) => panic!("{} must be refused", path.display()),
        Err(e) => e,
    }
}

/// The space-map chunk holding extent `k` (the last starting at or before it).
async fn chunk_holding(c: &mut sqlx::SqliteConnection, k: &pb::Extent) -> Chunk {
    let (start, width, data): (i64, i64, Vec<u8>) = sqlx::query_as(
        "SELECT start, width, data FROM spacemaps WHERE pool = 1 AND vdev = ? AND start <= ?
         ORDER BY start DESC LIMIT 1",
    )
    .bind(k.vdev as i64)
    .bind(k.offset as i64)
    .fetch_one(&mut *c)
    .await
    .unwrap();
    Chunk::new(k.vdev, start as u64, width as u8, data).unwrap()
}

/// Overwrite `old`'s row with a chunk of `extents` (none: just delete it).
async fn replace_chunk(c: &mut sqlx::SqliteConnection, old: &Chunk, extents: &[(u64, u64)]) {
    sqlx::query("DELETE FROM spacemaps WHERE pool = 1 AND vdev = ? AND start = ?")
        .bind(old.vdev as i64)
        .bind(old.start as i64)
        .execute(&mut *c)
        .await
        .unwrap();
    if !extents.is_empty() {
        let n = Chunk::encode(old.vdev, extents);
        sqlx::query(
            "INSERT INTO spacemaps (pool, vdev, start, width, data) VALUES (1, ?, ?, ?, ?)",
        )
        .bind(n.vdev as i64)
        .bind(n.start as i64)
        .bind(n.width as i64)
        .bind(n.data)
        .execute(&mut *c)
        .await
        .unwrap();
    }
}

async fn rw(path: &Path) -> sqlx::SqliteConnection {
    let o = sqlx::sqlite::SqliteConnectOptions::new().filename(path);
    sqlx::SqliteConnection::connect_with(&o).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_stores_are_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let good = db_path(dir.path());
    let (kept, _) = populated(dir.path()).await;
    assert!(
        !dir.path().join("pool.db-wal").exists(),
        "a clean close checkpoints"
    );
    let guid = sqlite_store::preflight(&good).await.unwrap().unwrap().guid;

    // Another pool's store: by name, and by an expected guid.
    let before = bytes(&good);
    let e = refused(&good, "other", None).await;
    assert!(matches!(e, OpenError::OtherPool { .. }), "{e}");
    assert!(e.to_string().contains("\"aliquot\""), "{e}");
    let e = refused(&good, POOL, Some(guid ^ 1)).await;
    assert!(e.to_string().contains("expected"), "{e}");
    assert_eq!(bytes(&good), before, "refusal left the file untouched");
    // Through the binary's own entry point: a configuration error.
    let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
    c.data_dir = dir.path().to_path_buf();
    c.pool = "other".into();
    let e = aliquot_allocator::run(c).await.unwrap_err();
    assert!(
        e.downcast_ref::<aliquot_allocator::ConfigError>().is_some(),
        "{e:#}"
    );
    assert_eq!(bytes(&good), before);

    // Truncated copies (mid-page and at a page boundary).
    for cut in [before.len() / 2 + 100, 2 * 4096] {
        let p = dir.path().join(format!("cut{cut}.db"));
        std::fs::write(&p, &before[..cut]).unwrap();
        let snap = bytes(&p);
        let e = refused(&p, POOL, None).await;
        assert!(e.to_string().contains("truncated"), "{e}");
        assert_eq!(bytes(&p), snap);
    }
    // Not SQLite at all.
    let p = dir.path().join("garbage.db");
    std::fs::write(&p, vec![0x5a; 8192]).unwrap();
    let e = refused(&p, POOL, None).await;
    assert!(e.to_string().contains("not an SQLite database"), "{e}");
    assert_eq!(bytes(&p), vec![0x5a; 8192]);

    // A newer schema.
    let newer = dir.path().join("newer.db");
    std::fs::write(&newer, &before).unwrap();
    {
        let mut c = rw(&newer).await;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99, 'from the future', 1, x'00', 0)",
        )
        .execute(&mut c)
        .await
        .unwrap();
        c.close().await.unwrap();
    }
    let snap = bytes(&newer);
    let e = refused(&newer, POOL, None).await;
    assert!(e.to_string().contains("newer"), "{e}");
    assert_eq!(bytes(&newer), snap);

    // Opens, but inconsistent: the first inconsistency is named and the
    // allocator refuses to start; nothing is repaired.
    let overlap = dir.path().join("overlap");
    std::fs::create_dir_all(&overlap).unwrap();
    let op = db_path(&overlap);
    std::fs::write(&op, &before).unwrap();
    let k = kept[0];
    {
        let mut c = rw(&op).await;
        sqlx::query("INSERT INTO extents (pool, vdev, offset, size, txg) VALUES (1, ?, ?, ?, 1)")
            .bind(k.vdev as i64)
            .bind((k.offset + 4096) as i64)
            .bind(k.size as i64)
            .execute(&mut c)
            .await
            .unwrap();
        sqlx::query("UPDATE vdevs SET allocated = allocated + ? WHERE pool = 1 AND id = ?")
            .bind(k.size as i64)
            .bind(k.vdev as i64)
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
    }
    let snap = bytes(&op);
    let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
    c.data_dir = overlap.clone();
    let e = aliquot_allocator::run(c).await.unwrap_err().to_string();
    assert!(e.contains("inconsistent") && e.contains("overlaps"), "{e}");
    assert_eq!(bytes(&op), snap, "an inconsistent store is not repaired");
    let e = sqlite_store::read_only(&op)
        .await
        .map(|r| aliquot_allocator::recovery::verify(&r.unwrap().1))
        .unwrap()
        .unwrap_err();
    assert!(e.contains("overlaps"), "{e}");

    // A lost extent (dropped from its space-map chunk): the per-vdev sum
    // no longer matches.
    let lost = dir.path().join("lost.db");
    std::fs::write(&lost, &before).unwrap();
    {
        let mut c = rw(&lost).await;
        let chunk = chunk_holding(&mut c, &k).await;
        let rest: Vec<(u64, u64)> = chunk.iter().filter(|e| e.0 != k.offset).collect();
        assert_eq!(rest.len() + 1, chunk.len(), "k is in its chunk");
        replace_chunk(&mut c, &chunk, &rest).await;
        c.close().await.unwrap();
    }
    let snap = bytes(&lost);
    let e = match SqliteStore::open(&lost, POOL, None)
        .await
        .unwrap()
        .load()
        .await
    {
        Ok(_) => panic!("a lost extent must be noticed"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&format!("vdev {}", k.vdev)) && e.contains("sum"),
        "{e}"
    );
    assert_eq!(bytes(&lost), snap);

    // An extent written twice into its space-map chunk (sums kept right):
    // refused at start, naming the overlap; the file untouched.
    let twice = dir.path().join("twice");
    std::fs::create_dir_all(&twice).unwrap();
    let tp = db_path(&twice);
    std::fs::write(&tp, &before).unwrap();
    {
        let mut c = rw(&tp).await;
        let chunk = chunk_holding(&mut c, &k).await;
        let mut dup: Vec<(u64, u64)> = chunk.iter().collect();
        dup.push((k.offset, k.size));
        dup.sort();
        replace_chunk(&mut c, &chunk, &dup).await;
        sqlx::query("UPDATE vdevs SET allocated = allocated + ? WHERE pool = 1 AND id = ?")
            .bind(k.size as i64)
            .bind(k.vdev as i64)
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
    }
    let snap = bytes(&tp);
    let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
    c.data_dir = twice.clone();
    let e = aliquot_allocator::run(c).await.unwrap_err().to_string();
    assert!(
        e.contains("inconsistent")
            && e.contains(&format!("overlaps extent {}:{:#x}", k.vdev, k.offset)),
        "{e}"
    );
    assert_eq!(bytes(&tp), snap, "an inconsistent store is not repaired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_time_tunables_survive_restarts_unless_overridden() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    for (n, v) in [("metaslab_aliquot", "2097152"), ("zfs_txg_timeout", "7")] {
        h.alloc
            .set_tunable(pb::SetTunableRequest {
                name: n.into(),
                value: v.into(),
            })
            .await
            .unwrap();
    }
    h.server.shutdown().await.unwrap();
    store.close().await;

    let get = |list: &pb::TunableList, n: &str| {
        list.tunables
            .iter()
            .find(|t| t.name == n)
            .map(|t| t.value.clone())
            .unwrap()
    };
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    let list = h
        .alloc
        .get_tunables(pb::GetTunablesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(get(&list, "zfs_txg_timeout"), "7");
    let aliquot = get(&list, "metaslab_aliquot");
    assert!(aliquot == "2097152" || aliquot == "2MiB", "{aliquot}");
    h.server.shutdown().await.unwrap();
    store.close().await;

    // An explicit --tunable at start wins over the stored value.
    let store = open(&path).await;
    let mut c = config();
    c.tunables = vec![
        "zfs_txg_timeout=9".into(),
        "zfs_unflushed_log_txg_max=50".into(),
    ];
    let mut h = start_with(c, store.clone()).await;
    let list = h
        .alloc
        .get_tunables(pb::GetTunablesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(get(&list, "zfs_txg_timeout"), "9");
    // The log space map's bounds, the store's: set at start, listed.
    assert_eq!(get(&list, "zfs_unflushed_log_txg_max"), "50");
    assert_eq!(
        get(&list, "zfs_unflushed_max_mem_amt"),
        (1u64 << 30).to_string()
    );
    assert_eq!(store.log_tunables().unwrap().zfs_unflushed_log_txg_max, 50);
    h.server.shutdown().await.unwrap();
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dirty_bound_closes_the_txg_early() {
    let mut c = config(); // zfs_txg_timeout 600 s
    c.txg_dirty_max = 4 * MIB;
    let mut h = start(c).await;
    h.add_vdev(1, 4 * GIB).await;
    let synced = h.pool().await.synced_txg;
    let mut first_txg = 0;
    for i in 0..3 {
        let (_, t) = alloc_commit(&mut h, MIB, false).await;
        if i == 0 {
            first_txg = t;
        }
    }
    // 3 MiB: below the bound, nothing syncs.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.pool().await.synced_txg, synced);
    alloc_commit(&mut h, MIB, false).await;
    let mut probe = h.alloc.clone();
    eventually("dirty bound sync", Duration::from_secs(5), || {
        let mut p = probe.clone();
        async move {
            p.get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner()
                .synced_txg
                >= first_txg
        }
    })
    .await;
    let _ = &mut probe;
}

/// A store whose `persist` waits for the test to open a gate, so a sync can
/// be held "in flight".
struct GateStore {
    inner: MemStore,
    open: watch::Sender<bool>,
    persisting: watch::Sender<u64>,
}

impl GateStore {
    fn new() -> Arc<GateStore> {
        Arc::new(GateStore {
            inner: MemStore::new(),
            open: watch::Sender::new(true),
            persisting: watch::Sender::new(0),
        })
    }
}

impl Store for GateStore {
    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>> {
        self.inner.load()
    }
    fn create(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.create(g)
    }
    fn persist<'a>(&'a self, r: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.persisting.send_replace(r.sync.txg);
            let mut rx = self.open.subscribe();
            let _ = rx.wait_for(|o| *o).await;
            self.inner.persist(r).await
        })
    }
    fn set_tunable<'a>(&'a self, n: &'a str, v: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.set_tunable(n, v)
    }
    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.open_generation()
    }
    fn allocated_overlapping(
        &self,
        e: metaslab::Extent,
    ) -> BoxFuture<'_, Result<Vec<metaslab::Extent>, StoreError>> {
        self.inner.allocated_overlapping(e)
    }
    fn fenced(&self) -> bool {
        self.inner.fenced()
    }
    fn log_tunables(&self) -> Option<aliquot_allocator::spacemap_log::LogTunables> {
        self.inner.log_tunables()
    }
    fn set_log_tunables(&self, t: aliquot_allocator::spacemap_log::LogTunables) {
        self.inner.set_log_tunables(t)
    }
    fn handed_over_cleanly(&self) -> bool {
        self.inner.handed_over_cleanly()
    }
    fn generation_history(
        &self,
    ) -> BoxFuture<'_, Result<std::collections::BTreeMap<u64, u64>, StoreError>> {
        self.inner.generation_history()
    }
    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.rewind_generation()
    }
    fn set_rewind_generation(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.set_rewind_generation(g)
    }
    fn allocated_overlapping_many<'a>(
        &'a self,
        extents: &'a [metaslab::Extent],
    ) -> BoxFuture<'a, Result<Vec<Vec<metaslab::Extent>>, StoreError>> {
        self.inner.allocated_overlapping_many(extents)
    }
    fn largest_extents(
        &self,
        vdev: u32,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<metaslab::Extent>, StoreError>> {
        self.inner.largest_extents(vdev, limit)
    }
    fn copies_of(&self, at: (u32, u64)) -> BoxFuture<'_, Result<Vec<(u32, u64)>, StoreError>> {
        self.inner.copies_of(at)
    }
    fn copies_on<'a>(
        &'a self,
        vdev: u32,
        starts: &'a [u64],
    ) -> BoxFuture<'a, Result<aliquot_allocator::block_copies::CopySets, StoreError>> {
        self.inner.copies_on(vdev, starts)
    }
    fn relocation(
        &self,
        id: u64,
    ) -> BoxFuture<'_, Result<Option<aliquot_allocator::store::RelocationRecord>, StoreError>> {
        self.inner.relocation(id)
    }
    fn relocation_totals(&self) -> BoxFuture<'_, Result<(u64, u64), StoreError>> {
        self.inner.relocation_totals()
    }
    fn agent_bindings(
        &self,
    ) -> BoxFuture<'_, Result<std::collections::BTreeMap<String, u64>, StoreError>> {
        self.inner.agent_bindings()
    }
    fn bind_agent<'a>(&'a self, n: &'a str, g: u64) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.bind_agent(n, g)
    }
    fn evacuations(&self) -> BoxFuture<'_, Result<Vec<Evacuation>, StoreError>> {
        self.inner.evacuations()
    }
    fn set_evacuation(
        &self,
        v: u32,
        e: Option<Evacuation>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.set_evacuation(v, e)
    }
}

/// Start a sync of the open txg and wait until its persist is in flight.
async fn hold_sync(h: &Harness, gate: &GateStore) -> (u64, tokio::task::JoinHandle<u64>) {
    gate.open.send_replace(false);
    let (txg, generation) = {
        let mut a = h.alloc.clone();
        let p = a
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        (p.open_txg, p.generation)
    };
    let mut a = h.alloc.clone();
    let waiter = tokio::spawn(async move {
        a.sync_txg(pb::SyncTxgRequest { txg, generation })
            .await
            .unwrap()
            .into_inner()
            .synced_txg
    });
    let mut rx = gate.persisting.subscribe();
    tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|t| *t == txg))
        .await
        .expect("sync started")
        .unwrap();
    (txg, waiter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_goes_on_while_a_sync_is_written() {
    let gate = GateStore::new();
    let mut h = start_with(config(), gate.clone()).await;
    h.add_vdev(1, 4 * GIB).await;
    alloc_commit(&mut h, MIB, false).await;
    let (txg, waiter) = hold_sync(&h, &gate).await;
    // The store is "writing" txg; allocate and commit go on in txg + 1.
    for _ in 0..10 {
        let (_, t) = tokio::time::timeout(Duration::from_secs(2), alloc_commit(&mut h, MIB, false))
            .await
            .expect("allocation must not wait for the sync");
        assert_eq!(t, txg + 1);
    }
    let s = h.pool().await;
    assert!(s.synced_txg < txg, "not durable before the store returned");
    assert!(!waiter.is_finished(), "SyncTxg waits for the store");
    gate.open.send_replace(true);
    assert!(waiter.await.unwrap() >= txg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_is_not_reusable_before_its_txg_is_durable() {
    // A full pool (claimed end to end, which ignores slop) makes the next
    // sync skip the two-txg deferral ("nodefer"); even then the freed range
    // must not be handed out while the txg that freed it is being written.
    let gate = GateStore::new();
    let mut h = start_with(config(), gate.clone()).await;
    let v = h.add_vdev(1, GIB).await;
    let s = h.pool().await;
    let vd = &s.vdevs[0];
    let end = vd.metaslab_size * vd.metaslab_count as u64;
    // The first 4 MiB as an extent of its own: the block freed below (a
    // free names exactly one committed extent).
    let mut whole: Vec<pb::Extent> = vec![
        pb::Extent {
            vdev: v,
            offset: 0,
            size: 4 * MIB,
        },
        pb::Extent {
            vdev: v,
            offset: 4 * MIB,
            size: vd.metaslab_size - 4 * MIB,
        },
    ];
    whole.extend((1..vd.metaslab_count as u64).map(|m| pb::Extent {
        vdev: v,
        offset: m * vd.metaslab_size,
        size: vd.metaslab_size,
    }));
    claim(&mut h, whole).await.expect("claim the whole vdev");
    h.sync().await;
    let log = pb::AllocateRequest {
        class: pb::AllocationClass::Log as i32,
        size: 4096,
        copies: 1,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    };
    assert!(h.alloc.allocate(log).await.is_err(), "the pool is full");
    let freed = pb::Extent {
        vdev: v,
        offset: 0,
        size: 4 * MIB,
    };
    h.alloc
        .free(pb::FreeRequest {
            extents: vec![freed],
        })
        .await
        .unwrap();
    let (txg, waiter) = hold_sync(&h, &gate).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    // While txg is being written, the freed range is not allocatable.
    match h.alloc.allocate(log).await {
        Ok(a) => {
            let e = a.into_inner().extents[0];
            panic!(
                "allocated {}:{:#x} while the free of txg {txg} was not durable (vdev end {end:#x})",
                e.vdev, e.offset
            );
        }
        Err(e) => assert_ne!(e.code(), Code::Internal, "{e}"),
    }
    gate.open.send_replace(true);
    waiter.await.unwrap();
    // Durable now: after the following sync the space comes back.
    h.sync().await;
    let a = h.alloc.allocate(log).await.expect("reusable once durable");
    let e = a.into_inner().extents[0];
    assert!(e.offset < freed.size, "from the freed range: {e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frees_split_stored_extents_in_one_transaction() {
    use metaslab::{SpaceChange, SpaceChangeKind, TxgSync};
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    store.create(5).await.unwrap();
    let e = |offset: u64, size: u64| metaslab::testing::ext(0, offset, size);
    let ch = |kind, extent| SpaceChange { kind, extent };
    let rec = |txg, changes| TxgRecord {
        sync: TxgSync {
            txg,
            changes,
            undeferred_bytes: 0,
            ..Default::default()
        },
        vdevs: vec![],
        ..Default::default()
    };
    let mut first = rec(
        4,
        vec![
            ch(SpaceChangeKind::Alloc, e(0, 16384)),
            ch(SpaceChangeKind::Alloc, e(65536, 4096)),
        ],
    );
    first.vdevs.push(vdev_record(0, GIB, 27));
    store.persist(&first).await.unwrap();
    // A run of frees: two split the first extent (the one-pass merge of
    // exact frees gives up, the change-by-change path splits), one removes
    // the second exactly.
    let second = rec(
        5,
        vec![
            ch(SpaceChangeKind::Free, e(4096, 4096)),
            ch(SpaceChangeKind::Free, e(8192, 4096)),
            ch(SpaceChangeKind::Free, e(65536, 4096)),
        ],
    );
    store.persist(&second).await.unwrap();
    // Retrying a txg that landed is a no-op; an older one is refused.
    store.persist(&second).await.unwrap();
    assert!(store.persist(&first).await.is_err());
    // A free of space the store does not hold fails the whole txg.
    let bad = rec(6, vec![ch(SpaceChangeKind::Free, e(4096, 8192))]);
    assert!(store.persist(&bad).await.is_err());
    let p = store.load().await.unwrap().unwrap();
    assert_eq!(p.synced_txg, 5);
    assert_eq!(
        p.allocated.iter().collect::<Vec<_>>(),
        vec![e(0, 4096), e(12288, 4096)]
    );
    aliquot_allocator::recovery::verify(&p).expect("consistent");
    store.close().await;
}

/// A txg the pool vouched for (`TxgSync::checked`: its changes fit the
/// pool's in-memory space maps) is appended to the log without reading the
/// chunks. Were a pool wrong, what it vouched for could not get past the
/// next restart: the replay of the log onto the chunks refuses the store as
/// inconsistent, naming the bad change, as a flush would refuse its txg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vouched_txg_that_does_not_fit_is_refused_by_the_replay() {
    use metaslab::{SpaceChange, SpaceChangeKind, TxgSync};
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    store.create(5).await.unwrap();
    let e = |offset: u64, size: u64| metaslab::testing::ext(0, offset, size);
    let rec = |txg, changes, checked| TxgRecord {
        sync: TxgSync {
            txg,
            changes,
            checked,
            ..Default::default()
        },
        ..Default::default()
    };
    let alloc = |x| SpaceChange {
        kind: SpaceChangeKind::Alloc,
        extent: x,
    };
    let mut first = rec(4, vec![alloc(e(0, 16384))], false);
    first.vdevs.push(vdev_record(0, GIB, 27));
    store.persist(&first).await.unwrap();
    // Unvouched, the overlap is refused at once (the chunks are read).
    let over = |checked| rec(5, vec![alloc(e(4096, 4096))], checked);
    assert!(store.persist(&over(false)).await.is_err());
    // Vouched, it goes into the log (no metaslab is flushed yet) ...
    store.persist(&over(true)).await.unwrap();
    store.close().await;
    // ... and the restart that replays it refuses the store.
    let store = open(&path).await;
    let err = store.load().await.unwrap_err().to_string();
    assert!(err.contains("inconsistent"), "{err}");
    store.close().await;
}

/// ExpandVdev (the operator's `zpool online -e`): grows a vdev, durable when
/// it answers (a crash right after keeps the new capacity), never shrinks,
/// never beyond what the store reopens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_vdev_grows_durably_and_refuses_shrinking_and_oversize() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    let v = h.add_vdev(21, 256 * MIB).await;
    let expand = |vdev, capacity| pb::ExpandVdevRequest { vdev, capacity };
    // Past the device its agent reported: refused.
    let e = h.alloc.expand_vdev(expand(v, GIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("grow the device first"), "{e:?}");
    // The agent reports a 1 GiB device: the vdev may grow to it.
    let _reports = reporter(&h.registry, v, GIB, Duration::from_millis(20));
    let mut grown = None;
    for _ in 0..250 {
        match h.alloc.expand_vdev(expand(v, GIB)).await {
            Ok(r) => {
                grown = Some(r.into_inner());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let grown = grown.expect("expand once the agent reported the device's size");
    assert_eq!(grown.capacity, GIB);
    assert!(grown.metaslab_count as u64 * grown.metaslab_size <= GIB);
    assert!(
        grown.metaslab_count as u64 * grown.metaslab_size > 256 * MIB,
        "new metaslabs: {grown:?}"
    );
    let e = h.alloc.expand_vdev(expand(v, 512 * MIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = h.alloc.expand_vdev(expand(v, u64::MAX)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = h.alloc.expand_vdev(expand(v + 9, GIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Space on the new metaslabs is allocatable: fill past the old end.
    let mut past_old_end = false;
    // 32 x 16 MiB is twice the old capacity: it cannot all fit below it.
    for _ in 0..32 {
        let a = h.allocate(16 * MIB).await.expect("allocate");
        h.commit(vec![a.allocation_id]).await.unwrap();
        past_old_end |= a.extents[0].offset >= 256 * MIB;
        if past_old_end {
            break;
        }
    }
    assert!(past_old_end, "allocations reach the expanded space");
    // No sync after the expand's own: only its wait made it durable.

    // Crash (the store closes under the server), reopen: still 1 GiB.
    store.close().await;
    drop(h);
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    let st = h.pool().await;
    let vs = st.vdevs.iter().find(|x| x.vdev == v).expect("vdev");
    assert_eq!(vs.capacity, GIB, "the expansion survived the crash");
    h.server.shutdown().await.unwrap();
    store.close().await;
}

/// The space-map store against the reference (`MemStore`, one set entry per
/// extent) over many txgs of mixed changes on two vdevs: more extents than
/// fit one chunk, exact frees, frees splitting an extent, frees spanning
/// two touching extents, reallocation of freed space, an allocation freed
/// in its own txg. After every txg both load the same extents and answer
/// the same overlap and largest-extent queries; the file also reopens to
/// the same state, and a file in the old one-row-per-extent layout is moved
/// into space maps at open without a change of content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn space_maps_match_the_reference_store() {
    use std::collections::BTreeMap;

    use metaslab::{Extent, SpaceChange, SpaceChangeKind, TxgSync};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const K: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    let mem = MemStore::new();
    store.create(5).await.unwrap();
    mem.create(5).await.unwrap();
    // Vdev 0 in 16 MiB metaslabs: its changes spread over ~10 of them, a
    // few flushed into their chunks each txg, the rest only in the log.
    let vdev = |id| vdev_record(id, 64 * GIB, if id == 0 { 24 } else { 30 });
    let mut store = store;
    // OpenZFS's policy: a metaslab or more flushed each txg.
    let one = aliquot_allocator::spacemap_log::LogTunables {
        zfs_min_metaslabs_to_flush: 1,
        ..Default::default()
    };
    store.set_log_tunables(one);
    let mut rng = SmallRng::seed_from_u64(14);
    // What is allocated, per vdev: offset -> size.
    let mut live: [BTreeMap<u64, u64>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let mut cursor = [0u64; 2];
    let mut holes: Vec<Extent> = Vec::new();
    let alloc =
        |v: u32, live: &mut [BTreeMap<u64, u64>; 2], e: Extent, out: &mut Vec<SpaceChange>| {
            live[v as usize].insert(e.offset, e.size);
            out.push(SpaceChange {
                kind: SpaceChangeKind::Alloc,
                extent: e,
            });
        };
    let free = |e: Extent, out: &mut Vec<SpaceChange>| {
        out.push(SpaceChange {
            kind: SpaceChangeKind::Free,
            extent: e,
        })
    };
    for txg in 4..24u64 {
        let mut ch: Vec<SpaceChange> = Vec::new();
        let n_alloc = if txg == 4 {
            9000
        } else {
            rng.random_range(0..400)
        };
        for _ in 0..n_alloc {
            let v = if rng.random_bool(0.9) { 0 } else { 1 };
            // Touching runs now and then, so a free can span two extents.
            let gap = if rng.random_bool(0.3) {
                0
            } else {
                K * rng.random_range(1..4)
            };
            let e = Extent {
                vdev: v,
                offset: cursor[v as usize] + gap,
                size: K * rng.random_range(1..5),
            };
            cursor[v as usize] = e.offset + e.size;
            alloc(v, &mut live, e, &mut ch);
        }
        // Freed space of earlier txgs, allocated again.
        for e in std::mem::take(&mut holes) {
            if rng.random_bool(0.5) {
                alloc(e.vdev, &mut live, e, &mut ch);
            }
        }
        if txg > 4 {
            for _ in 0..rng.random_range(50..600) {
                let v = if rng.random_bool(0.9) { 0 } else { 1 };
                let m = &mut live[v as usize];
                if m.is_empty() {
                    continue;
                }
                let at = rng.random_range(0..cursor[v as usize]);
                let Some((&off, &size)) = m.range(at..).next() else {
                    continue;
                };
                let e = Extent {
                    vdev: v,
                    offset: off,
                    size,
                };
                match rng.random_range(0..10) {
                    // A middle block of a longer extent: a split.
                    0 if size >= 3 * K => {
                        m.remove(&off);
                        m.insert(off, K);
                        m.insert(off + 2 * K, size - 2 * K);
                        free(
                            Extent {
                                offset: off + K,
                                size: K,
                                ..e
                            },
                            &mut ch,
                        );
                    }
                    // This extent and the next when they touch.
                    1 => {
                        let next = m.range(off + size..).next().map(|(&o, &s)| (o, s));
                        m.remove(&off);
                        match next {
                            Some((o, s)) if o == off + size => {
                                m.remove(&o);
                                free(
                                    Extent {
                                        size: size + s,
                                        ..e
                                    },
                                    &mut ch,
                                );
                            }
                            _ => free(e, &mut ch),
                        }
                    }
                    _ => {
                        m.remove(&off);
                        free(e, &mut ch);
                        holes.push(e);
                    }
                }
            }
        }
        // An allocation freed in its own txg.
        let e = Extent {
            vdev: 1,
            offset: cursor[1] + K,
            size: K,
        };
        cursor[1] += 2 * K;
        ch.push(SpaceChange {
            kind: SpaceChangeKind::Alloc,
            extent: e,
        });
        free(e, &mut ch);
        let rec = TxgRecord {
            sync: TxgSync {
                txg,
                changes: ch,
                undeferred_bytes: 0,
                ..Default::default()
            },
            vdevs: if txg == 4 {
                vec![vdev(0), vdev(1)]
            } else {
                vec![]
            },
            ..Default::default()
        };
        store.persist(&rec).await.unwrap();
        mem.persist(&rec).await.unwrap();
        let (a, b) = (
            store.load().await.unwrap().unwrap(),
            mem.load().await.unwrap().unwrap(),
        );
        assert_eq!(a.allocated, b.allocated, "txg {txg}");
        let want: Vec<Extent> = (0..2u32)
            .flat_map(|v| {
                live[v as usize].iter().map(move |(&offset, &size)| Extent {
                    vdev: v,
                    offset,
                    size,
                })
            })
            .collect();
        assert!(a.allocated.iter().eq(want.iter().copied()), "txg {txg}");
        let mut probes = Vec::new();
        for _ in 0..20 {
            let v = rng.random_range(0..2u32);
            let probe = Extent {
                vdev: v,
                offset: K * rng.random_range(0..cursor[v as usize] / K + 2),
                size: K * rng.random_range(1..40),
            };
            let want = mem.allocated_overlapping(probe).await.unwrap();
            assert_eq!(
                store.allocated_overlapping(probe).await.unwrap(),
                want,
                "txg {txg}: {probe}"
            );
            probes.push((probe, want));
        }
        // The same probes as one batch (Free's check of a request): one
        // query per vdev's span, the same answers in the same order.
        let batch: Vec<Extent> = probes.iter().map(|p| p.0).collect();
        let want: Vec<Vec<Extent>> = probes.into_iter().map(|p| p.1).collect();
        assert_eq!(
            store.allocated_overlapping_many(&batch).await.unwrap(),
            want,
            "txg {txg}"
        );
        for v in 0..2 {
            assert_eq!(
                store.largest_extents(v, 7).await.unwrap(),
                mem.largest_extents(v, 7).await.unwrap()
            );
        }
        if txg % 6 == 0 {
            // A restart mid-way through flushing: some metaslabs flushed,
            // others only in the log, which the load replays.
            let (logged, flushed) = log_rows(&path).await;
            assert!(
                logged > 0 && flushed > 0,
                "txg {txg}: {logged} log rows, {flushed} flushed"
            );
            store.close().await;
            store = open(&path).await;
            store.set_log_tunables(one);
            let (_, a) = sqlite_store::read_only(&path).await.unwrap().unwrap();
            assert_eq!(a.allocated, b.allocated, "txg {txg}, read only");
            assert_eq!(
                store.load().await.unwrap().unwrap().allocated,
                b.allocated,
                "txg {txg}, after a restart"
            );
        }
    }
    // Everything flushed in one txg: the log empties, the maps stay.
    let all = aliquot_allocator::spacemap_log::LogTunables {
        zfs_min_metaslabs_to_flush: u64::MAX,
        ..Default::default()
    };
    store.set_log_tunables(all);
    let last = TxgRecord {
        sync: TxgSync {
            txg: 24,
            ..Default::default()
        },
        ..Default::default()
    };
    store.persist(&last).await.unwrap();
    mem.persist(&last).await.unwrap();
    assert_eq!(log_rows(&path).await.0, 0, "all flushed");
    let want = mem.load().await.unwrap().unwrap();
    aliquot_allocator::recovery::verify(&want).expect("consistent");
    store.close().await;
    let store = open(&path).await;
    assert_eq!(
        store.load().await.unwrap().unwrap().allocated,
        want.allocated
    );
    store.close().await;

    // The same content in the old layout: one row per extent (and no log:
    // an old binary kept none).
    {
        let mut c = rw(&path).await;
        for sql in [
            "DELETE FROM spacemaps",
            "DELETE FROM spacemap_log",
            "DELETE FROM metaslab_flushes",
        ] {
            sqlx::query(sql).execute(&mut c).await.unwrap();
        }
        for e in want.allocated.iter() {
            sqlx::query(
                "INSERT INTO extents (pool, vdev, offset, size, txg) VALUES (1, ?, ?, ?, 1)",
            )
            .bind(e.vdev as i64)
            .bind(e.offset as i64)
            .bind(e.size as i64)
            .execute(&mut c)
            .await
            .unwrap();
        }
        c.close().await.unwrap();
    }
    let (_, old) = sqlite_store::read_only(&path).await.unwrap().unwrap();
    assert_eq!(old.allocated, want.allocated, "read without converting");
    let store = open(&path).await;
    assert_eq!(
        store.load().await.unwrap().unwrap().allocated,
        want.allocated
    );
    store.close().await;
    let mut c = rw(&path).await;
    let (rows, chunks): (i64, i64) =
        sqlx::query_as("SELECT (SELECT COUNT(*) FROM extents), (SELECT COUNT(*) FROM spacemaps)")
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!(rows, 0, "moved out of the old table");
    assert!(
        chunks >= 3,
        "{chunks} chunks for {} extents",
        want.allocated.len()
    );
    c.close().await.unwrap();
}

/// Rows of the log space map, and metaslabs with a flush txg recorded.
async fn log_rows(path: &Path) -> (i64, i64) {
    let mut c = rw(path).await;
    let r = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM spacemap_log), (SELECT COUNT(*) FROM metaslab_flushes)",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    r
}

/// A device's label keeps the store's state digest beside the
/// synced txg; at the same txg a different digest means the store is of
/// another history (a copy that went its own way): refused, and sticky.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_another_history_at_the_same_txg_is_refused() {
    let mut h = start(config()).await;
    let v = h.add_vdev(1, GIB).await;
    let a = h.allocate(MIB).await.unwrap();
    h.commit(vec![a.allocation_id]).await.unwrap();
    h.sync().await;
    let pool = h.pool().await;
    let ack = h
        .registry
        .report(tokio_stream::iter([pb::AgentReport {
            vdev: v,
            capacity: GIB,
            health: pb::VdevHealth::Healthy as i32,
            ..Default::default()
        }]))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ack.synced_txg, pool.synced_txg);
    assert_ne!(ack.state_digest, 0, "a digest once a txg synced");
    // The same history: accepted.
    let mut same = register_req(1, GIB);
    same.label_pool_guid = pool.guid;
    same.label_txg = ack.synced_txg;
    same.label_state_digest = ack.state_digest;
    h.registry.register(same).await.expect("the same history");
    // Another history at the same txg: refused, and nothing is served after.
    let mut other = register_req(3, GIB);
    other.label_pool_guid = pool.guid;
    other.label_txg = ack.synced_txg;
    other.label_state_digest = ack.state_digest ^ 1;
    let e = h.registry.register(other).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("is not the pool's"), "{e}");
    assert!(e.message().contains("--rewind-to"), "{e}");
    let e = h.allocate(MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
}

/// A claim after the claim window names a block of generation N whose txg
/// was lost; generation N+1 gave its space out again and committed a block
/// there (synced). The claim must be refused although the store holds
/// exactly that extent (same client, same shape): claiming it would leave
/// two "durable" blocks on one extent. Sub-ranges and straddling ranges are
/// refused too; answered per extent, only what overlaps is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_claim_over_space_committed_in_this_generation_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(dir.path());
    let store = open(&path).await;
    let mut h = start_with(config(), store.clone()).await;
    h.add_vdev(11, 256 * MIB).await;
    // The vdev synced, nothing allocated: after the restart the vdev is as
    // empty as it was, and the first Allocate lands where X did.
    h.sync().await;
    let gen_n = h.pool().await.generation;
    // X: committed in generation N, its txg never synced.
    let (x, _) = alloc_commit(&mut h, 64 << 10, false).await;
    store.close().await;
    drop(h);

    let store = open(&path).await;
    let mut c = config();
    c.claim_window = Duration::ZERO; // every claim from now on is late
    let mut h = start_with(c, store.clone()).await;
    assert!(h.pool().await.generation > gen_n);
    h.rejoin(11, 256 * MIB).await;
    // The first Allocate of the new generation gets X's space: Y.
    let (y, y_txg) = alloc_commit(&mut h, 64 << 10, true).await;
    assert_eq!(y, x, "the lost block's extent is given out again");
    assert!(h.pool().await.synced_txg >= y_txg);

    let e = claim(&mut h, vec![x]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("committed over it"), "{e}");
    let sub = pb::Extent {
        offset: x.offset + 4096,
        size: 4096,
        ..x
    };
    let e = claim(&mut h, vec![sub]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "sub-range: {e}");
    let straddling = pb::Extent {
        offset: x.offset + x.size / 2,
        size: x.size,
        ..x
    };
    let e = claim(&mut h, vec![straddling]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "straddling: {e}");

    // Per extent: the refused one is named, the free one beside it claimed.
    let pool = h.pool().await;
    let vd = &pool.vdevs[0];
    let end = vd.metaslab_size * vd.metaslab_count as u64;
    let free = pb::Extent {
        vdev: x.vdev,
        offset: end - 8192,
        size: 8192,
    };
    let r = h
        .alloc
        .claim(pb::ClaimRequest {
            extents: vec![x, free, sub],
            per_extent: true,
            allocation_ids: Vec::new(),
        })
        .await
        .expect("a per-extent claim answers each extent")
        .into_inner();
    let claimed: Vec<bool> = r.results.iter().map(|x| x.claimed).collect();
    assert_eq!(claimed, vec![false, true, false], "{:?}", r.results);
    assert_eq!(r.results[0].extent, Some(x));
    assert_eq!(
        r.results[0].reason,
        pb::ErrorReason::ClaimConflict as i32,
        "{:?}",
        r.results[0]
    );
    assert!(r.txg > 0);
    // The claimed one is allocated now: a free of it is exact.
    h.alloc
        .free(pb::FreeRequest {
            extents: vec![free],
        })
        .await
        .expect("the claimed extent is allocated");

    // Y freed (and its free synced): X's space is free again, but Y's
    // bytes overwrote X's; the claim is still refused.
    h.alloc
        .free(pb::FreeRequest { extents: vec![y] })
        .await
        .unwrap();
    for _ in 0..3 {
        h.sync().await;
    }
    let e = claim(&mut h, vec![x]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "after Y's free: {e}");
    h.server.shutdown().await.unwrap();
    store.close().await;
}
