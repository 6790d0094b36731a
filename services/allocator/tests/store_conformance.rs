//! One conformance suite for every store: each test below runs against the
//! in-memory store, SQLite (a real file) and PostgreSQL (a private server
//! from `local-postgres`), through the `Store` trait only, with restarts
//! (close, open again, load). A store that answers differently from the
//! others fails here, whichever it is.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::extent_owners::{OwnerChanges, OwnerWindow};
use aliquot_allocator::store::{
    AdminState, Evacuation, Mapping, MappingChange, RelocationRecord, TxgRecord, VdevRecord,
    state_digest,
};
use aliquot_allocator::{MemStore, PgStore, SqliteStore, Store, sqlite_store};
use metaslab::{Extent, SpaceChange, SpaceChangeKind, TxgSync, VdevRole, VdevSpec};

const POOL: &str = "conformance";
const MIB: u64 = 1 << 20;

/// A store under test, opened again after `close` as a restart would.
trait Backend {
    type S: Store;
    async fn open(&mut self) -> Arc<Self::S>;
    async fn close(&mut self, s: Arc<Self::S>);
}

/// The in-memory store: a restart is the same object (what it keeps is what
/// a process keeps).
struct Mem(Arc<MemStore>);

impl Mem {
    fn new() -> Mem {
        Mem(Arc::new(MemStore::new()))
    }
}

impl Backend for Mem {
    type S = MemStore;
    async fn open(&mut self) -> Arc<MemStore> {
        self.0.clone()
    }
    async fn close(&mut self, _: Arc<MemStore>) {}
}

struct Sqlite(tempfile::TempDir);

impl Sqlite {
    fn new() -> Sqlite {
        Sqlite(tempfile::tempdir().unwrap())
    }
}

impl Backend for Sqlite {
    type S = SqliteStore;
    async fn open(&mut self) -> Arc<SqliteStore> {
        let path = self.0.path().join(sqlite_store::DB_FILE);
        Arc::new(SqliteStore::open(&path, POOL, None).await.unwrap())
    }
    async fn close(&mut self, s: Arc<SqliteStore>) {
        s.close().await;
    }
}

/// A private PostgreSQL server; each open is a new allocator taking the
/// pool's leadership (the previous one stepped down at close).
struct Pg {
    server: local_postgres::Postgres,
    opened: u32,
}

impl Pg {
    fn new() -> Pg {
        Pg {
            server: local_postgres::Postgres::start(),
            opened: 0,
        }
    }

