//! The balance-history store: one SQLite file (WAL) holding raw per-vdev
//! samples for the retention window and 1-minute aggregates for ever.
//!
//! Opening checks the file BEFORE sqlx may create or alter anything: a file
//! that is not SQLite, a foreign SQLite database, or a schema newer than this
//! binary is refused and left byte-for-byte untouched. Writes go through one
//! connection (SQLite has one writer anyway), reads through a small pool.
//!
//! Aggregation is exactly-once: `pools.aggregated_until_ms` is a watermark;
//! the background pass folds raw minutes at or above it into `vdev_minutes`
//! and moves it up, and a late sample (a pusher's backlog) that lands below
//! it is folded into its minute at ingest. History reads raw samples above a
//! boundary and aggregates below it, so nothing is counted twice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aliquot_proto::v1::{
    HistoryPoint, HistoryReply, HistoryRequest, PoolEvent, PoolSnapshot, PoolSummary, VdevSeries,
};
use sqlx::query_builder::Separated;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, QueryBuilder, Row, Sqlite};

use crate::error::{MetricsError, Result};

/// The schema, embedded from `migrations/metrics/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/metrics");

/// Tables the newest migration creates; anything else marks a foreign file.
const OUR_TABLES: &[&str] = &[
    "_sqlx_migrations",
    "pools",
    "vdevs",
    "snapshots",
    "vdev_samples",
    "vdev_minutes",
    "class_samples",
    "events",
];

/// The spread of used fraction under which a pool counts as rebalanced.
pub const BALANCED_SPREAD: f64 = 0.05;
const MINUTE_MS: i64 = 60_000;
/// Longest gap between snapshots the written-bytes integral bridges: past a
/// gap (metrics down, snapshots dropped) the old rate is not extrapolated.
const MAX_INTEGRAL_GAP_MS: i64 = 60_000;
/// History never returns more points per vdev than this, whatever is asked.
pub const MAX_POINTS_LIMIT: u32 = 10_000;

/// What an ingest stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    pub snapshots: u64,
    pub rows: u64,
}

/// What a maintenance pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaintainStats {
    pub minutes_aggregated: u64,
    pub rows_pruned: u64,
}

pub struct Store {
    path: PathBuf,
    writer: SqlitePool,
    reader: SqlitePool,
    latest: crate::exposition::Latest,
    /// False from a failed write until the next one that commits: health
    /// and `/metrics` show it.
    writable: tokio::sync::watch::Sender<bool>,
}

fn floor_minute(ms: i64) -> i64 {
    ms.div_euclid(MINUTE_MS) * MINUTE_MS
}

fn clamp_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn finite(v: f64) -> f64 {
    if v.is_finite() { v } else { 0.0 }
}

fn used_fraction(allocated: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        0.0
    } else {
        allocated as f64 / capacity as f64
    }
}

/// Check that `path` is absent, empty, or a database of ours at a schema
/// version this binary knows. Opens the file read-only, so it cannot change.
pub async fn preflight(path: &Path) -> Result<()> {
    let refuse = |reason: String| MetricsError::Refused {
        path: path.display().to_string(),
        reason,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(refuse(format!("cannot stat it: {e}"))),
    };
    if !meta.is_file() {
        return Err(refuse("it is not a regular file".into()));
    }
    if meta.len() == 0 {
        return Ok(());
    }
    let mut head = [0u8; 16];
    {
        use std::io::Read;
        let mut f =
            std::fs::File::open(path).map_err(|e| refuse(format!("cannot read it: {e}")))?;
        let n = f
            .read(&mut head)
            .map_err(|e| refuse(format!("cannot read it: {e}")))?;
        if n < 16 || &head != b"SQLite format 3\0" {
            return Err(refuse(
                "it is not an SQLite database (bad file header); point --db at a new path".into(),
            ));
        }
    }
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .create_if_missing(false);
    let mut conn = SqliteConnection::connect_with(&opts)
        .await
        .map_err(|e| refuse(format!("cannot open it read-only: {e}")))?;
    let checked = sqlite_preflight::check_schema(
        &mut conn,
        &MIGRATOR,
        OUR_TABLES,
        "aliquot-metrics",
        "point --db at a new path",
    )
    .await;
    let _ = conn.close().await;
    checked.map_err(refuse)
}

/// One vdev sample, ready to bind.
struct SampleRow {
    time_ms: i64,
    vdev: i64,
    txg: i64,
    capacity: i64,
    allocated: i64,
    free_fraction: f64,
    fragmentation: i64,
    aliquot: i64,
    queue_target: i64,
    queue_depth: i64,
    write_bps: f64,
    read_bps: f64,
    p50: i64,
    p99: i64,
    health: i64,
    used: f64,
}

