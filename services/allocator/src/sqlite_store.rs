//! The durable store: the pool's state in one SQLite file (WAL,
//! `synchronous = FULL`), schema from `migrations/allocator/`. Each txg sync
//! is ONE transaction (its space changes, the vdevs it added or changed, and
//! `pool.synced_txg`), so after any crash the file holds exactly the pool as
//! of some synced txg. The extents are kept as space-map chunks
//! (`crate::spacemap`): a txg rewrites the chunks it touched, a restart
//! streams the chunks into the pool.
//!
//! Opening checks the file read-only BEFORE anything may write to it: not an
//! SQLite file, truncated, corrupt, a newer schema, a foreign database, or
//! the store of another pool (name or expected guid) is refused and left
//! byte-for-byte untouched. A store that opens but is inconsistent is
//! refused by recovery (`crate::recovery`), never repaired.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use metaslab::{Extent, SpaceChangeKind, Txg, VdevRole};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, Row, Sqlite, SqliteExecutor};

use crate::owner_map;
use crate::spacemap::{self, Chunk, Extents};
use crate::store::{
    Persisted, RelocationRecord, Store, StoreError, TxgRecord, VdevChanges, VdevRow,
};

/// The schema, embedded from `migrations/allocator/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/allocator");

/// The store's file name inside `--data-dir`.
pub const DB_FILE: &str = "pool.db";

/// Tables of the newest schema; anything else marks a foreign database.
const OUR_TABLES: &[&str] = &[
    "_sqlx_migrations",
    "pool",
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
];

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

/// The SQLite store of one pool.
pub struct SqliteStore {
    path: PathBuf,
    db: SqlitePool,
    pool_name: String,
}

fn u(v: i64) -> u64 {
    v as u64
}

/// The chunk rows any extent in `[?2, ?3)` of vdev `?1` can be in: the one
/// starting last at or before `?2`, then those starting inside (see
/// `spacemap`); each searched in place, not decoded. Free's batch form
/// appends a LIMIT.
macro_rules! span_rows_sql {
    () => {
        "SELECT start, width, data FROM spacemaps
         WHERE vdev = ?1 AND start < ?3 AND start >= COALESCE(
             (SELECT MAX(start) FROM spacemaps WHERE vdev = ?1 AND start <= ?2), ?2)
         ORDER BY start"
    };
}

fn i(v: u64) -> i64 {
    v as i64
}

fn now_ms() -> i64 {
    crate::convert::unix_ms() as i64
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
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .create_if_missing(false);
    let mut conn = SqliteConnection::connect_with(&opts)
        .await
        .map_err(|e| refuse(format!("cannot open it read-only: {e}")))?;
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

async fn quick_check(conn: &mut SqliteConnection) -> Result<(), String> {
    let rows: Vec<String> = sqlx::query_scalar("PRAGMA quick_check(5)")
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| format!("it is corrupt ({e})"))?;
    if rows.len() == 1 && rows[0] == "ok" {
        Ok(())
    } else {
        Err(format!("it is corrupt (quick_check: {})", rows.join("; ")))
    }
}

async fn has_table(conn: &mut SqliteConnection, name: &str) -> Result<bool, String> {
    let n: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?")
            .bind(name)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
    Ok(n > 0)
}

async fn read_identity(conn: &mut SqliteConnection) -> Result<Option<Identity>, String> {
    if !has_table(conn, "pool").await? {
        return Ok(None);
    }
    let row = sqlx::query("SELECT guid, name, synced_txg FROM pool WHERE id = 1")
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| format!("cannot read its pool row: {e}"))?;
    Ok(row.map(|r| Identity {
        guid: u(r.get(0)),
        name: r.get(1),
        synced_txg: u(r.get(2)),
    }))
}

