//! The SQLite dialect of the SQL store (`crate::sql_store`): the pool's
//! state in one SQLite file (WAL, `synchronous = FULL`), schema from
//! `migrations/allocator/`. After each txg's commit the WAL is checkpointed
//! into the file. One writer by construction (the data dir's lock), so the
//! generation is bumped at open and no txg is ever fenced.
//!
//! Opening checks the file read-only BEFORE anything may write to it: not an
//! SQLite file, truncated, corrupt, a newer schema, a foreign database, or
//! the store of another pool (name or expected guid) is refused and left
//! byte-for-byte untouched. A store that opens but is inconsistent is
//! refused by recovery (`crate::recovery`), never repaired.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use metaslab::Txg;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Row as _, Sqlite, TypeInfo, ValueRef};

use crate::sql_store::{Conn, Dialect, EachRow, Row, SqlStore, Val, args, i, u};
use crate::store::{Persisted, Store, StoreError};

/// The schema, embedded from `migrations/allocator/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/allocator");

/// The store's file name inside `--data-dir`.
pub const DB_FILE: &str = "pool.db";

/// The migration that gave SQLite the PostgreSQL store's tables and keys:
/// a file at an older one is read through a migrated copy.
pub const ONE_SCHEMA: i64 = 11;

/// Tables of every schema this binary knows (the one before
/// [`ONE_SCHEMA`] included); anything else marks a foreign database.
const OUR_TABLES: &[&str] = &[
    "_sqlx_migrations",
    "pool",
    "pools",
    "leaders",
    "vdevs",
    "extents",
    "tunables",
    "generations",
    "agent_bindings",
    "relocations",
    "spacemaps",
    "owners",
    "owner_runs",
    "owner_maps",
    "indirect_mappings",
    "spacemap_log",
    "metaslab_flushes",
    "vdev_evacuations",
    "block_copies",
];

mod sql {
    macro_rules! sql {
        ($($name:ident = $file:literal;)*) => {
            $(pub const $name: &str = include_str!(concat!("sql_store/sqlite/", $file));)*
        };
    }
    sql! {
        INSERT_SPACEMAP = "insert_spacemap.sql";
        INSERT_OWNER_MAP = "insert_owner_map.sql";
        COPIES_ON = "copies_on.sql";
        DELETE_OWNER_WINDOWS = "delete_owner_windows.sql";
        LEGACY_EXTENTS = "legacy_extents.sql";
        DELETE_LEGACY_EXTENTS = "delete_legacy_extents.sql";
        OPEN_GENERATION = "open_generation.sql";
        WAL_CHECKPOINT = "wal_checkpoint.sql";
        VACUUM_INTO = "vacuum_into.sql";
        REPAIR_READ = "repair_read.sql";
        REPAIR_WRITE = "repair_write.sql";
        HAS_TABLE = "has_table.sql";
        IDENTITY = "identity.sql";
        IDENTITY_BEFORE_ONE_SCHEMA = "identity_before_one_schema.sql";
        QUICK_CHECK = "quick_check.sql";
        FIRST_POOL = "first_pool.sql";
    }
}

/// Why a store was not opened. Every refusal leaves the file untouched.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The store belongs to another pool: a configuration mistake.
    #[error(
        "refusing store {path}: {detail}; point --data-dir at this pool's store (the file was left untouched)"
    )]
    OtherPool { path: String, detail: String },
    /// Not a store this binary can trust (corrupt, truncated, newer, foreign).
    #[error("refusing store {path}: {reason} (the file was left untouched)")]
    Refused { path: String, reason: String },
    #[error("store {path}: {reason}")]
    Io { path: String, reason: String },
}

/// Who a store belongs to, read without writing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub guid: u64,
    pub name: String,
    pub synced_txg: Txg,
}

/// SQLite: one file, one pool, one writer.
pub struct SqliteDialect {
    path: PathBuf,
    /// The allocator before this one shut down cleanly
    /// ([`SqliteStore::hand_over_cleanly`]), as read when this one opened
    /// its generation.
    clean_before: std::sync::atomic::AtomicBool,
}

