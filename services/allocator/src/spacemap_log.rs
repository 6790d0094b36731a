//! The log space map: what makes a txg cost what it changed, not what the
//! pool holds (the idea of OpenZFS's feature@log_spacemap,
//! `spa_log_spacemap.c:spa_flush_metaslabs@zfs-2.4.0`). Rewriting every
//! space-map chunk a txg touched made a txg of spread frees rewrite most of
//! the store; instead each txg appends its changes to one pool-wide log (a
//! row per metaslab it touched, [`log_rows`]) and flushes only a few
//! metaslabs' changes into their chunks, the metaslabs whose oldest
//! unflushed txg is oldest first ([`Unflushed::plan_flush`]), as many as
//! keep the unflushed changes under the memory and log-size bounds
//! ([`LogTunables`]). A metaslab's log rows go in the txg that flushes it,
//! with its flush txg recorded; a restart loads the chunks and replays the
//! rows newer than each metaslab's flush txg.
//!
//! The chunks of a metaslab are as of its flush txg; [`Unflushed`] holds the
//! changes since, in memory (what the memory bound counts), so a lookup
//! answers as of the last synced txg ([`Unflushed::adjust`]).
//!
//! A metaslab is `offset >> metaslab_shift` of its vdev; a change belongs to
//! the metaslab of its offset (allocations never cross a metaslab's end).
//! Pure code (no I/O): the store does the SQL.

use std::collections::BTreeMap;

use metaslab::{Extent, SpaceChangeKind};

use crate::spacemap::{Change, Chunk, Largest};

/// Bytes per log entry: offset, then size with the top bit set for a free
/// (sizes are below 2^63: the store refuses larger).
const ENTRY: usize = 16;
const FREE_BIT: u64 = 1 << 63;

/// What an unflushed change is counted as in memory (its index entry).
pub const ENTRY_MEM: u64 = 64;

/// Changes per log block: what a restart's replay is counted in. A row
/// counts as the blocks of 128 KiB its entries fill (at least one), as
/// OpenZFS's log space map blocks (`zfs_log_sm_blksz`) do, so a bound on
/// blocks bounds the changes a restart replays, not only the rows: one row
/// of a million frees in one metaslab is 123 blocks.
pub const BLOCK_ENTRIES: u64 = (128 << 10) / ENTRY as u64;

/// Log blocks a row of `entries` changes counts as.
pub fn blocks(entries: u64) -> u64 {
    entries.div_ceil(BLOCK_ENTRIES).max(1)
}

/// The flush policy's bounds, with OpenZFS's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogTunables {
    /// Bytes of unflushed changes held in memory at most (counted at
    /// [`ENTRY_MEM`] a change); beyond it the oldest metaslabs are flushed
    /// until under.
    pub zfs_unflushed_max_mem_amt: u64,
    /// Log blocks ([`BLOCK_ENTRIES`] changes; a row, a metaslab's changes
    /// of one txg, counts at least one) a restart may have to replay at
    /// most: beyond it the oldest metaslabs are flushed until under.
    pub zfs_unflushed_log_block_max: u64,
    /// A metaslab's changes stay unflushed for this many txgs at most.
    pub zfs_unflushed_log_txg_max: u64,
    /// Metaslabs flushed per txg at least (when any is dirty). OpenZFS
    /// flushes one; here 0 by default: a flush rewrites every chunk the
    /// metaslab's changes fall in (OpenZFS appends to its space map), so
    /// spread changes are best gathered until the bounds above call for it.
    pub zfs_min_metaslabs_to_flush: u64,
}

impl Default for LogTunables {
    fn default() -> Self {
        LogTunables {
            zfs_unflushed_max_mem_amt: 1 << 30,
            // 16.8 million changes, as many as the memory bound holds:
            // a restart's replay is bounded whatever the memory bound is
            // set to (OpenZFS's 131072 blocks are 16 GiB of log; its
            // replay is bounded by its metaslab count in practice,
            // `spa_log_spacemap.c:spa_estimate_metaslabs_to_flush@zfs-2.2.0`).
            zfs_unflushed_log_block_max: 2048,
            zfs_unflushed_log_txg_max: 1000,
            zfs_min_metaslabs_to_flush: 0,
        }
    }
}

