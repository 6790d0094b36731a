//! The PostgreSQL dialect of the SQL store (`crate::sql_store`): the
//! pool's state in a database several allocators share, schema from
//! `migrations/allocator-postgres/`. One database may hold several pools,
//! each by name with its own leadership.
//!
//! Leadership is the pool's `leaders` row, taken by compare-and-swap with
//! the next generation when the holder's lease has expired by the
//! database's clock (neon's storage controller does the same with its
//! generation row: `docs/rfcs/034-storage-controller-restarts.md`). Every
//! txg's transaction starts with `UPDATE leaders … WHERE generation =
//! mine` (the dialect's fence): a leader that was paused and replaced
//! persists nothing, and [`PgStore::deposed`] says so. The txg and the
//! leader's renewals race on that row lock, so a txg either commits before
//! a takeover (the new leader loads it) or sees the new generation and
//! commits nothing.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use metaslab::Txg;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{Column as _, Postgres, Row as _, TypeInfo, ValueRef};

use crate::sql_store::{Conn, Dialect, EachRow, Row, SqlStore, Val, args, i, u};
use crate::store::{Persisted, StoreError};

/// The schema, embedded from `migrations/allocator-postgres/`.
pub static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/allocator-postgres");

mod sql {
    macro_rules! sql {
        ($($name:ident = $file:literal;)*) => {
            $(pub const $name: &str = include_str!(concat!("sql_store/postgres/", $file));)*
        };
    }
    sql! {
        INSERT_SPACEMAP = "insert_spacemap.sql";
        INSERT_OWNER_MAP = "insert_owner_map.sql";
        COPIES_ON = "copies_on.sql";
        DELETE_OWNER_WINDOWS = "delete_owner_windows.sql";
        FENCE = "fence.sql";
        SNAPSHOT = "snapshot.sql";
        TRY_ACQUIRE = "try_acquire.sql";
        FORGET_STANDBY = "forget_standby.sql";
        RENEW = "renew.sql";
        STAND_BY = "stand_by.sql";
        STANDBYS = "standbys.sql";
        LEADER = "leader.sql";
        HAS_MIGRATIONS = "has_migrations.sql";
        NEWEST_MIGRATION = "newest_migration.sql";
        READ_ONLY = "read_only.sql";
        COMMIT = "commit.sql";
    }
}

/// Why a PostgreSQL store was not opened. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("--store {url}: {reason}")]
    Url { url: String, reason: String },
    #[error("cannot reach the store at {url}: {reason} (is PostgreSQL running there?)")]
    Connect { url: String, reason: String },
    #[error("refusing the store at {url}: {reason} (nothing was written)")]
    Refused { url: String, reason: String },
    #[error(
        "refusing the store at {url}: {detail}; give this pool's --pool and --pool-guid (nothing was written)"
    )]
    OtherPool { url: String, detail: String },
}

/// Who leads a pool, as the leadership row says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leader {
    pub generation: u64,
    pub id: String,
    pub address: String,
    /// Milliseconds left on its lease by the database's clock (0: expired).
    pub lease_left_ms: u64,
}

/// PostgreSQL: several pools and several allocators per database; this
/// allocator's part in its pool's leadership.
pub struct PgDialect {
    /// This allocator's identity in the leadership row.
    me: String,
    /// The generation this allocator leads under (0: not leading).
    generation: AtomicU64,
    /// A write or renewal found the leadership row at another generation.
    deposed: AtomicBool,
    /// The address standbys name as the leader's.
    address: Mutex<String>,
    /// The leader before this one handed over cleanly (`release(true)`).
    clean_before: AtomicBool,
}

/// The store of one pool in a PostgreSQL database.
pub type PgStore = SqlStore<PgDialect>;

fn bind_all(
    mut q: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    args: Vec<Val>,
) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
    for a in args {
        q = match a {
            Val::Null => q.bind(None::<i64>),
            Val::Int(v) => q.bind(v),
            Val::Real(v) => q.bind(v),
            Val::Text(v) => q.bind(v),
            Val::Blob(v) => q.bind(v),
            Val::Ints(v) => q.bind(v),
            Val::Blobs(v) => q.bind(v),
        };
    }
    q
}