struct ClassRow {
    time_ms: i64,
    class: String,
    alloc_max: i64,
    reserved: i64,
    busy: bool,
}

struct SnapRow {
    time_ms: i64,
    txg: i64,
    spread: f64,
    dropped: i64,
}

/// Insert `rows` with multi-row statements of 256, 16 and 1 rows: three
/// distinct SQL texts, so every statement is prepared once and cached.
async fn insert_chunked<T>(
    conn: &mut SqliteConnection,
    head: &'static str,
    rows: &[T],
    bind: impl Fn(&mut Separated<'_, Sqlite, &'static str>, &T),
) -> Result<()> {
    let mut rest = rows;
    while !rest.is_empty() {
        let n = if rest.len() >= 256 {
            256
        } else if rest.len() >= 16 {
            16
        } else {
            1
        };
        let (chunk, tail) = rest.split_at(n);
        let mut qb = QueryBuilder::<Sqlite>::new(head);
        qb.push_values(chunk, |mut b, r| bind(&mut b, r));
        qb.build().execute(&mut *conn).await?;
        rest = tail;
    }
    Ok(())
}

const SAMPLE_INSERT: &str = "INSERT INTO vdev_samples (pool_id, time_ms, vdev, txg, capacity, allocated, \
    free_fraction, fragmentation, aliquot, queue_target, queue_depth, write_bps, read_bps, \
    latency_p50_us, latency_p99_us, health) ";

/// The pool's running figures, read and written once per ingest.
struct PoolState {
    id: i64,
    first_ms: i64,
    last_ms: i64,
    last_spread: f64,
    worst_spread: f64,
    last_vdev_add_ms: Option<i64>,
    rebalanced_ms: Option<i64>,
    total_written: f64,
    snapshots: i64,
    dropped: i64,
    aggregated_until_ms: i64,
}

