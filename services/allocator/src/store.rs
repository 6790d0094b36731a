//! The durability seam. A txg sync hands the store exactly what changed in
//! that txg ([`TxgRecord`]); SyncTxg waiters are released only after
//! `persist` returned. At start the service `load`s what was persisted and
//! rebuilds the pool from it (`metaslab::Pool::restore`). [`MemStore`] keeps
//! the records in memory (tests), refusing what the SQL stores refuse;
//! `crate::sql_store::SqlStore` is the durable one (one SQL transaction per
//! txg, on SQLite or PostgreSQL). The conformance suite
//! (`tests/store_conformance.rs`) runs the same tests on all of them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures_util::future::BoxFuture;
use metaslab::{Extent, SpaceChangeKind, Txg, TxgSync, VdevId, VdevRole, VdevSpec};

pub use crate::indirect::Mapping;
use crate::spacemap::Extents;

/// A vdev as the store keeps it (the identity that survives restarts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VdevRecord {
    pub id: VdevId,
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    /// `metaslab_shift` is always `Some` here: the shift chosen at add time.
    pub spec: VdevSpec,
}

/// A `vdevs` row as the SQL store keeps it (integers as BIGINT / the i64
/// bit patterns of u64), checked into a [`VdevRecord`] by [`VdevRow::records`].
#[derive(Clone, Debug)]
pub struct VdevRow {
    pub id: i64,
    pub guid: i64,
    pub name: String,
    pub endpoint: String,
    pub capacity: i64,
    pub ashift: i64,
    pub metaslab_shift: i64,
    pub metaslab_size: i64,
    pub children: i64,
    pub parity: i64,
    pub rotational: i64,
    pub class: String,
    pub allocated: i64,
    pub admin_state: String,
}

/// Vdevs with their administrative states (non-online ones) and the
/// allocated bytes each records.
pub type VdevRecords = (
    Vec<VdevRecord>,
    BTreeMap<VdevId, AdminState>,
    BTreeMap<VdevId, u64>,
);

impl VdevRow {
    /// Check each row (shift against size, known class and admin state, ids
    /// in range) into records.
    pub fn records(rows: Vec<VdevRow>) -> Result<VdevRecords, String> {
        let mut vdevs = Vec::with_capacity(rows.len());
        let mut states = BTreeMap::new();
        let mut recorded = BTreeMap::new();
        for r in rows {
            let vid = r.id;
            let (shift, ms_size) = (r.metaslab_shift, r.metaslab_size);
            if !(0..64).contains(&shift) || 1i64.checked_shl(shift as u32) != Some(ms_size) {
                return Err(format!(
                    "vdev {vid}: metaslab size {ms_size} does not match its shift {shift}"
                ));
            }
            let role = match r.class.as_str() {
                "normal" => VdevRole::Normal,
                "log" => VdevRole::Log,
                other => return Err(format!("vdev {vid}: unknown class {other:?}")),
            };
            let vid = u32::try_from(vid).map_err(|_| format!("vdev id {vid} is out of range"))?;
            recorded.insert(vid, r.allocated as u64);
            match AdminState::parse(&r.admin_state) {
                Some(AdminState::Online) => {}
                Some(a) => {
                    states.insert(vid, a);
                }
                None => {
                    return Err(format!(
                        "vdev {vid}: unknown admin state {:?}",
                        r.admin_state
                    ));
                }
            }
            vdevs.push(VdevRecord {
                id: vid,
                guid: r.guid as u64,
                name: r.name,
                endpoint: r.endpoint,
                spec: VdevSpec {
                    capacity: r.capacity as u64,
                    ashift: u8::try_from(r.ashift)
                        .map_err(|_| format!("vdev {vid}: ashift out of range"))?,
                    children: r.children as u32,
                    parity: r.parity as u32,
                    rotational: r.rotational != 0,
                    role,
                    metaslab_shift: Some(shift as u8),
                },
            });
        }
        Ok((vdevs, states, recorded))
    }
}

/// A vdev's administrative state, as persisted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdminState {
    #[default]
    Online,
    /// No new allocations (SetVdevState offline, `vdev drain`).
    Offline,
    /// Forgotten by the pool (RemoveVdev); the id stays taken.
    Removed,
}

impl AdminState {
    pub fn as_str(self) -> &'static str {
        match self {
            AdminState::Online => "online",
            AdminState::Offline => "offline",
            AdminState::Removed => "removed",
        }
    }

    pub fn parse(s: &str) -> Option<AdminState> {
        Some(match s {
            "online" => AdminState::Online,
            "offline" => AdminState::Offline,
            "removed" => AdminState::Removed,
            _ => return None,
        })
    }
}

/// A committed relocation: the block copy at `from` now lives at `to`
/// (the same txg freed `from` and allocated `to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelocationRecord {
    pub allocation_id: u64,
    pub plan_id: u64,
    pub from: Extent,
    pub to: Extent,
    pub txg: Txg,
}