/// A row's values by their column types.
fn row_of(r: &PgRow) -> Result<Row, sqlx::Error> {
    let mut out = Vec::with_capacity(r.len());
    for k in 0..r.len() {
        let v = if r.try_get_raw(k)?.is_null() {
            Val::Null
        } else {
            match r.column(k).type_info().name() {
                "INT8" => Val::Int(r.try_get(k)?),
                "INT4" => Val::Int(r.try_get::<i32, _>(k)?.into()),
                "INT2" => Val::Int(r.try_get::<i16, _>(k)?.into()),
                "FLOAT8" => Val::Real(r.try_get(k)?),
                "BYTEA" => Val::Blob(r.try_get(k)?),
                _ => Val::Text(r.try_get(k)?),
            }
        };
        out.push(v);
    }
    Ok(Row(out))
}

impl Dialect for PgDialect {
    type Db = Postgres;
    const INSERT_SPACEMAP: &'static str = sql::INSERT_SPACEMAP;
    const INSERT_OWNER_MAP: &'static str = sql::INSERT_OWNER_MAP;
    const COPIES_ON: &'static str = sql::COPIES_ON;
    const DELETE_OWNER_WINDOWS: &'static str = sql::DELETE_OWNER_WINDOWS;
    const ARRAYS: bool = true;
    const LEGACY_EXTENTS: Option<(&'static str, &'static str)> = None;
    const SNAPSHOT: Option<&'static str> = Some(sql::SNAPSHOT);
    const BEGIN_TXG: &'static str = "BEGIN";

    fn exec<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            Ok(bind_all(sqlx::query(sql), args)
                .execute(&mut *c)
                .await?
                .rows_affected())
        })
    }

    fn fetch<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<Vec<Row>, sqlx::Error>> {
        Box::pin(async move {
            bind_all(sqlx::query(sql), args)
                .fetch_all(&mut *c)
                .await?
                .iter()
                .map(row_of)
                .collect()
        })
    }

    fn each<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
        f: EachRow<'c>,
    ) -> BoxFuture<'c, Result<(), String>> {
        Box::pin(async move {
            let mut rows = bind_all(sqlx::query(sql), args).fetch(&mut *c);
            while let Some(r) = rows.try_next().await.map_err(|e| e.to_string())? {
                f(row_of(&r).map_err(|e| e.to_string())?)?;
            }
            Ok(())
        })
    }

    fn fence<'c>(
        s: &'c SqlStore<Self>,
        c: &'c mut Conn<Self>,
        txg: Txg,
    ) -> BoxFuture<'c, Result<(), StoreError>> {
        Box::pin(async move {
            let mine = s.generation();
            let a = args![&s.pool_name, i(mine), i(txg), &s.dialect.me];
            let n = Self::exec(c, sql::FENCE, a)
                .await
                .map_err(|e| StoreError(format!("txg {txg}: {e}")))?;
            if n == 0 {
                s.dialect.deposed.store(true, Ordering::Release);
                return Err(StoreError(format!(
                    "txg {txg}: generation {mine} no longer leads pool {:?}: persisted nothing",
                    s.pool_name
                )));
            }
            Ok(())
        })
    }

    fn after_commit(_: &mut Conn<Self>, _: Txg) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn open_generation(s: &SqlStore<Self>) -> BoxFuture<'_, Result<u64, StoreError>> {
        // The generation was taken with the leadership (`try_acquire`).
        let g = s.generation();
        Box::pin(async move {
            if g == 0 {
                return Err(StoreError(
                    "open_generation before taking the leadership".into(),
                ));
            }
            Ok(g)
        })
    }

    fn fenced(s: &SqlStore<Self>) -> bool {
        s.deposed()
    }

    fn handed_over_cleanly(s: &SqlStore<Self>) -> bool {
        s.dialect.clean_before.load(Ordering::Acquire)
    }
}

/// The lease `PgStore::open` bounds its sessions by (tools and tests that
/// lead no pool under a lease of their own).
const DEFAULT_SESSION_LEASE: Duration = Duration::from_secs(10);