/// Everything persisted, with the store's own per-vdev check (the recorded
/// `vdevs.allocated` against the sum of its extents). `None`: no pool yet.
async fn load_state(conn: &mut SqliteConnection) -> Result<Option<Persisted>, String> {
    let Some(id) = read_identity(conn).await? else {
        return Ok(None);
    };
    let db = |e: sqlx::Error| e.to_string();
    let rows: Vec<VdevRow> = sqlx::query_as(VdevRow::SELECT)
        .fetch_all(&mut *conn)
        .await
        .map_err(db)?;
    let (vdevs, vdev_states, recorded) = VdevRow::records(rows)?;
    // Streamed chunk by chunk: the rows are never all materialised.
    let mut loading = spacemap::Loading::new(&recorded);
    if has_table(conn, "spacemaps").await? {
        let mut rows =
            sqlx::query("SELECT vdev, start, width, data FROM spacemaps ORDER BY vdev, start")
                .fetch(&mut *conn);
        while let Some(r) = rows.try_next().await.map_err(db)? {
            loading.push(chunk_of_row(&r)?)?;
        }
    }
    // Rows of the one-row-per-extent layout (a file an older binary wrote,
    // read without converting it): merged in, in order, so an overlap
    // between the two is still seen by recovery.
    let mut legacy: Vec<Extent> = Vec::new();
    let mut rows = sqlx::query("SELECT vdev, offset, size FROM extents ORDER BY vdev, offset")
        .fetch(&mut *conn);
    while let Some(r) = rows.try_next().await.map_err(db)? {
        let vdev: i64 = r.get(0);
        let e = Extent {
            vdev: vdev as u32,
            offset: u(r.get(1)),
            size: u(r.get(2)),
        };
        if !recorded.contains_key(&e.vdev) {
            return Err(format!("extent {e}: no vdev {vdev}"));
        }
        loading.count(e.vdev, e.size);
        legacy.push(e);
    }
    drop(rows);
    let mut allocated = loading.finish()?;
    if !legacy.is_empty() {
        legacy.extend(allocated.iter());
        legacy.sort();
        allocated = Extents::from(legacy);
    }
    let tunables = sqlx::query_as::<_, (String, String)>(
        "SELECT name, value FROM tunables ORDER BY set_ms, name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    // A store written by a binary from before owners (read by `verify`
    // without migrating) has no owner tables: no owners.
    // Stores from before digests (read by `verify` unmigrated): unknown.
    let state_digest: i64 = sqlx::query_scalar("SELECT state_digest FROM pool WHERE id = 1")
        .fetch_one(&mut *conn)
        .await
        .unwrap_or(0);
    let has = |table: &'static str| {
        sqlx::query_scalar::<_, bool>(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?",
        )
        .bind(table)
    };
    let has_owners: bool = has("owner_runs").fetch_one(&mut *conn).await.map_err(db)?;
    if !has_owners {
        return Ok(Some(Persisted {
            pool_guid: id.guid,
            synced_txg: id.synced_txg,
            vdevs,
            allocated,
            tunables,
            vdev_states,
            state_digest: u(state_digest),
            ..Default::default()
        }));
    }
    let owner_identities: Vec<(u32, String)> =
        sqlx::query_as::<_, (i64, String)>("SELECT idx, identity FROM owners ORDER BY idx")
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(i, n)| (i as u32, n))
            .collect();
    // A store from before owner maps (read by `verify` unmigrated) has
    // only the row-per-run table.
    let has_maps: bool = has("owner_maps").fetch_one(&mut *conn).await.map_err(db)?;
    let owner_runs = read_owner_runs(&mut *conn, has_maps).await?;
    Ok(Some(Persisted {
        pool_guid: id.guid,
        synced_txg: id.synced_txg,
        vdevs,
        allocated,
        tunables,
        vdev_states,
        owner_identities,
        owner_runs,
        state_digest: u(state_digest),
    }))
}

/// Read a store without changing it (for `aliquotctl verify`, on a stopped
/// or a running pool: WAL readers see the last committed txg).
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
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .create_if_missing(false);
    let mut conn = SqliteConnection::connect_with(&opts)
        .await
        .map_err(|e| refuse(format!("cannot open it read-only: {e}")))?;
    // One read transaction: a consistent snapshot even while a sync commits.
    let r = async {
        sqlx::query("BEGIN")
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let s = load_state(&mut conn).await;
        let _ = sqlx::query("COMMIT").execute(&mut conn).await;
        s
    }
    .await;
    let _ = conn.close().await;
    let persisted = r.map_err(|e| refuse(format!("it is inconsistent: {e}")))?;
    Ok(persisted.map(|p| (id, p)))
}

