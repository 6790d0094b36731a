//! The PostgreSQL store (issue 26): the pool's state in a database several
//! allocators share, behind the same seam as the SQLite store
//! (`crate::store`), schema from `migrations/allocator-postgres/`. One
//! database may hold several pools, each by name with its own leadership.
//!
//! Leadership is the pool's `leaders` row, taken by compare-and-swap with
//! the next generation when the holder's lease has expired by the
//! database's clock (neon's storage controller does the same with its
//! generation row: `docs/rfcs/034-storage-controller-restarts.md`). Every
//! txg's transaction starts with `UPDATE leaders … WHERE generation =
//! mine`: a leader that was paused and replaced persists nothing, and
//! [`PgStore::deposed`] says so. The txg and the leader's renewals race on
//! that row lock, so a txg either commits before a takeover (the new leader
//! loads it) or sees the new generation and commits nothing.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::TryStreamExt;
use futures_util::future::BoxFuture;
use metaslab::{Extent, SpaceChangeKind, Txg, VdevRole};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row};

use crate::owner_map;
use crate::spacemap::{self, Chunk};
use crate::store::{
    Persisted, RelocationRecord, Store, StoreError, TxgRecord, VdevChanges, VdevRow,
};

/// The schema, embedded from `migrations/allocator-postgres/`.
pub static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/allocator-postgres");

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

