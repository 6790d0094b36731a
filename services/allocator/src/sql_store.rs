//! The one SQL store: every [`Store`] method written once over a
//! [`Dialect`] (SQLite or PostgreSQL, `crate::sqlite_store` and
//! `crate::pg_store`). Both databases hold the same tables and keys (one
//! schema design, keyed by pool: `migrations/allocator*/`), so the
//! statements are shared (`sql_store/queries/*.sql`); a dialect supplies
//! only what really differs (`sql_store/{sqlite,postgres}/*.sql`): how a run
//! of rows is inserted, the PostgreSQL leadership fence, SQLite's WAL
//! checkpoint, how a generation is opened, and the legacy rows only old
//! SQLite files hold.
//!
//! Each txg sync is ONE transaction (its space changes, the vdevs it added
//! or changed, relocations, owners, and `pools.synced_txg`), so after any
//! crash the database holds exactly the pool as of some synced txg. The
//! extents are kept as space-map chunks (`crate::spacemap`): a txg rewrites
//! the chunks it touched, a restart streams the chunks into the pool.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};

use futures_util::future::BoxFuture;
use metaslab::{Extent, SpaceChangeKind, Txg, VdevRole};

use crate::owner_map;
use crate::spacemap::{self, Chunk, Extents};
use crate::spacemap_log;
use crate::store::{
    AdminState, Evacuation, Mapping, MappingChange, Persisted, RelocationRecord, Store, StoreError,
    TxgRecord, VdevChanges, VdevRow,
};

/// The statements both dialects run.
pub(crate) mod q {
    macro_rules! sql {
        ($($name:ident = $file:literal;)*) => {
            $(pub const $name: &str = include_str!(concat!("sql_store/queries/", $file));)*
        };
    }
    sql! {
        POOL_OF_NAME = "pool_of_name.sql";
        INSERT_LEADER = "insert_leader.sql";
        CREATE_POOL = "create_pool.sql";
        POOL_ROW = "pool_row.sql";
        SYNCED_TXG = "synced_txg.sql";
        SET_SYNCED = "set_synced.sql";
        UPSERT_VDEV = "upsert_vdev.sql";
        VDEVS = "vdevs.sql";
        ADD_ALLOCATED = "add_allocated.sql";
        SET_ADMIN_STATE = "set_admin_state.sql";
        SPACEMAP_KEYS = "spacemap_keys.sql";
        SPACEMAPS_OF_POOL = "spacemaps_of_pool.sql";
        SPACEMAPS_OF_VDEV = "spacemaps_of_vdev.sql";
        READ_RUN = "read_run.sql";
        DELETE_RUN = "delete_run.sql";
        SPAN_ROWS = "span_rows.sql";
        INSERT_RELOCATION = "insert_relocation.sql";
        RELOCATION = "relocation.sql";
        RELOCATION_TOTALS = "relocation_totals.sql";
        INSERT_OWNER = "insert_owner.sql";
        OWNERS = "owners.sql";
        OWNER_RUNS = "owner_runs.sql";
        OWNER_RUNS_BY_POOL = "owner_runs_by_pool.sql";
        DELETE_OWNER_RUNS = "delete_owner_runs.sql";
        DELETE_ALL_OWNER_MAPS = "delete_all_owner_maps.sql";
        OWNER_MAPS = "owner_maps.sql";
        TUNABLES = "tunables.sql";
        UPSERT_TUNABLE = "upsert_tunable.sql";
        AGENT_BINDINGS = "agent_bindings.sql";
        BIND_AGENT = "bind_agent.sql";
        REWIND_GENERATION = "rewind_generation.sql";
        SET_REWIND_GENERATION = "set_rewind_generation.sql";
        GENERATION_HISTORY = "generation_history.sql";
        INSERT_GENERATION = "insert_generation.sql";
        POOL_SYNCED_OF_NAME = "pool_synced_of_name.sql";
        RELEASE = "release.sql";
        LEADER_ID = "leader_id.sql";
        INSERT_MAPPING = "insert_mapping.sql";
        DELETE_MAPPING = "delete_mapping.sql";
        MAPPINGS = "mappings.sql";
        INSERT_LOG = "insert_log.sql";
        METASLAB_LOG = "metaslab_log.sql";
        DELETE_LOG = "delete_log.sql";
        SET_FLUSHED = "set_flushed.sql";
        LOG_OF_POOL = "log_of_pool.sql";
        LOG_METASLABS_OF_VDEV = "log_metaslabs_of_vdev.sql";
        STALE_LOG_ROWS = "stale_log_rows.sql";
        EVACUATIONS = "evacuations.sql";
        LEADER_ROW = "leader_row.sql";
        IMPORT_LEADER = "import_leader.sql";
        RELOCATIONS_OF_POOL = "relocations_of_pool.sql";
        INSERT_EVACUATION = "insert_evacuation.sql";
        DELETE_EVACUATION = "delete_evacuation.sql";
    }
}

/// The holder id a leader leaves in the `leaders` row when it hands over
/// cleanly (a PostgreSQL step-down or shutdown, a SQLite shutdown): its last
/// txg synced and it had no claim window open, so the next leader has
/// nothing to wait for claims of.
pub(crate) const HANDED_OVER_CLEANLY: &str = "(handed over cleanly)";

mod copies;
mod dialect;
mod log;
mod transfer;
pub(crate) use dialect::args;
pub use dialect::{Conn, Dialect, EachRow, Row, Val};
pub use transfer::PoolImage;