/// Repair one vdev's row so the pool opens again, without editing SQLite by
/// hand: set its capacity (when given) and the metaslab shift a new vdev of
/// that capacity gets, and recount its `allocated` from its extents. The
/// capacity must hold every extent of the vdev. The caller holds the data
/// dir's lock (no allocator is running). Returns what changed.
pub async fn repair_vdev(path: &Path, vdev: u32, capacity: Option<u64>) -> Result<String, String> {
    // The sizing rule of a new vdev under the default tunables.
    let tunables = metaslab::Tunables::default();
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(false)
        .synchronous(SqliteSynchronous::Full);
    let mut conn = SqliteConnection::connect_with(&opts)
        .await
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let db = |e: sqlx::Error| e.to_string();
    let mut tx = conn.begin().await.map_err(db)?;
    let row = sqlx::query("SELECT capacity, metaslab_shift, allocated FROM vdevs WHERE id = ?")
        .bind(vdev as i64)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?
        .ok_or_else(|| format!("the store has no vdev {vdev}"))?;
    let (old_cap, old_shift, old_alloc) = (u(row.get(0)), row.get::<i64, _>(1), u(row.get(2)));
    let (mut sum, mut end) = (0i64, 0i64);
    for (off, size) in read_run(&mut *tx, vdev, 0, i64::MAX as u64).await? {
        sum += size as i64;
        end = end.max((off + size) as i64);
    }
    // Rows an older binary left (not yet moved into chunks) count too.
    let (lsum, lend): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(SUM(size), 0), COALESCE(MAX(offset + size), 0) FROM extents WHERE vdev = ?",
    )
    .bind(vdev as i64)
    .fetch_one(&mut *tx)
    .await
    .map_err(db)?;
    sum += lsum;
    end = end.max(lend);
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
    sqlx::query(
        "UPDATE vdevs SET capacity = ?, metaslab_shift = ?, metaslab_size = ?, allocated = ? WHERE id = ?",
    )
    .bind(i(cap))
    .bind(shift)
    .bind(1i64 << shift)
    .bind(sum)
    .bind(vdev as i64)
    .execute(&mut *tx)
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    let _ = conn.close().await;
    Ok(format!(
        "vdev {vdev}: capacity {old_cap} -> {cap}, metaslab shift {old_shift} -> {shift}, \
         allocated {old_alloc} -> {sum}"
    ))
}