/// A change of the indirect mapping (`crate::indirect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappingChange {
    /// A move committed: the block at `from` lives at `to`.
    Add(Mapping),
    /// The entry of old extent `from` is gone (remapped or freed).
    Drop(Extent),
}

/// Everything one txg sync persists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxgRecord {
    pub sync: TxgSync,
    /// Vdevs added, or whose endpoint or capacity changed, in this txg.
    pub vdevs: Vec<VdevRecord>,
    /// Administrative state changes in this txg, in order.
    pub vdev_states: Vec<(VdevId, AdminState)>,
    /// Relocations committed in this txg.
    pub relocations: Vec<RelocationRecord>,
    /// Owners of committed extents changed in this txg.
    pub owners: crate::extent_owners::OwnerChanges,
    /// Indirect mapping entries added (moves committed) and dropped in
    /// this txg, in order.
    pub mappings: Vec<MappingChange>,
    /// Blocks committed with several copies in this txg: their copies'
    /// link (`crate::block_copies`).
    pub copies: Vec<crate::block_copies::CopyLink>,
    /// The store's state digest after this txg: [`state_digest`] of the
    /// previous one and this record. Devices' labels keep it beside the
    /// txg, so a store of another history at the same txg is caught.
    pub state_digest: u64,
}

/// One txg's space changes, checked to fit a store's i64 columns and
/// grouped per vdev in order, with each vdev's net change of allocated
/// bytes: what every SQL store's persist applies.
pub struct VdevChanges {
    pub by_vdev: BTreeMap<VdevId, Vec<crate::spacemap::Change>>,
    pub delta: BTreeMap<VdevId, i64>,
}

impl VdevChanges {
    pub fn of(rec: &TxgRecord) -> Result<VdevChanges, String> {
        let txg = rec.sync.txg;
        let mut out = VdevChanges {
            by_vdev: BTreeMap::new(),
            delta: BTreeMap::new(),
        };
        for c in &rec.sync.changes {
            let e = c.extent;
            if e.size == 0
                || e.offset
                    .checked_add(e.size)
                    .is_none_or(|end| end > i64::MAX as u64)
            {
                return Err(format!("txg {txg}: extent {e} cannot be stored"));
            }
            let d = out.delta.entry(e.vdev).or_default();
            match c.kind {
                SpaceChangeKind::Alloc => *d += e.size as i64,
                SpaceChangeKind::Free => *d -= e.size as i64,
            }
            out.by_vdev
                .entry(e.vdev)
                .or_default()
                .push((c.kind, e.offset, e.size));
        }
        Ok(out)
    }
}

impl RelocationRecord {
    /// From a `relocations` row's columns: plan id, from (vdev, offset,
    /// size), to (vdev, offset, size), txg; i64 bit patterns of u64s.
    pub fn from_columns(allocation_id: u64, c: [i64; 8]) -> RelocationRecord {
        let ext = |v: i64, o: i64, s: i64| Extent {
            vdev: v as u32,
            offset: o as u64,
            size: s as u64,
        };
        RelocationRecord {
            allocation_id,
            plan_id: c[0] as u64,
            from: ext(c[1], c[2], c[3]),
            to: ext(c[4], c[5], c[6]),
            txg: c[7] as u64,
        }
    }
}

/// The state digest after `rec`, chained from the previous txg's `prev`
/// (FNV-1a 64 over the txg and its space changes, in persist order): two
/// stores at the same txg with different histories differ in it.
pub fn state_digest(prev: u64, rec: &TxgRecord) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(prev);
    eat(rec.sync.txg);
    for c in &rec.sync.changes {
        eat(matches!(c.kind, SpaceChangeKind::Alloc) as u64);
        eat(c.extent.vdev as u64);
        eat(c.extent.offset);
        eat(c.extent.size);
    }
    // Never 0: 0 means "not known" (stores from before digests).
    h.max(1)
}

/// What `load` returns: the state as of the last synced txg.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Persisted {
    pub pool_guid: u64,
    pub synced_txg: Txg,
    pub vdevs: Vec<VdevRecord>,
    /// Durable allocated extents (deferred frees not yet reusable included:
    /// after a restart they are simply free, as nothing references them),
    /// in `(vdev, offset)` order, compactly (`crate::spacemap`).
    pub allocated: Extents,
    /// Tunables set at run time, `(name, value)`, in the order they were set.
    pub tunables: Vec<(String, String)>,
    /// Vdevs whose administrative state is not `Online`.
    pub vdev_states: BTreeMap<VdevId, AdminState>,
    /// Owner identities by number, and the owner runs
    /// `(vdev, start, end, owner)` (see `crate::extent_owners`).
    pub owner_identities: Vec<(u32, String)>,
    pub owner_runs: Vec<(u32, u64, u64, u32)>,
    /// The state digest at `synced_txg` (0: not known).
    pub state_digest: u64,
    /// Live indirect mapping entries, in `(from.vdev, from.offset)` order.
    pub mappings: Vec<Mapping>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