/// The store of one pool in an SQL database.
pub struct SqlStore<D: Dialect> {
    pub(crate) db: sqlx::Pool<D::Db>,
    /// The database as messages name it (a path, or a URL without password).
    pub(crate) shown: String,
    pub(crate) pool_name: String,
    /// The pool row's id once it exists (0: not yet created).
    pub(crate) pool_id: AtomicI64,
    pub(crate) dialect: D,
    /// The log's unflushed changes as of the last synced txg (`None`: not
    /// read yet, or unknown after a failed txg). Lookups hold it shared
    /// while they read chunks; a txg holds it exclusively across its commit,
    /// so a lookup sees chunks and log of the same txg.
    pub(crate) unflushed: tokio::sync::RwLock<Option<crate::spacemap_log::Unflushed>>,
    pub(crate) log_tunables: std::sync::Mutex<crate::spacemap_log::LogTunables>,
}

pub(crate) fn u(v: i64) -> u64 {
    v as u64
}

pub(crate) fn i(v: u64) -> i64 {
    v as i64
}

pub(crate) fn now_ms() -> i64 {
    crate::convert::unix_ms() as i64
}

fn chunk_of_row(mut r: Row) -> Result<Chunk, String> {
    let vdev = r.int(0)?;
    let width = r.int(2)?;
    let vdev =
        u32::try_from(vdev).map_err(|_| format!("space map chunk of vdev {vdev}: out of range"))?;
    Chunk::new(
        vdev,
        u(r.int(1)?),
        u8::try_from(width).unwrap_or(0),
        r.blob(3)?,
    )
}

fn vdev_row(mut r: Row) -> Result<VdevRow, String> {
    Ok(VdevRow {
        id: r.int(0)?,
        guid: r.int(1)?,
        name: r.text(2)?,
        endpoint: r.text(3)?,
        capacity: r.int(4)?,
        ashift: r.int(5)?,
        metaslab_shift: r.int(6)?,
        metaslab_size: r.int(7)?,
        children: r.int(8)?,
        parity: r.int(9)?,
        rotational: r.int(10)?,
        class: r.text(11)?,
        allocated: r.int(12)?,
        admin_state: r.text(13)?,
    })
}

impl<D: Dialect> SqlStore<D> {
    pub(crate) fn new(db: sqlx::Pool<D::Db>, shown: String, pool_name: &str, dialect: D) -> Self {
        SqlStore {
            db,
            shown,
            pool_name: pool_name.to_string(),
            pool_id: AtomicI64::new(0),
            dialect,
            unflushed: Default::default(),
            log_tunables: Default::default(),
        }
    }

    pub fn pool_name(&self) -> &str {
        &self.pool_name
    }

    /// Close the connections (SQLite: the WAL is checkpointed into the file).
    pub async fn close(&self) {
        self.db.close().await;
    }

    /// The log space map as a restart would replay it, as of the last
    /// load or txg: `(changes, rows, blocks)` (`None`: not read yet).
    pub async fn log_size(&self) -> Option<(u64, u64, u64)> {
        let g = self.unflushed.read().await;
        g.as_ref().map(|u| (u.entries(), u.rows(), u.blocks()))
    }

    pub(crate) fn pool_id(&self) -> Result<i64, StoreError> {
        match self.pool_id.load(Ordering::Acquire) {
            0 => Err(StoreError("the pool is not created yet".into())),
            id => Ok(id),
        }
    }

    /// After open: the leadership row of the pool (its generation's home),
    /// and the pool row's id and guid if the pool exists.
    pub(crate) async fn find_pool(&self) -> Result<Option<u64>, String> {
        let mut c = self.db.acquire().await.map_err(|e| e.to_string())?;
        D::exec(&mut *c, q::INSERT_LEADER, args![&self.pool_name])
            .await
            .map_err(|e| e.to_string())?;
        let row = D::fetch(&mut *c, q::POOL_OF_NAME, args![&self.pool_name])
            .await
            .map_err(|e| e.to_string())?;
        match row.first() {
            Some(r) => {
                self.pool_id.store(r.int(0)?, Ordering::Release);
                Ok(Some(u(r.int(1)?)))
            }
            None => Ok(None),
        }
    }

    /// Move rows of the legacy layouts (an older binary's: one row per
    /// extent, one row per owner run) into space maps and owner maps, each
    /// in one transaction. An overlap refuses the store as inconsistent,
    /// with nothing written. Returns (extents, runs) moved.
    pub(crate) async fn convert_legacy(&self) -> Result<(u64, u64), String> {
        let extents = match D::LEGACY_EXTENTS {
            Some((read, delete)) => self.convert_legacy_extents(read, delete).await?,
            None => 0,
        };
        Ok((extents, self.convert_owner_runs().await?))
    }

    async fn convert_legacy_extents(
        &self,
        read: &'static str,
        delete: &'static str,
    ) -> Result<u64, String> {
        let Ok(pool) = self.pool_id() else {
            return Ok(0);
        };
        let dbe = |e: sqlx::Error| e.to_string();
        let mut tx = self.db.begin().await.map_err(dbe)?;
        let rows = D::fetch(&mut *tx, read, args![pool]).await.map_err(dbe)?;
        if rows.is_empty() {
            return Ok(0);
        }
        let mut by_vdev: BTreeMap<u32, Vec<(SpaceChangeKind, u64, u64)>> = BTreeMap::new();
        for r in &rows {
            by_vdev.entry(r.int(0)? as u32).or_default().push((
                SpaceChangeKind::Alloc,
                u(r.int(1)?),
                u(r.int(2)?),
            ));
        }
        for (vdev, allocs) in &by_vdev {
            let all = (0, i64::MAX as u64);
            let cur = Self::read_run(&mut *tx, pool, *vdev, all.0, all.1).await?;
            let out = spacemap::apply(cur, allocs)
                .map_err(|e| format!("it is inconsistent: vdev {vdev}: {e}"))?;
            Self::write_run(&mut *tx, pool, *vdev, Some(all), &out).await?;
        }
        D::exec(&mut *tx, delete, args![pool]).await.map_err(dbe)?;
        tx.commit().await.map_err(dbe)?;
        Ok(rows.len() as u64)
    }