    async fn leader(&mut self) -> PgStore {
        self.opened += 1;
        let me = format!("allocator-{}", self.opened);
        let s = PgStore::open(&self.server.url(), POOL, None, &me)
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if s.try_acquire(Duration::from_secs(60))
                .await
                .unwrap()
                .is_some()
            {
                return s;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{me} never took the leadership"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Backend for Pg {
    type S = PgStore;
    async fn open(&mut self) -> Arc<PgStore> {
        Arc::new(self.leader().await)
    }
    async fn close(&mut self, s: Arc<PgStore>) {
        s.release(false).await.unwrap();
        s.close().await;
    }
}

fn ext(vdev: u32, offset: u64, size: u64) -> Extent {
    Extent { vdev, offset, size }
}

fn alloc(e: Extent) -> SpaceChange {
    SpaceChange {
        kind: SpaceChangeKind::Alloc,
        extent: e,
    }
}

fn free(e: Extent) -> SpaceChange {
    SpaceChange {
        kind: SpaceChangeKind::Free,
        extent: e,
    }
}

fn vdev(id: u32) -> VdevRecord {
    VdevRecord {
        id,
        guid: 0x1000 + id as u64,
        name: format!("vdev{id}"),
        endpoint: format!("http://127.0.0.1:{}", 7000 + id),
        spec: VdevSpec {
            capacity: 1 << 30,
            ashift: 12,
            children: 1,
            parity: 0,
            rotational: id % 2 == 1,
            role: if id == 9 {
                VdevRole::Log
            } else {
                VdevRole::Normal
            },
            metaslab_shift: Some(24),
        },
    }
}

/// A txg record chaining its digest from `prev`.
fn txg(n: u64, prev: u64, changes: Vec<SpaceChange>) -> TxgRecord {
    let mut r = TxgRecord {
        sync: TxgSync {
            txg: n,
            changes,
            ..Default::default()
        },
        ..Default::default()
    };
    r.state_digest = state_digest(prev, &r);
    r
}

/// Persist through the trait, panicking with the store's words.
async fn persist(s: &impl Store, r: &TxgRecord) {
    s.persist(r)
        .await
        .unwrap_or_else(|e| panic!("txg {}: {e}", r.sync.txg));
}

fn sorted(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
    v.sort();
    v
}

/// The everything-txg: two vdevs, allocations, an owner, a relocation, an
/// offline vdev; then a second txg freeing part of an extent.
fn history() -> (Vec<TxgRecord>, Vec<Extent>) {
    let mut t1 = txg(
        1,
        0,
        vec![
            alloc(ext(0, 0, 4 * MIB)),
            alloc(ext(0, 8 * MIB, MIB)),
            alloc(ext(1, 0, 2 * MIB)),
        ],
    );
    t1.vdevs = vec![vdev(0), vdev(1)];
    t1.owners = OwnerChanges {
        identities: vec![(1, "client/a".into())],
        windows: vec![OwnerWindow {
            vdev: 0,
            start: 0,
            end: 16 * MIB,
            runs: vec![(0, 4 * MIB, 1), (8 * MIB, 9 * MIB, 1)],
        }],
    };
    t1.state_digest = state_digest(0, &t1);
    // Relocate vdev 1's extent to vdev 0; free the middle of vdev 0's first.
    let mut t2 = txg(
        2,
        t1.state_digest,
        vec![
            alloc(ext(0, 12 * MIB, 2 * MIB)),
            free(ext(1, 0, 2 * MIB)),
            free(ext(0, MIB, MIB)),
        ],
    );
    t2.relocations = vec![RelocationRecord {
        allocation_id: 77,
        plan_id: 5,
        from: ext(1, 0, 2 * MIB),
        to: ext(0, 12 * MIB, 2 * MIB),
        txg: 2,
    }];
    t2.vdev_states = vec![(1, AdminState::Offline)];
    t2.state_digest = state_digest(t1.state_digest, &t2);
    let allocated = vec![
        ext(0, 0, MIB),
        ext(0, 2 * MIB, 2 * MIB),
        ext(0, 8 * MIB, MIB),
        ext(0, 12 * MIB, 2 * MIB),
    ];
    (vec![t1, t2], allocated)
}

mod suite {
    pub use super::mapping::*;
    use super::*;

    /// Before `create`: nothing to load, nothing written; `create` once.
    pub async fn a_fresh_store_is_empty_and_refuses_writes_before_create<B: Backend>(b: &mut B) {
        let s = b.open().await;
        assert_eq!(s.load().await.unwrap(), None);
        assert!(s.persist(&txg(1, 0, vec![])).await.is_err());
        assert!(s.set_tunable("x", "1").await.is_err());
        assert!(s.bind_agent("agent", 1).await.is_err());
        assert!(s.set_rewind_generation(1).await.is_err());
        assert!(s.allocated_overlapping(ext(0, 0, 1)).await.is_err());
        assert!(s.largest_extents(0, 1).await.is_err());
        assert_eq!(s.relocation(1).await.unwrap(), None);
        assert_eq!(s.relocation_totals().await.unwrap(), (0, 0));
        assert!(s.agent_bindings().await.unwrap().is_empty());
        assert_eq!(s.rewind_generation().await.unwrap(), 0);
        assert!(!s.fenced());
        s.create(0xfeed).await.unwrap();
        assert!(s.create(0xfeed).await.is_err(), "a pool is created once");
        let p = s.load().await.unwrap().unwrap();
        assert_eq!((p.pool_guid, p.synced_txg, p.state_digest), (0xfeed, 0, 0));
        assert!(p.vdevs.is_empty() && p.allocated.is_empty() && p.tunables.is_empty());
        b.close(s).await;
        let s = b.open().await;
        assert_eq!(s.load().await.unwrap().unwrap().pool_guid, 0xfeed);
        b.close(s).await;
    }

    /// Every kind of change a txg carries, loaded back after a restart,
    /// with the side tables (tunables, bindings, rewind, relocations).
    pub async fn everything_persisted_is_loaded_after_a_restart<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        s.open_generation().await.unwrap();
        let (txgs, allocated) = history();
        for t in &txgs {
            persist(&*s, t).await;
        }
        s.set_tunable("metaslab_aliquot", "1048576").await.unwrap();
        s.set_tunable("zfs_txg_timeout", "5").await.unwrap();
        s.set_tunable("metaslab_aliquot", "2097152").await.unwrap();
        s.bind_agent("agent-a", 0x1000).await.unwrap();
        s.bind_agent("agent-b", u64::MAX).await.unwrap();
        s.set_rewind_generation(3).await.unwrap();
        b.close(s).await;

        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.pool_guid, 7);
        assert_eq!(p.synced_txg, 2);
        assert_eq!(p.state_digest, txgs[1].state_digest);
        assert_eq!(p.vdevs, vec![vdev(0), vdev(1)]);
        assert_eq!(p.allocated.iter().collect::<Vec<_>>(), allocated);
        assert_eq!(p.vdev_states, BTreeMap::from([(1, AdminState::Offline)]));
        assert_eq!(p.owner_identities, vec![(1, "client/a".to_string())]);
        assert_eq!(
            p.owner_runs,
            vec![(0, 0, 4 * MIB, 1), (0, 8 * MIB, 9 * MIB, 1)]
        );
        assert_eq!(
            sorted(p.tunables.clone()),
            vec![
                ("metaslab_aliquot".to_string(), "2097152".to_string()),
                ("zfs_txg_timeout".to_string(), "5".to_string()),
            ]
        );
        assert_eq!(
            s.relocation(77).await.unwrap(),
            Some(txgs[1].relocations[0])
        );
        assert_eq!(s.relocation(78).await.unwrap(), None);
        assert_eq!(s.relocation_totals().await.unwrap(), (1, 2 * MIB));
        assert_eq!(
            s.agent_bindings().await.unwrap(),
            BTreeMap::from([("agent-a".into(), 0x1000), ("agent-b".into(), u64::MAX)])
        );
        assert_eq!(s.rewind_generation().await.unwrap(), 3);
        aliquot_allocator::recovery::verify(&p).expect("a consistent pool");
        // A vdev's endpoint changes and it comes back online.
        let mut t3 = txg(3, p.state_digest, vec![]);
        let mut moved = vdev(1);
        moved.endpoint = "http://127.0.0.1:9999".into();
        t3.vdevs = vec![moved.clone()];
        t3.vdev_states = vec![(1, AdminState::Online)];
        persist(&*s, &t3).await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.vdevs, vec![vdev(0), moved]);
        assert!(p.vdev_states.is_empty());
        b.close(s).await;
    }

    /// Txgs persist in order: the last one again is a retry whose commit
    /// landed (nothing changes), an older one is refused.
    pub async fn txgs_persist_in_order_and_a_retry_is_a_no_op<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let (txgs, _) = history();
        persist(&*s, &txgs[0]).await;
        persist(&*s, &txgs[1]).await;
        let before = s.load().await.unwrap().unwrap();
        persist(&*s, &txgs[1]).await;
        assert_eq!(
            s.load().await.unwrap().unwrap(),
            before,
            "a retry changes nothing"
        );
        let e = s.persist(&txgs[0]).await.unwrap_err().to_string();
        assert!(e.contains("out of order"), "{e}");
        assert_eq!(s.load().await.unwrap().unwrap(), before);
        // A gap is fine: txgs with nothing to write are not persisted.
        persist(
            &*s,
            &txg(9, before.state_digest, vec![alloc(ext(0, 20 * MIB, MIB))]),
        )
        .await;
        assert_eq!(s.load().await.unwrap().unwrap().synced_txg, 9);
        b.close(s).await;
    }

    /// A txg refused part-way (its last statement fails) leaves nothing of
    /// itself: not its vdev, extents, relocation, owners, nor its txg.
    pub async fn a_torn_txg_leaves_nothing<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let (txgs, _) = history();
        persist(&*s, &txgs[0]).await;
        let before = s.load().await.unwrap().unwrap();
        let changes = vec![alloc(ext(2, 0, MIB)), free(ext(0, 8 * MIB, MIB))];
        let mut torn = txg(2, before.state_digest, changes.clone());
        torn.vdevs = vec![vdev(2)];
        torn.relocations = vec![RelocationRecord {
            allocation_id: 9,
            plan_id: 1,
            from: ext(0, 8 * MIB, MIB),
            to: ext(2, 0, MIB),
            txg: 2,
        }];
        // Owner number 1 is taken: the last write of the txg fails.
        torn.owners.identities = vec![(1, "client/other".into())];
        assert!(s.persist(&torn).await.is_err(), "owner 1 recorded twice");
        // An allocation over a stored extent, and a free of space never
        // allocated: refused too, with nothing written.
        let over = txg(2, before.state_digest, vec![alloc(ext(0, MIB, MIB))]);
        assert!(s.persist(&over).await.is_err());
        let unallocated = txg(2, before.state_digest, vec![free(ext(0, 5 * MIB, MIB))]);
        assert!(s.persist(&unallocated).await.is_err());
        b.close(s).await;
        let s = b.open().await;
        assert_eq!(s.load().await.unwrap().unwrap(), before);
        assert_eq!(s.relocation(9).await.unwrap(), None);
        // The same txg number, whole this time, is not mistaken for a retry.
        let mut whole = txg(2, before.state_digest, changes);
        whole.vdevs = vec![vdev(2)];
        persist(&*s, &whole).await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.synced_txg, 2);
        assert_eq!(p.vdevs.len(), 3);
        b.close(s).await;
    }

    /// A txg the pool checked against its in-memory space maps
    /// (`TxgSync::checked`) is not checked against the chunks again, but
    /// the flush that applies it to them still refuses what does not fit:
    /// here every metaslab is flushed in its own txg, so the txg is refused
    /// whole. Checked and fitting, it persists (into the log) and loads.
    pub async fn a_pool_checked_txg_still_meets_the_flush<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let (txgs, allocated) = history();
        persist(&*s, &txgs[0]).await;
        let before = s.load().await.unwrap().unwrap();
        let flush_all = aliquot_allocator::spacemap_log::LogTunables {
            zfs_min_metaslabs_to_flush: u64::MAX,
            ..Default::default()
        };
        s.set_log_tunables(flush_all);
        let checked = |changes| {
            let mut r = txg(2, before.state_digest, changes);
            r.sync.checked = true;
            r.state_digest = state_digest(before.state_digest, &r);
            r
        };
        let over = checked(vec![alloc(ext(0, MIB, MIB))]);
        assert!(s.persist(&over).await.is_err(), "allocated over an extent");
        let unallocated = checked(vec![free(ext(0, 5 * MIB, MIB))]);
        assert!(s.persist(&unallocated).await.is_err(), "freed free space");
        b.close(s).await;
        let s = b.open().await;
        assert_eq!(s.load().await.unwrap().unwrap(), before);
        let mut t2 = txgs[1].clone();
        t2.sync.checked = true;
        persist(&*s, &t2).await;
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.synced_txg, 2);
        assert_eq!(p.allocated.iter().collect::<Vec<_>>(), allocated);
        b.close(s).await;
    }

    /// The lookups Claim, Free and the rebalancer make, against a model.
    pub async fn lookups_answer_from_the_durable_extents<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let mut t1 = txg(1, 0, vec![]);
        t1.vdevs = vec![vdev(0), vdev(1)];
        let mut model = Vec::new();
        // Enough extents for several space-map chunks on vdev 0.
        for k in 0..9000u64 {
            let e = ext(0, k * 8192, 4096 * (1 + k % 2));
            model.push(e);
            t1.sync.changes.push(alloc(e));
        }
        let big = ext(1, 64 * MIB, 8 * MIB);
        model.push(big);
        t1.sync.changes.push(alloc(big));
        t1.state_digest = state_digest(0, &t1);
        persist(&*s, &t1).await;
        // Free the middle of the big one: it splits.
        let t2 = txg(2, t1.state_digest, vec![free(ext(1, 66 * MIB, MIB))]);
        persist(&*s, &t2).await;
        model.retain(|e| *e != big);
        model.push(ext(1, 64 * MIB, 2 * MIB));
        model.push(ext(1, 67 * MIB, 5 * MIB));
        let overlapping = |p: Extent| -> Vec<Extent> {
            let mut v: Vec<Extent> = model
                .iter()
                .filter(|e| {
                    e.vdev == p.vdev && e.offset < p.offset + p.size && p.offset < e.offset + e.size
                })
                .copied()
                .collect();
            v.sort();
            v
        };
        let probes = vec![
            ext(0, 0, 1),
            ext(0, 4096, 4096),
            ext(0, 8192 * 4000 + 100, 8192 * 3),
            ext(0, 8192 * 9000, MIB),
            ext(1, 65 * MIB, 4 * MIB),
            ext(1, 66 * MIB, MIB),
            ext(3, 0, MIB),
        ];
        for &p in &probes {
            assert_eq!(
                s.allocated_overlapping(p).await.unwrap(),
                overlapping(p),
                "{p}"
            );
        }
        let want: Vec<Vec<Extent>> = probes.iter().map(|&p| overlapping(p)).collect();
        assert_eq!(s.allocated_overlapping_many(&probes).await.unwrap(), want);
        assert_eq!(
            s.largest_extents(1, 5).await.unwrap(),
            vec![ext(1, 67 * MIB, 5 * MIB), ext(1, 64 * MIB, 2 * MIB)]
        );
        let top = s.largest_extents(0, 3).await.unwrap();
        assert_eq!(
            top,
            vec![
                ext(0, 8192, 8192),
                ext(0, 3 * 8192, 8192),
                ext(0, 5 * 8192, 8192)
            ],
            "largest first, then by offset"
        );
        assert!(s.largest_extents(5, 3).await.unwrap().is_empty());
        b.close(s).await;
    }

    /// Each start opens a generation; the history says what each generation
    /// found synced when it opened, across restarts.
    pub async fn generations_and_their_history_survive_restarts<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let g1 = s.open_generation().await.unwrap();
        let (txgs, _) = history();
        for t in &txgs {
            persist(&*s, t).await;
        }
        b.close(s).await;
        let s = b.open().await;
        let g2 = s.open_generation().await.unwrap();
        assert!(g2 > g1, "{g2} after {g1}");
        let h = s.generation_history().await.unwrap();
        assert_eq!(h.get(&g1), Some(&0));
        assert_eq!(h.get(&g2), Some(&2), "{h:?}");
        assert_eq!(h.keys().max(), Some(&g2));
        b.close(s).await;
    }

    /// Owner windows: a txg rewrites exactly the windows it names.
    pub async fn owner_windows_are_replaced_whole<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let w = 16 * MIB;
        let mut t1 = txg(1, 0, vec![alloc(ext(0, 0, 4 * w))]);
        t1.vdevs = vec![vdev(0)];
        t1.owners = OwnerChanges {
            identities: vec![(1, "a".into()), (2, "b".into())],
            windows: vec![
                OwnerWindow {
                    vdev: 0,
                    start: 0,
                    end: w,
                    runs: vec![(0, MIB, 1), (MIB, 2 * MIB, 2)],
                },
                OwnerWindow {
                    vdev: 0,
                    start: 2 * w,
                    end: 3 * w,
                    runs: vec![(2 * w, 2 * w + MIB, 2)],
                },
                OwnerWindow {
                    vdev: 0,
                    start: 3 * w,
                    end: 4 * w,
                    runs: vec![(3 * w, 3 * w + MIB, 1), (3 * w + 2 * MIB, 4 * w, 2)],
                },
            ],
        };
        t1.state_digest = state_digest(0, &t1);
        persist(&*s, &t1).await;
        let mut t2 = txg(2, t1.state_digest, vec![]);
        t2.owners = OwnerChanges {
            identities: vec![(3, "c".into())],
            // The first window replaced, the last emptied, the one between
            // left as it is.
            windows: vec![
                OwnerWindow {
                    vdev: 0,
                    start: 0,
                    end: w,
                    runs: vec![(5 * MIB, 6 * MIB, 3)],
                },
                OwnerWindow {
                    vdev: 0,
                    start: 3 * w,
                    end: 4 * w,
                    runs: vec![],
                },
            ],
        };
        persist(&*s, &t2).await;
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(
            p.owner_identities,
            vec![(1, "a".into()), (2, "b".into()), (3, "c".into())]
        );
        assert_eq!(
            p.owner_runs,
            vec![(0, 5 * MIB, 6 * MIB, 3), (0, 2 * w, 2 * w + MIB, 2)]
        );
        b.close(s).await;
    }

    /// Bindings are keys both ways: a name binds one device, a device one
    /// name.
    pub async fn an_agent_binds_one_device_and_a_device_one_agent<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        s.bind_agent("a", 1).await.unwrap();
        assert!(s.bind_agent("a", 2).await.is_err(), "name bound");
        assert!(s.bind_agent("b", 1).await.is_err(), "device bound");
        s.bind_agent("b", 2).await.unwrap();
        assert_eq!(
            s.agent_bindings().await.unwrap(),
            BTreeMap::from([("a".into(), 1), ("b".into(), 2)])
        );
        b.close(s).await;
    }

    /// Txgs persisting while tunables and bindings are written from other
    /// tasks: every write lands, none is lost or torn.
    pub async fn concurrent_writers_all_land<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        let mut t1 = txg(1, 0, vec![]);
        t1.vdevs = vec![vdev(0)];
        persist(&*s, &t1).await;
        let syncer = {
            let s = s.clone();
            tokio::spawn(async move {
                let mut prev = t1.state_digest;
                for n in 2..=40u64 {
                    let t = txg(n, prev, vec![alloc(ext(0, n * MIB, MIB))]);
                    prev = t.state_digest;
                    persist(&*s, &t).await;
                }
            })
        };
        let mut others = Vec::new();
        for k in 0..16u64 {
            let s = s.clone();
            others.push(tokio::spawn(async move {
                s.set_tunable(&format!("t{k}"), &k.to_string())
                    .await
                    .unwrap();
                s.bind_agent(&format!("agent{k}"), 100 + k).await.unwrap();
            }));
        }
        syncer.await.unwrap();
        for o in others {
            o.await.unwrap();
        }
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.synced_txg, 40);
        assert_eq!(p.allocated.len(), 39);
        assert_eq!(p.tunables.len(), 16);
        assert_eq!(s.agent_bindings().await.unwrap().len(), 16);
        b.close(s).await;
    }
}