/// The store of one pool in a PostgreSQL database.
pub struct PgStore {
    db: PgPool,
    url: String,
    pool_name: String,
    /// The pool row's id once it exists (0: not yet created).
    pool_id: AtomicI64,
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

/// The holder id a leader leaves in the `leaders` row when it hands over
/// cleanly: its last txg synced and it had no claim window open, so the
/// next leader has nothing to wait for claims of.
const HANDED_OVER_CLEANLY: &str = "(handed over cleanly)";

fn u(v: i64) -> u64 {
    v as u64
}

/// The chunk rows any extent in `[$3, $4)` of vdev `$2` can be in: the
/// one starting last at or before `$3`, then those starting inside (see
/// `spacemap`). Free's batch form appends a LIMIT.
macro_rules! span_rows_sql {
    () => {
        "SELECT start, width, data FROM spacemaps
         WHERE pool = $1 AND vdev = $2 AND start < $4 AND start >= COALESCE(
             (SELECT MAX(start) FROM spacemaps
              WHERE pool = $1 AND vdev = $2 AND start <= $3), $3)
         ORDER BY start"
    };
}

fn i(v: u64) -> i64 {
    v as i64
}

fn now_ms() -> i64 {
    crate::convert::unix_ms() as i64
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
fn leader_of(r: Option<(i64, String, String, f64)>) -> Leader {
    r.map_or_else(Leader::default, |(g, id, address, left)| Leader {
        generation: u(g),
        id,
        address,
        lease_left_ms: left as u64,
    })
}

/// Is `s` a PostgreSQL URL (what `--store` takes)?
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

impl PgStore {
    /// Connect, refuse a schema newer than this binary or a pool of another
    /// guid, then migrate. `me` names this allocator in the leadership row.
    pub async fn open(
        url: &str,
        pool_name: &str,
        expect_guid: Option<u64>,
        me: &str,
    ) -> Result<PgStore, OpenError> {
        let shown = redact(url);
        let opts: PgConnectOptions = url.parse().map_err(|e| OpenError::Url {
            url: shown.clone(),
            reason: format!("not a PostgreSQL URL: {e}"),
        })?;
        let opts = opts
            .application_name("aliquot-allocator")
            // A hung server must not hang a txg for ever: the leader's
            // lease runs out meanwhile and it stops serving anyway.
            .options([("statement_timeout", "10000"), ("lock_timeout", "10000")]);
        let db = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts)
            .await
            .map_err(|e| OpenError::Connect {
                url: shown.clone(),
                reason: e.to_string(),
            })?;
        let refuse = |reason: String| OpenError::Refused {
            url: shown.clone(),
            reason,
        };
        check_schema(&db).await.map_err(refuse)?;
        MIGRATOR
            .run(&db)
            .await
            .map_err(|e| refuse(format!("cannot migrate it: {e}")))?;
        let moved = convert_owner_runs(&db).await.map_err(refuse)?;
        if moved > 0 {
            tracing::info!(store = %shown, runs = moved, "owner rows moved into owner maps");
        }
        let row: Option<(i64, i64)> = sqlx::query_as("SELECT id, guid FROM pools WHERE name = $1")
            .bind(pool_name)
            .fetch_optional(&db)
            .await
            .map_err(|e| refuse(e.to_string()))?;
        if let (Some((_, guid)), Some(want)) = (row, expect_guid)
            && u(guid) != want
        {
            return Err(OpenError::OtherPool {
                url: shown,
                detail: format!(
                    "its pool {pool_name:?} has guid {:#x}, not the expected {want:#x}",
                    u(guid)
                ),
            });
        }
        sqlx::query("INSERT INTO leaders (pool) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(pool_name)
            .execute(&db)
            .await
            .map_err(|e| refuse(e.to_string()))?;
        tracing::info!(store = %shown, pool = pool_name, "PostgreSQL store opened");
        Ok(PgStore {
            db,
            url: shown,
            pool_name: pool_name.to_string(),
            pool_id: AtomicI64::new(row.map_or(0, |r| r.0)),
            me: me.to_string(),
            generation: AtomicU64::new(0),
            deposed: AtomicBool::new(false),
            address: Mutex::new(String::new()),
            clean_before: AtomicBool::new(false),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn close(&self) {
        self.db.close().await;
    }

    /// The address this allocator advertises as leader.
    pub fn address(&self) -> String {
        self.address
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Set the address this allocator advertises as leader.
    pub fn set_address(&self, a: &str) {
        *self.address.lock().unwrap_or_else(|p| p.into_inner()) = a.to_string();
    }

    /// A write or renewal found another generation: stop serving.
    pub fn deposed(&self) -> bool {
        self.deposed.load(Ordering::Acquire)
    }

    /// The generation this allocator leads under, 0 if none.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Take the leadership when its lease expired (or nobody held it),
    /// with the next generation, recorded in the history with the synced
    /// txg at this moment. `Some(generation)` when taken.
    pub async fn try_acquire(&self, lease: Duration) -> Result<Option<u64>, StoreError> {
        let db = |e: sqlx::Error| StoreError(format!("take the leadership: {e}"));
        let address = self
            .address
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut tx = self.db.begin().await.map_err(db)?;
        // Read before the row is taken over: did the last leader leave it
        // cleanly?
        let before: Option<String> =
            sqlx::query_scalar("SELECT leader_id FROM leaders WHERE pool = $1")
                .bind(&self.pool_name)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db)?;
        let g: Option<i64> = sqlx::query_scalar(
            "UPDATE leaders SET generation = generation + 1, leader_id = $2, leader_address = $3,
                lease_until = clock_timestamp() + $4 * interval '1 millisecond'
             WHERE pool = $1 AND lease_until < clock_timestamp()
             RETURNING generation",
        )
        .bind(&self.pool_name)
        .bind(&self.me)
        .bind(&address)
        .bind(lease.as_millis() as i64)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let Some(g) = g else {
            return Ok(None);
        };
        // The pool row, if an earlier leader created it: its id, and the
        // synced txg this generation opens at.
        let pool: Option<(i64, i64)> =
            sqlx::query_as("SELECT id, synced_txg FROM pools WHERE name = $1")
                .bind(&self.pool_name)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db)?;
        let (id, synced) = pool.unwrap_or((0, 0));
        sqlx::query(
            "INSERT INTO generations (pool, generation, synced_txg_at_open, opened_ms, leader_id,
                leader_address) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&self.pool_name)
        .bind(g)
        .bind(synced)
        .bind(now_ms())
        .bind(&self.me)
        .bind(&address)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        sqlx::query("DELETE FROM standbys WHERE pool = $1 AND id = $2")
            .bind(&self.pool_name)
            .bind(&self.me)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        self.clean_before.store(
            before.as_deref() == Some(HANDED_OVER_CLEANLY),
            Ordering::Release,
        );
        self.pool_id.store(id, Ordering::Release);
        self.deposed.store(false, Ordering::Release);
        self.generation.store(u(g), Ordering::Release);
        Ok(Some(u(g)))
    }

    /// Extend the lease. `Ok(false)`: another allocator took the pool (or
    /// this one stepped down): this one is deposed.
    pub async fn renew(&self, lease: Duration) -> Result<bool, StoreError> {
        let mine = self.generation();
        if mine == 0 || self.deposed() {
            return Ok(false);
        }
        let n = sqlx::query(
            "UPDATE leaders SET lease_until = clock_timestamp() + $3 * interval '1 millisecond'
             WHERE pool = $1 AND generation = $2 AND leader_id = $4",
        )
        .bind(&self.pool_name)
        .bind(i(mine))
        .bind(lease.as_millis() as i64)
        .bind(&self.me)
        .execute(&self.db)
        .await
        .map_err(|e| StoreError(format!("renew the leadership: {e}")))?
        .rows_affected();
        if n == 0 {
            self.deposed.store(true, Ordering::Release);
        }
        Ok(n == 1)
    }

    /// Give the leadership up at once (step-down): a standby takes it at
    /// its next poll, without waiting for the lease. `clean`: the last txg
    /// synced and no claim window was open, which the row then says (the
    /// next leader opens no claim window).
    pub async fn release(&self, clean: bool) -> Result<(), StoreError> {
        let mine = self.generation();
        self.deposed.store(true, Ordering::Release);
        if mine == 0 {
            return Ok(());
        }
        sqlx::query(
            "UPDATE leaders SET lease_until = '-infinity',
                leader_id = CASE WHEN $4 THEN $5 ELSE leader_id END
             WHERE pool = $1 AND generation = $2 AND leader_id = $3",
        )
        .bind(&self.pool_name)
        .bind(i(mine))
        .bind(&self.me)
        .bind(clean)
        .bind(HANDED_OVER_CLEANLY)
        .execute(&self.db)
        .await
        .map_err(|e| StoreError(format!("step down: {e}")))?;
        Ok(())
    }

    /// A standby's poll: record that it polls (for the leader's status
    /// view) and read who leads, in one statement.
    pub async fn stand_by(&self) -> Result<Leader, StoreError> {
        let address = self.address();
        let r: Option<(i64, String, String, f64)> = sqlx::query_as(
            "WITH seen AS (
                INSERT INTO standbys (pool, id, address, seen)
                VALUES ($1, $2, $3, clock_timestamp())
                ON CONFLICT (pool, id) DO UPDATE SET address = excluded.address,
                    seen = excluded.seen)
             SELECT generation, leader_id, leader_address,
                GREATEST(0, EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::float8
             FROM leaders WHERE pool = $1",
        )
        .bind(&self.pool_name)
        .bind(&self.me)
        .bind(&address)
        .fetch_optional(&self.db)
        .await
        .map_err(|e| StoreError(format!("standby poll: {e}")))?;
        Ok(leader_of(r))
    }

    /// Standbys seen polling in the last 3 s (this allocator excluded).
    pub async fn standbys(&self) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT address FROM standbys WHERE pool = $1 AND id <> $2
                AND seen > clock_timestamp() - interval '3 seconds' ORDER BY address",
        )
        .bind(&self.pool_name)
        .bind(&self.me)
        .fetch_all(&self.db)
        .await
        .map_err(|e| StoreError(format!("read the standbys: {e}")))
    }

    /// The pool's leader as the database says.
    pub async fn leader(&self) -> Result<Leader, StoreError> {
        let r: Option<(i64, String, String, f64)> = sqlx::query_as(
            "SELECT generation, leader_id, leader_address,
                GREATEST(0, EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::float8
             FROM leaders WHERE pool = $1",
        )
        .bind(&self.pool_name)
        .fetch_optional(&self.db)
        .await
        .map_err(|e| StoreError(format!("read the leadership: {e}")))?;
        Ok(leader_of(r))
    }

    fn pool_id(&self) -> Result<i64, StoreError> {
        match self.pool_id.load(Ordering::Acquire) {
            0 => Err(StoreError("the pool is not created yet".into())),
            id => Ok(id),
        }
    }

    async fn persist_txg(&self, rec: &TxgRecord) -> Result<(), StoreError> {
        let pool = self.pool_id()?;
        let mine = self.generation();
        let txg = rec.sync.txg;
        let db = |e: sqlx::Error| StoreError(format!("txg {txg}: {e}"));
        let mut tx = self.db.begin().await.map_err(db)?;
        // The fence: first, and holding the leadership row until commit.
        let fenced = sqlx::query(
            "UPDATE leaders SET last_txg = $3 WHERE pool = $1 AND generation = $2 AND leader_id = $4",
        )
        .bind(&self.pool_name)
        .bind(i(mine))
        .bind(i(txg))
        .bind(&self.me)
        .execute(&mut *tx)
        .await
        .map_err(db)?
        .rows_affected()
            == 0;
        if fenced {
            self.deposed.store(true, Ordering::Release);
            return Err(StoreError(format!(
                "txg {txg}: generation {mine} no longer leads pool {:?}: persisted nothing",
                self.pool_name
            )));
        }
        let synced: i64 = sqlx::query_scalar("SELECT synced_txg FROM pools WHERE id = $1")
            .bind(pool)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        let synced = u(synced);
        if txg <= synced {
            if txg == synced {
                return Ok(()); // a retry of a txg whose commit did land
            }
            return Err(StoreError(format!(
                "txg {txg} persisted out of order (last {synced})"
            )));
        }
        for v in &rec.vdevs {
            let shift = v.spec.metaslab_shift.ok_or_else(|| {
                StoreError(format!("vdev {}: no metaslab shift to persist", v.id))
            })?;
            sqlx::query(
                "INSERT INTO vdevs (pool, id, guid, name, endpoint, capacity, ashift, metaslab_shift,
                    metaslab_size, children, parity, rotational, class, allocated, added_txg)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 0, $14)
                 ON CONFLICT (pool, id) DO UPDATE SET guid = excluded.guid, name = excluded.name,
                    endpoint = excluded.endpoint, capacity = excluded.capacity,
                    ashift = excluded.ashift, metaslab_shift = excluded.metaslab_shift,
                    metaslab_size = excluded.metaslab_size, children = excluded.children,
                    parity = excluded.parity, rotational = excluded.rotational,
                    class = excluded.class",
            )
            .bind(pool)
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
        let VdevChanges { by_vdev, delta } = VdevChanges::of(rec).map_err(StoreError)?;
        for (vdev, changes) in &by_vdev {
            persist_vdev(&mut tx, pool, *vdev, changes)
                .await
                .map_err(|e| StoreError(format!("txg {txg}: vdev {vdev}: {e}")))?;
        }
        for (vdev, d) in delta {
            if d != 0 {
                sqlx::query(
                    "UPDATE vdevs SET allocated = allocated + $1 WHERE pool = $2 AND id = $3",
                )
                .bind(d)
                .bind(pool)
                .bind(vdev as i64)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            }
        }
        for &(vdev, state) in &rec.vdev_states {
            sqlx::query(
                "UPDATE vdevs SET admin_state = $1,
                    removed_txg = CASE WHEN $1 = 'removed' THEN $2 ELSE removed_txg END
                 WHERE pool = $3 AND id = $4",
            )
            .bind(state.as_str())
            .bind(i(txg))
            .bind(pool)
            .bind(vdev as i64)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        let ms = now_ms();
        for r in &rec.relocations {
            sqlx::query(
                "INSERT INTO relocations (pool, allocation_id, plan_id, from_vdev, from_offset,
                    from_size, to_vdev, to_offset, to_size, txg, committed_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            )
            .bind(pool)
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
            sqlx::query("INSERT INTO owners (pool, idx, identity) VALUES ($1, $2, $3)")
                .bind(pool)
                .bind(*idx as i64)
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        for w in &rec.owners.windows {
            write_owner_maps(&mut tx, pool, w.vdev, w.start, w.end, &w.runs)
                .await
                .map_err(db)?;
        }
        sqlx::query("UPDATE pools SET synced_txg = $1, state_digest = $2 WHERE id = $3")
            .bind(i(txg))
            .bind(i(rec.state_digest))
            .bind(pool)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(())
    }
}

/// Refuse a database whose schema is newer than this binary's migrations
/// (a newer allocator migrated it), before migrating anything.
async fn check_schema(db: &PgPool) -> Result<(), String> {
    let has: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables
            WHERE table_schema = current_schema() AND table_name = '_sqlx_migrations')",
    )
    .fetch_one(db)
    .await
    .map_err(|e| e.to_string())?;
    if !has {
        return Ok(());
    }
    let newest: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations")
        .fetch_one(db)
        .await
        .map_err(|e| e.to_string())?;
    let ours = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match newest {
        Some(v) if v > ours => Err(format!(
            "its schema is at version {v}, newer than this binary's {ours}: run a newer \
             aliquot-allocator"
        )),
        _ => Ok(()),
    }
}

fn chunk_of_row(r: &PgRow) -> Result<Chunk, String> {
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

async fn read_run(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    pool: i64,
    vdev: u32,
    first: u64,
    last: u64,
) -> Result<Vec<(u64, u64)>, String> {
    let rows = sqlx::query(
        "SELECT vdev, start, width, data FROM spacemaps
         WHERE pool = $1 AND vdev = $2 AND start >= $3 AND start <= $4 ORDER BY start",
    )
    .bind(pool)
    .bind(vdev as i64)
    .bind(i(first))
    .bind(i(last))
    .fetch_all(&mut **tx)
    .await
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for r in &rows {
        out.extend(chunk_of_row(r)?.iter());
    }
    Ok(out)
}

async fn write_run(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    pool: i64,
    vdev: u32,
    old: Option<(u64, u64)>,
    extents: &[(u64, u64)],
) -> Result<(), String> {
    let db = |e: sqlx::Error| e.to_string();
    if let Some((first, last)) = old {
        sqlx::query(
            "DELETE FROM spacemaps WHERE pool = $1 AND vdev = $2 AND start >= $3 AND start <= $4",
        )
        .bind(pool)
        .bind(vdev as i64)
        .bind(i(first))
        .bind(i(last))
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    }
    let chunks = spacemap::rechunk(vdev, extents);
    if chunks.is_empty() {
        return Ok(());
    }
    let (mut starts, mut widths, mut datas) = (Vec::new(), Vec::new(), Vec::new());
    for c in chunks {
        starts.push(i(c.start));
        widths.push(c.width as i64);
        datas.push(c.data);
    }
    sqlx::query(
        "INSERT INTO spacemaps (pool, vdev, start, width, data)
         SELECT $1, $2, * FROM UNNEST($3::BIGINT[], $4::BIGINT[], $5::BYTEA[])",
    )
    .bind(pool)
    .bind(vdev as i64)
    .bind(&starts)
    .bind(&widths)
    .bind(&datas)
    .execute(&mut **tx)
    .await
    .map_err(db)?;
    Ok(())
}

async fn persist_vdev(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    pool: i64,
    vdev: u32,
    changes: &[(SpaceChangeKind, u64, u64)],
) -> Result<(), String> {
    let keys: Vec<u64> = sqlx::query_scalar::<_, i64>(
        "SELECT start FROM spacemaps WHERE pool = $1 AND vdev = $2 ORDER BY start",
    )
    .bind(pool)
    .bind(vdev as i64)
    .fetch_all(&mut **tx)
    .await
    .map_err(|e| e.to_string())?
    .into_iter()
    .map(u)
    .collect();
    if keys.is_empty() {
        let out = spacemap::apply(Vec::new(), changes)?;
        return write_run(tx, pool, vdev, None, &out).await;
    }
    for ((kf, kl), changes) in spacemap::plan_runs(&keys, changes) {
        let cur = read_run(tx, pool, vdev, kf, kl).await?;
        let out = spacemap::apply(cur, &changes)?;
        write_run(tx, pool, vdev, Some((kf, kl)), &out).await?;
    }
    Ok(())
}

/// Everything persisted for pool `pool` (by id), in one snapshot.
async fn load_state(conn: &mut sqlx::PgConnection, pool: i64) -> Result<Option<Persisted>, String> {
    let db = |e: sqlx::Error| e.to_string();
    let row: Option<(i64, i64, i64)> =
        sqlx::query_as("SELECT guid, synced_txg, state_digest FROM pools WHERE id = $1")
            .bind(pool)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db)?;
    let Some((guid, synced_txg, state_digest)) = row else {
        return Ok(None);
    };
    let rows: Vec<VdevRow> = sqlx::query_as(VdevRow::SELECT_OF_POOL)
        .bind(pool)
        .fetch_all(&mut *conn)
        .await
        .map_err(db)?;
    let (vdevs, vdev_states, recorded) = VdevRow::records(rows)?;
    let mut loading = spacemap::Loading::new(&recorded);
    {
        let mut rows = sqlx::query(
            "SELECT vdev, start, width, data FROM spacemaps WHERE pool = $1 ORDER BY vdev, start",
        )
        .bind(pool)
        .fetch(&mut *conn);
        while let Some(r) = rows.try_next().await.map_err(db)? {
            loading.push(chunk_of_row(&r)?)?;
        }
    }
    let allocated = loading.finish()?;
    let tunables = sqlx::query_as::<_, (String, String)>(
        "SELECT name, value FROM tunables WHERE pool = $1 ORDER BY set_ms, name",
    )
    .bind(pool)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    let owner_identities: Vec<(u32, String)> = sqlx::query_as::<_, (i64, String)>(
        "SELECT idx, identity FROM owners WHERE pool = $1 ORDER BY idx",
    )
    .bind(pool)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?
    .into_iter()
    .map(|(i, n)| (i as u32, n))
    .collect();
    let owner_runs = read_owner_runs(&mut *conn, pool).await?;
    Ok(Some(Persisted {
        pool_guid: u(guid),
        synced_txg: u(synced_txg),
        vdevs,
        allocated,
        tunables,
        vdev_states,
        owner_identities,
        owner_runs,
        state_digest: u(state_digest),
    }))
}

/// Every owner run of `pool`, in order: the owner maps' rows decoded,
/// plus any rows of the older one-row-per-run table.
async fn read_owner_runs(
    conn: &mut sqlx::PgConnection,
    pool: i64,
) -> Result<Vec<(u32, u64, u64, u32)>, String> {
    let db = |e: sqlx::Error| e.to_string();
    let legacy = sqlx::query_as::<_, (i64, i64, i64, i64)>(
        "SELECT vdev, start, stop, owner FROM owner_runs WHERE pool = $1 ORDER BY vdev, start",
    )
    .bind(pool)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?
    .into_iter()
    .map(|(v, s, e, o)| (v as u32, u(s), u(e), o as u32))
    .collect();
    let rows = sqlx::query_as::<_, (i64, i64, Vec<u8>)>(
        "SELECT vdev, start, data FROM owner_maps WHERE pool = $1 ORDER BY vdev, start",
    )
    .bind(pool)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?
    .into_iter()
    .map(|(v, s, d)| (v as u32, u(s), d))
    .collect();
    owner_map::load_runs(rows, legacy)
}

/// Replace the owner-map rows of `vdev` in `[start, end)` (whole windows)
/// by `runs`: one DELETE, one INSERT of every row (UNNEST of the columns).
async fn write_owner_maps(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    pool: i64,
    vdev: u32,
    start: u64,
    end: u64,
    runs: &[(u64, u64, u32)],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM owner_maps WHERE pool = $1 AND vdev = $2 AND start >= $3 AND start < $4",
    )
    .bind(pool)
    .bind(vdev as i64)
    .bind(i(start))
    .bind(i(end.min(i64::MAX as u64)))
    .execute(&mut **tx)
    .await?;
    let (windows, data): (Vec<i64>, Vec<Vec<u8>>) = owner_map::rows(runs)
        .into_iter()
        .map(|(w, d)| (i(w), d))
        .unzip();
    if windows.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO owner_maps (pool, vdev, start, data)
         SELECT $1, $2, * FROM UNNEST($3::BIGINT[], $4::BYTEA[])",
    )
    .bind(pool)
    .bind(vdev as i64)
    .bind(&windows)
    .bind(&data)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Move rows of the one-row-per-run owner table (an older binary's) into
/// owner maps, every pool's, in one transaction. Overlapping runs refuse the
/// store as inconsistent, with nothing written.
async fn convert_owner_runs(db: &PgPool) -> Result<u64, String> {
    let dbe = |e: sqlx::Error| e.to_string();
    let mut tx = db.begin().await.map_err(dbe)?;
    let pools: Vec<(i64, i64)> =
        sqlx::query_as("SELECT pool, count(*) FROM owner_runs GROUP BY pool ORDER BY pool")
            .fetch_all(&mut *tx)
            .await
            .map_err(dbe)?;
    let mut moved = 0;
    for (pool, n) in pools {
        let all = read_owner_runs(&mut tx, pool)
            .await
            .map_err(|e| format!("it is inconsistent: {e}"))?;
        for q in [
            "DELETE FROM owner_maps WHERE pool = $1",
            "DELETE FROM owner_runs WHERE pool = $1",
        ] {
            sqlx::query(q)
                .bind(pool)
                .execute(&mut *tx)
                .await
                .map_err(dbe)?;
        }
        for (vdev, runs) in owner_map::by_vdev(&all) {
            write_owner_maps(&mut tx, pool, vdev, 0, u64::MAX, &runs)
                .await
                .map_err(dbe)?;
        }
        moved += n as u64;
    }
    tx.commit().await.map_err(dbe)?;
    Ok(moved)
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
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut conn)
        .await
        .map_err(db)?;
    let id: Option<i64> = sqlx::query_scalar("SELECT id FROM pools WHERE name = $1")
        .bind(pool_name)
        .fetch_optional(&mut conn)
        .await
        .map_err(|e| format!("the store at {shown} holds no Aliquot schema? ({e})"))?;
    let r = match id {
        Some(id) => load_state(&mut conn, id).await,
        None => Ok(None),
    };
    let _ = sqlx::query("COMMIT").execute(&mut conn).await;
    r.map_err(|e| format!("the store at {shown} is inconsistent: {e}"))
}