    /// Every pool's rows of the one-row-per-run owner table, into owner maps.
    async fn convert_owner_runs(&self) -> Result<u64, String> {
        let dbe = |e: sqlx::Error| e.to_string();
        let mut tx = self.db.begin().await.map_err(dbe)?;
        let pools = D::fetch(&mut *tx, q::OWNER_RUNS_BY_POOL, args![])
            .await
            .map_err(dbe)?;
        let mut moved = 0;
        for r in pools {
            let (pool, n) = (r.int(0)?, r.int(1)?);
            let all = Self::read_owner_runs(&mut *tx, pool)
                .await
                .map_err(|e| format!("it is inconsistent: {e}"))?;
            for sql in [q::DELETE_ALL_OWNER_MAPS, q::DELETE_OWNER_RUNS] {
                D::exec(&mut *tx, sql, args![pool]).await.map_err(dbe)?;
            }
            let by_vdev = owner_map::by_vdev(&all);
            let spans: Vec<OwnerSpan> = by_vdev
                .iter()
                .map(|(vdev, runs)| (*vdev, 0, u64::MAX, runs.as_slice()))
                .collect();
            Self::write_owner_maps(&mut *tx, pool, &spans)
                .await
                .map_err(dbe)?;
            moved += n as u64;
        }
        tx.commit().await.map_err(dbe)?;
        Ok(moved)
    }

    /// Everything persisted for pool `pool` (by id), with the store's own
    /// per-vdev check (the recorded `vdevs.allocated` against the sum of its
    /// extents). `None`: no pool yet. The caller makes it one snapshot.
    pub(crate) async fn load_state(
        c: &mut Conn<D>,
        pool: i64,
    ) -> Result<Option<Persisted>, String> {
        Ok(Self::load_with_log(c, pool).await?.map(|(p, _)| p))
    }

    /// [`Self::load_state`], and the log's unflushed changes: the chunks
    /// as flushed, then the log rows newer than their metaslab's flush txg
    /// replayed onto them with the space maps' own checks (an allocation
    /// over an extent, a free of space not allocated, a log row a flush
    /// should have deleted: the store is inconsistent).
    pub(crate) async fn load_with_log(
        c: &mut Conn<D>,
        pool: i64,
    ) -> Result<Option<(Persisted, crate::spacemap_log::Unflushed)>, String> {
        let db = |e: sqlx::Error| e.to_string();
        let row = D::fetch(c, q::POOL_ROW, args![pool]).await.map_err(db)?;
        let Some(row) = row.first() else {
            return Ok(None);
        };
        let (guid, synced_txg, state_digest) = (row.int(0)?, row.int(1)?, row.int(2)?);
        let rows = D::fetch(c, q::VDEVS, args![pool]).await.map_err(db)?;
        let rows = rows.into_iter().map(vdev_row).collect::<Result<_, _>>()?;
        let (vdevs, vdev_states, recorded) = VdevRow::records(rows)?;
        // Streamed chunk by chunk: the rows are never all materialised.
        let mut loading = spacemap::Loading::new(&recorded);
        D::each(c, q::SPACEMAPS_OF_POOL, args![pool], &mut |r| {
            loading.push(chunk_of_row(r)?)
        })
        .await?;
        // Rows of the one-row-per-extent layout (a file an older binary
        // wrote, read without converting it): merged in, in order, so an
        // overlap between the two is still seen by recovery.
        let mut legacy: Vec<Extent> = Vec::new();
        if let Some((read, _)) = D::LEGACY_EXTENTS {
            for r in D::fetch(c, read, args![pool]).await.map_err(db)? {
                let vdev = r.int(0)?;
                let e = Extent {
                    vdev: vdev as u32,
                    offset: u(r.int(1)?),
                    size: u(r.int(2)?),
                };
                if !recorded.contains_key(&e.vdev) {
                    return Err(format!("extent {e}: no vdev {vdev}"));
                }
                loading.count(e.vdev, e.size);
                legacy.push(e);
            }
        }
        let shifts = vdevs
            .iter()
            .map(|v| (v.id, v.spec.metaslab_shift.unwrap_or(0)))
            .collect();
        let (replay, unflushed) = Self::read_log(c, pool, &shifts, u(synced_txg)).await?;
        for (vdev, changes) in &replay {
            loading
                .replay(*vdev, changes)
                .map_err(|e| format!("space map log of vdev {vdev}: {e}"))?;
        }
        let mut allocated = loading.finish()?;
        if !legacy.is_empty() {
            legacy.extend(allocated.iter());
            legacy.sort();
            allocated = Extents::from(legacy);
        }
        let mut tunables = Vec::new();
        for mut r in D::fetch(c, q::TUNABLES, args![pool]).await.map_err(db)? {
            tunables.push((r.text(0)?, r.text(1)?));
        }
        let mut owner_identities = Vec::new();
        for mut r in D::fetch(c, q::OWNERS, args![pool]).await.map_err(db)? {
            owner_identities.push((r.int(0)? as u32, r.text(1)?));
        }
        let owner_runs = Self::read_owner_runs(c, pool).await?;
        let mut mappings = Vec::new();
        D::each(c, q::MAPPINGS, args![pool], &mut |r| {
            let c = |k| r.int(k).map(u);
            let ext = |v: u64, o, s| Extent {
                vdev: v as u32,
                offset: o,
                size: s,
            };
            mappings.push(Mapping {
                from: ext(c(0)?, c(1)?, c(2)?),
                to: ext(c(3)?, c(4)?, c(5)?),
                txg: c(6)?,
            });
            Ok(())
        })
        .await?;
        Ok(Some((
            Persisted {
                pool_guid: u(guid),
                synced_txg: u(synced_txg),
                vdevs,
                allocated,
                tunables,
                vdev_states,
                owner_identities,
                owner_runs,
                state_digest: u(state_digest),
                mappings,
            },
            unflushed,
        )))
    }

