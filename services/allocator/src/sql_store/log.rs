//! The log space map's statements, written once for both dialects (layout
//! and flush policy: `crate::spacemap_log`). A txg's changes are checked
//! (by the pool against its in-memory space maps when it made them, else
//! here against the durable extents: the chunks they fall in, read, and the
//! unflushed log), appended to `spacemap_log`, and the txg flushes the
//! metaslabs the policy picks into their chunks, deleting their rows and
//! recording their flush txg: all in the txg's one transaction.

use std::collections::{BTreeMap, BTreeSet};

use metaslab::Extent;
use tokio::sync::RwLockReadGuard;

use super::{Conn, Dialect, SqlStore, args, i, q, span_refs, u};
use crate::spacemap::{self, Change};
use crate::spacemap_log::{self, LogTunables, Metaslab, Unflushed};
use crate::store::{StoreError, VdevRow};

/// A txg's log rows: vdev, metaslab, its changes there in order.
pub(crate) type LogRows = Vec<(u32, u64, Vec<Change>)>;

impl<D: Dialect> SqlStore<D> {
    /// The log rows of `pool` newer than their metaslab's flush txg: each
    /// vdev's changes in replay order, and as [`Unflushed`] (current at
    /// `synced`). Refuses rows a flush should have deleted, rows of another
    /// metaslab's changes, of an unknown vdev, or after `synced`.
    pub(crate) async fn read_log(
        c: &mut Conn<D>,
        pool: i64,
        shifts: &BTreeMap<u32, u8>,
        synced: u64,
    ) -> Result<(BTreeMap<u32, Vec<Change>>, Unflushed), String> {
        let stale = D::fetch(c, q::STALE_LOG_ROWS, args![pool])
            .await
            .map_err(|e| e.to_string())?;
        let stale = stale.first().map_or(Ok(0), |r| r.int(0))?;
        if stale != 0 {
            return Err(format!(
                "space map log: {stale} rows at or before their metaslab's flush txg"
            ));
        }
        let mut unflushed = Unflushed::default();
        unflushed.synced = synced;
        for (&v, &s) in shifts {
            unflushed.set_shift(v, s);
        }
        let mut replay: BTreeMap<u32, Vec<Change>> = BTreeMap::new();
        D::each(c, q::LOG_OF_POOL, args![pool], &mut |mut r| {
            let vdev = r.int(0)?;
            let (ms, txg) = (u(r.int(1)?), u(r.int(2)?));
            let changes = spacemap_log::decode(&r.blob(3)?)?;
            let vdev = u32::try_from(vdev).map_err(|_| format!("space map log: vdev {vdev}"))?;
            let shift = shifts
                .get(&vdev)
                .ok_or_else(|| format!("space map log: no vdev {vdev}"))?;
            if txg > synced {
                return Err(format!(
                    "space map log: a row of txg {txg}, after the synced txg {synced}"
                ));
            }
            if changes.iter().any(|c| c.1 >> shift != ms) {
                return Err(format!(
                    "space map log: the row of metaslab {ms} of vdev {vdev} at txg {txg} \
                     holds another metaslab's change"
                ));
            }
            unflushed.record(vdev, ms, txg, &changes);
            replay.entry(vdev).or_default().extend(changes);
            Ok(())
        })
        .await?;
        Ok((replay, unflushed))
    }

    /// [`Unflushed`] of `pool` read on `c` (its vdevs' shifts and synced
    /// txg from the same snapshot).
    pub(crate) async fn read_unflushed(c: &mut Conn<D>, pool: i64) -> Result<Unflushed, String> {
        let db = |e: sqlx::Error| e.to_string();
        let synced = D::fetch(c, q::SYNCED_TXG, args![pool]).await.map_err(db)?;
        let synced = u(synced.first().ok_or("no pool row")?.int(0)?);
        let rows = D::fetch(c, q::VDEVS, args![pool]).await.map_err(db)?;
        let rows = rows
            .into_iter()
            .map(super::vdev_row)
            .collect::<Result<Vec<VdevRow>, _>>()?;
        let (vdevs, _, _) = VdevRow::records(rows)?;
        let shifts = vdevs
            .iter()
            .map(|v| (v.id, v.spec.metaslab_shift.unwrap_or(0)))
            .collect();
        Ok(Self::read_log(c, pool, &shifts, synced).await?.1)
    }