impl Store for PgStore {
    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>> {
        Box::pin(async move {
            let id = self.pool_id.load(Ordering::Acquire);
            if id == 0 {
                return Ok(None);
            }
            let mut tx = self
                .db
                .begin()
                .await
                .map_err(|e| StoreError(e.to_string()))?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *tx)
                .await
                .map_err(|e| StoreError(e.to_string()))?;
            let r = load_state(&mut tx, id)
                .await
                .map_err(|e| StoreError(format!("the store at {} is inconsistent: {e}", self.url)));
            let _ = tx.commit().await;
            r
        })
    }

    fn create(&self, pool_guid: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO pools (name, guid, created_ms) VALUES ($1, $2, $3) RETURNING id",
            )
            .bind(&self.pool_name)
            .bind(i(pool_guid))
            .bind(now_ms())
            .fetch_one(&self.db)
            .await
            .map_err(|e| StoreError(format!("create pool {:?}: {e}", self.pool_name)))?;
            self.pool_id.store(id, Ordering::Release);
            Ok(())
        })
    }

    fn persist<'a>(&'a self, record: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.persist_txg(record))
    }

    fn fenced(&self) -> bool {
        self.deposed()
    }

    fn handed_over_cleanly(&self) -> bool {
        self.clean_before.load(Ordering::Acquire)
    }

    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        // The generation was taken with the leadership (`try_acquire`).
        let g = self.generation();
        Box::pin(async move {
            if g == 0 {
                return Err(StoreError(
                    "open_generation before taking the leadership".into(),
                ));
            }
            Ok(g)
        })
    }

    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let g: Option<i64> =
                sqlx::query_scalar("SELECT rewind_generation FROM pools WHERE id = $1")
                    .bind(self.pool_id.load(Ordering::Acquire))
                    .fetch_optional(&self.db)
                    .await
                    .map_err(|e| StoreError(format!("read the rewind generation: {e}")))?;
            Ok(g.map_or(0, u))
        })
    }

    fn set_rewind_generation(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query("UPDATE pools SET rewind_generation = $1 WHERE id = $2")
                .bind(i(g))
                .bind(self.pool_id()?)
                .execute(&self.db)
                .await
                .map_err(|e| StoreError(format!("record the rewind: {e}")))?;
            Ok(())
        })
    }

    fn generation_history(&self) -> BoxFuture<'_, Result<BTreeMap<u64, Txg>, StoreError>> {
        Box::pin(async move {
            let rows = sqlx::query_as::<_, (i64, i64)>(
                "SELECT generation, synced_txg_at_open FROM generations WHERE pool = $1
                 ORDER BY generation",
            )
            .bind(&self.pool_name)
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
                 FROM relocations WHERE pool = $1 AND allocation_id = $2",
            )
            .bind(self.pool_id()?)
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
            let (n, bytes): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), COALESCE(SUM(from_size), 0)::BIGINT FROM relocations
                 WHERE pool = $1",
            )
            .bind(self.pool_id.load(Ordering::Acquire))
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
                "SELECT vdev, start, width, data FROM spacemaps WHERE pool = $1 AND vdev = $2
                 ORDER BY start",
            )
            .bind(self.pool_id()?)
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
                .bind(self.pool_id()?)
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
        let pool = match self.pool_id() {
            Ok(p) => p,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let fetch = move |vdev: u32, off: u64, end: u64, limit: usize| async move {
            sqlx::query(concat!(span_rows_sql!(), " LIMIT $5"))
                .bind(pool)
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
                "INSERT INTO tunables (pool, name, value, set_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (pool, name) DO UPDATE SET value = excluded.value,
                    set_ms = excluded.set_ms",
            )
            .bind(self.pool_id()?)
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
                sqlx::query_as("SELECT name, device_guid FROM agent_bindings WHERE pool = $1")
                    .bind(self.pool_id.load(Ordering::Acquire))
                    .fetch_all(&self.db)
                    .await
                    .map_err(|e| StoreError(format!("read agent bindings: {e}")))?;
            Ok(rows.into_iter().map(|(n, g)| (n, u(g))).collect())
        })
    }

    fn bind_agent<'a>(
        &'a self,
        name: &'a str,
        device_guid: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO agent_bindings (pool, name, device_guid, bound_ms)
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(self.pool_id()?)
            .bind(name)
            .bind(i(device_guid))
            .bind(now_ms())
            .execute(&self.db)
            .await
            .map_err(|e| StoreError(format!("bind agent {name}: {e}")))?;
            Ok(())
        })
    }
}