impl LogTunables {
    /// Set `name` to `value` if it is one of these (false: it is not).
    pub fn set(&mut self, name: &str, value: &str) -> Result<bool, String> {
        let slot = match name {
            "zfs_unflushed_max_mem_amt" => &mut self.zfs_unflushed_max_mem_amt,
            "zfs_unflushed_log_block_max" => &mut self.zfs_unflushed_log_block_max,
            "zfs_unflushed_log_txg_max" => &mut self.zfs_unflushed_log_txg_max,
            "zfs_min_metaslabs_to_flush" => &mut self.zfs_min_metaslabs_to_flush,
            _ => return Ok(false),
        };
        *slot = value
            .parse()
            .map_err(|_| format!("{name}: {value:?} is not a whole number"))?;
        Ok(true)
    }

    /// `(name, value, default, description)` of each, for GetTunables.
    pub fn list(&self) -> Vec<(&'static str, String, String, &'static str)> {
        let d = LogTunables::default();
        vec![
            (
                "zfs_unflushed_max_mem_amt",
                self.zfs_unflushed_max_mem_amt.to_string(),
                d.zfs_unflushed_max_mem_amt.to_string(),
                "bytes of unflushed log space map changes held in memory at most",
            ),
            (
                "zfs_unflushed_log_block_max",
                self.zfs_unflushed_log_block_max.to_string(),
                d.zfs_unflushed_log_block_max.to_string(),
                "log space map blocks (8192 changes) a restart replays at most",
            ),
            (
                "zfs_unflushed_log_txg_max",
                self.zfs_unflushed_log_txg_max.to_string(),
                d.zfs_unflushed_log_txg_max.to_string(),
                "txgs a metaslab's changes stay unflushed at most",
            ),
            (
                "zfs_min_metaslabs_to_flush",
                self.zfs_min_metaslabs_to_flush.to_string(),
                d.zfs_min_metaslabs_to_flush.to_string(),
                "metaslabs flushed per txg at least",
            ),
        ]
    }
}

/// A metaslab: vdev and index (`offset >> metaslab_shift`).
pub type Metaslab = (u32, u64);