/// A chunk row `(start, width, data)` as a span query returns it.
pub(crate) type SpanRow = (i64, i64, Vec<u8>);
pub(crate) type SpanRows = Vec<SpanRow>;

/// Most chunk rows one query of [`overlapping_batched`] reads (1 MiB of
/// 32 KiB chunks).
pub(crate) const SPAN_ROWS: usize = 32;

/// `[off, end)` of `e` as the span queries bind it (SQL integers are
/// signed).
pub(crate) fn sql_span(e: &Extent) -> (u64, u64) {
    let off = e.offset.min(i64::MAX as u64);
    (off, e.offset.saturating_add(e.size).min(i64::MAX as u64))
}

/// A span query's failure, naming what it looked for.
pub(crate) fn overlap_error(
    what: impl std::fmt::Display,
    err: impl std::fmt::Display,
) -> StoreError {
    StoreError(format!("extents overlapping {what}: {err}"))
}

/// The batch's rows, copied (the sweep keeps them across the extents it
/// resolves).
pub(crate) fn span_rows<'a>(rows: impl Iterator<Item = (i64, i64, &'a [u8])>) -> SpanRows {
    rows.map(|(start, width, data)| (start, width, data.to_vec()))
        .collect()
}

/// [`Store::allocated_overlapping`] from its span query's rows, searched
/// where the driver holds them: Claim and Relocate ask one at a time.
pub(crate) fn overlapping_in_rows<'a>(
    e: &Extent,
    rows: impl Iterator<Item = (i64, i64, &'a [u8])>,
) -> Result<Vec<Extent>, StoreError> {
    let (off, end) = sql_span(e);
    crate::spacemap::overlapping_rows(e.vdev, rows, off, end).map_err(|err| overlap_error(e, err))
}

/// [`Store::allocated_overlapping_many`] for a store of space-map chunk
/// rows: per vdev, the extents in offset order are swept with queries of at
/// most `max_rows` rows. `fetch(vdev, off, end, limit)` returns, in start
/// order and at most `limit`, the row starting last at or before `off`,
/// then those starting before `end` (the rows any extent in `[off, end)`
/// can be in; see `spacemap`). One query from the first unresolved extent
/// to the end of the last resolves every extent that ends before the first
/// row it did not return; the next query starts at the next extent. So a
/// 1024-extent Free of a run of blocks is one query instead of 1024 (each a
/// hop to the store's thread), extents scattered over a large vdev cost a
/// query per `max_rows` rows their span covers, and never more than one per
/// extent, plus one for an extent spanning more than `max_rows` rows (whose
/// rows are then read whole).
pub(crate) async fn overlapping_batched<F, Fut>(
    extents: &[Extent],
    max_rows: usize,
    fetch: F,
) -> Result<Vec<Vec<Extent>>, StoreError>
where
    F: Fn(u32, u64, u64, usize) -> Fut,
    Fut: std::future::Future<Output = Result<SpanRows, StoreError>>,
{
    let probe = sql_span;
    let mut order: Vec<usize> = (0..extents.len()).collect();
    order.sort_by_key(|&i| (extents[i].vdev, extents[i].offset));
    let mut out = vec![Vec::new(); extents.len()];
    for group in order.chunk_by(|&a, &b| extents[a].vdev == extents[b].vdev) {
        let vdev = extents[group[0]].vdev;
        // The furthest end from each extent on: every query's `end`, found
        // once instead of rescanning the rest per query.
        let mut ends: Vec<u64> = group.iter().map(|&i| probe(&extents[i]).1).collect();
        for k in (1..ends.len()).rev() {
            ends[k - 1] = ends[k - 1].max(ends[k]);
        }
        let mut rest = group;
        while let Some(&first) = rest.first() {
            let (off, _) = probe(&extents[first]);
            let end = ends[group.len() - rest.len()];
            let mut rows = fetch(vdev, off, end, max_rows + 1).await?;
            // Rows from the first not returned on are unknown: resolve the
            // extents that end before it.
            let known_to = if rows.len() > max_rows {
                let cut = rows[max_rows].0 as u64;
                rows.truncate(max_rows);
                cut
            } else {
                u64::MAX
            };
            let mut n = rest
                .iter()
                .take_while(|&&i| probe(&extents[i]).1 <= known_to)
                .count();
            if n == 0 {
                // The first extent alone spans more than `max_rows` rows.
                let (off, end) = probe(&extents[first]);
                rows = fetch(vdev, off, end, usize::MAX).await?;
                n = 1;
            }
            let probes: Vec<(u64, u64)> = rest[..n].iter().map(|&i| probe(&extents[i])).collect();
            let found = crate::spacemap::overlapping_each(vdev, &rows, &probes)
                .map_err(|err| overlap_error(format_args!("{off}..{end} of vdev {vdev}"), err))?;
            for (&i, f) in rest[..n].iter().zip(found) {
                out[i] = f;
            }
            rest = &rest[n..];
        }
    }
    Ok(out)
}