impl SqliteStore {
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
        let refused = |reason| OpenError::Refused {
            path: p.clone(),
            reason,
        };
        let moved = convert_legacy_rows(&db).await.map_err(refused)?;
        if moved > 0 {
            tracing::info!(path = %p, extents = moved, "extent rows moved into space maps");
        }
        let moved = convert_owner_runs(&db).await.map_err(refused)?;
        if moved > 0 {
            tracing::info!(path = %p, runs = moved, "owner rows moved into owner maps");
        }
        tracing::info!(path = %p, "store opened");
        Ok(SqliteStore {
            path: path.to_path_buf(),
            db,
            pool_name: pool_name.to_string(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Close the connection (the WAL is checkpointed into the file).
    pub async fn close(&self) {
        self.db.close().await;
    }

    /// Persist one txg on the store's connection. A connection on which
    /// anything of the txg's transaction failed is closed, never reused:
    /// after SQLITE_FULL on COMMIT SQLite has already rolled back, sqlx's
    /// own ROLLBACK then fails and leaves its transaction depth out of step,
    /// so the next BEGIN became a SAVEPOINT inside a stale transaction and a
    /// retry read its own uncommitted `synced_txg` as persisted. The pool
    /// opens a fresh connection for the retry.
    async fn persist_txg(&self, rec: &TxgRecord) -> Result<(), String> {
        let mut conn = self.db.acquire().await.map_err(|e| e.to_string())?;
        let r = Self::persist_on(&mut conn, rec).await;
        match r {
            Ok(()) => {
                // Move the txg from the WAL into the database file at once.
                // Left to SQLite's auto-checkpoint (every 1000 pages) a small
                // pool lived in `pool.db-wal` for good: one unlink of that
                // file from empty. After a TRUNCATE checkpoint the WAL is
                // empty and the file alone holds every synced txg. It costs
                // the file's fsync per txg; txgs are seconds apart. (The
                // connection is the store's only one, so no reader can hold
                // the checkpoint back.) The txg is durable in the WAL
                // already: a failed checkpoint is said, not a failed txg.
                let ck: Result<(i64, i64, i64), _> =
                    sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
                        .fetch_one(&mut *conn)
                        .await;
                match ck {
                    Ok((0, _, _)) => {}
                    Ok((_, log, done)) => tracing::warn!(
                        txg = rec.sync.txg,
                        wal_pages = log,
                        checkpointed = done,
                        "WAL checkpoint incomplete"
                    ),
                    Err(e) => {
                        tracing::warn!(txg = rec.sync.txg, error = %e, "WAL checkpoint failed; the txg is durable in the WAL");
                        conn.close_on_drop();
                    }
                }
                Ok(())
            }
            Err(e) => {
                conn.close_on_drop();
                Err(e)
            }
        }
    }

    async fn persist_on(conn: &mut SqliteConnection, rec: &TxgRecord) -> Result<(), String> {
        let db = |e: sqlx::Error| e.to_string();
        let txg = rec.sync.txg;
        // A plain BEGIN on a connection sqlx believes is in a transaction
        // is a SAVEPOINT (nothing commits with it); BEGIN IMMEDIATE is
        // refused there instead, and takes the write lock up front.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(db)?;
        let synced: i64 = sqlx::query_scalar("SELECT synced_txg FROM pool WHERE id = 1")
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?
            .ok_or("persist before create")?;
        let synced = u(synced);
        if txg <= synced {
            if txg == synced {
                // A retry of a txg whose commit did land: nothing to do.
                return Ok(());
            }
            return Err(format!("txg {txg} persisted out of order (last {synced})"));
        }
        for v in &rec.vdevs {
            let shift = v
                .spec
                .metaslab_shift
                .ok_or_else(|| format!("vdev {}: no metaslab shift to persist", v.id))?;
            sqlx::query(
                "INSERT INTO vdevs (id, guid, name, endpoint, capacity, ashift, metaslab_shift,
                    metaslab_size, children, parity, rotational, class, allocated, added_txg)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)
                 ON CONFLICT (id) DO UPDATE SET guid = excluded.guid, name = excluded.name,
                    endpoint = excluded.endpoint, capacity = excluded.capacity,
                    ashift = excluded.ashift, metaslab_shift = excluded.metaslab_shift,
                    metaslab_size = excluded.metaslab_size, children = excluded.children,
                    parity = excluded.parity, rotational = excluded.rotational,
                    class = excluded.class",
            )
            .bind(v.id as i64)
            .bind(i(v.guid))
            .bind(&v.name)
            .bind(&v.endpoint)
            .bind(i(v.spec.capacity))
            .bind(v.spec.ashift as i64)
            .bind(shift as i64)
            .bind(1i64 << shift)
            .bind(v.spec.children as i64)
            .bind(v.spec.parity as i64)
            .bind(v.spec.rotational as i64)
            .bind(match v.spec.role {
                VdevRole::Normal => "normal",
                VdevRole::Log => "log",
            })
            .bind(i(txg))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        // Each vdev's changes, in order, applied to the chunks they fall in.
        let VdevChanges { by_vdev, delta } = VdevChanges::of(rec)?;
        for (vdev, changes) in &by_vdev {
            persist_vdev(&mut tx, *vdev, changes)
                .await
                .map_err(|e| format!("txg {txg}: vdev {vdev}: {e}"))?;
        }
        for (vdev, d) in delta {
            if d != 0 {
                sqlx::query("UPDATE vdevs SET allocated = allocated + ? WHERE id = ?")
                    .bind(d)
                    .bind(vdev as i64)
                    .execute(&mut *tx)
                    .await
                    .map_err(db)?;
            }
        }
        for &(vdev, state) in &rec.vdev_states {
            sqlx::query(
                "UPDATE vdevs SET admin_state = ?,
                    removed_txg = CASE WHEN ? = 'removed' THEN ? ELSE removed_txg END
                 WHERE id = ?",
            )
            .bind(state.as_str())
            .bind(state.as_str())
            .bind(i(txg))
            .bind(vdev as i64)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        let ms = now_ms();
        for r in &rec.relocations {
            sqlx::query(
                "INSERT INTO relocations (allocation_id, plan_id, from_vdev, from_offset, from_size,
                    to_vdev, to_offset, to_size, txg, committed_ms)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(i(r.allocation_id))
            .bind(i(r.plan_id))
            .bind(r.from.vdev as i64)
            .bind(i(r.from.offset))
            .bind(i(r.from.size))
            .bind(r.to.vdev as i64)
            .bind(i(r.to.offset))
            .bind(i(r.to.size))
            .bind(i(r.txg))
            .bind(ms)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        for (idx, name) in &rec.owners.identities {
            sqlx::query("INSERT INTO owners (idx, identity) VALUES (?, ?)")
                .bind(*idx as i64)
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        for w in &rec.owners.windows {
            write_owner_maps(&mut tx, w.vdev, w.start, w.end, &w.runs).await?;
        }
        sqlx::query("UPDATE pool SET synced_txg = ?, state_digest = ? WHERE id = 1")
            .bind(i(txg))
            .bind(i(rec.state_digest))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(())
    }
}

fn chunk_of_row(r: &sqlx::sqlite::SqliteRow) -> Result<Chunk, String> {
    let vdev: i64 = r.get(0);
    let width: i64 = r.get(2);
    let vdev =
        u32::try_from(vdev).map_err(|_| format!("space map chunk of vdev {vdev}: out of range"))?;
    Chunk::new(
        vdev,
        u(r.get(1)),
        u8::try_from(width).unwrap_or(0),
        r.get(3),
    )
}

/// The chunks of `vdev` with keys in `first ..= last`, decoded in order.
async fn read_run<'e>(
    ex: impl SqliteExecutor<'e>,
    vdev: u32,
    first: u64,
    last: u64,
) -> Result<Vec<(u64, u64)>, String> {
    let mut out = Vec::new();
    let mut rows = sqlx::query(
        "SELECT vdev, start, width, data FROM spacemaps
         WHERE vdev = ? AND start >= ? AND start <= ? ORDER BY start",
    )
    .bind(vdev as i64)
    .bind(i(first))
    .bind(i(last))
    .fetch(ex);
    while let Some(r) = rows.try_next().await.map_err(|e| e.to_string())? {
        out.extend(chunk_of_row(&r)?.iter());
    }
    Ok(out)
}

/// Replace the chunks of `vdev` with keys in `old` (none: `None`) by
/// `extents`, rechunked.
async fn write_run(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    vdev: u32,
    old: Option<(u64, u64)>,
    extents: &[(u64, u64)],
) -> Result<(), String> {
    let db = |e: sqlx::Error| e.to_string();
    if let Some((first, last)) = old {
        sqlx::query("DELETE FROM spacemaps WHERE vdev = ? AND start >= ? AND start <= ?")
            .bind(vdev as i64)
            .bind(i(first))
            .bind(i(last))
            .execute(&mut **tx)
            .await
            .map_err(db)?;
    }
    for c in spacemap::rechunk(vdev, extents) {
        sqlx::query("INSERT INTO spacemaps (vdev, start, width, data) VALUES (?, ?, ?, ?)")
            .bind(vdev as i64)
            .bind(i(c.start))
            .bind(c.width as i64)
            .bind(c.data)
            .execute(&mut **tx)
            .await
            .map_err(db)?;
    }
    Ok(())
}

/// Apply one txg's changes of `vdev` (in order) to its stored chunks: only
/// the chunks a change can overlap are read and rewritten. Chunks are
/// handled one at a time unless a change spans several, which are then
/// joined into one run (so a sync of a million frees never holds more than
/// a few chunks decoded).
async fn persist_vdev(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    vdev: u32,
    changes: &[(SpaceChangeKind, u64, u64)],
) -> Result<(), String> {
    let keys: Vec<u64> =
        sqlx::query_scalar::<_, i64>("SELECT start FROM spacemaps WHERE vdev = ? ORDER BY start")
            .bind(vdev as i64)
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(u)
            .collect();
    if keys.is_empty() {
        let out = spacemap::apply(Vec::new(), changes)?;
        return write_run(tx, vdev, None, &out).await;
    }
    for ((kf, kl), changes) in spacemap::plan_runs(&keys, changes) {
        let cur = read_run(&mut **tx, vdev, kf, kl).await?;
        let out = spacemap::apply(cur, &changes)?;
        write_run(tx, vdev, Some((kf, kl)), &out).await?;
    }
    Ok(())
}

/// Move rows of the one-row-per-extent layout (an older binary's) into
/// space-map chunks, in one transaction. An overlap refuses the store as
/// inconsistent, with nothing written.
async fn convert_legacy_rows(db: &SqlitePool) -> Result<u64, String> {
    let dbe = |e: sqlx::Error| e.to_string();
    let mut tx = db.begin().await.map_err(dbe)?;
    let rows: Vec<(i64, i64, i64)> =
        sqlx::query_as("SELECT vdev, offset, size FROM extents ORDER BY vdev, offset")
            .fetch_all(&mut *tx)
            .await
            .map_err(dbe)?;
    if rows.is_empty() {
        return Ok(0);
    }
    let mut by_vdev: BTreeMap<u32, Vec<(SpaceChangeKind, u64, u64)>> = BTreeMap::new();
    for &(v, off, size) in &rows {
        by_vdev
            .entry(v as u32)
            .or_default()
            .push((SpaceChangeKind::Alloc, u(off), u(size)));
    }
    for (vdev, allocs) in &by_vdev {
        let cur = read_run(&mut *tx, *vdev, 0, i64::MAX as u64).await?;
        let out = spacemap::apply(cur, allocs)
            .map_err(|e| format!("it is inconsistent: vdev {vdev}: {e}"))?;
        write_run(&mut tx, *vdev, Some((0, i64::MAX as u64)), &out).await?;
    }
    sqlx::query("DELETE FROM extents")
        .execute(&mut *tx)
        .await
        .map_err(dbe)?;
    tx.commit().await.map_err(dbe)?;
    Ok(rows.len() as u64)
}

/// Every owner run, in order: the owner maps' rows decoded, plus any rows
/// of the older one-row-per-run table.
async fn read_owner_runs(
    conn: &mut sqlx::SqliteConnection,
    has_maps: bool,
) -> Result<Vec<(u32, u64, u64, u32)>, String> {
    let legacy = sqlx::query_as::<_, (i64, i64, i64, i64)>(
        "SELECT vdev, start, stop, owner FROM owner_runs ORDER BY vdev, start",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| e.to_string())?
    .into_iter()
    .map(|(v, s, e, o)| (v as u32, u(s), u(e), o as u32))
    .collect();
    let rows = if has_maps {
        sqlx::query_as::<_, (i64, i64, Vec<u8>)>(
            "SELECT vdev, start, data FROM owner_maps ORDER BY vdev, start",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|(v, s, d)| (v as u32, u(s), d))
        .collect()
    } else {
        Vec::new()
    };
    owner_map::load_runs(rows, legacy)
}

/// Replace the owner-map rows of `vdev` in `[start, end)` (whole windows)
/// by `runs`.
async fn write_owner_maps(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    vdev: u32,
    start: u64,
    end: u64,
    runs: &[(u64, u64, u32)],
) -> Result<(), String> {
    let db = |e: sqlx::Error| e.to_string();
    sqlx::query("DELETE FROM owner_maps WHERE vdev = ? AND start >= ? AND start < ?")
        .bind(vdev as i64)
        .bind(i(start))
        .bind(i(end.min(i64::MAX as u64)))
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    for (window, data) in owner_map::rows(runs) {
        sqlx::query("INSERT INTO owner_maps (vdev, start, data) VALUES (?, ?, ?)")
            .bind(vdev as i64)
            .bind(i(window))
            .bind(data)
            .execute(&mut **tx)
            .await
            .map_err(db)?;
    }
    Ok(())
}

/// Move rows of the one-row-per-run owner table (an older binary's) into
/// owner maps, in one transaction. Overlapping runs refuse the store as
/// inconsistent, with nothing written.
async fn convert_owner_runs(db: &SqlitePool) -> Result<u64, String> {
    let dbe = |e: sqlx::Error| e.to_string();
    let mut tx = db.begin().await.map_err(dbe)?;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM owner_runs")
        .fetch_one(&mut *tx)
        .await
        .map_err(dbe)?;
    if n == 0 {
        return Ok(0);
    }
    let all = read_owner_runs(&mut tx, true)
        .await
        .map_err(|e| format!("it is inconsistent: {e}"))?;
    sqlx::query("DELETE FROM owner_maps")
        .execute(&mut *tx)
        .await
        .map_err(dbe)?;
    sqlx::query("DELETE FROM owner_runs")
        .execute(&mut *tx)
        .await
        .map_err(dbe)?;
    for (vdev, runs) in owner_map::by_vdev(&all) {
        write_owner_maps(&mut tx, vdev, 0, u64::MAX, &runs).await?;
    }
    tx.commit().await.map_err(dbe)?;
    Ok(n as u64)
}

impl Store for SqliteStore {
    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>> {
        Box::pin(async move {
            let mut conn = self
                .db
                .acquire()
                .await
                .map_err(|e| StoreError(e.to_string()))?;
            load_state(&mut conn).await.map_err(|e| {
                StoreError(format!(
                    "store {} is inconsistent: {e}",
                    self.path.display()
                ))
            })
        })
    }

    fn create(&self, pool_guid: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO pool (id, guid, name, synced_txg, created_ms) VALUES (1, ?, ?, 0, ?)",
            )
            .bind(i(pool_guid))
            .bind(&self.pool_name)
            .bind(now_ms())
            .execute(&self.db)
            .await
            .map_err(|e| StoreError(format!("create pool: {e}")))?;
            Ok(())
        })
    }

    fn persist<'a>(&'a self, record: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move { self.persist_txg(record).await.map_err(StoreError) })
    }

    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let db = |e: sqlx::Error| StoreError(format!("bump the generation: {e}"));
            // The bump and its history row in one transaction.
            let mut tx = self.db.begin().await.map_err(db)?;
            let (g, synced): (i64, i64) = sqlx::query_as(
                "UPDATE pool SET generation = generation + 1 WHERE id = 1
                 RETURNING generation, synced_txg",
            )
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
            sqlx::query(
                "INSERT INTO generations (generation, synced_txg_at_open, opened_ms)
                 VALUES (?, ?, ?)",
            )
            .bind(g)
            .bind(synced)
            .bind(now_ms())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
            tx.commit().await.map_err(db)?;
            Ok(u(g))
        })
    }

    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let g: i64 = sqlx::query_scalar("SELECT rewind_generation FROM pool WHERE id = 1")
                .fetch_one(&self.db)
                .await
                .map_err(|e| StoreError(format!("read the rewind generation: {e}")))?;
            Ok(u(g))
        })
    }

    fn set_rewind_generation(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query("UPDATE pool SET rewind_generation = ? WHERE id = 1")
                .bind(i(g))
                .execute(&self.db)
                .await
                .map_err(|e| StoreError(format!("record the rewind: {e}")))?;
            Ok(())
        })
    }

    fn generation_history(&self) -> BoxFuture<'_, Result<BTreeMap<u64, Txg>, StoreError>> {
        Box::pin(async move {
            let rows = sqlx::query_as::<_, (i64, i64)>(
                "SELECT generation, synced_txg_at_open FROM generations ORDER BY generation",
            )
            .fetch_all(&self.db)
            .await
            .map_err(|e| StoreError(format!("read the generation history: {e}")))?;
            Ok(rows.into_iter().map(|(g, t)| (u(g), u(t))).collect())
        })
    }

    fn relocation(&self, id: u64) -> BoxFuture<'_, Result<Option<RelocationRecord>, StoreError>> {
        Box::pin(async move {
            let row = sqlx::query(
                "SELECT plan_id, from_vdev, from_offset, from_size, to_vdev, to_offset, to_size, txg
                 FROM relocations WHERE allocation_id = ?",
            )
            .bind(i(id))
            .fetch_optional(&self.db)
            .await
            .map_err(|e| StoreError(format!("relocation {id}: {e}")))?;
            Ok(row.map(|r| {
                RelocationRecord::from_columns(id, std::array::from_fn(|k| r.get::<i64, _>(k)))
            }))
        })
    }

    fn relocation_totals(&self) -> BoxFuture<'_, Result<(u64, u64), StoreError>> {
        Box::pin(async move {
            let (n, bytes): (i64, i64) =
                sqlx::query_as("SELECT COUNT(*), COALESCE(SUM(from_size), 0) FROM relocations")
                    .fetch_one(&self.db)
                    .await
                    .map_err(|e| StoreError(format!("relocation totals: {e}")))?;
            Ok((u(n), u(bytes)))
        })
    }

    fn largest_extents(
        &self,
        vdev: u32,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        Box::pin(async move {
            let err = |err: String| StoreError(format!("largest extents of vdev {vdev}: {err}"));
            let mut best = spacemap::Largest::new(limit);
            let mut rows = sqlx::query(
                "SELECT vdev, start, width, data FROM spacemaps WHERE vdev = ? ORDER BY start",
            )
            .bind(vdev as i64)
            .fetch(&self.db);
            while let Some(r) = rows.try_next().await.map_err(|e| err(e.to_string()))? {
                best.push_chunk(&chunk_of_row(&r).map_err(err)?);
            }
            Ok(best.into_extents(vdev))
        })
    }

    fn allocated_overlapping(&self, e: Extent) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        Box::pin(async move {
            let (off, end) = crate::store::sql_span(&e);
            let rows = sqlx::query(span_rows_sql!())
                .bind(e.vdev as i64)
                .bind(i(off))
                .bind(i(end))
                .fetch_all(&self.db)
                .await
                .map_err(|err| crate::store::overlap_error(e, err))?;
            crate::store::overlapping_in_rows(&e, rows.iter().map(crate::store::span_row))
        })
    }

    fn allocated_overlapping_many<'a>(
        &'a self,
        extents: &'a [Extent],
    ) -> BoxFuture<'a, Result<Vec<Vec<Extent>>, StoreError>> {
        let fetch = move |vdev: u32, off: u64, end: u64, limit: usize| async move {
            sqlx::query(concat!(span_rows_sql!(), " LIMIT ?4"))
                .bind(vdev as i64)
                .bind(i(off))
                .bind(i(end))
                .bind(limit.min(i64::MAX as usize) as i64)
                .fetch_all(&self.db)
                .await
                .map(|rows| crate::store::span_rows(rows.iter().map(crate::store::span_row)))
                .map_err(|err| {
                    crate::store::overlap_error(format_args!("{off}..{end} of vdev {vdev}"), err)
                })
        };
        Box::pin(crate::store::overlapping_batched(
            extents,
            crate::store::SPAN_ROWS,
            fetch,
        ))
    }

    fn set_tunable<'a>(
        &'a self,
        name: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO tunables (name, value, set_ms) VALUES (?, ?, ?)
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value, set_ms = excluded.set_ms",
            )
            .bind(name)
            .bind(value)
            .bind(now_ms())
            .execute(&self.db)
            .await
            .map_err(|e| StoreError(format!("persist tunable {name}: {e}")))?;
            Ok(())
        })
    }

    fn agent_bindings(&self) -> BoxFuture<'_, Result<BTreeMap<String, u64>, StoreError>> {
        Box::pin(async move {
            let rows: Vec<(String, i64)> =
                sqlx::query_as("SELECT name, device_guid FROM agent_bindings")
                    .fetch_all(&self.db)
                    .await
                    .map_err(|e| StoreError(format!("read agent bindings: {e}")))?;
            // Guids are u64 stored as SQLite's i64, bit for bit.
            Ok(rows.into_iter().map(|(n, g)| (n, g as u64)).collect())
        })
    }

    fn bind_agent<'a>(
        &'a self,
        name: &'a str,
        device_guid: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO agent_bindings (name, device_guid, bound_ms) VALUES (?, ?, ?)",
            )
            .bind(name)
            .bind(device_guid as i64)
            .bind(now_ms())
            .execute(&self.db)
            .await
            .map_err(|e| StoreError(format!("bind agent {name}: {e}")))?;
            Ok(())
        })
    }
}