    /// The unflushed changes, shared (lookups hold them while they read
    /// chunks on `c`); read on `c` first if not known. A lookup takes its
    /// connection before this guard, as a txg's persist takes its
    /// connection before the write guard: the other order deadlocks a
    /// store with one connection (SQLite), a lookup holding the guard
    /// waiting for the connection the persist holds while it waits for the
    /// guard.
    pub(crate) async fn unflushed_on(
        &self,
        c: &mut Conn<D>,
    ) -> Result<RwLockReadGuard<'_, Option<Unflushed>>, StoreError> {
        let g = self.unflushed.read().await;
        if g.is_some() {
            return Ok(g);
        }
        drop(g);
        let pool = self.pool_id()?;
        let mut w = self.unflushed.write().await;
        if w.is_none() {
            let se = |e: String| StoreError(format!("read the space map log: {e}"));
            let mut tx = sqlx::Connection::begin(&mut *c)
                .await
                .map_err(|e| se(e.to_string()))?;
            if let Some(snapshot) = D::SNAPSHOT {
                D::exec(&mut *tx, snapshot, args![])
                    .await
                    .map_err(|e| se(e.to_string()))?;
            }
            let r = Self::read_unflushed(&mut *tx, pool).await.map_err(se);
            let _ = tx.commit().await;
            *w = Some(r?);
        }
        Ok(w.downgrade())
    }

    /// The chunks' extents overlapping each of `probes`, read on `c` in
    /// batches of span queries (as of the chunks only: the caller applies
    /// the log's unflushed changes).
    pub(crate) async fn stored_overlapping(
        c: &mut Conn<D>,
        pool: i64,
        probes: &[Extent],
    ) -> Result<Vec<Vec<Extent>>, StoreError> {
        let conn = tokio::sync::Mutex::new(c);
        let fetch = |vdev: u32, off: u64, end: u64, limit: usize| {
            let conn = &conn;
            async move {
                let what = format!("{off}..{end} of vdev {vdev}");
                let limit = limit.min(i64::MAX as usize) as i64;
                let a = args![pool, vdev as i64, i(off), i(end), limit];
                let mut c = conn.lock().await;
                let rows = D::fetch(&mut **c, q::SPAN_ROWS, a)
                    .await
                    .map_err(|err| crate::store::overlap_error(&what, err))?;
                let rows =
                    span_refs(&rows).map_err(|err| crate::store::overlap_error(&what, err))?;
                Ok(crate::store::span_rows(rows.into_iter()))
            }
        };
        crate::store::overlapping_batched(probes, crate::store::SPAN_ROWS, fetch).await
    }

    /// Refuse changes that do not fit the durable extents as of the last
    /// synced txg (chunks and unflushed log): an allocation over an extent,
    /// a free that is not of allocated space. Reads the chunks the changes
    /// fall in (a query per span of them), writes nothing.
    pub(crate) async fn check_changes(
        c: &mut Conn<D>,
        pool: i64,
        unflushed: &Unflushed,
        by_vdev: &BTreeMap<u32, Vec<Change>>,
    ) -> Result<(), String> {
        for (&vdev, changes) in by_vdev {
            let probes: Vec<Extent> = changes
                .iter()
                .map(|&(_, offset, size)| Extent { vdev, offset, size })
                .collect();
            let stored = Self::stored_overlapping(&mut *c, pool, &probes)
                .await
                .map_err(|e| e.0)?;
            let mut base: Vec<(u64, u64)> = Vec::new();
            for (p, s) in probes.iter().zip(stored) {
                let (off, end) = crate::store::sql_span(p);
                let now = unflushed.adjust(vdev, off, end, s);
                base.extend(now.into_iter().map(|e| (e.offset, e.size)));
            }
            base.sort_unstable();
            base.dedup();
            spacemap::apply(base, changes).map_err(|e| format!("vdev {vdev}: {e}"))?;
        }
        Ok(())
    }

    /// Append the txg's changes to the log and flush the metaslabs the
    /// policy picks (their log rows, this txg's included, applied to their
    /// chunks; their rows deleted; their flush txg recorded). A change that
    /// crosses a metaslab's end (never one the pool makes; a store's own
    /// callers may) is not logged: the metaslabs it spans are flushed in
    /// this txg, together, their older rows first and then this txg's
    /// changes there in their order (changes within different metaslabs
    /// touch different bytes, so only a crossing one needs that order).
    /// Returns the rows appended and the metaslabs flushed, for
    /// [`Unflushed`] once the txg commits.
    pub(crate) async fn log_and_flush(
        c: &mut Conn<D>,
        pool: i64,
        txg: u64,
        unflushed: &Unflushed,
        new_shifts: &BTreeMap<u32, u8>,
        by_vdev: &BTreeMap<u32, Vec<Change>>,
        t: &LogTunables,
    ) -> Result<(LogRows, Vec<Metaslab>), String> {
        let db = |e: sqlx::Error| e.to_string();
        let mut appended: LogRows = Vec::new();
        let mut joined: Vec<(u32, BTreeSet<u64>, Vec<Change>)> = Vec::new();
        for (&vdev, changes) in by_vdev {
            let shift = unflushed
                .shift(vdev)
                .or_else(|| new_shifts.get(&vdev).copied())
                .ok_or_else(|| format!("vdev {vdev}: no metaslab shift"))?;
            let group = spacemap_log::crossed(shift, changes);
            for (ms, ch) in spacemap_log::log_rows(shift, changes) {
                if group.contains(&ms) {
                    continue;
                }
                let a = args![pool, vdev as i64, i(ms), i(txg), spacemap_log::encode(&ch)];
                D::exec(c, q::INSERT_LOG, a).await.map_err(db)?;
                appended.push((vdev, ms, ch));
            }
            if !group.is_empty() {
                let mine: Vec<Change> = changes
                    .iter()
                    .filter(|ch| group.contains(&(ch.1 >> shift)))
                    .copied()
                    .collect();
                joined.push((vdev, group, mine));
            }
        }
        let pending: Vec<(Metaslab, u64)> = appended
            .iter()
            .map(|(v, m, ch)| ((*v, *m), ch.len() as u64))
            .collect();
        let mut plan = unflushed.plan_flush(txg, &pending, t);
        plan.retain(|(v, m)| !joined.iter().any(|j| j.0 == *v && j.1.contains(m)));
        let mut flushed = Vec::new();
        for &(vdev, ms) in &plan {
            let changes = Self::metaslab_log(c, pool, vdev, ms).await?;
            Self::persist_vdev(c, pool, vdev, &changes)
                .await
                .map_err(|e| format!("flush of metaslab {ms} of vdev {vdev}: {e}"))?;
            Self::mark_flushed(c, pool, vdev, ms, txg).await?;
            flushed.push((vdev, ms));
        }
        for (vdev, group, mine) in joined {
            let mut changes = Vec::new();
            for &ms in &group {
                changes.extend(Self::metaslab_log(c, pool, vdev, ms).await?);
            }
            changes.extend(mine);
            Self::persist_vdev(c, pool, vdev, &changes)
                .await
                .map_err(|e| format!("flush of metaslabs {group:?} of vdev {vdev}: {e}"))?;
            for ms in group {
                Self::mark_flushed(c, pool, vdev, ms, txg).await?;
                flushed.push((vdev, ms));
            }
        }
        Ok((appended, flushed))
    }

    /// Flush every metaslab of `vdev` that has log rows (applied to its
    /// chunks, the rows deleted, its flush txg recorded as `synced`), so
    /// its chunks alone hold its extents: before anything that reads them
    /// alone or changes the vdev's metaslab shift, which its log rows are
    /// keyed by (`verify --repair-vdev`).
    pub(crate) async fn flush_vdev(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        synced: u64,
    ) -> Result<(), String> {
        let mut metaslabs = BTreeSet::new();
        for r in D::fetch(c, q::LOG_METASLABS_OF_VDEV, args![pool, vdev as i64])
            .await
            .map_err(|e| e.to_string())?
        {
            metaslabs.insert(u(r.int(0)?));
        }
        for ms in metaslabs {
            let changes = Self::metaslab_log(c, pool, vdev, ms).await?;
            Self::persist_vdev(c, pool, vdev, &changes)
                .await
                .map_err(|e| format!("flush of metaslab {ms} of vdev {vdev}: {e}"))?;
            Self::mark_flushed(c, pool, vdev, ms, synced).await?;
        }
        Ok(())
    }

    /// The changes in the log of one metaslab, in order.
    async fn metaslab_log(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        ms: u64,
    ) -> Result<Vec<Change>, String> {
        let mut out = Vec::new();
        for mut r in D::fetch(c, q::METASLAB_LOG, args![pool, vdev as i64, i(ms)])
            .await
            .map_err(|e| e.to_string())?
        {
            out.extend(spacemap_log::decode(&r.blob(0)?)?);
        }
        Ok(out)
    }

    /// A flushed metaslab: its rows deleted, its flush txg recorded.
    async fn mark_flushed(
        c: &mut Conn<D>,
        pool: i64,
        vdev: u32,
        ms: u64,
        txg: u64,
    ) -> Result<(), String> {
        let a = args![pool, vdev as i64, i(ms), i(txg)];
        D::exec(c, q::DELETE_LOG, a.clone())
            .await
            .map_err(|e| e.to_string())?;
        D::exec(c, q::SET_FLUSHED, a)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}