mod mapping {
    use super::*;

    /// Entries added in a move's txg are loaded after a restart, in
    /// `(vdev, offset)` order; a drop in a later txg removes exactly its
    /// entry; an entry added twice refuses the whole txg (nothing of it
    /// lands); a torn txg's entries are not there.
    pub async fn indirect_mappings_live_from_their_move_to_their_drop<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(9).await.unwrap();
        let m = |from: Extent, to: Extent, txg| Mapping { from, to, txg };
        let a = m(ext(1, 8 * MIB, MIB), ext(0, 0, MIB), 1);
        let c = m(ext(1, 0, 2 * MIB), ext(0, 4 * MIB, 2 * MIB), 1);
        let mut t1 = txg(
            1,
            0,
            vec![alloc(ext(0, 0, 8 * MIB)), alloc(ext(1, 0, 16 * MIB))],
        );
        t1.vdevs = vec![vdev(0), vdev(1)];
        t1.mappings = vec![MappingChange::Add(a), MappingChange::Add(c)];
        t1.state_digest = state_digest(0, &t1);
        persist(&*s, &t1).await;
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.mappings, vec![c, a], "in (vdev, offset) order");
        // Txg 2 adds one and drops one.
        let d = m(ext(1, 12 * MIB, MIB), ext(0, 6 * MIB, MIB), 2);
        let mut t2 = txg(2, t1.state_digest, vec![]);
        t2.mappings = vec![MappingChange::Drop(c.from), MappingChange::Add(d)];
        t2.state_digest = state_digest(t1.state_digest, &t2);
        persist(&*s, &t2).await;
        // Txg 3 maps `a`'s old extent again: refused, and its other change
        // (a drop of `d`) does not land either.
        let mut t3 = txg(3, t2.state_digest, vec![]);
        t3.mappings = vec![
            MappingChange::Drop(d.from),
            MappingChange::Add(m(a.from, ext(0, 7 * MIB, MIB), 3)),
        ];
        t3.state_digest = state_digest(t2.state_digest, &t3);
        assert!(s.persist(&t3).await.is_err(), "an entry mapped twice");
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.synced_txg, 2);
        assert_eq!(p.mappings, vec![a, d]);
        // Dropped and added again in one txg: the new target stands.
        let mut t3 = txg(3, t2.state_digest, vec![]);
        let a2 = m(a.from, ext(0, 7 * MIB, MIB), 3);
        t3.mappings = vec![MappingChange::Drop(a.from), MappingChange::Add(a2)];
        t3.state_digest = state_digest(t2.state_digest, &t3);
        persist(&*s, &t3).await;
        b.close(s).await;
        let s = b.open().await;
        let p = s.load().await.unwrap().unwrap();
        assert_eq!(p.mappings, vec![a2, d]);
        b.close(s).await;
    }

    /// A vdev removal's row: recorded (replaced when recorded again), kept
    /// across a restart, gone when ended.
    pub async fn a_removal_is_recorded_until_it_ends<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(7).await.unwrap();
        assert_eq!(s.evacuations().await.unwrap(), vec![]);
        let ev = |bytes| Evacuation {
            vdev: 2,
            bytes,
            extents: 3,
            started_ms: 1_700_000_000_000,
        };
        s.set_evacuation(2, Some(ev(MIB))).await.unwrap();
        s.set_evacuation(2, Some(ev(3 * MIB))).await.unwrap();
        b.close(s).await;
        let s = b.open().await;
        s.load().await.unwrap().unwrap();
        assert_eq!(s.evacuations().await.unwrap(), vec![ev(3 * MIB)]);
        s.set_evacuation(2, None).await.unwrap();
        b.close(s).await;
        let s = b.open().await;
        s.load().await.unwrap().unwrap();
        assert_eq!(s.evacuations().await.unwrap(), vec![]);
        b.close(s).await;
    }

    /// The txg that records a vdev removed deletes its removal's row (the
    /// removal is over with it), and only that vdev's.
    pub async fn a_removal_ends_in_the_txg_that_removes_its_vdev<B: Backend>(b: &mut B) {
        let s = b.open().await;
        s.create(8).await.unwrap();
        let mut t1 = txg(1, 0, vec![]);
        t1.vdevs = vec![vdev(0), vdev(1), vdev(2)];
        t1.state_digest = state_digest(0, &t1);
        persist(&*s, &t1).await;
        let ev = |vdev| Evacuation {
            vdev,
            bytes: MIB,
            extents: 1,
            started_ms: 1_700_000_000_000,
        };
        s.set_evacuation(1, Some(ev(1))).await.unwrap();
        s.set_evacuation(2, Some(ev(2))).await.unwrap();
        let mut t2 = txg(2, t1.state_digest, vec![]);
        t2.vdev_states = vec![(1, AdminState::Offline), (2, AdminState::Removed)];
        t2.state_digest = state_digest(t1.state_digest, &t2);
        persist(&*s, &t2).await;
        b.close(s).await;
        let s = b.open().await;
        s.load().await.unwrap().unwrap();
        assert_eq!(s.evacuations().await.unwrap(), vec![ev(1)]);
        b.close(s).await;
    }

    /// A block's copies are linked by the txg that commits them; a link
    /// follows its copy's relocation (one that frees its source and one
    /// that keeps its address alike), goes with its copy's free, survives
    /// a restart, and a refused txg links nothing.
    pub async fn copies_are_linked_until_freed_and_follow_their_moves<B: Backend>(b: &mut B) {
        use aliquot_allocator::block_copies::CopyLink;
        let s = b.open().await;
        s.create(6).await.unwrap();
        let (a0, a1) = (ext(0, 0, MIB), ext(1, 0, MIB));
        let (b0, b1, b2) = (ext(0, MIB, MIB), ext(1, MIB, MIB), ext(2, 0, MIB));
        let single = ext(2, 4 * MIB, MIB);
        let mut t1 = txg(
            1,
            0,
            [a0, a1, b0, b1, b2, single]
                .into_iter()
                .map(alloc)
                .collect(),
        );
        t1.vdevs = vec![vdev(0), vdev(1), vdev(2)];
        t1.copies = vec![
            CopyLink {
                block: (1 << 40) | 7,
                extents: vec![a0, a1],
            },
            CopyLink {
                block: (1 << 40) | 8,
                extents: vec![b2, b0, b1],
            },
        ];
        t1.state_digest = state_digest(0, &t1);
        persist(&*s, &t1).await;
        let of = |e: Extent| (e.vdev, e.offset);
        assert_eq!(s.copies_of(of(a0)).await.unwrap(), vec![of(a1)]);
        assert_eq!(s.copies_of(of(b1)).await.unwrap(), vec![of(b0), of(b2)]);
        assert_eq!(s.copies_of(of(single)).await.unwrap(), vec![]);
        assert_eq!(s.copies_of((0, 12 * MIB)).await.unwrap(), vec![]);
        // The sets of the copies asked for, by start: a start of no link
        // (or of no extent) adds none.
        assert_eq!(
            s.copies_on(1, &[MIB, 7 * MIB, 0, MIB]).await.unwrap(),
            vec![vec![of(a0), of(a1)], vec![of(b0), of(b1), of(b2)]]
        );
        assert_eq!(
            s.copies_on(1, &[MIB]).await.unwrap(),
            vec![vec![of(b0), of(b1), of(b2)]]
        );
        assert_eq!(s.copies_on(1, &[]).await.unwrap(), Vec::<Vec<_>>::new());
        assert_eq!(
            s.copies_on(2, &[single.offset, b2.offset]).await.unwrap(),
            vec![vec![of(b0), of(b1), of(b2)]]
        );
        b.close(s).await;
        let s = b.open().await;
        s.load().await.unwrap().unwrap();
        assert_eq!(s.copies_of(of(a1)).await.unwrap(), vec![of(a0)]);
        // Txg 2: a1 relocated to vdev 2 (freed), b0 moved to vdev 1
        // keeping its address (b0 stays allocated behind an entry).
        let (a1n, b0n) = (ext(2, 8 * MIB, MIB), ext(1, 8 * MIB, MIB));
        let mut t2 = txg(2, t1.state_digest, vec![alloc(a1n), free(a1), alloc(b0n)]);
        let reloc = |id, from, to| RelocationRecord {
            allocation_id: id,
            plan_id: 0,
            from,
            to,
            txg: 2,
        };
        t2.relocations = vec![
            reloc((1 << 40) | 20, a1, a1n),
            reloc((1 << 40) | 21, b0, b0n),
        ];
        t2.mappings = vec![MappingChange::Add(Mapping {
            from: b0,
            to: b0n,
            txg: 2,
        })];
        t2.state_digest = state_digest(t1.state_digest, &t2);
        persist(&*s, &t2).await;
        assert_eq!(s.copies_of(of(a0)).await.unwrap(), vec![of(a1n)]);
        assert_eq!(s.copies_of(of(a1)).await.unwrap(), vec![]);
        assert_eq!(s.copies_of(of(b2)).await.unwrap(), vec![of(b1), of(b0n)]);
        assert_eq!(s.copies_of(of(b0)).await.unwrap(), vec![]);
        assert_eq!(
            s.copies_on(2, &[a1n.offset, b2.offset]).await.unwrap(),
            vec![vec![of(b1), of(b0n), of(b2)], vec![of(a0), of(a1n)]]
        );
        // Txg 3 links a block over a freed range and frees twice what is
        // allocated: refused whole, nothing of it linked.
        let mut t3 = txg(3, t2.state_digest, vec![free(ext(0, 32 * MIB, MIB))]);
        t3.copies = vec![CopyLink {
            block: (1 << 40) | 30,
            extents: vec![single, ext(0, 32 * MIB, MIB)],
        }];
        t3.state_digest = state_digest(t2.state_digest, &t3);
        assert!(s.persist(&t3).await.is_err(), "a free of free space");
        assert_eq!(s.copies_of(of(single)).await.unwrap(), vec![]);
        // Txg 3: a0 and b2 freed.
        let mut t3 = txg(3, t2.state_digest, vec![free(a0), free(b2)]);
        t3.state_digest = state_digest(t2.state_digest, &t3);
        persist(&*s, &t3).await;
        assert_eq!(s.copies_of(of(a1n)).await.unwrap(), vec![]);
        assert_eq!(s.copies_of(of(b1)).await.unwrap(), vec![of(b0n)]);
        b.close(s).await;
        let s = b.open().await;
        s.load().await.unwrap().unwrap();
        assert_eq!(s.copies_of(of(b0n)).await.unwrap(), vec![of(b1)]);
        assert_eq!(s.copies_of(of(a0)).await.unwrap(), vec![]);
        b.close(s).await;
    }
}
/// Instantiates every test of [`suite`] for one store.
macro_rules! store_test_suite {
    ($store:ident, $backend:expr) => {
        mod $store {
            use super::*;
            store_test_suite!(@tests $backend;
                a_fresh_store_is_empty_and_refuses_writes_before_create,
                everything_persisted_is_loaded_after_a_restart,
                txgs_persist_in_order_and_a_retry_is_a_no_op,
                a_torn_txg_leaves_nothing,
                a_pool_checked_txg_still_meets_the_flush,
                lookups_answer_from_the_durable_extents,
                generations_and_their_history_survive_restarts,
                owner_windows_are_replaced_whole,
                an_agent_binds_one_device_and_a_device_one_agent,
                concurrent_writers_all_land,
                indirect_mappings_live_from_their_move_to_their_drop,
                a_removal_is_recorded_until_it_ends,
                a_removal_ends_in_the_txg_that_removes_its_vdev,
                copies_are_linked_until_freed_and_follow_their_moves,
            );
        }
    };
    (@tests $backend:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let mut b = $backend;
                suite::$test(&mut b).await;
            }
        )*
    };
}