impl SqlStore<PgDialect> {
    /// Connect, refuse a schema newer than this binary or a pool of another
    /// guid, then migrate. `me` names this allocator in the leadership row.
    pub async fn open(
        url: &str,
        pool_name: &str,
        expect_guid: Option<u64>,
        me: &str,
    ) -> Result<PgStore, OpenError> {
        Self::open_with_lease(url, pool_name, expect_guid, me, DEFAULT_SESSION_LEASE).await
    }

    /// `open` for an allocator leading under a `lease`: every session it
    /// opens bounds its statements by the lease and its lock waits and
    /// idle transactions by half of it. A leader cut off from the server
    /// inside a txg's transaction (which holds the `leaders` row) then has
    /// that transaction ended by the server, its row lock released, within
    /// half a lease, so a standby takes the pool when the lease runs out
    /// and the cut-off transaction commits nothing.
    pub async fn open_with_lease(
        url: &str,
        pool_name: &str,
        expect_guid: Option<u64>,
        me: &str,
        lease: Duration,
    ) -> Result<PgStore, OpenError> {
        let shown = redact(url);
        let opts: PgConnectOptions = url.parse().map_err(|e| OpenError::Url {
            url: shown.clone(),
            reason: format!("not a PostgreSQL URL: {e}"),
        })?;
        let opts = opts.application_name("aliquot-allocator");
        let connect = |lease: Duration, n: u32| {
            let ms = |d: Duration| d.as_millis().max(1).to_string();
            PgPoolOptions::new()
                .max_connections(n)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(opts.clone().options([
                    ("statement_timeout", ms(lease)),
                    ("lock_timeout", ms(lease / 2)),
                    ("idle_in_transaction_session_timeout", ms(lease / 2)),
                ]))
        };
        let unreachable = |e: sqlx::Error| OpenError::Connect {
            url: shown.clone(),
            reason: e.to_string(),
        };
        let refuse = |reason: String| OpenError::Refused {
            url: shown.clone(),
            reason,
        };
        let dialect = || PgDialect {
            me: me.to_string(),
            generation: AtomicU64::new(0),
            deposed: AtomicBool::new(false),
            address: Mutex::new(String::new()),
            clean_before: AtomicBool::new(false),
        };
        // The schema is checked, migrated and converted on a session of its
        // own with the default bounds: a migration (or waiting for another
        // allocator's) may take longer than a short lease allows.
        let setup = connect(DEFAULT_SESSION_LEASE, 1)
            .await
            .map_err(unreachable)?;
        {
            let mut c = setup.acquire().await.map_err(|e| refuse(e.to_string()))?;
            check_schema(&mut c).await.map_err(refuse)?;
        }
        MIGRATOR
            .run(&setup)
            .await
            .map_err(|e| refuse(format!("cannot migrate it: {e}")))?;
        let converting = SqlStore::new(setup, shown.clone(), pool_name, dialect());
        let (_, moved) = converting.convert_legacy().await.map_err(refuse)?;
        if moved > 0 {
            tracing::info!(store = %shown, runs = moved, "owner rows moved into owner maps");
        }
        converting.db.close().await;
        let db = connect(lease, 4).await.map_err(unreachable)?;
        let store = SqlStore::new(db, shown.clone(), pool_name, dialect());
        let guid = store.find_pool().await.map_err(refuse)?;
        if let (Some(guid), Some(want)) = (guid, expect_guid)
            && guid != want
        {
            return Err(OpenError::OtherPool {
                url: shown,
                detail: format!(
                    "its pool {pool_name:?} has guid {guid:#x}, not the expected {want:#x}"
                ),
            });
        }
        tracing::info!(store = %shown, pool = pool_name, "PostgreSQL store opened");
        Ok(store)
    }

    pub fn url(&self) -> &str {
        &self.shown
    }

