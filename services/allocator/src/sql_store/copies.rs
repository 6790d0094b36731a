//! The copies' links (`crate::block_copies`) in the SQL store: a txg's
//! relocations, frees and new links applied to `block_copies` in its one
//! transaction, and the lookup of a copy's siblings.

use metaslab::VdevId;

use super::{Conn, Dialect, SqlStore, args, i, u};
use crate::block_copies::freed_ranges;
use crate::store::TxgRecord;

const INSERT_COPY: &str = include_str!("queries/insert_copy.sql");
const MOVE_COPY: &str = include_str!("queries/move_copy.sql");
const DELETE_COPIES: &str = include_str!("queries/delete_copies.sql");
const ANY_COPY: &str = include_str!("queries/any_copy.sql");
const COPIES_OF: &str = include_str!("queries/copies_of.sql");
const COPIES_OF_POOL: &str = include_str!("queries/copies_of_pool.sql");

/// One link row: the copy's (vdev, offset) and its block.
pub type CopyRow = (VdevId, u64, u64);

/// Starts a `copies_on` statement asks for at most (its JSON list bounded).
const STARTS_PER_QUERY: usize = 4096;

impl<D: Dialect> SqlStore<D> {
    /// Apply `rec`'s changes to the links, in `crate::block_copies`' order.
    /// A pool that has no links (no block of several copies) pays one
    /// query per txg with frees, not one per free.
    pub(crate) async fn persist_copies(
        c: &mut Conn<D>,
        pool: i64,
        rec: &TxgRecord,
    ) -> Result<(), sqlx::Error> {
        let frees = freed_ranges(rec).next().is_some();
        let linked = (frees || !rec.relocations.is_empty())
            && !D::fetch(c, ANY_COPY, args![pool]).await?.is_empty();
        if linked {
            for r in &rec.relocations {
                // Rows inside the new extent are stale (it was free): gone
                // first, so the moved row cannot meet one.
                let (vdev, start) = (r.to.vdev as i64, i(r.to.offset));
                let end = i(r.to.offset.saturating_add(r.to.size));
                D::exec(c, DELETE_COPIES, args![pool, vdev, start, end]).await?;
                let a = args![pool, r.from.vdev as i64, i(r.from.offset), vdev, start];
                D::exec(c, MOVE_COPY, a).await?;
            }
            for (vdev, start, end) in freed_ranges(rec) {
                let a = args![pool, vdev as i64, i(start), i(end)];
                D::exec(c, DELETE_COPIES, a).await?;
            }
        }
        for l in &rec.copies {
            for e in &l.extents {
                let a = args![pool, e.vdev as i64, i(e.offset), i(l.block)];
                D::exec(c, INSERT_COPY, a).await?;
            }
        }
        Ok(())
    }

    /// Every link row of `pool`, for a move of the pool to another store
    /// (`SqlStore::export`).
    pub(crate) async fn copy_rows(&self, pool: i64) -> Result<Vec<CopyRow>, String> {
        let rows = self
            .fetch(COPIES_OF_POOL, args![pool])
            .await
            .map_err(|e| e.to_string())?;
        rows.into_iter()
            .map(|r| Ok((r.int(0)? as VdevId, u(r.int(1)?), u(r.int(2)?))))
            .collect()
    }

    /// Write `rows` as `pool`'s links (`SqlStore::import`).
    pub(crate) async fn write_copy_rows(
        c: &mut Conn<D>,
        pool: i64,
        rows: &[CopyRow],
    ) -> Result<(), sqlx::Error> {
        for &(vdev, start, block) in rows {
            let a = args![pool, vdev as i64, i(start), i(block)];
            D::exec(c, INSERT_COPY, a).await?;
        }
        Ok(())
    }

    /// [`crate::store::Store::copies_on`]: a query per [`STARTS_PER_QUERY`]
    /// starts, in order, so the sets come by start.
    pub(crate) async fn copies_on_vdev(
        &self,
        pool: i64,
        vdev: VdevId,
        starts: &[u64],
    ) -> Result<crate::block_copies::CopySets, String> {
        // Starts as stored (u64 bit patterns in i64), in stored order.
        let mut starts: Vec<i64> = starts.iter().map(|&s| i(s)).collect();
        starts.sort_unstable();
        starts.dedup();
        let mut out: crate::block_copies::CopySets = Vec::new();
        for batch in starts.chunks(STARTS_PER_QUERY) {
            let list = serde_json::to_string(batch).map_err(|e| e.to_string())?;
            let rows = self
                .fetch(D::COPIES_ON, args![pool, vdev as i64, list])
                .await
                .map_err(|e| e.to_string())?;
            let mut at = None;
            for r in rows {
                let me = r.int(0)?;
                if at != Some(me) {
                    out.push(Vec::new());
                    at = Some(me);
                }
                if let Some(set) = out.last_mut() {
                    set.push((r.int(1)? as VdevId, u(r.int(2)?)));
                }
            }
        }
        Ok(out)
    }

    /// [`crate::store::Store::copies_of`].
    pub(crate) async fn copies_of_at(
        &self,
        pool: i64,
        at: (VdevId, u64),
    ) -> Result<Vec<(VdevId, u64)>, String> {
        let rows = self
            .fetch(COPIES_OF, args![pool, at.0 as i64, i(at.1)])
            .await
            .map_err(|e| e.to_string())?;
        rows.into_iter()
            .map(|r| Ok((r.int(0)? as VdevId, u(r.int(1)?))))
            .collect()
    }
}