store_test_suite!(mem, Mem::new());
store_test_suite!(sqlite, Sqlite::new());
store_test_suite!(postgres, Pg::new());

/// PostgreSQL's own fence: a leader replaced while paused persists
/// nothing, says it is fenced, and the new leader loads none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_deposed_leader_persists_nothing() {
    let mut b = Pg::new();
    let old = b.open().await;
    old.create(7).await.unwrap();
    let (txgs, _) = history();
    persist(&*old, &txgs[0]).await;
    // The new leader takes over without the old one stepping down (its
    // lease is given up on its behalf, as expiry would).
    let url = b.server.url();
    let new = PgStore::open(&url, POOL, None, "allocator-new")
        .await
        .unwrap();
    {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query("UPDATE leaders SET lease_until = '-infinity' WHERE pool = $1")
            .bind(POOL)
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
    }
    let g = new
        .try_acquire(Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the lease expired");
    assert!(g > old.generation());
    assert!(!old.fenced());
    let e = old.persist(&txgs[1]).await.unwrap_err().to_string();
    assert!(e.contains("no longer leads"), "{e}");
    assert!(old.fenced(), "the fence is remembered");
    let p = new.load().await.unwrap().unwrap();
    assert_eq!(p.synced_txg, 1, "the deposed leader's txg is not there");
    assert_eq!(new.relocation(77).await.unwrap(), None);
    persist(&new, &txgs[1]).await;
    assert!(!new.fenced());
    old.close().await;
    new.close().await;
}

