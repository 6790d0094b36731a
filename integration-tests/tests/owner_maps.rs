//! Owner maps: the owners of committed extents are kept
//! as varint rows per vdev and 16 MiB window (`owner_map.rs`), in SQLite and
//! in PostgreSQL alike. Random commits, frees and moves by three clients over
//! many windows are persisted txg by txg into both stores and the in-memory
//! one; each loads back exactly the runs the allocator held. A store written
//! by an older binary (one row per run) is converted when opened; a damaged
//! row refuses the store, naming it.

use aliquot_allocator::SqliteStore;
use aliquot_allocator::extent_owners::ExtentOwners;
use aliquot_allocator::owner_map::WINDOW;
use aliquot_allocator::pg_store::PgStore;
use aliquot_allocator::store::{MemStore, Store, TxgRecord};
use integration_tests::postgres::Postgres;
use metaslab::{Extent, TxgSync};

const POOL: &str = "owners";
const KIB: u64 = 1024;

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

async fn persist_all(stores: &[&dyn Store], txg: u64, owners: &mut ExtentOwners) {
    let rec = TxgRecord {
        sync: TxgSync {
            txg,
            ..Default::default()
        },
        owners: owners.take_changes(),
        state_digest: txg,
        ..Default::default()
    };
    for s in stores {
        s.persist(&rec).await.expect("persist");
    }
}

async fn loaded_runs(s: &dyn Store) -> Vec<(u32, u64, u64, u32)> {
    s.load().await.expect("load").expect("a pool").owner_runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_maps_hold_every_run_in_sqlite_and_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start();
    let sqlite = SqliteStore::open(&dir.path().join("pool.db"), POOL, None)
        .await
        .unwrap();
    let postgres = PgStore::open(&pg.url(), POOL, None, "test").await.unwrap();
    postgres
        .try_acquire(std::time::Duration::from_secs(60))
        .await
        .unwrap()
        .expect("leader");
    let mem = MemStore::new();
    let stores: [&dyn Store; 3] = [&sqlite, &postgres, &mem];
    for s in stores {
        s.create(0x0a11_c0de).await.unwrap();
    }

    let mut owners = ExtentOwners::default();
    let names = ["client/alice", "client/bob", "client/carol"];
    // Blocks of 4 KiB to 1 MiB, one per slot, 64 slots of ~2.5 MiB on each
    // of two vdevs (10 windows each): (vdev, slot) -> (size, owner).
    let slot = 2 * WINDOW / 13;
    let mut held: std::collections::BTreeMap<(u32, u64), (u64, usize)> = Default::default();
    let mut rng = Rng(0x005e_ed0f_0a11_c0de);
    for txg in 1..=60u64 {
        for _ in 0..80 {
            let vdev = rng.next(2) as u32;
            let k = rng.next(64);
            let at = |k: u64| Extent {
                vdev,
                offset: k * slot,
                size: 0,
            };
            match held.get(&(vdev, k)).copied() {
                Some((size, _)) if rng.next(4) == 0 => {
                    owners.freed(&[Extent { size, ..at(k) }]);
                    held.remove(&(vdev, k));
                }
                Some((size, who)) if rng.next(4) == 0 => {
                    // A move to a free slot of the other vdev keeps the owner.
                    let to_vdev = 1 - vdev;
                    let to = rng.next(64);
                    if held.contains_key(&(to_vdev, to)) {
                        continue;
                    }
                    owners.moved(
                        &Extent { size, ..at(k) },
                        &[Extent {
                            vdev: to_vdev,
                            offset: to * slot,
                            size,
                        }],
                    );
                    held.remove(&(vdev, k));
                    held.insert((to_vdev, to), (size, who));
                }
                Some(_) => {}
                None => {
                    let size = (4 * KIB) << rng.next(9);
                    // Mostly one client's stream, sometimes interleaved.
                    let who = if rng.next(3) == 0 {
                        rng.next(3) as usize
                    } else {
                        (txg % 3) as usize
                    };
                    owners.committed(names[who], &[Extent { size, ..at(k) }]);
                    held.insert((vdev, k), (size, who));
                }
            }
        }
        persist_all(&stores, txg, &mut owners).await;
        if txg % 20 == 0 {
            let want = owners.all_runs();
            assert!(!want.is_empty());
            for s in stores {
                assert_eq!(loaded_runs(s).await, want, "txg {txg}");
            }
        }
    }
    // Restored from each store, the same owner for every held block.
    for s in stores {
        let p = s.load().await.unwrap().unwrap();
        let r = ExtentOwners::restore(p.owner_identities, p.owner_runs);
        for (&(vdev, k), &(size, who)) in &held {
            let e = Extent {
                vdev,
                offset: k * slot,
                size,
            };
            assert_eq!(
                r.foreign(names[who], &[e]),
                None,
                "{e:?} is {}'s",
                names[who]
            );
            let other = names[(who + 1) % 3];
            assert_eq!(
                r.foreign(other, &[e]).map(|x| x.1).as_deref(),
                Some(names[who])
            );
        }
    }
    // Rows are few and small: at most one per vdev and window.
    let rows: Vec<(i64, i64, i64)> = {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect(&format!(
            "sqlite://{}?mode=ro",
            dir.path().join("pool.db").display()
        ))
        .await
        .unwrap();
        sqlx::query_as("SELECT vdev, start, length(data) FROM owner_maps ORDER BY vdev, start")
            .fetch_all(&mut c)
            .await
            .unwrap()
    };
    assert!(rows.len() <= 2 * 10, "{} rows", rows.len());
    assert!(rows.iter().all(|r| (r.1 as u64).is_multiple_of(WINDOW)));
    let bytes: i64 = rows.iter().map(|r| r.2).sum();
    assert!(
        (bytes as usize) < 8 * owners.runs() + rows.len(),
        "{bytes} bytes for {} runs",
        owners.runs()
    );
    sqlite.close().await;
    postgres.close().await;
}