/// What every store does, with the same answers (the conformance suite
/// checks MemStore, SQLite and PostgreSQL alike). No method has a default:
/// a new store states each answer.
pub trait Store: Send + Sync + 'static {
    /// The persisted pool, or `None` for a fresh one.
    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>>;
    /// Record the pool guid of a fresh pool (refused if it exists).
    fn create(&self, pool_guid: u64) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Persist one txg, atomically: all of it or nothing. Called in txg
    /// order, one at a time; the last persisted txg again is a retry whose
    /// commit landed (a no-op), an older one is refused.
    fn persist<'a>(&'a self, record: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Remember a tunable set at run time (outside any txg: it is durable
    /// when this returns).
    fn set_tunable<'a>(
        &'a self,
        name: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// A persist failed because another allocator leads the pool now (the
    /// txg's fencing check found a newer generation): never retry, stop
    /// serving. Stores with one writer by construction answer false.
    fn fenced(&self) -> bool;
    /// Bump the pool's generation (once per start, after `load`/`create`)
    /// and return the new one; durable when this returns.
    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>>;
    /// Generation -> the synced txg when it opened, for every generation
    /// the store recorded (the one `open_generation` started included):
    /// what generation G synced is the entry of G + 1. Generations opened
    /// before the store kept a history have no entry (fencing then falls
    /// back to the current generation's synced txg at open).
    fn generation_history(&self) -> BoxFuture<'_, Result<BTreeMap<u64, Txg>, StoreError>>;
    /// The generation that accepted a rollback (`--rewind-to`), 0 if none:
    /// device labels of older generations are not compared with the store.
    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>>;
    /// Whether the generation before this one handed the pool over cleanly
    /// (its last txg synced, nothing dirty, no claim window of its own
    /// open): then nothing can be claimed and no claim window opens. Stores
    /// that do not record handovers answer false.
    fn handed_over_cleanly(&self) -> bool;
    /// Record that generation `g` accepted a rollback; durable on return.
    fn set_rewind_generation(&self, g: u64) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Durable allocated extents overlapping `e` (for Claim's exact check).
    fn allocated_overlapping(&self, e: Extent) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>>;
    /// [`Self::allocated_overlapping`] of each of `extents`, in their order
    /// (Free's exact check of a whole request). Stores of chunk rows answer
    /// a batch with a query per span ([`overlapping_batched`]), not one per
    /// extent.
    fn allocated_overlapping_many<'a>(
        &'a self,
        extents: &'a [Extent],
    ) -> BoxFuture<'a, Result<Vec<Vec<Extent>>, StoreError>>;
    /// The log space map's flush bounds (`crate::spacemap_log`); `None`: a
    /// store that keeps no log.
    fn log_tunables(&self) -> Option<crate::spacemap_log::LogTunables>;
    /// Set them (from --tunable at start); a store without a log ignores it.
    fn set_log_tunables(&self, t: crate::spacemap_log::LogTunables);
    /// Up to `limit` durable extents of `vdev`, largest first (ties by
    /// offset): the candidates of a rebalance plan.
    fn largest_extents(
        &self,
        vdev: u32,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>>;
    /// The committed relocation made by allocation `id`, if its txg
    /// persisted.
    fn relocation(&self, id: u64) -> BoxFuture<'_, Result<Option<RelocationRecord>, StoreError>>;
    /// Durable relocations ever made: (count, bytes of the extents freed).
    fn relocation_totals(&self) -> BoxFuture<'_, Result<(u64, u64), StoreError>>;
    /// Agent certificate name -> the device guid it is bound to (see
    /// `binding`).
    fn agent_bindings(&self) -> BoxFuture<'_, Result<BTreeMap<String, u64>, StoreError>>;
    /// Bind agent certificate `name` to `device_guid`, durable when this
    /// returns (before the Register that made it is answered). A name or a
    /// device already bound is refused.
    fn bind_agent<'a>(
        &'a self,
        name: &'a str,
        device_guid: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// The vdev removals under way (`crate::mover`), by vdev.
    fn evacuations(&self) -> BoxFuture<'_, Result<Vec<Evacuation>, StoreError>>;
    /// Record a removal under way (replacing the vdev's row), or with
    /// `None` end it; durable when this returns (outside any txg: what is
    /// left to move is what the synced txgs leave on the vdev). The txg
    /// that records the vdev removed deletes its row too.
    fn set_evacuation(
        &self,
        vdev: VdevId,
        e: Option<Evacuation>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    /// The other copies `(vdev, offset)` of the block whose copy starts at
    /// `at` (durable links, `crate::block_copies`), in order; empty for a
    /// block of one copy or committed before copies were linked.
    fn copies_of(&self, at: (VdevId, u64))
    -> BoxFuture<'_, Result<Vec<(VdevId, u64)>, StoreError>>;
    /// The copies `(vdev, offset)` of every linked block with a copy on
    /// `vdev` starting at one of `starts` (any order), each set in order
    /// (its copy on `vdev` included), the sets by that copy's offset: a
    /// plan's fact of which vdevs each candidate's block already uses.
    /// Asked for the candidates only, so a vdev of many linked blocks costs
    /// what the plan looks at.
    fn copies_on<'a>(
        &'a self,
        vdev: VdevId,
        starts: &'a [u64],
    ) -> BoxFuture<'a, Result<crate::block_copies::CopySets, StoreError>>;
}

/// A vdev removal under way: the vdev and what it held when it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evacuation {
    pub vdev: VdevId,
    pub bytes: u64,
    pub extents: u64,
    pub started_ms: u64,
}