/// The SQLite store of one pool.
pub type SqliteStore = SqlStore<SqliteDialect>;

fn bind_all(
    mut q: sqlx::query::Query<'_, Sqlite, sqlx::sqlite::SqliteArguments>,
    args: Vec<Val>,
) -> Result<sqlx::query::Query<'_, Sqlite, sqlx::sqlite::SqliteArguments>, sqlx::Error> {
    for a in args {
        q = match a {
            Val::Null => q.bind(None::<i64>),
            Val::Int(v) => q.bind(v),
            Val::Real(v) => q.bind(v),
            Val::Text(v) => q.bind(v),
            Val::Blob(v) => q.bind(v),
            Val::Ints(_) | Val::Blobs(_) => {
                return Err(sqlx::Error::Protocol("SQLite binds no arrays".into()));
            }
        };
    }
    Ok(q)
}

/// A row's values by their storage class.
fn row_of(r: &sqlx::sqlite::SqliteRow) -> Result<Row, sqlx::Error> {
    let mut out = Vec::with_capacity(r.len());
    for k in 0..r.len() {
        let raw = r.try_get_raw(k)?;
        let v = if raw.is_null() {
            Val::Null
        } else {
            match raw.type_info().name() {
                "INTEGER" | "BOOLEAN" => Val::Int(r.try_get(k)?),
                "REAL" => Val::Real(r.try_get(k)?),
                // Text that is not UTF-8 can only be bytes (`x'09' || x'80'`
                // is TEXT to SQLite): the blob readers take it as such.
                "TEXT" => match r.try_get(k) {
                    Ok(t) => Val::Text(t),
                    Err(_) => Val::Blob(r.try_get(k)?),
                },
                _ => Val::Blob(r.try_get(k)?),
            }
        };
        out.push(v);
    }
    Ok(Row(out))
}

impl Dialect for SqliteDialect {
    type Db = Sqlite;
    const INSERT_SPACEMAP: &'static str = sql::INSERT_SPACEMAP;
    const INSERT_OWNER_MAP: &'static str = sql::INSERT_OWNER_MAP;
    const COPIES_ON: &'static str = sql::COPIES_ON;
    const DELETE_OWNER_WINDOWS: &'static str = sql::DELETE_OWNER_WINDOWS;
    const ARRAYS: bool = false;
    const LEGACY_EXTENTS: Option<(&'static str, &'static str)> =
        Some((sql::LEGACY_EXTENTS, sql::DELETE_LEGACY_EXTENTS));
    const SNAPSHOT: Option<&'static str> = None;
    // Also takes the write lock up front.
    const BEGIN_TXG: &'static str = "BEGIN IMMEDIATE";