/// Encode changes (in order) as one log row's data.
pub fn encode(changes: &[Change]) -> Vec<u8> {
    let mut out = Vec::with_capacity(changes.len() * ENTRY);
    for &(kind, off, size) in changes {
        let s = match kind {
            SpaceChangeKind::Alloc => size,
            SpaceChangeKind::Free => size | FREE_BIT,
        };
        out.extend_from_slice(&off.to_le_bytes());
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// Decode one log row's data; refuses what is not whole entries.
pub fn decode(data: &[u8]) -> Result<Vec<Change>, String> {
    if !data.len().is_multiple_of(ENTRY) {
        return Err(format!(
            "a log row of {} bytes is not whole {ENTRY}-byte entries",
            data.len()
        ));
    }
    Ok(data
        .chunks_exact(ENTRY)
        .map(|b| {
            let off = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
            let s = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
            let kind = if s & FREE_BIT != 0 {
                SpaceChangeKind::Free
            } else {
                SpaceChangeKind::Alloc
            };
            (kind, off, s & !FREE_BIT)
        })
        .collect())
}

/// One txg's changes of a vdev, grouped by metaslab (order kept within
/// each): the log rows the txg appends.
pub fn log_rows(shift: u8, changes: &[Change]) -> BTreeMap<u64, Vec<Change>> {
    let mut out: BTreeMap<u64, Vec<Change>> = BTreeMap::new();
    for c in changes {
        out.entry(c.1 >> shift).or_default().push(*c);
    }
    out
}

/// The metaslabs spanned by changes that cross a metaslab's end (empty
/// when none does, as the pool's own never do).
pub fn crossed(shift: u8, changes: &[Change]) -> std::collections::BTreeSet<u64> {
    let mut out = std::collections::BTreeSet::new();
    for &(_, off, size) in changes {
        let (first, last) = (off >> shift, (off + size.max(1) - 1) >> shift);
        if first != last {
            out.extend(first..=last);
        }
    }
    out
}

/// What the log holds for one dirty metaslab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MsLog {
    /// Its oldest unflushed txg (flush order: oldest first).
    first_txg: u64,
    /// Its newest txg in the log.
    last_txg: u64,
    entries: u64,
    rows: u64,
    /// Log blocks of its rows ([`blocks`] of each).
    blocks: u64,
    /// Changes in its newest row (a txg's row recorded in several calls
    /// grows).
    last_row: u64,
}

/// The unflushed changes of one vdev, keyed by (offset, txg, index in the
/// txg) so that those in a range are found in order of their offsets.
#[derive(Clone, Debug, Default)]
struct VdevLog {
    changes: BTreeMap<(u64, u64, u32), (SpaceChangeKind, u64)>,
    /// The largest size among them: how far below a range to look.
    max_size: u64,
}

/// Every change in the log not yet flushed into its metaslab's chunks, as
/// of the txg `synced`; exactly what a replay of the log rows gives.
#[derive(Clone, Debug, Default)]
pub struct Unflushed {
    /// The synced txg this is current at.
    pub synced: u64,
    shifts: BTreeMap<u32, u8>,
    vdevs: BTreeMap<u32, VdevLog>,
    metaslabs: BTreeMap<Metaslab, MsLog>,
    entries: u64,
    rows: u64,
    blocks: u64,
}

impl Unflushed {
    /// The metaslab shift of `vdev` (recorded as it was added).
    pub fn set_shift(&mut self, vdev: u32, shift: u8) {
        self.shifts.insert(vdev, shift);
    }

    pub fn shift(&self, vdev: u32) -> Option<u8> {
        self.shifts.get(&vdev).copied()
    }

    /// Record one log row: metaslab `ms` of `vdev`, txg `txg`, its changes
    /// in order.
    pub fn record(&mut self, vdev: u32, ms: u64, txg: u64, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        let log = self.vdevs.entry(vdev).or_default();
        let m = self.metaslabs.entry((vdev, ms)).or_insert(MsLog {
            first_txg: txg,
            last_txg: txg,
            entries: 0,
            rows: 0,
            blocks: 0,
            last_row: 0,
        });
        // Rows are recorded in txg order; an index continues a txg's row
        // split over several calls.
        let base = if m.rows > 0 && m.last_txg == txg {
            m.last_row as u32
        } else {
            m.rows += 1;
            self.rows += 1;
            m.last_row = 0;
            0
        };
        let n = changes.len() as u64;
        let grown = blocks(m.last_row + n) - if base == 0 { 0 } else { blocks(m.last_row) };
        m.blocks += grown;
        self.blocks += grown;
        m.last_row += n;
        m.first_txg = m.first_txg.min(txg);
        m.last_txg = m.last_txg.max(txg);
        for (k, &(kind, off, size)) in changes.iter().enumerate() {
            log.changes
                .insert((off, txg, base + k as u32), (kind, size));
            log.max_size = log.max_size.max(size);
        }
        m.entries += changes.len() as u64;
        self.entries += changes.len() as u64;
    }

    /// Metaslab `ms` of `vdev` was flushed: its changes are in its chunks.
    pub fn flushed(&mut self, vdev: u32, ms: u64) {
        let Some(m) = self.metaslabs.remove(&(vdev, ms)) else {
            return;
        };
        self.entries -= m.entries;
        self.rows -= m.rows;
        self.blocks -= m.blocks;
        let shift = self.shifts.get(&vdev).copied().unwrap_or(63) as u32;
        if let Some(log) = self.vdevs.get_mut(&vdev) {
            let lo = ms << shift;
            let hi = (ms + 1).checked_shl(shift).unwrap_or(u64::MAX);
            let keys: Vec<_> = log
                .changes
                .range((lo, 0, 0)..(hi, 0, 0))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                log.changes.remove(&k);
            }
            if log.changes.is_empty() {
                self.vdevs.remove(&vdev);
            }
        }
    }

    /// Unflushed changes in all.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Log rows a restart would replay.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Log blocks ([`blocks`]) a restart would replay.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Dirty metaslabs.
    pub fn dirty(&self) -> usize {
        self.metaslabs.len()
    }

    /// The metaslabs the txg `txg` flushes, given its own log rows
    /// `pending` (metaslab, changes) not recorded yet: the oldest unflushed
    /// first, a budget that grows with how full the bounds are (`dirty ×
    /// used share`, at least `zfs_min_metaslabs_to_flush`; 0 flushes only
    /// what the bounds force), then as many
    /// more as bring memory and log blocks under their bounds and leave no
    /// metaslab's changes older than `zfs_unflushed_log_txg_max` txgs.
    pub fn plan_flush(
        &self,
        txg: u64,
        pending: &[(Metaslab, u64)],
        t: &LogTunables,
    ) -> Vec<Metaslab> {
        let mut ms: BTreeMap<Metaslab, (u64, u64, u64)> = self
            .metaslabs
            .iter()
            .map(|(&k, m)| (k, (m.first_txg, m.entries, m.blocks)))
            .collect();
        let (mut entries, mut rows) = (self.entries, self.blocks);
        for &(k, n) in pending {
            let m = ms.entry(k).or_insert((txg, 0, 0));
            m.0 = m.0.min(txg);
            m.1 += n;
            m.2 += blocks(n);
            entries += n;
            rows += blocks(n);
        }
        let mut order: Vec<(u64, Metaslab, u64, u64)> = ms
            .into_iter()
            .map(|(k, (first, e, r))| (first, k, e, r))
            .collect();
        order.sort_unstable();
        let max_mem = t.zfs_unflushed_max_mem_amt.max(1);
        let max_rows = t.zfs_unflushed_log_block_max.max(1);
        let mut mem = entries.saturating_mul(ENTRY_MEM);
        let share = (mem as f64 / max_mem as f64).max(rows as f64 / max_rows as f64);
        let budget =
            ((order.len() as f64 * share).floor() as u64).max(t.zfs_min_metaslabs_to_flush);
        let mut out = Vec::new();
        for (first, ms, entries, r) in order {
            let old = first.saturating_add(t.zfs_unflushed_log_txg_max) <= txg;
            if (out.len() as u64) >= budget && mem <= max_mem && rows <= max_rows && !old {
                break;
            }
            out.push(ms);
            mem = mem.saturating_sub(entries.saturating_mul(ENTRY_MEM));
            rows = rows.saturating_sub(r);
        }
        out
    }

    /// `stored`, the chunks' extents of `vdev` overlapping `[off, end)`,
    /// with the unflushed changes applied: the extents overlapping it as of
    /// the synced txg. Only extents overlapping the range can leave pieces
    /// in it, and only the changes overlapping them or it can shape those
    /// pieces: they are applied in order, leniently (the map holds part of
    /// the vdev), and the pieces overlapping the range kept.
    pub fn adjust(&self, vdev: u32, off: u64, end: u64, stored: Vec<Extent>) -> Vec<Extent> {
        let Some(log) = self.vdevs.get(&vdev) else {
            return stored;
        };
        let in_range = |o: u64, s: u64| o < end && o.saturating_add(s) > off;
        let from = off.saturating_sub(log.max_size);
        let mut lo = off;
        let mut hi = end;
        for e in &stored {
            lo = lo.min(e.offset);
            hi = hi.max(e.offset.saturating_add(e.size));
        }
        for (&(o, _, _), &(kind, s)) in log.changes.range((from, 0, 0)..(end, 0, 0)) {
            if kind == SpaceChangeKind::Alloc && in_range(o, s) {
                lo = lo.min(o);
                hi = hi.max(o.saturating_add(s));
            }
        }
        let mut relevant: Vec<((u64, u32), SpaceChangeKind, u64, u64)> = log
            .changes
            .range((lo.saturating_sub(log.max_size), 0, 0)..(hi, 0, 0))
            .filter(|(k, v)| k.0 < hi && k.0.saturating_add(v.1) > lo)
            .map(|(&(o, txg, k), &(kind, s))| ((txg, k), kind, o, s))
            .collect();
        if relevant.is_empty() {
            return stored;
        }
        relevant.sort_unstable_by_key(|r| r.0);
        let mut map: BTreeMap<u64, u64> = stored.iter().map(|e| (e.offset, e.size)).collect();
        for (_, kind, o, s) in relevant {
            let e = o.saturating_add(s);
            match kind {
                SpaceChangeKind::Alloc => {
                    map.insert(o, s);
                }
                SpaceChangeKind::Free => {
                    let first = match map.range(..=o).next_back() {
                        Some((&a, &l)) if a + l > o => a,
                        _ => o,
                    };
                    let hits: Vec<(u64, u64)> =
                        map.range(first..e).map(|(&a, &l)| (a, l)).collect();
                    for (a, l) in hits {
                        map.remove(&a);
                        if a < o {
                            map.insert(a, o - a);
                        }
                        if a + l > e {
                            map.insert(e, a + l - e);
                        }
                    }
                }
            }
        }
        map.into_iter()
            .filter(|&(o, s)| in_range(o, s))
            .map(|(offset, size)| Extent { vdev, offset, size })
            .collect()
    }
}