/// A leader that steps down cleanly says so to the next leader only; a
/// leader that stops otherwise (here: steps down with a txg it could not
/// sync) leaves nothing that says "clean".
#[tokio::test]
async fn postgres_a_clean_handover_is_said_to_the_next_leader_only() {
    let mut b = Pg::new();
    let first = b.open().await;
    first.create(7).await.unwrap();
    assert!(!first.handed_over_cleanly(), "nobody led before");
    first.release(true).await.unwrap();
    let url = b.server.url();
    let take = |me: &'static str| {
        let url = url.clone();
        async move {
            let s = PgStore::open(&url, POOL, None, me).await.unwrap();
            s.try_acquire(Duration::from_secs(60))
                .await
                .unwrap()
                .expect("the leadership was given up");
            s
        }
    };
    let second = take("allocator-second").await;
    assert!(
        second.handed_over_cleanly(),
        "the first stepped down cleanly"
    );
    second.release(false).await.unwrap();
    let third = take("allocator-third").await;
    assert!(
        !third.handed_over_cleanly(),
        "the second did not hand over cleanly"
    );
    first.close().await;
    second.close().await;
    third.close().await;
}

/// SQLite's clean-shutdown mark, the same `leaders` row mark as a
/// PostgreSQL handover: a shutdown marked clean is said to the next start
/// only; a start that ends otherwise (a crash: no mark) leaves nothing
/// that says "clean", and a mark of an older generation is ignored.
#[tokio::test]
async fn sqlite_a_clean_shutdown_is_said_to_the_next_start_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(sqlite_store::DB_FILE);
    let open = || async {
        let s = SqliteStore::open(&path, POOL, None).await.unwrap();
        let g = s.open_generation().await.unwrap();
        (s, g)
    };
    let s = SqliteStore::open(&path, POOL, None).await.unwrap();
    s.create(7).await.unwrap();
    let g1 = s.open_generation().await.unwrap();
    assert!(!s.handed_over_cleanly(), "nobody ran before");
    s.hand_over_cleanly(g1).await.unwrap();
    s.close().await;
    let (s, g2) = open().await;
    assert!(s.handed_over_cleanly(), "the first shut down cleanly");
    // Crashes (closes without the mark).
    s.close().await;
    let (s, g3) = open().await;
    assert!(
        !s.handed_over_cleanly(),
        "the second did not shut down cleanly"
    );
    // A mark for a generation that is not the row's changes nothing.
    s.hand_over_cleanly(g2).await.unwrap();
    s.close().await;
    let (s, _) = open().await;
    assert!(
        !s.handed_over_cleanly(),
        "generation {g2}'s mark under {g3}"
    );
    s.close().await;
}