    /// Every owner run of `pool`, in order: the owner maps' rows decoded,
    /// plus any rows of the older one-row-per-run table.
    async fn read_owner_runs(
        c: &mut Conn<D>,
        pool: i64,
    ) -> Result<Vec<(u32, u64, u64, u32)>, String> {
        let db = |e: sqlx::Error| e.to_string();
        let mut legacy = Vec::new();
        for r in D::fetch(c, q::OWNER_RUNS, args![pool]).await.map_err(db)? {
            legacy.push((
                r.int(0)? as u32,
                u(r.int(1)?),
                u(r.int(2)?),
                r.int(3)? as u32,
            ));
        }
        let mut rows = Vec::new();
        for mut r in D::fetch(c, q::OWNER_MAPS, args![pool]).await.map_err(db)? {
            rows.push((r.int(0)? as u32, u(r.int(1)?), r.blob(2)?));
        }
        owner_map::load_runs(rows, legacy)
    }

    /// Replace the owner-map rows in each span `(vdev, start, end)` (whole
    /// windows) by that span's runs. One statement deletes every span's
    /// rows: a txg of spread frees rewrites a window per free, and a
    /// statement each made the txg cost a round trip per window.
    pub(crate) async fn write_owner_maps(
        c: &mut Conn<D>,
        pool: i64,
        spans: &[OwnerSpan<'_>],
    ) -> Result<(), sqlx::Error> {
        if spans.is_empty() {
            return Ok(());
        }
        let list: Vec<(u32, i64, i64)> = spans
            .iter()
            .map(|&(v, start, end, _)| (v, i(start), i(end.min(i64::MAX as u64))))
            .collect();
        let list = serde_json::to_string(&list).map_err(|e| sqlx::Error::Encode(e.into()))?;
        D::exec(c, D::DELETE_OWNER_WINDOWS, args![pool, list]).await?;
        // The new rows, as many a statement as fit its bounds.
        let mut rows: Vec<(u32, i64, usize, usize)> = Vec::new();
        let mut data: Vec<u8> = Vec::new();
        for &(vdev, _, _, runs) in spans {
            for (window, d) in owner_map::rows(runs) {
                if rows.len() >= OWNER_ROWS_PER_INSERT
                    || (!rows.is_empty() && data.len() + d.len() > OWNER_BYTES_PER_INSERT)
                {
                    Self::insert_owner_maps(c, pool, &rows, std::mem::take(&mut data)).await?;
                    rows.clear();
                }
                rows.push((vdev, i(window), data.len() + 1, d.len()));
                data.extend_from_slice(&d);
            }
        }
        if !rows.is_empty() {
            Self::insert_owner_maps(c, pool, &rows, data).await?;
        }
        Ok(())
    }

    /// One [`Dialect::INSERT_OWNER_MAP`]: `rows` (vdev, start, 1-based
    /// offset and length in `data`).
    async fn insert_owner_maps(
        c: &mut Conn<D>,
        pool: i64,
        rows: &[(u32, i64, usize, usize)],
        data: Vec<u8>,
    ) -> Result<(), sqlx::Error> {
        let list = serde_json::to_string(rows).map_err(|e| sqlx::Error::Encode(e.into()))?;
        D::exec(c, D::INSERT_OWNER_MAP, args![pool, list, data]).await?;
        Ok(())
    }

    /// The chunks of `vdev` with keys in `first ..= last`, decoded in order.
    pub(crate) async fn read_run(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        first: u64,
        last: u64,
    ) -> Result<Vec<(u64, u64)>, String> {
        let mut out = Vec::new();
        let a = args![pool, vdev as i64, i(first), i(last)];
        D::each(c, q::READ_RUN, a, &mut |r| {
            out.extend(chunk_of_row(r)?.iter());
            Ok(())
        })
        .await?;
        Ok(out)
    }

    /// Replace the chunks of `vdev` with keys in `old` (none: `None`) by
    /// `extents`, rechunked.
    async fn write_run(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        old: Option<(u64, u64)>,
        extents: &[(u64, u64)],
    ) -> Result<(), String> {
        let db = |e: sqlx::Error| e.to_string();
        let v = vdev as i64;
        if let Some((first, last)) = old {
            D::exec(c, q::DELETE_RUN, args![pool, v, i(first), i(last)])
                .await
                .map_err(db)?;
        }
        let chunks = spacemap::rechunk(vdev, extents);
        if chunks.is_empty() {
            return Ok(());
        }
        if D::ARRAYS {
            let (mut starts, mut widths, mut datas) = (Vec::new(), Vec::new(), Vec::new());
            for ch in chunks {
                starts.push(i(ch.start));
                widths.push(ch.width as i64);
                datas.push(ch.data);
            }
            let a = vec![
                Val::Int(pool),
                Val::Int(v),
                Val::Ints(starts),
                Val::Ints(widths),
                Val::Blobs(datas),
            ];
            D::exec(c, D::INSERT_SPACEMAP, a).await.map_err(db)?;
        } else {
            for ch in chunks {
                let a = args![pool, v, i(ch.start), ch.width as i64, ch.data];
                D::exec(c, D::INSERT_SPACEMAP, a).await.map_err(db)?;
            }
        }
        Ok(())
    }

    /// Apply one txg's changes of `vdev` (in order) to its stored chunks:
    /// only the chunks a change can overlap are read and rewritten. Chunks
    /// are handled one at a time unless a change spans several, which are
    /// then joined into one run (so a sync of a million frees never holds
    /// more than a few chunks decoded).
    async fn persist_vdev(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        changes: &[(SpaceChangeKind, u64, u64)],
    ) -> Result<(), String> {
        let rows = D::fetch(c, q::SPACEMAP_KEYS, args![pool, vdev as i64])
            .await
            .map_err(|e| e.to_string())?;
        let keys: Vec<u64> = rows
            .iter()
            .map(|r| r.int(0).map(u))
            .collect::<Result<_, _>>()?;
        if keys.is_empty() {
            let out = spacemap::apply(Vec::new(), changes)?;
            return Self::write_run(c, pool, vdev, None, &out).await;
        }
        for ((kf, kl), changes) in spacemap::plan_runs(&keys, changes) {
            let cur = Self::read_run(c, pool, vdev, kf, kl).await?;
            let out = spacemap::apply(cur, &changes)?;
            Self::write_run(c, pool, vdev, Some((kf, kl)), &out).await?;
        }
        Ok(())
    }

    /// Persist one txg. A connection on which anything of the txg's
    /// transaction failed is closed, never given back to the pool: after
    /// SQLITE_FULL on COMMIT SQLite has already rolled back, the driver's
    /// own ROLLBACK then fails and leaves its transaction depth out of step,
    /// and a retry on that connection read its own uncommitted `synced_txg`
    /// as persisted. The retry gets a fresh connection.
    async fn persist_txg(&self, rec: &TxgRecord) -> Result<(), StoreError> {
        let txg = rec.sync.txg;
        let mut conn = self
            .db
            .acquire()
            .await
            .map_err(|e| StoreError(format!("txg {txg}: {e}")))?;
        if let Err(e) = self.persist_on(&mut conn, rec).await {
            conn.close_on_drop();
            return Err(e);
        }
        if let Err(e) = D::after_commit(&mut conn, txg).await {
            tracing::warn!(txg, error = %e.0, "after the txg's commit (the txg is durable)");
            conn.close_on_drop();
        }
        Ok(())
    }

    async fn persist_on(&self, conn: &mut Conn<D>, rec: &TxgRecord) -> Result<(), StoreError> {
        let pool = self.pool_id()?;
        let txg = rec.sync.txg;
        let db = |e: sqlx::Error| StoreError(format!("txg {txg}: {e}"));
        let err = |e: String| StoreError(format!("txg {txg}: {e}"));
        let mut tx = sqlx::Connection::begin_with(conn, D::BEGIN_TXG)
            .await
            .map_err(db)?;
        D::fence(self, &mut *tx, txg).await?;
        let synced = D::fetch(&mut *tx, q::SYNCED_TXG, args![pool])
            .await
            .map_err(db)?;
        let synced = u(synced
            .first()
            .ok_or_else(|| StoreError("persist before create".into()))?
            .int(0)
            .map_err(err)?);
        // The log's unflushed changes, current at the synced txg (read on
        // this transaction when not: after a takeover, or a commit whose
        // outcome was not known).
        let mut w = self.unflushed.write().await;
        if w.as_ref().is_none_or(|x| x.synced != synced) {
            *w = Some(Self::read_unflushed(&mut *tx, pool).await.map_err(err)?);
        }
        let unflushed = w.downgrade();
        if txg <= synced {
            if txg == synced {
                // A retry of a txg whose commit did land: nothing to do.
                return Ok(());
            }
            return Err(StoreError(format!(
                "txg {txg} persisted out of order (last {synced})"
            )));
        }
        for v in &rec.vdevs {
            Self::upsert_vdev(&mut *tx, pool, v, txg).await?;
        }
        // Each vdev's changes, in order: checked, appended to the log; a
        // few metaslabs flushed.
        let VdevChanges { by_vdev, delta } = VdevChanges::of(rec).map_err(StoreError)?;
        let new_shifts: BTreeMap<u32, u8> = rec
            .vdevs
            .iter()
            .filter_map(|v| v.spec.metaslab_shift.map(|s| (v.id, s)))
            .collect();
        let tunables = *self.log_tunables.lock().unwrap_or_else(|p| p.into_inner());
        let log = unflushed
            .as_ref()
            .ok_or_else(|| StoreError(format!("txg {txg}: the space map log is not read")))?;
        // The pool checked its own txg against its in-memory space maps
        // (`Pool::txg_changes_fit`): reading every chunk the changes fall
        // in again would make the txg cost what the pool holds. A record
        // the pool did not vouch for is checked against the chunks. Either
        // way a flush applies the changes to the chunks with the same
        // refusals, and a restart's replay too.
        if !rec.sync.checked {
            Self::check_changes(&mut *tx, pool, log, &by_vdev)
                .await
                .map_err(err)?;
        }
        let (appended, flushed) =
            Self::log_and_flush(&mut *tx, pool, txg, log, &new_shifts, &by_vdev, &tunables)
                .await
                .map_err(err)?;
        for (vdev, d) in delta {
            if d != 0 {
                D::exec(&mut *tx, q::ADD_ALLOCATED, args![d, pool, vdev as i64])
                    .await
                    .map_err(db)?;
            }
        }
        for &(vdev, state) in &rec.vdev_states {
            let a = args![state.as_str(), i(txg), pool, vdev as i64];
            D::exec(&mut *tx, q::SET_ADMIN_STATE, a).await.map_err(db)?;
            if state == AdminState::Removed {
                // Its removal (if one moved its blocks) ends with it.
                let a = args![pool, vdev as i64];
                D::exec(&mut *tx, q::DELETE_EVACUATION, a)
                    .await
                    .map_err(db)?;
            }
        }
        let ms = now_ms();
        for r in &rec.relocations {
            D::exec(&mut *tx, q::INSERT_RELOCATION, relocation_args(pool, r, ms))
                .await
                .map_err(db)?;
        }
        for c in &rec.mappings {
            let (sql, a) = match c {
                MappingChange::Add(m) => (q::INSERT_MAPPING, mapping_args(pool, m)),
                MappingChange::Drop(e) => {
                    (q::DELETE_MAPPING, args![pool, e.vdev as i64, i(e.offset)])
                }
            };
            D::exec(&mut *tx, sql, a).await.map_err(db)?;
        }
        Self::persist_copies(&mut *tx, pool, rec)
            .await
            .map_err(db)?;
        for (idx, name) in &rec.owners.identities {
            D::exec(&mut *tx, q::INSERT_OWNER, args![pool, *idx as i64, name])
                .await
                .map_err(db)?;
        }
        let spans: Vec<OwnerSpan> = rec
            .owners
            .windows
            .iter()
            .map(|w| (w.vdev, w.start, w.end, w.runs.as_slice()))
            .collect();
        Self::write_owner_maps(&mut *tx, pool, &spans)
            .await
            .map_err(db)?;
        let a = args![i(txg), i(rec.state_digest), pool];
        D::exec(&mut *tx, q::SET_SYNCED, a).await.map_err(db)?;
        // The commit and the log's new state at once, for lookups.
        drop(unflushed);
        let mut w = self.unflushed.write().await;
        if let Err(e) = tx.commit().await {
            *w = None;
            return Err(db(e));
        }
        if let Some(u) = w.as_mut() {
            for (v, s) in new_shifts {
                u.set_shift(v, s);
            }
            for (v, m, ch) in appended {
                u.record(v, m, txg, &ch);
            }
            for (v, m) in flushed {
                u.flushed(v, m);
            }
            u.synced = txg;
        }
        Ok(())
    }

    /// Write vdev `v` (added, or its endpoint or capacity changed, in txg
    /// `txg`) into its row.
    async fn upsert_vdev(
        c: &mut Conn<D>,
        pool: i64,
        v: &crate::store::VdevRecord,
        txg: Txg,
    ) -> Result<(), StoreError> {
        let shift = v
            .spec
            .metaslab_shift
            .ok_or_else(|| StoreError(format!("vdev {}: no metaslab shift to persist", v.id)))?;
        let class = match v.spec.role {
            VdevRole::Normal => "normal",
            VdevRole::Log => "log",
        };
        let a = args![
            pool,
            v.id as i64,
            i(v.guid),
            &v.name,
            &v.endpoint,
            i(v.spec.capacity),
            v.spec.ashift as i64,
            shift as i64,
            1i64 << shift,
            v.spec.children as i64,
            v.spec.parity as i64,
            v.spec.rotational as i64,
            class,
            i(txg),
        ];
        D::exec(c, q::UPSERT_VDEV, a)
            .await
            .map_err(|e| StoreError(format!("txg {txg}: vdev {}: {e}", v.id)))?;
        Ok(())
    }

    /// One query on a connection of the pool.
    async fn fetch(&self, sql: &'static str, a: Vec<Val>) -> Result<Vec<Row>, sqlx::Error> {
        let mut c = self.db.acquire().await?;
        D::fetch(&mut *c, sql, a).await
    }

    pub(crate) async fn exec(&self, sql: &'static str, a: Vec<Val>) -> Result<u64, sqlx::Error> {
        let mut c = self.db.acquire().await?;
        D::exec(&mut *c, sql, a).await
    }

    /// Generation `g` opened at the pool's synced txg, recorded in `c`,
    /// the transaction that took it; the pool row's id (0: not created yet).
    pub(crate) async fn record_generation(
        &self,
        c: &mut Conn<D>,
        g: i64,
        leader_id: &str,
        leader_address: &str,
    ) -> Result<i64, sqlx::Error> {
        let (id, synced) = match D::fetch(c, q::POOL_SYNCED_OF_NAME, args![&self.pool_name])
            .await?
            .first()
        {
            Some(r) => (r.int(0).unwrap_or(0), r.int(1).unwrap_or(0)),
            None => (0, 0),
        };
        let a = args![
            &self.pool_name,
            g,
            synced,
            now_ms(),
            leader_id,
            leader_address
        ];
        D::exec(c, q::INSERT_GENERATION, a).await?;
        Ok(id)
    }
}

impl<D: Dialect> Store for SqlStore<D> {
    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>> {
        Box::pin(async move {
            let id = self.pool_id.load(Ordering::Acquire);
            if id == 0 {
                return Ok(None);
            }
            let se = |e: sqlx::Error| StoreError(e.to_string());
            let mut tx = self.db.begin().await.map_err(se)?;
            if let Some(snapshot) = D::SNAPSHOT {
                D::exec(&mut *tx, snapshot, args![]).await.map_err(se)?;
            }
            let mut overlay = self.unflushed.write().await;
            let r = Self::load_with_log(&mut *tx, id).await.map_err(|e| {
                StoreError(format!("the store at {} is inconsistent: {e}", self.shown))
            });
            let _ = tx.commit().await;
            Ok(match r? {
                Some((p, u)) => {
                    *overlay = Some(u);
                    Some(p)
                }
                None => {
                    *overlay = None;
                    None
                }
            })
        })
    }