impl Store {
    /// Check, create if absent, migrate, and open `path` in WAL mode.
    pub async fn open(path: &Path) -> Result<Store> {
        preflight(path).await?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                MetricsError::Config(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let base = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(base.clone().create_if_missing(true))
            .await?;
        MIGRATOR.run(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(base.read_only(true))
            .await?;
        Ok(Store {
            path: path.to_path_buf(),
            writer,
            reader,
            latest: Default::default(),
            writable: tokio::sync::watch::Sender::new(true),
        })
    }

    /// Whether the last write committed (true until one fails); changes
    /// are announced to subscribers (the health service).
    pub fn writable(&self) -> tokio::sync::watch::Receiver<bool> {
        self.writable.subscribe()
    }

    /// After a write that failed on `conn`: close that connection, so the
    /// next write starts on a fresh one. After SQLITE_FULL, SQLite may have
    /// rolled the transaction back on its own while sqlx still counts it
    /// open; on that connection every later BEGIN would be a savepoint and
    /// every COMMIT its release, acknowledged and never durable.
    fn write_failed(
        &self,
        mut conn: sqlx::pool::PoolConnection<Sqlite>,
        e: MetricsError,
    ) -> MetricsError {
        let MetricsError::Db(db) = e else {
            // Refused before anything was written (a bad request): the
            // connection and the store are fine.
            return e;
        };
        conn.close_on_drop();
        drop(conn);
        if self.writable.send_replace(false) {
            tracing::error!(db = %self.path.display(), error = %db, "the metrics store cannot write: refusing snapshots until it can (the sender keeps and resends them)");
        }
        MetricsError::StoreFailing(db.to_string())
    }

    fn write_ok(&self) {
        if !self.writable.send_replace(true) {
            tracing::info!(db = %self.path.display(), "the metrics store writes again");
        }
    }

    /// The newest stored snapshot of each pool (for `/metrics`).
    pub fn latest(&self) -> &crate::exposition::Latest {
        &self.latest
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The write connection (benches build large histories through it).
    pub fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    pub async fn close(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }

    /// Store `snaps` in one transaction.
    pub async fn ingest(&self, snaps: &[PoolSnapshot]) -> Result<IngestStats> {
        let mut by_pool: BTreeMap<&str, Vec<&PoolSnapshot>> = BTreeMap::new();
        for s in snaps {
            if s.pool.is_empty() {
                return Err(MetricsError::invalid(
                    "pool",
                    "snapshot without a pool name",
                ));
            }
            if s.pool.len() > 256 {
                return Err(MetricsError::invalid(
                    "pool",
                    "pool name longer than 256 bytes",
                ));
            }
            by_pool.entry(s.pool.as_str()).or_default().push(s);
        }
        if by_pool.is_empty() {
            return Ok(IngestStats::default());
        }
        let mut conn = self
            .writer
            .acquire()
            .await
            .map_err(|e| MetricsError::StoreFailing(e.to_string()))?;
        let stats = match ingest_tx(&mut conn, by_pool).await {
            Ok(st) => st,
            Err(e) => return Err(self.write_failed(conn, e)),
        };
        drop(conn);
        self.write_ok();
        for s in snaps {
            self.latest.offer(s);
        }
        Ok(stats)
    }

    /// Names of every pool with history.
    pub async fn pools(&self) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar("SELECT name FROM pools ORDER BY name")
            .fetch_all(&self.reader)
            .await?)
    }

    /// Per-vdev series over `[since, until]`, at most `max_points` per vdev.
    pub async fn history(&self, req: &HistoryRequest) -> Result<HistoryReply> {
        if req.pool.is_empty() {
            return Err(MetricsError::invalid("pool", "pool is required"));
        }
        if req.max_points == 0 {
            return Err(MetricsError::invalid(
                "max_points",
                "max_points must be at least 1",
            ));
        }
        if let (Some(s), Some(u)) = (req.since_ms, req.until_ms)
            && s > u
        {
            return Err(MetricsError::invalid(
                "since_ms",
                format!("since ({s} ms) is after until ({u} ms)"),
            ));
        }
        let mut conn = self.reader.acquire().await?;
        let pool = sqlx::query(
            "SELECT id, first_ms, last_ms, aggregated_until_ms, pruned_until_ms FROM pools WHERE name = ?",
        )
        .bind(&req.pool)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| MetricsError::NoPool {
            pool: req.pool.clone(),
        })?;
        let pool_id: i64 = pool.try_get(0)?;
        let first_ms: i64 = pool.try_get(1)?;
        let last_ms: i64 = pool.try_get(2)?;
        let aggregated_until: i64 = pool.try_get(3)?;
        let pruned_until: i64 = pool.try_get(4)?;

        let known: Vec<(i64, String)> =
            sqlx::query_as("SELECT vdev, name FROM vdevs WHERE pool_id = ? ORDER BY vdev")
                .bind(pool_id)
                .fetch_all(&mut *conn)
                .await?;
        let wanted: Vec<(i64, String)> = if req.vdevs.is_empty() {
            known
        } else {
            let mut w = Vec::new();
            for v in &req.vdevs {
                match known.iter().find(|(k, _)| *k == i64::from(*v)) {
                    Some(k) => w.push(k.clone()),
                    None => {
                        return Err(MetricsError::NoVdev {
                            pool: req.pool.clone(),
                            vdev: *v,
                        });
                    }
                }
            }
            w
        };

        let since = req.since_ms.unwrap_or(first_ms);
        let until = req.until_ms.unwrap_or(last_ms);
        let mut reply = HistoryReply::default();
        let mut series: BTreeMap<i64, VdevSeries> = wanted
            .iter()
            .map(|(v, name)| {
                (
                    *v,
                    VdevSeries {
                        vdev: *v as u32,
                        name: name.clone(),
                        points: Vec::new(),
                    },
                )
            })
            .collect();
        if since <= until && !wanted.is_empty() {
            let max_points = i64::from(req.max_points.min(MAX_POINTS_LIMIT));
            let span = until - since + 1;
            let width = ((span + max_points - 1) / max_points).max(1);
            // Coarse buckets read every complete aggregated minute; fine ones
            // read raw wherever raw still exists.
            let boundary = if width >= MINUTE_MS {
                aggregated_until
            } else {
                pruned_until
            };
            let mut qb = QueryBuilder::<Sqlite>::new(
                "SELECT vdev, b, SUM(n), TOTAL(t), TOTAL(used), TOTAL(alloc), TOTAL(cap), TOTAL(w), \
                 TOTAL(r), TOTAL(qd), TOTAL(qt), TOTAL(aq), TOTAL(fr), SUM(fn), MAX(p99) FROM (\
                 SELECT vdev, (time_ms - ",
            );
            qb.push_bind(since);
            qb.push(") / ");
            qb.push_bind(width);
            qb.push(" AS b, 1 AS n, time_ms - ");
            qb.push_bind(since);
            qb.push(
                " AS t, CASE WHEN capacity > 0 THEN CAST(allocated AS REAL) / capacity ELSE 0.0 END AS used, \
                 allocated AS alloc, capacity AS cap, write_bps AS w, read_bps AS r, queue_depth AS qd, \
                 queue_target AS qt, aliquot AS aq, \
                 CASE WHEN fragmentation >= 0 THEN fragmentation ELSE 0 END AS fr, \
                 CASE WHEN fragmentation >= 0 THEN 1 ELSE 0 END AS fn, latency_p99_us AS p99 \
                 FROM vdev_samples WHERE pool_id = ",
            );
            qb.push_bind(pool_id);
            qb.push(" AND time_ms >= ");
            qb.push_bind(since.max(boundary));
            qb.push(" AND time_ms <= ");
            qb.push_bind(until);
            push_vdev_filter(&mut qb, &req.vdevs);
            qb.push(" UNION ALL SELECT vdev, MAX(0, (minute_ms - ");
            qb.push_bind(since);
            qb.push(") / ");
            qb.push_bind(width);
            qb.push("), n, sum_time_ms - n * ");
            qb.push_bind(since);
            qb.push(
                ", sum_used, sum_allocated, sum_capacity, sum_write_bps, sum_read_bps, sum_queue_depth, \
                 sum_queue_target, sum_aliquot, sum_fragmentation, n_fragmentation, max_latency_p99_us \
                 FROM vdev_minutes WHERE pool_id = ",
            );
            qb.push_bind(pool_id);
            qb.push(" AND minute_ms > ");
            qb.push_bind(since - MINUTE_MS);
            qb.push(" AND minute_ms <= ");
            qb.push_bind(until);
            qb.push(" AND minute_ms < ");
            qb.push_bind(boundary);
            push_vdev_filter(&mut qb, &req.vdevs);
            qb.push(") GROUP BY vdev, b ORDER BY vdev, b");
            let rows = qb.build().fetch_all(&mut *conn).await?;
            for row in rows {
                let vdev: i64 = row.try_get(0)?;
                let n: i64 = row.try_get(2)?;
                if n <= 0 {
                    continue;
                }
                let nf = n as f64;
                let avg = |i: usize| -> Result<f64> { Ok(row.try_get::<f64, _>(i)? / nf) };
                let n_frag: i64 = row.try_get(13)?;
                let point = HistoryPoint {
                    time_ms: since + avg(3)?.round() as i64,
                    used_fraction: avg(4)?,
                    allocated: avg(5)?.round() as u64,
                    capacity: avg(6)?.round() as u64,
                    write_bytes_per_sec: avg(7)?,
                    read_bytes_per_sec: avg(8)?,
                    queue_depth: avg(9)?.round() as u64,
                    queue_target: avg(10)?.round() as u64,
                    aliquot: avg(11)?.round() as u64,
                    fragmentation: if n_frag > 0 {
                        (row.try_get::<f64, _>(12)? / n_frag as f64).round() as i32
                    } else {
                        -1
                    },
                    latency_p99_us: row.try_get::<i64, _>(14)?.max(0) as u64,
                };
                if let Some(s) = series.get_mut(&vdev) {
                    s.points.push(point);
                }
            }
            let events = sqlx::query(
                "SELECT time_ms, kind, vdev, detail FROM events WHERE pool_id = ? AND time_ms >= ? \
                 AND time_ms <= ? ORDER BY time_ms, rowid",
            )
            .bind(pool_id)
            .bind(since)
            .bind(until)
            .fetch_all(&mut *conn)
            .await?;
            for e in events {
                let vdev: i64 = e.try_get(2)?;
                if req.vdevs.is_empty() || req.vdevs.contains(&(vdev as u32)) {
                    reply.events.push(PoolEvent {
                        time_ms: e.try_get(0)?,
                        kind: e.try_get(1)?,
                        vdev: vdev as u32,
                        detail: e.try_get(3)?,
                    });
                }
            }
        }
        reply.series = series.into_values().collect();
        Ok(reply)
    }

