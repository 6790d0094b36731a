//! One schema design: SQLite and PostgreSQL, each migrated to the newest
//! schema, hold the same tables, columns and keys (the few differences are
//! listed here, with why). A store made at the migration before the
//! SQLite schema took PostgreSQL's shape is read (as `aliquotctl verify`
//! does, leaving it untouched) and opened (migrated), with everything it
//! held.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use aliquot_allocator::spacemap::Chunk;
use aliquot_allocator::store::{AdminState, RelocationRecord};
use aliquot_allocator::{PgStore, SqliteStore, Store, sqlite_store};
use metaslab::Extent;
use sqlx::{Connection, Row};

/// Tables one database has and the other has not, and why.
const ONLY_SQLITE: &[&str] = &[
    // Rows of files from before space maps, moved into `spacemaps` at open.
    "extents",
];
const ONLY_POSTGRES: &[&str] = &[
    // Standbys polling the leadership (several allocators per database).
    "standbys",
];

/// A table's shape: columns, primary key (in order), unique keys, and
/// foreign keys `(columns, table, columns)`.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shape {
    columns: BTreeSet<String>,
    primary_key: Vec<String>,
    unique: BTreeSet<Vec<String>>,
    foreign: BTreeSet<(Vec<String>, String, Vec<String>)>,
}

async fn sqlite_shapes(path: &Path) -> BTreeMap<String, Shape> {
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", path.display()))
        .await
        .unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'
            AND name <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    let mut out = BTreeMap::new();
    for t in tables {
        let mut s = Shape::default();
        let mut pk = Vec::new();
        for r in sqlx::query("SELECT name, pk FROM pragma_table_info(?)")
            .bind(&t)
            .fetch_all(&mut c)
            .await
            .unwrap()
        {
            let name: String = r.get("name");
            let k: i64 = r.get("pk");
            if k > 0 {
                pk.push((k, name.clone()));
            }
            s.columns.insert(name);
        }
        pk.sort();
        s.primary_key = pk.into_iter().map(|p| p.1).collect();
        for r in sqlx::query("SELECT name, origin FROM pragma_index_list(?)")
            .bind(&t)
            .fetch_all(&mut c)
            .await
            .unwrap()
        {
            let origin: String = r.get("origin");
            if origin != "u" {
                continue;
            }
            let idx: String = r.get("name");
            let cols = sqlx::query("SELECT name FROM pragma_index_info(?) ORDER BY seqno")
                .bind(&idx)
                .fetch_all(&mut c)
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<String, _>("name"))
                .collect();
            s.unique.insert(cols);
        }
        let mut fks: BTreeMap<i64, (Vec<String>, String, Vec<String>)> = BTreeMap::new();
        for r in sqlx::query(
            "SELECT id, \"from\", \"table\", \"to\" FROM pragma_foreign_key_list(?) ORDER BY id, seq",
        )
        .bind(&t)
            .fetch_all(&mut c)
            .await
            .unwrap()
        {
            let f = fks.entry(r.get("id")).or_default();
            f.0.push(r.get("from"));
            f.1 = r.get("table");
            f.2.push(r.get("to"));
        }
        s.foreign = fks.into_values().collect();
        out.insert(t, s);
    }
    c.close().await.unwrap();
    out
}