    fn create(&self, pool_guid: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let a = args![&self.pool_name, i(pool_guid), now_ms()];
            let rows = self
                .fetch(q::CREATE_POOL, a)
                .await
                .map_err(|e| StoreError(format!("create pool {:?}: {e}", self.pool_name)))?;
            let id = rows
                .first()
                .ok_or_else(|| StoreError("create pool: no id returned".into()))?
                .int(0)
                .map_err(StoreError)?;
            self.pool_id.store(id, Ordering::Release);
            Ok(())
        })
    }

    fn persist<'a>(&'a self, record: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.persist_txg(record))
    }

    fn set_tunable<'a>(
        &'a self,
        name: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let a = args![self.pool_id()?, name, value, now_ms()];
            self.exec(q::UPSERT_TUNABLE, a)
                .await
                .map_err(|e| StoreError(format!("persist tunable {name}: {e}")))?;
            Ok(())
        })
    }

    fn fenced(&self) -> bool {
        D::fenced(self)
    }

    fn log_tunables(&self) -> Option<spacemap_log::LogTunables> {
        Some(*self.log_tunables.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn set_log_tunables(&self, t: spacemap_log::LogTunables) {
        *self.log_tunables.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    fn handed_over_cleanly(&self) -> bool {
        D::handed_over_cleanly(self)
    }

    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        D::open_generation(self)
    }

    fn generation_history(&self) -> BoxFuture<'_, Result<BTreeMap<u64, Txg>, StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("read the generation history: {e}"));
            let rows = self
                .fetch(q::GENERATION_HISTORY, args![&self.pool_name])
                .await
                .map_err(|x| e(x.to_string()))?;
            rows.iter()
                .map(|r| Ok((u(r.int(0)?), u(r.int(1)?))))
                .collect::<Result<_, String>>()
                .map_err(e)
        })
    }

    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("read the rewind generation: {e}"));
            let pool = self.pool_id.load(Ordering::Acquire);
            let rows = self
                .fetch(q::REWIND_GENERATION, args![pool])
                .await
                .map_err(|x| e(x.to_string()))?;
            match rows.first() {
                Some(r) => Ok(u(r.int(0).map_err(e)?)),
                None => Ok(0),
            }
        })
    }

    fn set_rewind_generation(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.exec(q::SET_REWIND_GENERATION, args![i(g), self.pool_id()?])
                .await
                .map_err(|e| StoreError(format!("record the rewind: {e}")))?;
            Ok(())
        })
    }

    fn relocation(&self, id: u64) -> BoxFuture<'_, Result<Option<RelocationRecord>, StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("relocation {id}: {e}"));
            let pool = self.pool_id.load(Ordering::Acquire);
            let rows = self
                .fetch(q::RELOCATION, args![pool, i(id)])
                .await
                .map_err(|x| e(x.to_string()))?;
            let Some(r) = rows.first() else {
                return Ok(None);
            };
            let mut cols = [0i64; 8];
            for (k, c) in cols.iter_mut().enumerate() {
                *c = r.int(k).map_err(e)?;
            }
            Ok(Some(RelocationRecord::from_columns(id, cols)))
        })
    }

    fn relocation_totals(&self) -> BoxFuture<'_, Result<(u64, u64), StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("relocation totals: {e}"));
            let pool = self.pool_id.load(Ordering::Acquire);
            let rows = self
                .fetch(q::RELOCATION_TOTALS, args![pool])
                .await
                .map_err(|x| e(x.to_string()))?;
            let r = rows.first().ok_or_else(|| e("no row".into()))?;
            Ok((u(r.int(0).map_err(e)?), u(r.int(1).map_err(e)?)))
        })
    }

    fn evacuations(&self) -> BoxFuture<'_, Result<Vec<Evacuation>, StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("read vdev evacuations: {e}"));
            let pool = self.pool_id.load(Ordering::Acquire);
            let rows = self
                .fetch(q::EVACUATIONS, args![pool])
                .await
                .map_err(|x| e(x.to_string()))?;
            rows.into_iter()
                .map(|r| {
                    Ok(Evacuation {
                        vdev: r.int(0).map_err(e)? as u32,
                        bytes: u(r.int(1).map_err(e)?),
                        extents: u(r.int(2).map_err(e)?),
                        started_ms: u(r.int(3).map_err(e)?),
                    })
                })
                .collect()
        })
    }

    fn copies_of(
        &self,
        at: (metaslab::VdevId, u64),
    ) -> BoxFuture<'_, Result<Vec<(metaslab::VdevId, u64)>, StoreError>> {
        Box::pin(async move {
            let pool = self.pool_id.load(Ordering::Acquire);
            self.copies_of_at(pool, at)
                .await
                .map_err(|e| StoreError(format!("read the copies of {}:{}: {e}", at.0, at.1)))
        })
    }

    fn copies_on<'a>(
        &'a self,
        vdev: metaslab::VdevId,
        starts: &'a [u64],
    ) -> BoxFuture<'a, Result<crate::block_copies::CopySets, StoreError>> {
        Box::pin(async move {
            let pool = self.pool_id.load(Ordering::Acquire);
            self.copies_on_vdev(pool, vdev, starts)
                .await
                .map_err(|e| StoreError(format!("read the copies on vdev {vdev}: {e}")))
        })
    }

    fn set_evacuation(
        &self,
        vdev: metaslab::VdevId,
        ev: Option<Evacuation>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let pool = self.pool_id()?;
            let r = match ev {
                Some(ev) => {
                    let a = args![
                        pool,
                        vdev as i64,
                        i(ev.bytes),
                        i(ev.extents),
                        i(ev.started_ms)
                    ];
                    self.exec(q::INSERT_EVACUATION, a).await
                }
                None => {
                    self.exec(q::DELETE_EVACUATION, args![pool, vdev as i64])
                        .await
                }
            };
            r.map_err(|e| StoreError(format!("record the evacuation of vdev {vdev}: {e}")))?;
            Ok(())
        })
    }

    fn agent_bindings(&self) -> BoxFuture<'_, Result<BTreeMap<String, u64>, StoreError>> {
        Box::pin(async move {
            let e = |e: String| StoreError(format!("read agent bindings: {e}"));
            let pool = self.pool_id.load(Ordering::Acquire);
            let rows = self
                .fetch(q::AGENT_BINDINGS, args![pool])
                .await
                .map_err(|x| e(x.to_string()))?;
            rows.into_iter()
                .map(|mut r| Ok((r.text(0)?, u(r.int(1)?))))
                .collect::<Result<_, String>>()
                .map_err(e)
        })
    }

    fn bind_agent<'a>(
        &'a self,
        name: &'a str,
        device_guid: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let a = args![self.pool_id()?, name, i(device_guid), now_ms()];
            self.exec(q::BIND_AGENT, a)
                .await
                .map_err(|e| StoreError(format!("bind agent {name}: {e}")))?;
            Ok(())
        })
    }

    fn largest_extents(
        &self,
        vdev: u32,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        Box::pin(async move {
            let err = |err: String| StoreError(format!("largest extents of vdev {vdev}: {err}"));
            let pool = self.pool_id()?;
            let mut c = self.db.acquire().await.map_err(|e| err(e.to_string()))?;
            let log = self.unflushed_on(&mut c).await?;
            let mut best = spacemap::Largest::new(limit);
            // Each chunk's extents, and the unflushed changes between its key
            // and the next, as of the synced txg (`spacemap_log`).
            let mut at = spacemap_log::AsSynced::new(log.as_ref(), vdev);
            D::each(
                &mut *c,
                q::SPACEMAPS_OF_VDEV,
                args![pool, vdev as i64],
                &mut |r| {
                    at.push_chunk(chunk_of_row(r)?, &mut best);
                    Ok(())
                },
            )
            .await
            .map_err(err)?;
            at.finish(&mut best);
            Ok(best.into_extents(vdev))
        })
    }

    fn allocated_overlapping(&self, e: Extent) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        Box::pin(async move {
            let (off, end) = crate::store::sql_span(&e);
            let pool = self.pool_id()?;
            let mut c = self
                .db
                .acquire()
                .await
                .map_err(|err| crate::store::overlap_error(e, err))?;
            let log = self.unflushed_on(&mut c).await?;
            let a = args![pool, e.vdev as i64, i(off), i(end), i64::MAX];
            let rows = D::fetch(&mut *c, q::SPAN_ROWS, a)
                .await
                .map_err(|err| crate::store::overlap_error(e, err))?;
            let rows = span_refs(&rows).map_err(|err| crate::store::overlap_error(e, err))?;
            let stored = crate::store::overlapping_in_rows(&e, rows.into_iter())?;
            Ok(match log.as_ref() {
                Some(l) => l.adjust(e.vdev, off, end, stored),
                None => stored,
            })
        })
    }

    fn allocated_overlapping_many<'a>(
        &'a self,
        extents: &'a [Extent],
    ) -> BoxFuture<'a, Result<Vec<Vec<Extent>>, StoreError>> {
        Box::pin(async move {
            let pool = self.pool_id()?;
            let mut c = self
                .db
                .acquire()
                .await
                .map_err(|err| crate::store::overlap_error("a batch", err))?;
            let log = self.unflushed_on(&mut c).await?;
            let stored = Self::stored_overlapping(&mut c, pool, extents).await?;
            let Some(l) = log.as_ref() else {
                return Ok(stored);
            };
            Ok(extents
                .iter()
                .zip(stored)
                .map(|(e, s)| {
                    let (off, end) = crate::store::sql_span(e);
                    l.adjust(e.vdev, off, end, s)
                })
                .collect())
        })
    }
}