    /// Per-pool summary (`pool` empty = every pool); `now_ms` is the wall
    /// clock "time since the last vdev add" is measured against.
    pub async fn summary(&self, pool: &str, now_ms: i64) -> Result<Vec<PoolSummary>> {
        let sql = "SELECT p.name, p.last_spread, p.worst_spread, p.last_vdev_add_ms, p.rebalanced_ms, \
                   p.total_written_bytes, p.samples, p.first_ms, p.last_ms, p.dropped_snapshots, \
                   (SELECT COUNT(*) FROM vdevs v WHERE v.pool_id = p.id) \
                   FROM pools p WHERE ? = '' OR p.name = ? ORDER BY p.name";
        let rows = sqlx::query(sql)
            .bind(pool)
            .bind(pool)
            .fetch_all(&self.reader)
            .await?;
        if rows.is_empty() && !pool.is_empty() {
            return Err(MetricsError::NoPool {
                pool: pool.to_string(),
            });
        }
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let last_add: Option<i64> = r.try_get(3)?;
            let rebalanced: Option<i64> = r.try_get(4)?;
            out.push(PoolSummary {
                pool: r.try_get(0)?,
                current_spread: r.try_get(1)?,
                worst_spread: r.try_get(2)?,
                last_vdev_add_ms: last_add,
                since_last_vdev_add_ms: last_add.map(|a| (now_ms - a).max(0)),
                rebalance_ms: match (last_add, rebalanced) {
                    (Some(a), Some(b)) => Some((b - a).max(0)),
                    _ => None,
                },
                total_written_bytes: r.try_get::<f64, _>(5)?.max(0.0) as u64,
                samples: r.try_get::<i64, _>(6)?.max(0) as u64,
                first_ms: r.try_get(7)?,
                last_ms: r.try_get(8)?,
                dropped_snapshots: r.try_get::<i64, _>(9)?.max(0) as u64,
                vdevs: r.try_get::<i64, _>(10)?.max(0) as u32,
            });
        }
        Ok(out)
    }

    /// Fold complete minutes into aggregates and delete raw rows older than
    /// `retention` (only once they are aggregated). `now_ms` is injected so
    /// tests can run retention on constructed histories.
    pub async fn maintain(&self, now_ms: i64, retention: Duration) -> Result<MaintainStats> {
        let mut conn = self
            .writer
            .acquire()
            .await
            .map_err(|e| MetricsError::StoreFailing(e.to_string()))?;
        match maintain_tx(&mut conn, now_ms, retention).await {
            Ok(st) => Ok(st),
            Err(e) => Err(self.write_failed(conn, e)),
        }
    }

    /// Raw sample rows currently held (tests and benches).
    pub async fn raw_rows(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM vdev_samples")
            .fetch_one(&self.reader)
            .await?)
    }
}