async fn postgres_shapes(url: &str) -> BTreeMap<String, Shape> {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let mut out: BTreeMap<String, Shape> = BTreeMap::new();
    for r in sqlx::query(
        "SELECT table_name::text, column_name::text FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap()
    {
        out.entry(r.get(0)).or_default().columns.insert(r.get(1));
    }
    // Every key, its columns in order.
    for r in sqlx::query(
        "SELECT c.contype::text, c.conrelid::regclass::text, c.confrelid::regclass::text,
            ARRAY(SELECT a.attname::text FROM unnest(c.conkey) WITH ORDINALITY k(n, o)
                  JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.o),
            ARRAY(SELECT a.attname::text FROM unnest(c.confkey) WITH ORDINALITY k(n, o)
                  JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.o)
         FROM pg_constraint c JOIN pg_namespace ns ON ns.oid = c.connamespace
         WHERE ns.nspname = current_schema() AND c.contype IN ('p', 'u', 'f')",
    )
    .fetch_all(&mut c)
    .await
    .unwrap()
    {
        let (kind, table): (String, String) = (r.get(0), r.get(1));
        if table == "_sqlx_migrations" {
            continue;
        }
        let s = out.entry(table).or_default();
        let cols: Vec<String> = r.get(3);
        match kind.as_str() {
            "p" => s.primary_key = cols,
            "u" => {
                s.unique.insert(cols);
            }
            _ => {
                s.foreign.insert((cols, r.get(2), r.get(4)));
            }
        }
    }
    c.close().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_and_postgres_have_the_same_tables_columns_and_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(sqlite_store::DB_FILE);
    SqliteStore::open(&path, "p", None)
        .await
        .unwrap()
        .close()
        .await;
    let pg = local_postgres::Postgres::start();
    PgStore::open(&pg.url(), "p", None, "test")
        .await
        .unwrap()
        .close()
        .await;
    let mut lite = sqlite_shapes(&path).await;
    let mut post = postgres_shapes(&pg.url()).await;
    for t in ONLY_SQLITE {
        assert!(
            lite.remove(*t).is_some(),
            "{t} is gone from SQLite: update the list"
        );
        assert!(!post.contains_key(*t));
    }
    for t in ONLY_POSTGRES {
        assert!(
            post.remove(*t).is_some(),
            "{t} is gone from PostgreSQL: update the list"
        );
        assert!(!lite.contains_key(*t));
    }
    assert_eq!(
        lite.keys().collect::<Vec<_>>(),
        post.keys().collect::<Vec<_>>(),
        "tables"
    );
    for (t, s) in &lite {
        assert_eq!(s, &post[t], "table {t}: SQLite, then PostgreSQL");
    }
    assert!(lite["spacemaps"].primary_key == ["pool", "vdev", "start"]);
}

const OLD: i64 = sqlite_store::ONE_SCHEMA - 1;
const KIB: u64 = 1024;

/// A file exactly as the binary of the migration before [`ONE_SCHEMA`]
/// wrote it: pool row, two generations, two vdevs (one offline), extents
/// as a chunk and as one legacy row, tunables, a binding, a relocation,
/// owners as a map row and as one legacy run.
async fn old_file(path: &Path) {
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let db = sqlx::SqlitePool::connect_with(opts).await.unwrap();
    sqlite_store::MIGRATOR.run_to(OLD, &db).await.unwrap();
    let chunk = Chunk::encode(0, &[(0, 64 * KIB), (128 * KIB, 64 * KIB)]);
    let maps = aliquot_allocator::owner_map::rows(&[(0, 64 * KIB, 1)]);
    let q = |s: &'static str| sqlx::query(s);
    for stmt in [
        q(
            "INSERT INTO pool (id, guid, name, synced_txg, created_ms, generation,
            rewind_generation, state_digest) VALUES (1, -2, 'old', 12, 1, 2, 1, 4242)",
        ),
        q("INSERT INTO generations VALUES (1, 0, 1), (2, 9, 2)"),
        q(
            "INSERT INTO vdevs (id, guid, name, endpoint, capacity, ashift, metaslab_shift,
            metaslab_size, children, parity, rotational, class, allocated, added_txg,
            admin_state) VALUES
            (0, 100, 'a', 'http://a', 1073741824, 12, 24, 16777216, 1, 0, 0, 'normal', 131072, 1,
             'online'),
            (1, 101, 'b', 'http://b', 1073741824, 12, 24, 16777216, 1, 0, 1, 'normal', 8192, 1,
             'offline')",
        ),
        q("INSERT INTO extents (vdev, offset, size, txg) VALUES (1, 4096, 8192, 3)"),
        q("INSERT INTO tunables VALUES ('zfs_txg_timeout', '7', 5)"),
        q("INSERT INTO agent_bindings VALUES ('agent-a', 100, 1)"),
        q("INSERT INTO relocations VALUES (55, 3, 1, 0, 4096, 0, 128, 4096, 11, 1)"),
        q("INSERT INTO owners VALUES (1, 'client/a'), (2, 'client/b')"),
        q("INSERT INTO owner_runs VALUES (1, 4096, 12288, 2)"),
    ] {
        stmt.execute(&db).await.unwrap();
    }
    sqlx::query("INSERT INTO spacemaps (vdev, start, width, data) VALUES (0, ?, ?, ?)")
        .bind(chunk.start as i64)
        .bind(chunk.width as i64)
        .bind(chunk.data)
        .execute(&db)
        .await
        .unwrap();
    for (w, d) in maps {
        sqlx::query("INSERT INTO owner_maps VALUES (0, ?, ?)")
            .bind(w as i64)
            .bind(d)
            .execute(&db)
            .await
            .unwrap();
    }
    db.close().await;
}