    fn exec<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let q = bind_all(sqlx::query(sql), args)?;
            Ok(q.execute(&mut *c).await?.rows_affected())
        })
    }

    fn fetch<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<Vec<Row>, sqlx::Error>> {
        Box::pin(async move {
            let q = bind_all(sqlx::query(sql), args)?;
            q.fetch_all(&mut *c).await?.iter().map(row_of).collect()
        })
    }

    fn each<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
        f: EachRow<'c>,
    ) -> BoxFuture<'c, Result<(), String>> {
        Box::pin(async move {
            let q = bind_all(sqlx::query(sql), args).map_err(|e| e.to_string())?;
            let mut rows = q.fetch(&mut *c);
            while let Some(r) = rows.try_next().await.map_err(|e| e.to_string())? {
                f(row_of(&r).map_err(|e| e.to_string())?)?;
            }
            Ok(())
        })
    }

    fn fence<'c>(
        _: &'c SqlStore<Self>,
        _: &'c mut Conn<Self>,
        _: Txg,
    ) -> BoxFuture<'c, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn after_commit(c: &mut Conn<Self>, txg: Txg) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // Move the txg from the WAL into the database file at once. Left
            // to SQLite's auto-checkpoint (every 1000 pages) a small pool
            // lived in `pool.db-wal` for good: one unlink of that file from
            // empty. After a TRUNCATE checkpoint the WAL is empty and the
            // file alone holds every synced txg. It costs the file's fsync
            // per txg; txgs are seconds apart. (The connection is the
            // store's only one, so no reader can hold the checkpoint back.)
            let db = |e: sqlx::Error| StoreError(format!("txg {txg}: {e}"));
            let rows = Self::fetch(c, sql::WAL_CHECKPOINT, args![])
                .await
                .map_err(db)?;
            if let Some(r) = rows.first()
                && r.int(0).unwrap_or(0) != 0
            {
                tracing::warn!(
                    txg,
                    wal_pages = r.int(1).unwrap_or(0),
                    checkpointed = r.int(2).unwrap_or(0),
                    "WAL checkpoint incomplete"
                );
            }
            Ok(())
        })
    }

    fn open_generation(s: &SqlStore<Self>) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let db = |e: sqlx::Error| StoreError(format!("bump the generation: {e}"));
            s.pool_id()
                .map_err(|_| StoreError("open_generation before create".into()))?;
            // The bump and its history row in one transaction.
            let mut tx = s.db.begin().await.map_err(db)?;
            // Read before the bump clears it: did the last allocator shut
            // down cleanly?
            let mut before =
                Self::fetch(&mut tx, crate::sql_store::q::LEADER_ID, args![&s.pool_name])
                    .await
                    .map_err(db)?;
            let clean_before = match before.first_mut() {
                Some(r) => r.text(0).map_err(StoreError)? == crate::sql_store::HANDED_OVER_CLEANLY,
                None => false,
            };
            let rows = Self::fetch(&mut tx, sql::OPEN_GENERATION, args![&s.pool_name])
                .await
                .map_err(db)?;
            let g = rows
                .first()
                .ok_or_else(|| StoreError("bump the generation: no leadership row".into()))?
                .int(0)
                .map_err(StoreError)?;
            s.record_generation(&mut tx, g, "", "").await.map_err(db)?;
            tx.commit().await.map_err(db)?;
            s.dialect
                .clean_before
                .store(clean_before, std::sync::atomic::Ordering::Release);
            Ok(u(g))
        })
    }

    fn fenced(_: &SqlStore<Self>) -> bool {
        false
    }

    // One allocator serves a SQLite store; one that shut down with its
    // last txg synced and no claim window open says so in the `leaders`
    // row, as a PostgreSQL leader handing over does.
    fn handed_over_cleanly(s: &SqlStore<Self>) -> bool {
        s.dialect
            .clean_before
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

async fn fetch_on(
    c: &mut SqliteConnection,
    q: &'static str,
    a: Vec<Val>,
) -> Result<Vec<Row>, String> {
    SqliteDialect::fetch(c, q, a)
        .await
        .map_err(|e| e.to_string())
}

/// Check that `path` is absent, empty, or a sound store of ours at a schema
/// this binary knows; returns its identity if it has one. Read-only.
pub async fn preflight(path: &Path) -> Result<Option<Identity>, OpenError> {
    let p = path.display().to_string();
    let refuse = |reason: String| OpenError::Refused {
        path: p.clone(),
        reason,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(OpenError::Io {
                path: p,
                reason: format!("cannot stat it: {e}"),
            });
        }
    };
    if !meta.is_file() {
        return Err(refuse("it is not a regular file".into()));
    }
    if meta.len() == 0 {
        return Ok(None);
    }
    check_header(path, meta.len()).map_err(refuse)?;
    let mut conn = connect_read_only(path).await.map_err(refuse)?;
    let r = async {
        sqlite_preflight::check_schema(&mut conn, &MIGRATOR, OUR_TABLES, "aliquot-allocator", "")
            .await?;
        quick_check(&mut conn).await?;
        read_identity(&mut conn).await
    }
    .await;
    let _ = conn.close().await;
    r.map_err(refuse)
}