/// Keeps the persisted state in memory (for tests and until the SQLite
/// store lands). Shareable between allocator instances in one process, so a
/// "restart" can be tested.
#[derive(Debug, Default)]
pub struct MemStore {
    state: Mutex<Option<MemState>>,
}

#[derive(Debug, Default)]
struct MemState {
    pool_guid: u64,
    synced_txg: Txg,
    vdevs: BTreeMap<VdevId, VdevRecord>,
    allocated: BTreeSet<Extent>,
    tunables: Vec<(String, String)>,
    generation: u64,
    history: BTreeMap<u64, Txg>,
    bindings: BTreeMap<String, u64>,
    vdev_states: BTreeMap<VdevId, AdminState>,
    relocations: BTreeMap<u64, RelocationRecord>,
    rewind_generation: u64,
    owner_identities: BTreeMap<u32, String>,
    owner_runs: BTreeMap<(u32, u64), (u64, u32)>,
    state_digest: u64,
    mappings: BTreeMap<(u32, u64), Mapping>,
    evacuations: BTreeMap<VdevId, Evacuation>,
    copies: crate::block_copies::MemCopies,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// The last persisted txg (0 before any).
    pub fn synced_txg(&self) -> Txg {
        self.state
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |s| s.synced_txg)
    }

    /// Persist `record` as the SQL stores do: everything checked before
    /// anything changes (a refused txg leaves nothing), with the same
    /// refusals (an allocation over a stored extent, a free of space not
    /// stored, a relocation or owner number recorded twice). The space
    /// changes are checked even when the pool vouched for them
    /// (`TxgSync::checked`): here the extents are in memory, and an SQL
    /// store refuses the same txg at its flush or its replay.
    fn apply(&self, record: &TxgRecord) -> Result<(), StoreError> {
        let mut g = self.state.lock().unwrap();
        let st = g
            .as_mut()
            .ok_or_else(|| StoreError("persist before create".into()))?;
        let txg = record.sync.txg;
        if txg <= st.synced_txg {
            if txg == st.synced_txg {
                // A retry of a txg whose commit did land: nothing to do.
                return Ok(());
            }
            return Err(StoreError(format!(
                "txg {txg} persisted out of order (last {})",
                st.synced_txg
            )));
        }
        let VdevChanges { by_vdev, .. } = VdevChanges::of(record).map_err(StoreError)?;
        let mut replaced = Vec::with_capacity(by_vdev.len());
        for (&vdev, changes) in &by_vdev {
            let cur: Vec<(u64, u64)> = st
                .allocated
                .range(vdev_range(vdev))
                .map(|e| (e.offset, e.size))
                .collect();
            let out = crate::spacemap::apply(cur, changes)
                .map_err(|e| StoreError(format!("txg {txg}: vdev {vdev}: {e}")))?;
            replaced.push((vdev, out));
        }
        for r in &record.relocations {
            if st.relocations.contains_key(&r.allocation_id) {
                return Err(StoreError(format!(
                    "txg {txg}: relocation {} recorded twice",
                    r.allocation_id
                )));
            }
        }
        // Entries added and dropped in order, checked on a copy of the keys
        // touched: an entry added twice is refused (the tables' key).
        let mut mapped: BTreeMap<(u32, u64), bool> = BTreeMap::new();
        for c in &record.mappings {
            match c {
                MappingChange::Add(m) => {
                    let k = (m.from.vdev, m.from.offset);
                    let there = *mapped.get(&k).unwrap_or(&st.mappings.contains_key(&k));
                    if there {
                        return Err(StoreError(format!(
                            "txg {txg}: extent {} mapped twice",
                            m.from
                        )));
                    }
                    mapped.insert(k, true);
                }
                MappingChange::Drop(e) => {
                    mapped.insert((e.vdev, e.offset), false);
                }
            }
        }
        for (i, name) in &record.owners.identities {
            if st.owner_identities.contains_key(i)
                || st.owner_identities.values().any(|n| n == name)
            {
                return Err(StoreError(format!(
                    "txg {txg}: owner {i} ({name:?}) recorded twice"
                )));
            }
        }
        for v in &record.vdevs {
            if v.spec.metaslab_shift.is_none() {
                return Err(StoreError(format!(
                    "vdev {}: no metaslab shift to persist",
                    v.id
                )));
            }
        }
        for v in &record.vdevs {
            st.vdevs.insert(v.id, v.clone());
        }
        for (vdev, out) in replaced {
            let old: Vec<Extent> = st.allocated.range(vdev_range(vdev)).copied().collect();
            for e in old {
                st.allocated.remove(&e);
            }
            st.allocated
                .extend(
                    out.into_iter()
                        .map(|(offset, size)| Extent { vdev, offset, size }),
                );
        }
        for &(v, a) in &record.vdev_states {
            if a == AdminState::Removed {
                st.evacuations.remove(&v);
            }
            if !st.vdevs.contains_key(&v) {
                continue; // as an UPDATE of no row
            }
            if a == AdminState::Online {
                st.vdev_states.remove(&v);
            } else {
                st.vdev_states.insert(v, a);
            }
        }
        for r in &record.relocations {
            st.relocations.insert(r.allocation_id, *r);
        }
        for c in &record.mappings {
            match c {
                MappingChange::Add(m) => {
                    st.mappings.insert((m.from.vdev, m.from.offset), *m);
                }
                MappingChange::Drop(e) => {
                    st.mappings.remove(&(e.vdev, e.offset));
                }
            }
        }
        st.copies.apply(record);
        for (i, name) in &record.owners.identities {
            st.owner_identities.insert(*i, name.clone());
        }
        for w in &record.owners.windows {
            st.owner_runs
                .retain(|&(v, s), _| !(v == w.vdev && s >= w.start && s < w.end));
            for &(s, e, o) in &w.runs {
                st.owner_runs.insert((w.vdev, s), (e, o));
            }
        }
        st.synced_txg = txg;
        st.state_digest = record.state_digest;
        Ok(())
    }

    fn created<T>(
        &self,
        f: impl FnOnce(&mut MemState) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        match self.state.lock().unwrap().as_mut() {
            None => Err(StoreError("the pool is not created yet".into())),
            Some(st) => f(st),
        }
    }
}