/// An older binary's store (one row per run in `owner_runs`) is converted
/// into owner maps when opened, in SQLite and in PostgreSQL; a damaged
/// owner-map row refuses the SQLite store, naming the vdev and the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_older_binary_are_converted_and_damage_is_refused() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.db");
    let pg = Postgres::start();
    let old_runs: Vec<(u32, u64, u64, u32)> = (0..3000u64)
        .map(|k| (0, k * 8 * KIB, k * 8 * KIB + 4 * KIB, 1 + (k % 2) as u32))
        .chain([(1, 5 * WINDOW + 512, 9 * WINDOW, 2)])
        .collect();
    {
        let s = SqliteStore::open(&path, POOL, None).await.unwrap();
        s.create(7).await.unwrap();
        s.close().await;
        let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
            .await
            .unwrap();
        for (i, n) in [(1, "client/a"), (2, "client/b")] {
            sqlx::query("INSERT INTO owners (pool, idx, identity) VALUES (1, ?, ?)")
                .bind(i)
                .bind(n)
                .execute(&mut c)
                .await
                .unwrap();
        }
        for &(v, s, e, o) in &old_runs {
            sqlx::query(
                "INSERT INTO owner_runs (pool, vdev, start, stop, owner) VALUES (1, ?, ?, ?, ?)",
            )
            .bind(v as i64)
            .bind(s as i64)
            .bind(e as i64)
            .bind(o as i64)
            .execute(&mut c)
            .await
            .unwrap();
        }
        c.close().await.unwrap();
    }
    let s = SqliteStore::open(&path, POOL, None).await.unwrap();
    let p = s.load().await.unwrap().unwrap();
    assert_eq!(p.owner_runs, old_runs);
    assert_eq!(p.owner_identities.len(), 2);
    s.close().await;
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let (left, maps): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM owner_runs), (SELECT count(*) FROM owner_maps)",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(left, 0, "the old rows are gone");
    // 3000 blocks 8 KiB apart: two windows of vdev 0; one run on vdev 1.
    assert_eq!(maps, 3);

    // Damage one row: the store is refused, naming it.
    sqlx::query("UPDATE owner_maps SET data = x'09' || x'80' WHERE vdev = 1")
        .execute(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    let s = SqliteStore::open(&path, POOL, None).await.unwrap();
    let e = s
        .load()
        .await
        .expect_err("a damaged owner map is refused")
        .to_string();
    assert!(
        e.contains("inconsistent")
            && e.contains("vdev 1")
            && e.contains(&format!("{}", 5 * WINDOW)),
        "{e}"
    );

    // PostgreSQL: the same conversion.
    {
        let s = PgStore::open(&pg.url(), POOL, None, "test").await.unwrap();
        s.try_acquire(std::time::Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        s.create(7).await.unwrap();
        s.close().await;
    }
    let mut c = sqlx::PgConnection::connect(&pg.url()).await.unwrap();
    let pool: i64 = sqlx::query_scalar("SELECT id FROM pools WHERE name = $1")
        .bind(POOL)
        .fetch_one(&mut c)
        .await
        .unwrap();
    for (i, n) in [(1i64, "client/a"), (2, "client/b")] {
        sqlx::query("INSERT INTO owners (pool, idx, identity) VALUES ($1, $2, $3)")
            .bind(pool)
            .bind(i)
            .bind(n)
            .execute(&mut c)
            .await
            .unwrap();
    }
    for &(v, s, e, o) in &old_runs {
        sqlx::query(
            "INSERT INTO owner_runs (pool, vdev, start, stop, owner) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(pool)
        .bind(v as i64)
        .bind(s as i64)
        .bind(e as i64)
        .bind(o as i64)
        .execute(&mut c)
        .await
        .unwrap();
    }
    let s = PgStore::open(&pg.url(), POOL, None, "test").await.unwrap();
    let p = s.load().await.unwrap().unwrap();
    assert_eq!(p.owner_runs, old_runs);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM owner_runs")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(left, 0);
    s.close().await;
}