async fn connect_read_only(path: &Path) -> Result<SqliteConnection, String> {
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .create_if_missing(false);
    SqliteConnection::connect_with(&opts)
        .await
        .map_err(|e| format!("cannot open it read-only: {e}"))
}

async fn quick_check(conn: &mut SqliteConnection) -> Result<(), String> {
    let rows = fetch_on(conn, sql::QUICK_CHECK, args![])
        .await
        .map_err(|e| format!("it is corrupt ({e})"))?;
    let mut lines = Vec::new();
    for mut r in rows {
        lines.push(r.text(0)?);
    }
    if lines.len() == 1 && lines[0] == "ok" {
        Ok(())
    } else {
        Err(format!("it is corrupt (quick_check: {})", lines.join("; ")))
    }
}

async fn has_table(conn: &mut SqliteConnection, name: &str) -> Result<bool, String> {
    let rows = fetch_on(conn, sql::HAS_TABLE, args![name]).await?;
    Ok(rows.first().map(|r| r.int(0)).transpose()?.unwrap_or(0) > 0)
}

/// The pool the file holds, in either schema (before and after
/// [`ONE_SCHEMA`]).
async fn read_identity(conn: &mut SqliteConnection) -> Result<Option<Identity>, String> {
    let q = if has_table(conn, "pools").await? {
        sql::IDENTITY
    } else if has_table(conn, "pool").await? {
        sql::IDENTITY_BEFORE_ONE_SCHEMA
    } else {
        return Ok(None);
    };
    let rows = fetch_on(conn, q, args![])
        .await
        .map_err(|e| format!("cannot read its pool row: {e}"))?;
    let Some(mut r) = rows.into_iter().next() else {
        return Ok(None);
    };
    Ok(Some(Identity {
        guid: u(r.int(0)?),
        name: r.text(1)?,
        synced_txg: u(r.int(2)?),
    }))
}

/// Read a store without changing it (for `aliquotctl verify`, on a stopped
/// or a running pool: WAL readers see the last committed txg). A file of
/// the schema before [`ONE_SCHEMA`] is read through a migrated copy in a
/// temporary directory (the file itself is never migrated here).
pub async fn read_only(path: &Path) -> Result<Option<(Identity, Persisted)>, OpenError> {
    let p = path.display().to_string();
    if !path.exists() {
        return Err(OpenError::Io {
            path: p,
            reason: "no such file".into(),
        });
    }
    let Some(id) = preflight(path).await? else {
        return Ok(None);
    };
    let refuse = |reason: String| OpenError::Refused {
        path: p.clone(),
        reason,
    };
    let mut conn = connect_read_only(path).await.map_err(refuse)?;
    if !has_table(&mut conn, "pools").await.map_err(refuse)? {
        let r = read_copy(&mut conn, &id).await;
        let _ = conn.close().await;
        return r
            .map(|p| p.map(|p| (id, p)))
            .map_err(|e| refuse(format!("it is inconsistent: {e}")));
    }
    // One read transaction: a consistent snapshot even while a sync commits.
    let r = async {
        sqlx::query("BEGIN")
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let s = async {
            let rows = fetch_on(&mut conn, sql::FIRST_POOL, args![]).await?;
            match rows.first() {
                Some(r) => SqliteStore::load_state(&mut conn, r.int(0)?).await,
                None => Ok(None),
            }
        }
        .await;
        let _ = sqlx::query("COMMIT").execute(&mut conn).await;
        s
    }
    .await;
    let _ = conn.close().await;
    let persisted = r.map_err(|e| refuse(format!("it is inconsistent: {e}")))?;
    Ok(persisted.map(|p| (id, p)))
}