/// A SQLite pool moved into PostgreSQL (`export`, then `import`: what
/// `aliquot-allocator migrate-store` runs): the next leader there loads the
/// same pool and answers every question the SQLite store answered the same,
/// opening the generation after the source's, told of its clean shutdown. A
/// second import into the same pool is refused; an import that fails part
/// way (a binding the schema refuses, after every extent was written)
/// leaves no pool behind.
#[tokio::test]
async fn a_sqlite_pool_moves_into_postgres_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(sqlite_store::DB_FILE);
    let src = SqliteStore::open(&path, POOL, None).await.unwrap();
    src.create(0xfeed).await.unwrap();
    let g = src.open_generation().await.unwrap();
    let (records, _) = history();
    for r in &records {
        persist(&src, r).await;
    }
    // A block of two copies: its link moves with the pool.
    let (c0, c1) = (ext(0, 30 * MIB, MIB), ext(1, 30 * MIB, MIB));
    let mut linked = txg(3, records[1].state_digest, vec![alloc(c0), alloc(c1)]);
    linked.copies = vec![aliquot_allocator::block_copies::CopyLink {
        block: 5,
        extents: vec![c0, c1],
    }];
    linked.state_digest = state_digest(records[1].state_digest, &linked);
    persist(&src, &linked).await;
    src.set_tunable("zfs_txg_timeout", "3s").await.unwrap();
    src.bind_agent("agent/a", 0xabc).await.unwrap();
    let ev = Evacuation {
        vdev: 1,
        bytes: 2 * MIB,
        extents: 1,
        started_ms: 1234,
    };
    src.set_evacuation(1, Some(ev)).await.unwrap();
    src.hand_over_cleanly(g).await.unwrap();
    let img = src.export().await.unwrap().expect("a pool");
    let want = src.load().await.unwrap().expect("a pool");
    let history_before = src.generation_history().await.unwrap();
    src.close().await;
    assert_eq!(img.generation, g);

    let pg = local_postgres::Postgres::start();
    let url = pg.url();
    let dst = PgStore::open(&url, POOL, None, "migrate-store")
        .await
        .unwrap();
    let mut steps = Vec::new();
    dst.import(&img, &mut |s: String| steps.push(s))
        .await
        .unwrap();
    assert!(!steps.is_empty(), "no progress said");
    let again = dst
        .import(&img, &mut |_: String| {})
        .await
        .expect_err("a second import into the pool");
    assert!(again.0.contains("already holds a pool"), "{again}");
    dst.close().await;

    let mut pgb = Pg {
        server: pg,
        opened: 0,
    };
    let s = pgb.leader().await;
    assert!(s.handed_over_cleanly(), "the source shut down cleanly");
    assert_eq!(s.open_generation().await.unwrap(), g + 1);
    assert_eq!(s.load().await.unwrap().expect("the pool"), want);
    let mut history_after = s.generation_history().await.unwrap();
    history_after.remove(&(g + 1));
    assert_eq!(history_after, history_before);
    assert_eq!(
        s.agent_bindings().await.unwrap(),
        BTreeMap::from([("agent/a".to_string(), 0xabc)])
    );
    assert_eq!(s.evacuations().await.unwrap(), vec![ev]);
    assert_eq!(
        s.relocation(77).await.unwrap(),
        Some(records[1].relocations[0])
    );
    assert_eq!(s.relocation_totals().await.unwrap(), (1, 2 * MIB));
    assert_eq!(
        s.copies_of((0, 30 * MIB)).await.unwrap(),
        vec![(1, 30 * MIB)]
    );
    // The pool goes on from the source's synced txg.
    let t4 = txg(4, want.state_digest, vec![alloc(ext(0, 20 * MIB, MIB))]);
    persist(&s, &t4).await;
    s.release(true).await.unwrap();
    s.close().await;

    // Two bindings of one device: refused by the schema after the extents
    // are written; nothing of the pool stays.
    let mut bad = img.clone();
    bad.bindings.insert("agent/b".into(), 0xabc);
    let other = PgStore::open(&url, "other", None, "migrate-store")
        .await
        .unwrap();
    other
        .import(&bad, &mut |_: String| {})
        .await
        .expect_err("a binding the schema refuses");
    assert_eq!(
        aliquot_allocator::pg_store::read_only(&url, "other")
            .await
            .unwrap(),
        None,
        "a failed import left a pool"
    );
    other.import(&img, &mut |_: String| {}).await.unwrap();
    other.close().await;
    let moved = aliquot_allocator::pg_store::read_only(&url, "other")
        .await
        .unwrap()
        .expect("the pool");
    assert_eq!(moved, want);
}

