//! Moving a pool from one store to another (`aliquot-allocator
//! migrate-store`, `crate::migrate_cmd`). [`SqlStore::export`] reads what a
//! stopped pool's store holds with the store's own loaders: the pool as a
//! restart loads it (the space map log replayed into the extents), its
//! generation and their history, agent bindings, removals under way and
//! relocations. [`SqlStore::import`] writes that into a store holding no
//! such pool in ONE transaction with the store's own writers, so a failure
//! (or a crash) leaves the destination without the pool. The extents are
//! written as flushed space-map chunks: the destination starts with an
//! empty log.

use std::collections::BTreeMap;

use metaslab::Txg;

use super::{Dialect, SqlStore, args, i, now_ms, q, u};
use crate::owner_map;
use crate::store::{Evacuation, Persisted, RelocationRecord, Store, StoreError};

/// Everything a store holds of one pool, as [`SqlStore::export`] read it.
#[derive(Clone, Debug)]
pub struct PoolImage {
    pub persisted: Persisted,
    /// The pool's generation (the `leaders` row's), and its holder mark
    /// (`HANDED_OVER_CLEANLY` after a clean shutdown).
    pub generation: u64,
    pub leader_id: String,
    pub history: BTreeMap<u64, Txg>,
    pub rewind_generation: u64,
    pub bindings: BTreeMap<String, u64>,
    pub evacuations: Vec<Evacuation>,
    /// Relocations with the time each committed (ms since the epoch).
    pub relocations: Vec<(RelocationRecord, i64)>,
    /// The links of blocks' copies (`crate::block_copies`).
    pub copies: Vec<super::copies::CopyRow>,
}

impl<D: Dialect> SqlStore<D> {
    /// The pool as this store holds it, `None` if it holds none. The
    /// caller makes sure nothing writes meanwhile (the data dir's lock).
    pub async fn export(&self) -> Result<Option<PoolImage>, StoreError> {
        let Some(persisted) = self.load().await? else {
            return Ok(None);
        };
        let pool = self.pool_id()?;
        let err = |what: &str, e: String| StoreError(format!("read the {what}: {e}"));
        let rows = self
            .fetch(q::LEADER_ROW, args![&self.pool_name])
            .await
            .map_err(|e| err("leadership row", e.to_string()))?;
        let (generation, leader_id) = match rows.into_iter().next() {
            Some(mut r) => (
                u(r.int(0).map_err(|e| err("leadership row", e))?),
                r.text(1).map_err(|e| err("leadership row", e))?,
            ),
            None => (0, String::new()),
        };
        let mut relocations = Vec::new();
        let rows = self
            .fetch(q::RELOCATIONS_OF_POOL, args![pool])
            .await
            .map_err(|e| err("relocations", e.to_string()))?;
        for r in rows {
            let mut cols = [0i64; 8];
            for (k, c) in cols.iter_mut().enumerate() {
                *c = r.int(k + 1).map_err(|e| err("relocations", e))?;
            }
            let id = u(r.int(0).map_err(|e| err("relocations", e))?);
            let ms = r.int(9).map_err(|e| err("relocations", e))?;
            relocations.push((RelocationRecord::from_columns(id, cols), ms));
        }
        Ok(Some(PoolImage {
            persisted,
            generation,
            leader_id,
            history: self.generation_history().await?,
            rewind_generation: self.rewind_generation().await?,
            bindings: self.agent_bindings().await?,
            evacuations: self.evacuations().await?,
            relocations,
            copies: self
                .copy_rows(pool)
                .await
                .map_err(|e| err("copies' links", e))?,
        }))
    }