async fn version(path: &Path) -> i64 {
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", path.display()))
        .await
        .unwrap();
    let v = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations")
        .fetch_one(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_the_previous_schema_is_read_and_opened_with_all_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(sqlite_store::DB_FILE);
    old_file(&path).await;
    assert_eq!(version(&path).await, OLD);
    let before = std::fs::read(&path).unwrap();

    // Read as `aliquotctl verify` does: everything, the file untouched.
    let (id, read) = sqlite_store::read_only(&path).await.unwrap().unwrap();
    assert_eq!(
        (id.guid, id.name.as_str(), id.synced_txg),
        (u64::MAX - 1, "old", 12)
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "reading changes nothing"
    );
    assert_eq!(version(&path).await, OLD);
    assert_eq!(read.pool_guid, u64::MAX - 1);
    assert_eq!((read.synced_txg, read.state_digest), (12, 4242));
    assert_eq!(read.vdevs.len(), 2);
    assert_eq!(read.vdev_states, BTreeMap::from([(1, AdminState::Offline)]));
    let ext = |vdev, offset, size| Extent { vdev, offset, size };
    assert_eq!(
        read.allocated.iter().collect::<Vec<_>>(),
        vec![
            ext(0, 0, 64 * KIB),
            ext(0, 128 * KIB, 64 * KIB),
            ext(1, 4096, 8192)
        ]
    );
    assert_eq!(read.tunables, vec![("zfs_txg_timeout".into(), "7".into())]);
    assert_eq!(
        read.owner_identities,
        vec![(1, "client/a".into()), (2, "client/b".into())]
    );
    assert_eq!(
        read.owner_runs,
        vec![(0, 0, 64 * KIB, 1), (1, 4096, 12288, 2)]
    );
    aliquot_allocator::recovery::verify(&read).expect("consistent");

    // Opened by the allocator: migrated, and the same pool.
    let s = SqliteStore::open(&path, "old", Some(u64::MAX - 1))
        .await
        .unwrap();
    // Migrated to the newest schema this binary has.
    let newest = sqlite_store::MIGRATOR.iter().map(|m| m.version).max();
    assert_eq!(Some(version(&path).await), newest);
    assert_eq!(s.load().await.unwrap().unwrap(), read);
    assert_eq!(
        s.generation_history().await.unwrap(),
        BTreeMap::from([(1, 0), (2, 9)])
    );
    assert_eq!(s.rewind_generation().await.unwrap(), 1);
    assert_eq!(
        s.agent_bindings().await.unwrap(),
        BTreeMap::from([("agent-a".into(), 100)])
    );
    assert_eq!(
        s.relocation(55).await.unwrap(),
        Some(RelocationRecord {
            allocation_id: 55,
            plan_id: 3,
            from: ext(1, 0, 4096),
            to: ext(0, 128, 4096),
            txg: 11,
        })
    );
    assert_eq!(s.relocation_totals().await.unwrap(), (1, 4096));
    // The generation goes on from the old file's.
    assert_eq!(s.open_generation().await.unwrap(), 3);
    assert_eq!(s.generation_history().await.unwrap()[&3], 12);
    s.close().await;
    // And the migrated file reads the same.
    let (_, again) = sqlite_store::read_only(&path).await.unwrap().unwrap();
    assert_eq!(again, read);
}