/// Owner-map rows an insert statement carries at most, and their data's
/// bytes (a single larger row still goes, alone).
const OWNER_ROWS_PER_INSERT: usize = 4096;
const OWNER_BYTES_PER_INSERT: usize = 16 << 20;

/// Owner maps to rewrite: vdev, `[start, end)` (whole windows), the runs
/// in it.
pub(crate) type OwnerSpan<'a> = (u32, u64, u64, &'a [(u64, u64, u32)]);

/// A span query's row `(start, width, data)`, the data borrowed.
type SpanRef<'a> = (i64, i64, &'a [u8]);

/// A span query's rows.
fn span_refs(rows: &[Row]) -> Result<Vec<SpanRef<'_>>, String> {
    rows.iter()
        .map(|r| Ok((r.int(0)?, r.int(1)?, r.blob_ref(2)?)))
        .collect()
}

/// The arguments of `INSERT_MAPPING` for entry `m` (a txg's persist and a
/// store import write the same row).
pub(crate) fn mapping_args(pool: i64, m: &crate::store::Mapping) -> Vec<Val> {
    args![
        pool,
        m.from.vdev as i64,
        i(m.from.offset),
        i(m.from.size),
        m.to.vdev as i64,
        i(m.to.offset),
        i(m.to.size),
        i(m.txg),
    ]
}

/// The arguments of `INSERT_RELOCATION` for `r`, recorded at `ms`.
pub(crate) fn relocation_args(pool: i64, r: &crate::store::RelocationRecord, ms: i64) -> Vec<Val> {
    args![
        pool,
        i(r.allocation_id),
        i(r.plan_id),
        r.from.vdev as i64,
        i(r.from.offset),
        i(r.from.size),
        r.to.vdev as i64,
        i(r.to.offset),
        i(r.to.size),
        i(r.txg),
        ms,
    ]
}