    /// The address this allocator advertises as leader.
    pub fn address(&self) -> String {
        self.dialect
            .address
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Set the address this allocator advertises as leader.
    pub fn set_address(&self, a: &str) {
        *self
            .dialect
            .address
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = a.to_string();
    }

    /// A write or renewal found another generation: stop serving.
    pub fn deposed(&self) -> bool {
        self.dialect.deposed.load(Ordering::Acquire)
    }

    /// The generation this allocator leads under, 0 if none.
    pub fn generation(&self) -> u64 {
        self.dialect.generation.load(Ordering::Acquire)
    }

    /// Take the leadership when its lease expired (or nobody held it),
    /// with the next generation, recorded in the history with the synced
    /// txg at this moment. `Some(generation)` when taken.
    pub async fn try_acquire(&self, lease: Duration) -> Result<Option<u64>, StoreError> {
        let db = |e: sqlx::Error| StoreError(format!("take the leadership: {e}"));
        let address = self.address();
        let me = &self.dialect.me;
        let mut tx = self.db.begin().await.map_err(db)?;
        // Read before the row is taken over: did the last leader leave it
        // cleanly?
        let mut before = PgDialect::fetch(
            &mut tx,
            crate::sql_store::q::LEADER_ID,
            args![&self.pool_name],
        )
        .await
        .map_err(db)?;
        let clean_before = match before.first_mut() {
            Some(r) => r.text(0).map_err(StoreError)? == crate::sql_store::HANDED_OVER_CLEANLY,
            None => false,
        };
        let a = args![&self.pool_name, me, &address, lease.as_millis() as i64];
        let rows = PgDialect::fetch(&mut tx, sql::TRY_ACQUIRE, a)
            .await
            .map_err(db)?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let g = r.int(0).map_err(StoreError)?;
        // The pool row, if an earlier leader created it: its id, and the
        // synced txg this generation opens at.
        let id = self
            .record_generation(&mut tx, g, me, &address)
            .await
            .map_err(db)?;
        PgDialect::exec(&mut tx, sql::FORGET_STANDBY, args![&self.pool_name, me])
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        self.dialect
            .clean_before
            .store(clean_before, Ordering::Release);
        self.pool_id.store(id, Ordering::Release);
        self.dialect.deposed.store(false, Ordering::Release);
        self.dialect.generation.store(u(g), Ordering::Release);
        Ok(Some(u(g)))
    }

    async fn run(&self, sql: &'static str, a: Vec<Val>) -> Result<Vec<Row>, sqlx::Error> {
        let mut c = self.db.acquire().await?;
        PgDialect::fetch(&mut c, sql, a).await
    }

    async fn exec_one(&self, sql: &'static str, a: Vec<Val>) -> Result<u64, sqlx::Error> {
        let mut c = self.db.acquire().await?;
        PgDialect::exec(&mut c, sql, a).await
    }

    /// Extend the lease. `Ok(false)`: another allocator took the pool (or
    /// this one stepped down): this one is deposed.
    pub async fn renew(&self, lease: Duration) -> Result<bool, StoreError> {
        let mine = self.generation();
        if mine == 0 || self.deposed() {
            return Ok(false);
        }
        let a = args![
            &self.pool_name,
            i(mine),
            lease.as_millis() as i64,
            &self.dialect.me
        ];
        let n = self
            .exec_one(sql::RENEW, a)
            .await
            .map_err(|e| StoreError(format!("renew the leadership: {e}")))?;
        if n == 0 {
            self.dialect.deposed.store(true, Ordering::Release);
        }
        Ok(n == 1)
    }

    /// Give the leadership up at once (step-down): a standby takes it at
    /// its next poll, without waiting for the lease. `clean`: the last txg
    /// synced and no claim window was open, which the row then says (the
    /// next leader opens no claim window).
    pub async fn release(&self, clean: bool) -> Result<(), StoreError> {
        let mine = self.generation();
        self.dialect.deposed.store(true, Ordering::Release);
        if mine == 0 {
            return Ok(());
        }
        let a = args![
            &self.pool_name,
            i(mine),
            &self.dialect.me,
            clean as i64,
            crate::sql_store::HANDED_OVER_CLEANLY
        ];
        self.exec_one(crate::sql_store::q::RELEASE, a)
            .await
            .map_err(|e| StoreError(format!("step down: {e}")))?;
        Ok(())
    }

    /// A standby's poll: record that it polls (for the leader's status
    /// view) and read who leads, in one statement.
    pub async fn stand_by(&self) -> Result<Leader, StoreError> {
        let e = |e: String| StoreError(format!("standby poll: {e}"));
        let a = args![&self.pool_name, &self.dialect.me, self.address()];
        let rows = self
            .run(sql::STAND_BY, a)
            .await
            .map_err(|x| e(x.to_string()))?;
        leader_of(rows).map_err(e)
    }

    /// Standbys seen polling in the last 3 s (this allocator excluded).
    pub async fn standbys(&self) -> Result<Vec<String>, StoreError> {
        let e = |e: String| StoreError(format!("read the standbys: {e}"));
        let rows = self
            .run(sql::STANDBYS, args![&self.pool_name, &self.dialect.me])
            .await
            .map_err(|x| e(x.to_string()))?;
        rows.into_iter()
            .map(|mut r| r.text(0))
            .collect::<Result<_, _>>()
            .map_err(e)
    }

    /// The pool's leader as the database says.
    pub async fn leader(&self) -> Result<Leader, StoreError> {
        let e = |e: String| StoreError(format!("read the leadership: {e}"));
        let rows = self
            .run(sql::LEADER, args![&self.pool_name])
            .await
            .map_err(|x| e(x.to_string()))?;
        leader_of(rows).map_err(e)
    }
}

/// Refuse a database whose schema is newer than this binary's migrations
/// (a newer allocator migrated it), before migrating anything.
async fn check_schema(c: &mut sqlx::PgConnection) -> Result<(), String> {
    let db = |e: sqlx::Error| e.to_string();
    let rows = PgDialect::fetch(c, sql::HAS_MIGRATIONS, args![])
        .await
        .map_err(db)?;
    if rows.first().map(|r| r.int(0)).transpose()?.unwrap_or(0) == 0 {
        return Ok(());
    }
    let rows = PgDialect::fetch(c, sql::NEWEST_MIGRATION, args![])
        .await
        .map_err(db)?;
    let newest = rows.first().map(|r| r.opt_int(0)).transpose()?.flatten();
    let ours = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match newest {
        Some(v) if v > ours => Err(format!(
            "its schema is at version {v}, newer than this binary's {ours}: run a newer \
             aliquot-allocator"
        )),
        _ => Ok(()),
    }
}

/// Read pool `pool_name` without changing anything (`aliquotctl verify
/// --store postgres://…`), in one repeatable-read snapshot.
pub async fn read_only(url: &str, pool_name: &str) -> Result<Option<Persisted>, String> {
    let shown = redact(url);
    let opts: PgConnectOptions = url
        .parse()
        .map_err(|e| format!("--store {shown}: not a PostgreSQL URL: {e}"))?;
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect_with(&opts)
        .await
        .map_err(|e| format!("cannot reach the store at {shown}: {e}"))?;
    let db = |e: sqlx::Error| e.to_string();
    PgDialect::exec(&mut conn, sql::READ_ONLY, args![])
        .await
        .map_err(db)?;
    let rows = PgDialect::fetch(
        &mut conn,
        crate::sql_store::q::POOL_OF_NAME,
        args![pool_name],
    )
    .await
    .map_err(|e| format!("the store at {shown} holds no Aliquot schema? ({e})"))?;
    let r = match rows.first().map(|r| r.int(0)).transpose()? {
        Some(id) => PgStore::load_state(&mut conn, id).await,
        None => Ok(None),
    };
    let _ = PgDialect::exec(&mut conn, sql::COMMIT, args![]).await;
    r.map_err(|e| format!("the store at {shown} is inconsistent: {e}"))
}

/// The URL without its password, for messages and logs.
pub fn redact(url: &str) -> String {
    // scheme://user:password@host/…: the password is between the first
    // ':' after the scheme and the '@' ending the authority.
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}{path}")
        }
        _ => url.to_string(),
    }
}

/// A `leaders` row as read: generation, holder id, address, lease left (ms).
fn leader_of(rows: Vec<Row>) -> Result<Leader, String> {
    let Some(mut r) = rows.into_iter().next() else {
        return Ok(Leader::default());
    };
    Ok(Leader {
        generation: u(r.int(0)?),
        id: r.text(1)?,
        address: r.text(2)?,
        lease_left_ms: r.real(3)? as u64,
    })
}

/// Is `s` a PostgreSQL URL (what `--store` takes)?
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}