/// Every pool's snapshots in one transaction on `conn`.
async fn ingest_tx(
    conn: &mut SqliteConnection,
    by_pool: BTreeMap<&str, Vec<&PoolSnapshot>>,
) -> Result<IngestStats> {
    let mut stats = IngestStats::default();
    let mut tx = conn.begin().await?;
    for (pool, mut list) in by_pool {
        list.sort_by_key(|s| s.time_ms);
        let rows = ingest_pool(&mut tx, pool, &list).await?;
        stats.snapshots += list.len() as u64;
        stats.rows += rows;
    }
    tx.commit().await?;
    Ok(stats)
}

/// [`Store::maintain`] on the write connection `conn`, a transaction a pool.
async fn maintain_tx(
    conn: &mut SqliteConnection,
    now_ms: i64,
    retention: Duration,
) -> Result<MaintainStats> {
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let mut stats = MaintainStats::default();
    let pools: Vec<(i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT id, first_ms, aggregated_until_ms, pruned_until_ms FROM pools ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    for (id, first_ms, aggregated_until, pruned_until) in pools {
        let mut tx = conn.begin().await?;
        // A minute is folded once it ended a minute ago: snapshots for it
        // arriving later still count (see ingest's late-sample path).
        let target = floor_minute(now_ms - MINUTE_MS);
        let from = aggregated_until.max(floor_minute(first_ms));
        let mut agg = aggregated_until;
        if target > from {
            let r = sqlx::query(
                    "INSERT INTO vdev_minutes (pool_id, minute_ms, vdev, n, sum_time_ms, sum_used, \
                     sum_allocated, sum_capacity, sum_write_bps, sum_read_bps, sum_queue_depth, \
                     sum_queue_target, sum_aliquot, sum_fragmentation, n_fragmentation, max_latency_p99_us) \
                     SELECT pool_id, time_ms - (time_ms % 60000), vdev, COUNT(*), SUM(time_ms), \
                     TOTAL(CASE WHEN capacity > 0 THEN CAST(allocated AS REAL) / capacity ELSE 0.0 END), \
                     TOTAL(allocated), TOTAL(capacity), TOTAL(write_bps), TOTAL(read_bps), TOTAL(queue_depth), \
                     TOTAL(queue_target), TOTAL(aliquot), \
                     TOTAL(CASE WHEN fragmentation >= 0 THEN fragmentation ELSE 0 END), \
                     SUM(CASE WHEN fragmentation >= 0 THEN 1 ELSE 0 END), MAX(latency_p99_us) \
                     FROM vdev_samples WHERE pool_id = ?1 AND time_ms >= ?2 AND time_ms < ?3 \
                     GROUP BY 2, 3 \
                     ON CONFLICT (pool_id, minute_ms, vdev) DO UPDATE SET \
                     n = n + excluded.n, sum_time_ms = sum_time_ms + excluded.sum_time_ms, \
                     sum_used = sum_used + excluded.sum_used, \
                     sum_allocated = sum_allocated + excluded.sum_allocated, \
                     sum_capacity = sum_capacity + excluded.sum_capacity, \
                     sum_write_bps = sum_write_bps + excluded.sum_write_bps, \
                     sum_read_bps = sum_read_bps + excluded.sum_read_bps, \
                     sum_queue_depth = sum_queue_depth + excluded.sum_queue_depth, \
                     sum_queue_target = sum_queue_target + excluded.sum_queue_target, \
                     sum_aliquot = sum_aliquot + excluded.sum_aliquot, \
                     sum_fragmentation = sum_fragmentation + excluded.sum_fragmentation, \
                     n_fragmentation = n_fragmentation + excluded.n_fragmentation, \
                     max_latency_p99_us = MAX(max_latency_p99_us, excluded.max_latency_p99_us)",
                )
                .bind(id)
                .bind(from)
                .bind(target)
                .execute(&mut *tx)
                .await?;
            stats.minutes_aggregated += r.rows_affected();
            agg = target;
        }
        let horizon = floor_minute(now_ms.saturating_sub(retention_ms)).min(agg);
        let mut pruned = pruned_until;
        if horizon > pruned_until {
            for sql in [
                "DELETE FROM vdev_samples WHERE pool_id = ? AND time_ms < ?",
                "DELETE FROM snapshots WHERE pool_id = ? AND time_ms < ?",
                "DELETE FROM class_samples WHERE pool_id = ? AND time_ms < ?",
            ] {
                let r = sqlx::query(sql)
                    .bind(id)
                    .bind(horizon)
                    .execute(&mut *tx)
                    .await?;
                stats.rows_pruned += r.rows_affected();
            }
            pruned = horizon;
        }
        sqlx::query("UPDATE pools SET aggregated_until_ms = ?, pruned_until_ms = ? WHERE id = ?")
            .bind(agg)
            .bind(pruned)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(stats)
}

fn push_vdev_filter(qb: &mut QueryBuilder<Sqlite>, vdevs: &[u32]) {
    if vdevs.is_empty() {
        return;
    }
    qb.push(" AND vdev IN (");
    let mut sep = qb.separated(", ");
    for v in vdevs {
        sep.push_bind(i64::from(*v));
    }
    sep.push_unseparated(")");
}

async fn pool_state(conn: &mut SqliteConnection, pool: &str, first_ms: i64) -> Result<PoolState> {
    sqlx::query("INSERT INTO pools (name, first_ms, last_ms) VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING")
        .bind(pool)
        .bind(first_ms)
        .bind(first_ms)
        .execute(&mut *conn)
        .await?;
    let r = sqlx::query(
        "SELECT id, first_ms, last_ms, last_spread, worst_spread, last_vdev_add_ms, rebalanced_ms, \
         total_written_bytes, snapshots, dropped_snapshots, aggregated_until_ms FROM pools WHERE name = ?",
    )
    .bind(pool)
    .fetch_one(&mut *conn)
    .await?;
    Ok(PoolState {
        id: r.try_get(0)?,
        first_ms: r.try_get(1)?,
        last_ms: r.try_get(2)?,
        last_spread: r.try_get(3)?,
        worst_spread: r.try_get(4)?,
        last_vdev_add_ms: r.try_get(5)?,
        rebalanced_ms: r.try_get(6)?,
        total_written: r.try_get(7)?,
        snapshots: r.try_get(8)?,
        dropped: r.try_get(9)?,
        aggregated_until_ms: r.try_get(10)?,
    })
}

/// Store one pool's snapshots (sorted by time); returns vdev rows stored.
async fn ingest_pool(
    conn: &mut SqliteConnection,
    pool: &str,
    list: &[&PoolSnapshot],
) -> Result<u64> {
    let mut st = pool_state(conn, pool, list[0].time_ms).await?;
    let fresh = st.snapshots == 0;
    let mut prev_ms = if fresh { None } else { Some(st.last_ms) };
    let mut samples = Vec::new();
    let mut classes = Vec::new();
    let mut snaps = Vec::with_capacity(list.len());
    let mut names: BTreeMap<u32, (String, i64, i64)> = BTreeMap::new();
    let mut add_seen = false;
    for s in list {
        let t = s.time_ms;
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        let mut write_sum = 0.0;
        for v in &s.vdevs {
            let used = used_fraction(v.allocated, v.capacity);
            if v.capacity > 0 {
                lo = lo.min(used);
                hi = hi.max(used);
            }
            write_sum += finite(v.write_bytes_per_sec).max(0.0);
            samples.push(SampleRow {
                time_ms: t,
                vdev: i64::from(v.vdev),
                txg: clamp_u64(s.txg),
                capacity: clamp_u64(v.capacity),
                allocated: clamp_u64(v.allocated),
                free_fraction: finite(v.free_fraction),
                fragmentation: i64::from(v.fragmentation),
                aliquot: clamp_u64(v.aliquot),
                queue_target: clamp_u64(v.queue_target),
                queue_depth: clamp_u64(v.queue_depth),
                write_bps: finite(v.write_bytes_per_sec),
                read_bps: finite(v.read_bytes_per_sec),
                p50: clamp_u64(v.latency_p50_us),
                p99: clamp_u64(v.latency_p99_us),
                health: i64::from(v.health),
                used,
            });
            let e = names.entry(v.vdev).or_insert_with(|| (String::new(), t, t));
            if !v.name.is_empty() {
                e.0 = v.name.clone();
            }
            e.1 = e.1.min(t);
            e.2 = e.2.max(t);
        }
        let spread = if hi >= lo { hi - lo } else { 0.0 };
        for c in &s.classes {
            classes.push(ClassRow {
                time_ms: t,
                class: c.name.clone(),
                alloc_max: clamp_u64(c.alloc_max),
                reserved: clamp_u64(c.reserved),
                busy: c.busy,
            });
        }
        for ev in &s.events {
            let et = if ev.time_ms > 0 { ev.time_ms } else { t };
            sqlx::query(
                "INSERT INTO events (pool_id, time_ms, kind, vdev, detail) VALUES (?, ?, ?, ?, ?)",
            )
            .bind(st.id)
            .bind(et)
            .bind(&ev.kind)
            .bind(i64::from(ev.vdev))
            .bind(&ev.detail)
            .execute(&mut *conn)
            .await?;
            if ev.kind == "vdev_add" && st.last_vdev_add_ms.is_none_or(|a| et >= a) {
                st.last_vdev_add_ms = Some(et);
                st.rebalanced_ms = None;
                add_seen = true;
            }
        }
        if let Some(a) = st.last_vdev_add_ms
            && t >= a
            && spread < BALANCED_SPREAD
            && st.rebalanced_ms.is_none_or(|r| t < r)
        {
            st.rebalanced_ms = Some(t);
        }
        if let Some(p) = prev_ms
            && t > p
        {
            st.total_written += write_sum * (t - p).min(MAX_INTEGRAL_GAP_MS) as f64 / 1000.0;
        }
        prev_ms = Some(prev_ms.map_or(t, |p| p.max(t)));
        st.worst_spread = st.worst_spread.max(spread);
        if t >= st.last_ms {
            st.last_ms = t;
            st.last_spread = spread;
        }
        st.first_ms = st.first_ms.min(t);
        st.dropped = st.dropped.max(clamp_u64(s.dropped_snapshots));
        snaps.push(SnapRow {
            time_ms: t,
            txg: clamp_u64(s.txg),
            spread,
            dropped: clamp_u64(s.dropped_snapshots),
        });
    }

    for (vdev, (name, first, last)) in &names {
        let name = if name.is_empty() {
            format!("vdev{vdev}")
        } else {
            name.clone()
        };
        sqlx::query(
            "INSERT INTO vdevs (pool_id, vdev, name, first_ms, last_ms) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (pool_id, vdev) DO UPDATE SET name = excluded.name, \
             first_ms = MIN(first_ms, excluded.first_ms), last_ms = MAX(last_ms, excluded.last_ms)",
        )
        .bind(st.id)
        .bind(i64::from(*vdev))
        .bind(name)
        .bind(*first)
        .bind(*last)
        .execute(&mut *conn)
        .await?;
    }
    let id = st.id;
    insert_chunked(
        conn,
        "INSERT INTO snapshots (pool_id, time_ms, txg, spread, dropped) ",
        &snaps,
        |b, r| {
            b.push_bind(id)
                .push_bind(r.time_ms)
                .push_bind(r.txg)
                .push_bind(r.spread)
                .push_bind(r.dropped);
        },
    )
    .await?;
    insert_chunked(conn, SAMPLE_INSERT, &samples, |b, r| {
        b.push_bind(id)
            .push_bind(r.time_ms)
            .push_bind(r.vdev)
            .push_bind(r.txg)
            .push_bind(r.capacity)
            .push_bind(r.allocated)
            .push_bind(r.free_fraction)
            .push_bind(r.fragmentation)
            .push_bind(r.aliquot)
            .push_bind(r.queue_target)
            .push_bind(r.queue_depth)
            .push_bind(r.write_bps)
            .push_bind(r.read_bps)
            .push_bind(r.p50)
            .push_bind(r.p99)
            .push_bind(r.health);
    })
    .await?;
    insert_chunked(
        conn,
        "INSERT INTO class_samples (pool_id, time_ms, class, alloc_max, reserved, busy) ",
        &classes,
        |b, r| {
            b.push_bind(id)
                .push_bind(r.time_ms)
                .push_bind(r.class.clone())
                .push_bind(r.alloc_max)
                .push_bind(r.reserved)
                .push_bind(r.busy);
        },
    )
    .await?;
    // A backlog sample for a minute already aggregated joins that minute now.
    for r in samples
        .iter()
        .filter(|r| r.time_ms < st.aggregated_until_ms)
    {
        sqlx::query(
            "INSERT INTO vdev_minutes (pool_id, minute_ms, vdev, n, sum_time_ms, sum_used, sum_allocated, \
             sum_capacity, sum_write_bps, sum_read_bps, sum_queue_depth, sum_queue_target, sum_aliquot, \
             sum_fragmentation, n_fragmentation, max_latency_p99_us) \
             VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (pool_id, minute_ms, vdev) DO UPDATE SET n = n + 1, \
             sum_time_ms = sum_time_ms + excluded.sum_time_ms, sum_used = sum_used + excluded.sum_used, \
             sum_allocated = sum_allocated + excluded.sum_allocated, \
             sum_capacity = sum_capacity + excluded.sum_capacity, \
             sum_write_bps = sum_write_bps + excluded.sum_write_bps, \
             sum_read_bps = sum_read_bps + excluded.sum_read_bps, \
             sum_queue_depth = sum_queue_depth + excluded.sum_queue_depth, \
             sum_queue_target = sum_queue_target + excluded.sum_queue_target, \
             sum_aliquot = sum_aliquot + excluded.sum_aliquot, \
             sum_fragmentation = sum_fragmentation + excluded.sum_fragmentation, \
             n_fragmentation = n_fragmentation + excluded.n_fragmentation, \
             max_latency_p99_us = MAX(max_latency_p99_us, excluded.max_latency_p99_us)",
        )
        .bind(id)
        .bind(floor_minute(r.time_ms))
        .bind(r.vdev)
        .bind(r.time_ms)
        .bind(r.used)
        .bind(r.allocated as f64)
        .bind(r.capacity as f64)
        .bind(r.write_bps)
        .bind(r.read_bps)
        .bind(r.queue_depth as f64)
        .bind(r.queue_target as f64)
        .bind(r.aliquot as f64)
        .bind(r.fragmentation.max(0) as f64)
        .bind(i64::from(r.fragmentation >= 0))
        .bind(r.p99)
        .execute(&mut *conn)
        .await?;
    }
    if add_seen {
        // The add may predate snapshots stored earlier: look at them too.
        if let Some(a) = st.last_vdev_add_ms {
            st.rebalanced_ms = sqlx::query_scalar(
                "SELECT MIN(time_ms) FROM snapshots WHERE pool_id = ? AND time_ms >= ? AND spread < ?",
            )
            .bind(id)
            .bind(a)
            .bind(BALANCED_SPREAD)
            .fetch_one(&mut *conn)
            .await?;
        }
    }
    sqlx::query(
        "UPDATE pools SET first_ms = ?, last_ms = ?, last_spread = ?, worst_spread = ?, \
         last_vdev_add_ms = ?, rebalanced_ms = ?, total_written_bytes = ?, samples = samples + ?, \
         snapshots = snapshots + ?, dropped_snapshots = ? WHERE id = ?",
    )
    .bind(st.first_ms)
    .bind(st.last_ms)
    .bind(st.last_spread)
    .bind(st.worst_spread)
    .bind(st.last_vdev_add_ms)
    .bind(st.rebalanced_ms)
    .bind(st.total_written)
    .bind(samples.len() as i64)
    .bind(snaps.len() as i64)
    .bind(st.dropped)
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(samples.len() as u64)
}