/// A file of an older schema, read: a consistent copy (VACUUM INTO), opened
/// and migrated as the allocator would, loaded, deleted.
async fn read_copy(
    conn: &mut SqliteConnection,
    id: &Identity,
) -> Result<Option<Persisted>, String> {
    let dir = std::env::temp_dir().join(format!(
        "aliquot-read-{}-{}",
        std::process::id(),
        crate::convert::unix_ms()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let r = async {
        let copy = dir.join(DB_FILE);
        let target = copy.display().to_string();
        SqliteDialect::exec(conn, sql::VACUUM_INTO, args![target])
            .await
            .map_err(|e| format!("cannot copy it: {e}"))?;
        let store = SqliteStore::open(&copy, &id.name, Some(id.guid))
            .await
            .map_err(|e| e.to_string())?;
        let p = store.load().await.map_err(|e| e.0);
        store.close().await;
        p
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Repair one vdev's row so the pool opens again, without editing SQLite by
/// hand: set its capacity (when given) and the metaslab shift a new vdev of
/// that capacity gets, and recount its `allocated` from its extents. The
/// capacity must hold every extent of the vdev. The caller holds the data
/// dir's lock (no allocator is running); the file is migrated first, as
/// the allocator's next start would. Returns what changed.
pub async fn repair_vdev(path: &Path, vdev: u32, capacity: Option<u64>) -> Result<String, String> {
    let id = preflight(path)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{} holds no pool", path.display()))?;
    let store = SqliteStore::open(path, &id.name, Some(id.guid))
        .await
        .map_err(|e| e.to_string())?;
    let r = store.repair(vdev, capacity).await;
    store.close().await;
    r
}

impl SqlStore<SqliteDialect> {
    /// At a clean shutdown (the last txg synced, nothing dirty, no claim
    /// window open): say so in the `leaders` row, so that the next start
    /// opens no claim window (there is nothing to claim). Generation
    /// `generation` must still be the row's (a later one never marks an
    /// earlier one's shutdown).
    pub async fn hand_over_cleanly(&self, generation: u64) -> Result<(), StoreError> {
        let a = args![
            &self.pool_name,
            generation as i64,
            "",
            1i64,
            crate::sql_store::HANDED_OVER_CLEANLY
        ];
        self.exec(crate::sql_store::q::RELEASE, a)
            .await
            .map_err(|e| StoreError(format!("mark the clean shutdown: {e}")))?;
        Ok(())
    }

    /// Open (creating it if absent) the store at `path` for pool
    /// `pool_name`; `expect_guid` refuses a store of another guid.
    pub async fn open(
        path: &Path,
        pool_name: &str,
        expect_guid: Option<u64>,
    ) -> Result<SqliteStore, OpenError> {
        let p = path.display().to_string();
        if let Some(id) = preflight(path).await? {
            if id.name != pool_name {
                return Err(OpenError::OtherPool {
                    path: p,
                    detail: format!(
                        "it holds pool {:?} (guid {:#x}), not {pool_name:?}",
                        id.name, id.guid
                    ),
                });
            }
            if let Some(g) = expect_guid
                && g != id.guid
            {
                return Err(OpenError::OtherPool {
                    path: p,
                    detail: format!(
                        "it holds pool {:?} with guid {:#x}, not the expected {g:#x}",
                        id.name, id.guid
                    ),
                });
            }
        }
        let io = |reason: String| OpenError::Io {
            path: p.clone(),
            reason,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| io(format!("cannot create {}: {e}", dir.display())))?;
        }
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Every txg commit is fsynced before SyncTxg waiters are told.
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        // One connection: SQLite has one writer, and txgs persist in order.
        let db = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(opts)
            .await
            .map_err(|e| io(format!("cannot open it: {e}")))?;
        MIGRATOR
            .run(&db)
            .await
            .map_err(|e| io(format!("cannot migrate it: {e}")))?;
        let store = SqlStore::new(
            db,
            p.clone(),
            pool_name,
            SqliteDialect {
                path: path.to_path_buf(),
                clean_before: Default::default(),
            },
        );
        let refused = |reason| OpenError::Refused {
            path: p.clone(),
            reason,
        };
        store.find_pool().await.map_err(io)?;
        let (extents, runs) = store.convert_legacy().await.map_err(refused)?;
        if extents > 0 {
            tracing::info!(path = %p, extents, "extent rows moved into space maps");
        }
        if runs > 0 {
            tracing::info!(path = %p, runs, "owner rows moved into owner maps");
        }
        tracing::info!(path = %p, "store opened");
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.dialect.path
    }

    async fn repair(&self, vdev: u32, capacity: Option<u64>) -> Result<String, String> {
        // The sizing rule of a new vdev under the default tunables.
        let tunables = metaslab::Tunables::default();
        let pool = self.pool_id().map_err(|e| e.0)?;
        let db = |e: sqlx::Error| e.to_string();
        let mut tx = self.db.begin().await.map_err(db)?;
        let rows = SqliteDialect::fetch(&mut tx, sql::REPAIR_READ, args![pool, vdev as i64])
            .await
            .map_err(db)?;
        let row = rows
            .first()
            .ok_or_else(|| format!("the store has no vdev {vdev}"))?;
        let (old_cap, old_shift, old_alloc) = (u(row.int(0)?), row.int(1)?, u(row.int(2)?));
        // The log's rows of this vdev into its chunks first: they are keyed
        // by the metaslab shift this may change, and the recount reads the
        // chunks.
        let synced = SqliteDialect::fetch(&mut tx, crate::sql_store::q::SYNCED_TXG, args![pool])
            .await
            .map_err(db)?;
        let synced = u(synced.first().ok_or("the store has no pool row")?.int(0)?);
        Self::flush_vdev(&mut tx, pool, vdev, synced).await?;
        let (mut sum, mut end) = (0i64, 0i64);
        for (off, size) in Self::read_run(&mut tx, pool, vdev, 0, i64::MAX as u64).await? {
            sum += size as i64;
            end = end.max((off + size) as i64);
        }
        let cap = capacity.unwrap_or(old_cap);
        if (end as u64) > cap {
            return Err(format!(
                "vdev {vdev} has extents up to byte {end}: a capacity of {cap} cannot hold them"
            ));
        }
        if cap == 0 || cap > metaslab::pool::MAX_VDEV_CAPACITY {
            return Err(format!(
                "capacity {cap} is outside 1 ..= {} bytes",
                metaslab::pool::MAX_VDEV_CAPACITY
            ));
        }
        let shift = metaslab::vdev::metaslab_shift(cap, &tunables) as i64;
        let a = args![i(cap), shift, 1i64 << shift, sum, pool, vdev as i64];
        SqliteDialect::exec(&mut tx, sql::REPAIR_WRITE, a)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(format!(
            "vdev {vdev}: capacity {old_cap} -> {cap}, metaslab shift {old_shift} -> {shift}, \
             allocated {old_alloc} -> {sum}"
        ))
    }
}
/// The SQLite header: magic, page size, and a file at least as long as the
/// page count it declares (a truncated copy fails here, before SQLite reads
/// garbage).
fn check_header(path: &Path, len: u64) -> Result<(), String> {
    use std::io::Read;
    let mut head = [0u8; 100];
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let n = f
        .read(&mut head)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if n < 16 || &head[..16] != b"SQLite format 3\0" {
        return Err("it is not an SQLite database (bad file header)".into());
    }
    if n < 100 {
        return Err(format!(
            "it is truncated ({len} bytes, shorter than an SQLite header)"
        ));
    }
    let page_size = match u16::from_be_bytes([head[16], head[17]]) {
        1 => 65536,
        s => s as u64,
    };
    if page_size < 512 || !page_size.is_power_of_two() {
        return Err(format!("its header is corrupt (page size {page_size})"));
    }
    if !len.is_multiple_of(page_size) {
        return Err(format!(
            "it is truncated ({len} bytes is not a whole number of {page_size}-byte pages)"
        ));
    }
    let pages = u32::from_be_bytes([head[28], head[29], head[30], head[31]]) as u64;
    // The page count is valid when "version-valid-for" equals the change
    // counter (SQLite file format, header offsets 92 and 24).
    let valid = head[92..96] == head[24..28];
    if valid && pages > 0 && len < pages * page_size {
        return Err(format!(
            "it is truncated ({len} bytes; its header declares {pages} pages of {page_size} bytes)"
        ));
    }
    Ok(())
}