/// A vdev's chunks, streamed in key order, as of the synced txg: the
/// extents of each chunk with the unflushed changes between its key and the
/// next applied ([`Unflushed::adjust`] over that span: a chunk's extents
/// end before the next key), each extent handed on once.
pub struct AsSynced<'a> {
    log: Option<&'a Unflushed>,
    vdev: u32,
    pending: Option<Chunk>,
    /// Where the next span starts.
    from: u64,
    /// The end of the last extent handed on (one reaching into the next
    /// span is handed on once).
    emitted: u64,
}

impl<'a> AsSynced<'a> {
    pub fn new(log: Option<&'a Unflushed>, vdev: u32) -> AsSynced<'a> {
        AsSynced {
            log,
            vdev,
            pending: None,
            from: 0,
            emitted: 0,
        }
    }

    /// The next chunk (key order).
    pub fn push_chunk(&mut self, c: Chunk, out: &mut Largest) {
        let to = c.start;
        let prev = self.pending.replace(c);
        if prev.is_some() || to > 0 {
            self.span(prev, to, out);
        }
    }

    pub fn finish(mut self, out: &mut Largest) {
        let last = self.pending.take();
        self.span(last, u64::MAX, out);
    }

    /// The extents overlapping `[from, to)`: `c`'s, as of the synced txg.
    fn span(&mut self, c: Option<Chunk>, to: u64, out: &mut Largest) {
        let stored: Vec<Extent> = c.iter().flat_map(|c| c.extents()).collect();
        let now = match self.log {
            Some(l) => l.adjust(self.vdev, self.from, to, stored),
            None => stored,
        };
        for e in now {
            if e.offset >= self.emitted {
                out.push(e.offset, e.size);
                self.emitted = e.offset + e.size;
            }
        }
        self.from = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use SpaceChangeKind::{Alloc, Free};

    fn ext(offset: u64, size: u64) -> Extent {
        Extent {
            vdev: 0,
            offset,
            size,
        }
    }

    #[test]
    fn rows_round_trip_and_damage_is_refused() {
        let c = vec![(Alloc, 4096, 8192), (Free, 1 << 40, 512)];
        assert_eq!(decode(&encode(&c)).unwrap(), c);
        assert!(decode(&encode(&c)[..20]).is_err());
        let rows = log_rows(20, &[(Alloc, 0, 1), (Alloc, 3 << 20, 1), (Free, 5, 1)]);
        assert_eq!(rows.keys().copied().collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(rows[&0], vec![(Alloc, 0, 1), (Free, 5, 1)]);
    }

    #[test]
    fn lookups_see_the_unflushed_changes_in_order() {
        let mut u = Unflushed::default();
        u.set_shift(0, 20);
        // Stored: [0, 8192) and [16384, 24576); txg 5 frees the first and
        // allocates [8192, 4096); txg 6 frees part of the second and
        // reallocates [0, 4096).
        u.record(0, 0, 5, &[(Free, 0, 8192), (Alloc, 8192, 4096)]);
        u.record(0, 0, 6, &[(Free, 16384, 4096), (Alloc, 0, 4096)]);
        let stored = vec![ext(0, 8192), ext(16384, 8192)];
        assert_eq!(
            u.adjust(0, 0, 1 << 20, stored.clone()),
            vec![ext(0, 4096), ext(8192, 4096), ext(20480, 4096)]
        );
        // A probe the cut free does not overlap still sees the piece.
        assert_eq!(
            u.adjust(0, 22000, 22001, vec![ext(16384, 8192)]),
            vec![ext(20480, 4096)]
        );
        assert_eq!(u.adjust(0, 4096, 8192, vec![ext(0, 8192)]), vec![]);
        assert_eq!((u.entries(), u.rows(), u.dirty()), (4, 2, 1));
        u.flushed(0, 0);
        assert_eq!((u.entries(), u.rows(), u.dirty()), (0, 0, 0));
        assert_eq!(u.adjust(0, 0, 1 << 20, stored.clone()), stored);
    }

    #[test]
    fn the_oldest_metaslabs_flush_first_within_the_bounds() {
        let t = LogTunables {
            zfs_unflushed_max_mem_amt: 10 * ENTRY_MEM,
            zfs_unflushed_log_block_max: 100,
            zfs_unflushed_log_txg_max: 10,
            zfs_min_metaslabs_to_flush: 1,
        };
        let mut u = Unflushed::default();
        u.set_shift(0, 20);
        u.record(0, 3, 1, &[(Alloc, 3 << 20, 1)]);
        u.record(0, 1, 2, &[(Alloc, 1 << 20, 1)]);
        u.record(0, 2, 2, &[(Alloc, 2 << 20, 1)]);
        // Memory 3 of 10 entries: a budget of one, the oldest.
        assert_eq!(u.plan_flush(2, &[], &t), vec![(0, 3)]);
        // Past the memory bound: the oldest until under it.
        let many: Vec<Change> = (0..9).map(|k| (Alloc, (2 << 20) + 8 + k, 1)).collect();
        u.record(0, 2, 3, &many);
        assert_eq!(u.plan_flush(3, &[], &t), vec![(0, 3), (0, 1), (0, 2)]);
        // Too old: flushed whatever the budget.
        let mut u2 = Unflushed::default();
        u2.set_shift(0, 20);
        u2.record(0, 1, 1, &[(Alloc, 1 << 20, 1)]);
        u2.record(0, 2, 1, &[(Alloc, 2 << 20, 1)]);
        assert_eq!(u2.plan_flush(11, &[], &t).len(), 2);
        assert_eq!(u2.plan_flush(5, &[], &t).len(), 1);
        // The txg's own rows count as recorded.
        assert_eq!(u2.plan_flush(5, &[((0, 0), 20)], &t).len(), 3);
    }

    /// A restart's replay is bounded in changes, not rows: one large row
    /// counts the blocks it fills, and is flushed past the bound.
    #[test]
    fn a_large_row_counts_the_log_blocks_it_fills() {
        let t = LogTunables {
            zfs_unflushed_log_block_max: 6,
            zfs_unflushed_log_txg_max: 1000,
            ..Default::default()
        };
        let mut u = Unflushed::default();
        u.set_shift(0, 40);
        let row = |from: u64, n: u64| -> Vec<Change> {
            (from..from + n).map(|k| (Alloc, k * 8192, 4096)).collect()
        };
        u.record(0, 0, 1, &row(0, BLOCK_ENTRIES));
        // One txg's row given in two calls: one row, its blocks grown.
        u.record(0, 0, 2, &row(BLOCK_ENTRIES, 1));
        u.record(0, 0, 2, &row(BLOCK_ENTRIES + 1, BLOCK_ENTRIES));
        assert_eq!((u.rows(), u.blocks()), (2, 3));
        assert!(u.plan_flush(3, &[], &t).is_empty(), "under the bound");
        // A txg's one row of four blocks passes it: the oldest metaslab
        // (here the only one) is flushed.
        assert_eq!(
            u.plan_flush(3, &[((0, 0), 4 * BLOCK_ENTRIES)], &t),
            vec![(0, 0)]
        );
        u.record(0, 1, 3, &[(Alloc, 1 << 40, 4096)]);
        u.flushed(0, 0);
        assert_eq!((u.rows(), u.blocks(), u.entries()), (1, 1, 1));
    }
}