/// Every extent of `vdev`, as a range of the ordered set.
fn vdev_range(vdev: u32) -> std::ops::RangeInclusive<Extent> {
    Extent {
        vdev,
        offset: 0,
        size: 0,
    }..=Extent {
        vdev,
        offset: u64::MAX,
        size: u64::MAX,
    }
}

impl Store for MemStore {
    fn log_tunables(&self) -> Option<crate::spacemap_log::LogTunables> {
        None
    }

    fn set_log_tunables(&self, _: crate::spacemap_log::LogTunables) {}

    fn load(&self) -> BoxFuture<'_, Result<Option<Persisted>, StoreError>> {
        let out = self.state.lock().unwrap().as_ref().map(|s| Persisted {
            pool_guid: s.pool_guid,
            synced_txg: s.synced_txg,
            vdevs: s.vdevs.values().cloned().collect(),
            allocated: Extents::from(s.allocated.iter().copied().collect::<Vec<_>>()),
            tunables: s.tunables.clone(),
            vdev_states: s.vdev_states.clone(),
            owner_identities: s
                .owner_identities
                .iter()
                .map(|(i, n)| (*i, n.clone()))
                .collect(),
            owner_runs: s
                .owner_runs
                .iter()
                .map(|(&(v, st), &(e, o))| (v, st, e, o))
                .collect(),
            state_digest: s.state_digest,
            mappings: s.mappings.values().copied().collect(),
        });
        Box::pin(async move { Ok(out) })
    }

    fn create(&self, pool_guid: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut g = self.state.lock().unwrap();
        let r = if g.is_some() {
            Err(StoreError("pool already created".into()))
        } else {
            *g = Some(MemState {
                pool_guid,
                ..MemState::default()
            });
            Ok(())
        };
        Box::pin(async move { r })
    }

    fn persist<'a>(&'a self, record: &'a TxgRecord) -> BoxFuture<'a, Result<(), StoreError>> {
        let r = self.apply(record);
        Box::pin(async move { r })
    }

    fn set_tunable<'a>(
        &'a self,
        name: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let mut g = self.state.lock().unwrap();
        let r = match g.as_mut() {
            None => Err(StoreError("set_tunable before create".into())),
            Some(st) => {
                st.tunables.retain(|(n, _)| n != name);
                st.tunables.push((name.to_string(), value.to_string()));
                Ok(())
            }
        };
        Box::pin(async move { r })
    }

    fn rewind_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        let g = self.state.lock().unwrap();
        let r = g.as_ref().map_or(0, |s| s.rewind_generation);
        Box::pin(async move { Ok(r) })
    }

    fn set_rewind_generation(&self, gen_: u64) -> BoxFuture<'_, Result<(), StoreError>> {
        let r = self.created(|s| {
            s.rewind_generation = gen_;
            Ok(())
        });
        Box::pin(async move { r })
    }

    fn fenced(&self) -> bool {
        false
    }

    // One process, nothing to hand over to.
    fn handed_over_cleanly(&self) -> bool {
        false
    }

    fn open_generation(&self) -> BoxFuture<'_, Result<u64, StoreError>> {
        let mut g = self.state.lock().unwrap();
        let r = match g.as_mut() {
            None => Err(StoreError("open_generation before create".into())),
            Some(st) => {
                st.generation += 1;
                st.history.insert(st.generation, st.synced_txg);
                Ok(st.generation)
            }
        };
        Box::pin(async move { r })
    }

    fn generation_history(&self) -> BoxFuture<'_, Result<BTreeMap<u64, Txg>, StoreError>> {
        let h = self
            .state
            .lock()
            .unwrap()
            .as_ref()
            .map(|s| s.history.clone())
            .unwrap_or_default();
        Box::pin(async move { Ok(h) })
    }

    fn relocation(&self, id: u64) -> BoxFuture<'_, Result<Option<RelocationRecord>, StoreError>> {
        let r = self
            .state
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|s| s.relocations.get(&id).copied());
        Box::pin(async move { Ok(r) })
    }

    fn relocation_totals(&self) -> BoxFuture<'_, Result<(u64, u64), StoreError>> {
        let t = self.state.lock().unwrap().as_ref().map_or((0, 0), |s| {
            (
                s.relocations.len() as u64,
                s.relocations.values().map(|r| r.from.size).sum(),
            )
        });
        Box::pin(async move { Ok(t) })
    }

    fn agent_bindings(&self) -> BoxFuture<'_, Result<BTreeMap<String, u64>, StoreError>> {
        let b = self
            .state
            .lock()
            .unwrap()
            .as_ref()
            .map(|s| s.bindings.clone())
            .unwrap_or_default();
        Box::pin(async move { Ok(b) })
    }

    fn bind_agent<'a>(
        &'a self,
        name: &'a str,
        device_guid: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let r = self.created(|st| {
            // The keys of the SQL stores' table: one device per name, one
            // name per device.
            if st.bindings.contains_key(name) || st.bindings.values().any(|&g| g == device_guid) {
                return Err(StoreError(format!(
                    "bind agent {name}: the name or device {device_guid:#x} is already bound"
                )));
            }
            st.bindings.insert(name.to_owned(), device_guid);
            Ok(())
        });
        Box::pin(async move { r })
    }

    fn evacuations(&self) -> BoxFuture<'_, Result<Vec<Evacuation>, StoreError>> {
        let e = self
            .state
            .lock()
            .unwrap()
            .as_ref()
            .map(|s| s.evacuations.values().copied().collect())
            .unwrap_or_default();
        Box::pin(async move { Ok(e) })
    }

    fn set_evacuation(
        &self,
        vdev: VdevId,
        e: Option<Evacuation>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let r = self.created(|st| {
            match e {
                Some(e) => st.evacuations.insert(vdev, e),
                None => st.evacuations.remove(&vdev),
            };
            Ok(())
        });
        Box::pin(async move { r })
    }

    fn copies_of(
        &self,
        at: (VdevId, u64),
    ) -> BoxFuture<'_, Result<Vec<(VdevId, u64)>, StoreError>> {
        let r = self.created(|st| Ok(st.copies.copies_of(at)));
        Box::pin(async move { r })
    }

    fn copies_on<'a>(
        &'a self,
        vdev: VdevId,
        starts: &'a [u64],
    ) -> BoxFuture<'a, Result<crate::block_copies::CopySets, StoreError>> {
        let r = self.created(|st| Ok(st.copies.copies_on(vdev, starts)));
        Box::pin(async move { r })
    }

    fn allocated_overlapping(&self, e: Extent) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        // Extents are ordered by (vdev, offset) and never overlap: the one
        // starting at or before `e`, then those starting inside it.
        let out = self.created(|st| {
            let at = |offset, size| Extent {
                vdev: e.vdev,
                offset,
                size,
            };
            let end = e.offset.saturating_add(e.size);
            if end <= e.offset {
                return Ok(Vec::new());
            }
            let before = st.allocated.range(..=at(e.offset, u64::MAX)).next_back();
            let inside = st
                .allocated
                .range(at(e.offset, u64::MAX)..at(end, 0))
                .filter(|a| a.offset > e.offset);
            Ok(before
                .into_iter()
                .chain(inside)
                .filter(|a| a.vdev == e.vdev && a.offset < end && e.offset < a.offset + a.size)
                .copied()
                .collect())
        });
        Box::pin(async move { out })
    }

    fn allocated_overlapping_many<'a>(
        &'a self,
        extents: &'a [Extent],
    ) -> BoxFuture<'a, Result<Vec<Vec<Extent>>, StoreError>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(extents.len());
            for e in extents {
                out.push(self.allocated_overlapping(*e).await?);
            }
            Ok(out)
        })
    }

    fn largest_extents(
        &self,
        vdev: u32,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<Extent>, StoreError>> {
        let out = self.created(|st| {
            let mut out: Vec<Extent> = st.allocated.range(vdev_range(vdev)).copied().collect();
            out.sort_by(|a, b| b.size.cmp(&a.size).then(a.offset.cmp(&b.offset)));
            out.truncate(limit as usize);
            Ok(out)
        });
        Box::pin(async move { out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metaslab::SpaceChange;

    /// A batch's answer, however its queries are cut (one per vdev, a sweep
    /// of small ones, or one per extent), is each extent's own: checked
    /// against every stored extent, on many small chunks.
    #[test]
    fn a_batch_of_lookups_finds_what_each_lookup_finds() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(28);
        const K: u64 = 4096;
        // Two vdevs of non-overlapping extents, some touching, cut into
        // chunks of 7 (the store's are 4096) so spans cross many rows.
        let mut stored: Vec<(u32, Vec<(u64, u64)>)> = Vec::new();
        for vdev in [0u32, 3] {
            let (mut at, mut v) = (0, Vec::new());
            for _ in 0..500 {
                at += K * rng.random_range(0..3);
                let size = K * rng.random_range(1..6);
                v.push((at, size));
                at += size;
            }
            stored.push((vdev, v));
        }
        let rows: Vec<(u32, SpanRow)> = stored
            .iter()
            .flat_map(|(vdev, v)| {
                v.chunks(7).map(|c| {
                    let ch = crate::spacemap::Chunk::encode(*vdev, c);
                    (*vdev, (ch.start as i64, ch.width as i64, ch.data))
                })
            })
            .collect();
        // What the span query returns: the row starting last at or before
        // `off`, then those starting before `end`, at most `limit`.
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let fetch = |vdev: u32, off: u64, end: u64, limit: usize| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mine: Vec<&SpanRow> = rows.iter().filter(|r| r.0 == vdev).map(|r| &r.1).collect();
            let from = mine
                .iter()
                .filter(|r| r.0 as u64 <= off)
                .map(|r| r.0)
                .max()
                .unwrap_or(off as i64);
            let got: SpanRows = mine
                .into_iter()
                .filter(|r| r.0 >= from && (r.0 as u64) < end)
                .take(limit)
                .cloned()
                .collect();
            async move { Ok(got) }
        };
        let probes: Vec<Extent> = (0..300)
            .map(|_| {
                let vdev = if rng.random_bool(0.5) { 0 } else { 3 };
                Extent {
                    vdev,
                    // Some beyond every extent; some not on a 4 KiB boundary.
                    offset: rng.random_range(0..2600 * K) & !511,
                    size: 512 * rng.random_range(1..80),
                }
            })
            .collect();
        let want: Vec<Vec<Extent>> = probes
            .iter()
            .map(|p| {
                let (_, v) = stored.iter().find(|(vd, _)| *vd == p.vdev).unwrap();
                v.iter()
                    .filter(|&&(o, l)| o < p.offset + p.size && o + l > p.offset)
                    .map(|&(offset, size)| Extent {
                        vdev: p.vdev,
                        offset,
                        size,
                    })
                    .collect()
            })
            .collect();
        assert!(want.iter().any(|w| w.len() > 1), "some probes span extents");
        assert!(want.iter().any(|w| w.is_empty()), "some probes find none");
        let run = |max_rows| {
            futures_util::FutureExt::now_or_never(overlapping_batched(&probes, max_rows, fetch))
                .unwrap()
                .unwrap()
        };
        // A span of all: one query per vdev.
        assert_eq!(run(usize::MAX - 1), want);
        assert_eq!(calls.swap(0, std::sync::atomic::Ordering::Relaxed), 2);
        // Queries of at most 2 rows: a sweep of many, the same answers.
        assert_eq!(run(2), want);
        assert!(calls.swap(0, std::sync::atomic::Ordering::Relaxed) > 2);
        // No rows per query: each extent falls back to its own whole read.
        assert_eq!(run(0), want);
        assert!(calls.load(std::sync::atomic::Ordering::Relaxed) >= 2 * probes.len());
    }

    fn ext(offset: u64, size: u64) -> Extent {
        Extent {
            vdev: 0,
            offset,
            size,
        }
    }

    #[test]
    fn frees_split_allocated_extents_and_txgs_must_increase() {
        let s = MemStore::new();
        futures_util::FutureExt::now_or_never(s.create(7))
            .unwrap()
            .unwrap();
        let mut rec = TxgRecord::default();
        rec.sync.txg = 5;
        rec.sync.changes = vec![
            SpaceChange {
                kind: SpaceChangeKind::Alloc,
                extent: ext(0, 4096 * 4),
            },
            SpaceChange {
                kind: SpaceChangeKind::Free,
                extent: ext(4096, 4096),
            },
        ];
        s.apply(&rec).unwrap();
        // The same txg again is a retry whose commit landed; an older one
        // is refused.
        s.apply(&rec).unwrap();
        rec.sync.txg = 4;
        assert!(s.apply(&rec).is_err(), "an older txg must be refused");
        let p = futures_util::FutureExt::now_or_never(s.load())
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(p.pool_guid, 7);
        assert_eq!(p.synced_txg, 5);
        assert_eq!(
            p.allocated.iter().collect::<Vec<_>>(),
            vec![ext(0, 4096), ext(8192, 8192)]
        );
    }
}