    /// Write `img` as this store's pool (named as this store was opened),
    /// in one transaction. Refused, with nothing written, when the store
    /// holds a pool of that name or an allocator has ever led it here.
    /// `progress` is told of each step (a large pool takes a while).
    pub async fn import(
        &self,
        img: &PoolImage,
        progress: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), StoreError> {
        let name = &self.pool_name;
        let p = &img.persisted;
        let txg = p.synced_txg;
        let db = |what: &str, e: sqlx::Error| StoreError(format!("write the {what}: {e}"));
        let mut tx = self.db.begin().await.map_err(|e| db("pool", e))?;
        D::exec(&mut *tx, q::INSERT_LEADER, args![name])
            .await
            .map_err(|e| db("leadership row", e))?;
        if !D::fetch(&mut *tx, q::POOL_OF_NAME, args![name])
            .await
            .map_err(|e| db("pool", e))?
            .is_empty()
        {
            return Err(StoreError(format!(
                "{} already holds a pool {name:?}: refusing to write over it \
                 (nothing was written)",
                self.shown
            )));
        }
        let seen = D::fetch(&mut *tx, q::LEADER_ROW, args![name])
            .await
            .map_err(|e| db("leadership row", e))?;
        let seen = seen
            .first()
            .map_or(Ok(0), |r| r.int(0))
            .map_err(StoreError)?;
        if seen != 0 {
            return Err(StoreError(format!(
                "an allocator has led pool {name:?} in {} (generation {seen}): refusing to \
                 move a pool in under it (nothing was written)",
                self.shown
            )));
        }
        let rows = D::fetch(
            &mut *tx,
            q::CREATE_POOL,
            args![name, i(p.pool_guid), now_ms()],
        )
        .await
        .map_err(|e| db("pool row", e))?;
        let pool = rows
            .first()
            .ok_or_else(|| StoreError("create pool: no id returned".into()))?
            .int(0)
            .map_err(StoreError)?;
        for v in &p.vdevs {
            Self::upsert_vdev(&mut *tx, pool, v, txg).await?;
        }
        // Each vdev's extents (in (vdev, offset) order), as flushed chunks.
        let mut by_vdev: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for e in p.allocated.iter() {
            by_vdev.entry(e.vdev).or_default().push((e.offset, e.size));
        }
        for (vdev, extents) in &by_vdev {
            let bytes: u64 = extents.iter().map(|e| e.1).sum();
            Self::write_run(&mut *tx, pool, *vdev, None, extents)
                .await
                .map_err(|e| StoreError(format!("write the extents of vdev {vdev}: {e}")))?;
            D::exec(
                &mut *tx,
                q::ADD_ALLOCATED,
                args![i(bytes), pool, *vdev as i64],
            )
            .await
            .map_err(|e| db("allocated bytes", e))?;
            progress(format!(
                "vdev {vdev}: {} extents, {bytes} bytes written",
                extents.len()
            ));
        }
        for (&vdev, state) in &p.vdev_states {
            let a = args![state.as_str(), i(txg), pool, vdev as i64];
            D::exec(&mut *tx, q::SET_ADMIN_STATE, a)
                .await
                .map_err(|e| db("vdev states", e))?;
        }
        for m in &p.mappings {
            D::exec(&mut *tx, q::INSERT_MAPPING, super::mapping_args(pool, m))
                .await
                .map_err(|e| db("indirect mappings", e))?;
        }
        for (idx, identity) in &p.owner_identities {
            D::exec(
                &mut *tx,
                q::INSERT_OWNER,
                args![pool, *idx as i64, identity],
            )
            .await
            .map_err(|e| db("owners", e))?;
        }
        let by_vdev = owner_map::by_vdev(&p.owner_runs);
        let spans: Vec<super::OwnerSpan> = by_vdev
            .iter()
            .map(|(vdev, runs)| (*vdev, 0, u64::MAX, runs.as_slice()))
            .collect();
        Self::write_owner_maps(&mut *tx, pool, &spans)
            .await
            .map_err(|e| db("owner maps", e))?;
        progress(format!(
            "{} owner runs of {} owners, {} mapping entries written",
            p.owner_runs.len(),
            p.owner_identities.len(),
            p.mappings.len()
        ));
        for (k, v) in &p.tunables {
            D::exec(&mut *tx, q::UPSERT_TUNABLE, args![pool, k, v, now_ms()])
                .await
                .map_err(|e| db("tunables", e))?;
        }
        for (agent, guid) in &img.bindings {
            D::exec(
                &mut *tx,
                q::BIND_AGENT,
                args![pool, agent, i(*guid), now_ms()],
            )
            .await
            .map_err(|e| db("agent bindings", e))?;
        }
        Self::write_copy_rows(&mut *tx, pool, &img.copies)
            .await
            .map_err(|e| db("copies' links", e))?;
        for ev in &img.evacuations {
            let a = args![
                pool,
                ev.vdev as i64,
                i(ev.bytes),
                i(ev.extents),
                i(ev.started_ms)
            ];
            D::exec(&mut *tx, q::INSERT_EVACUATION, a)
                .await
                .map_err(|e| db("evacuations", e))?;
        }
        for (r, ms) in &img.relocations {
            D::exec(
                &mut *tx,
                q::INSERT_RELOCATION,
                super::relocation_args(pool, r, *ms),
            )
            .await
            .map_err(|e| db("relocations", e))?;
        }
        for (&g, &at) in &img.history {
            let a = args![name, i(g), i(at), now_ms(), "", ""];
            D::exec(&mut *tx, q::INSERT_GENERATION, a)
                .await
                .map_err(|e| db("generation history", e))?;
        }
        D::exec(
            &mut *tx,
            q::SET_REWIND_GENERATION,
            args![i(img.rewind_generation), pool],
        )
        .await
        .map_err(|e| db("rewind generation", e))?;
        D::exec(
            &mut *tx,
            q::SET_SYNCED,
            args![i(txg), i(p.state_digest), pool],
        )
        .await
        .map_err(|e| db("synced txg", e))?;
        // The generation last: the next allocator opens the one after the
        // source's, so no device label is of a generation the store lacks.
        let a = args![name, i(img.generation), &img.leader_id, i(txg), 0i64];
        let n = D::exec(&mut *tx, q::IMPORT_LEADER, a)
            .await
            .map_err(|e| db("leadership row", e))?;
        if n != 1 {
            return Err(StoreError(format!(
                "an allocator took pool {name:?} in {} meanwhile (nothing was written)",
                self.shown
            )));
        }
        progress(format!("committing txg {txg}"));
        tx.commit().await.map_err(|e| db("pool (commit)", e))?;
        Ok(())
    }
}