/// `migrate-store` refuses a source that does not verify (a vdev's row
/// says less capacity than its extents need): nothing is written to the
/// destination and the SQLite file stays where it was.
#[tokio::test]
async fn migrate_store_refuses_an_inconsistent_source() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(sqlite_store::DB_FILE);
    let src = SqliteStore::open(&path, POOL, None).await.unwrap();
    src.create(0xfeed).await.unwrap();
    src.open_generation().await.unwrap();
    for r in &history().0 {
        persist(&src, r).await;
    }
    src.close().await;
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    sqlx::query("UPDATE vdevs SET capacity = 4096 WHERE id = 0")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    let pg = local_postgres::Postgres::start();
    let args = aliquot_process::migrate_args::MigrateArgs {
        from: dir.path().display().to_string(),
        to: pg.url(),
    };
    let e = aliquot_allocator::migrate_cmd::run(args)
        .await
        .expect_err("an inconsistent source");
    assert!(
        e.to_string().to_lowercase().contains("inconsistent"),
        "{e:#}"
    );
    assert!(path.exists(), "the refused source was renamed");
    assert!(
        !matches!(
            aliquot_allocator::pg_store::read_only(&pg.url(), POOL).await,
            Ok(Some(_))
        ),
        "a refused move wrote the pool"
    );
}
