//! Space maps: how the SQLite store keeps the durable extents. One row per
//! extent made a restart cost a row decode per extent (~3.5 µs at 10^7) and
//! a free a DELETE per row; instead each vdev's extents, in offset order,
//! are cut into chunks of up to [`CHUNK_EXTENTS`] fixed-width entries, one
//! BLOB row each, keyed by the offset of the chunk's first extent (the idea
//! of OpenZFS's space maps, `space_map_write` at zfs-2.2.0, but keeping each
//! extent whole: Claim's and Free's exact-extent rules and the rebalance
//! candidates need block boundaries, which coalesced ranges would lose).
//!
//! A txg sync rewrites only the chunks its changes fall in ([`apply`] over
//! the decoded run, then [`rechunk`]). Because stored extents never overlap,
//! an extent of a chunk ends at or before the next chunk's key, so the
//! extents that can overlap a range lie in the chunk whose key is the last
//! at or before the range's start, and in those whose keys fall inside it.
//!
//! Pure code (no I/O): the store does the SQL.

use std::collections::BTreeMap;

use metaslab::{Extent, SpaceChangeKind};

/// Extents per chunk at most. 4096 entries are 32 KiB narrow: small enough
/// that a txg touching one block rewrites little, large enough that 10^7
/// extents are a few thousand rows.
pub const CHUNK_EXTENTS: usize = 4096;

/// Narrow entries count 512-byte units (the smallest ashift, 9).
const UNIT_SHIFT: u32 = 9;
/// Narrow entry: offset from the chunk key and size, u32 units each (LE).
pub const NARROW: u8 = 8;
/// Wide entry: absolute offset and size in bytes, u64 each (LE), for what
/// the narrow form cannot hold (misaligned, or beyond 2 TiB).
pub const WIDE: u8 = 16;

/// One stored chunk: extents of one vdev, in offset order, the first at
/// `start`.
#[derive(Clone, PartialEq, Eq)]
pub struct Chunk {
    pub vdev: u32,
    pub start: u64,
    pub width: u8,
    pub data: Vec<u8>,
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Chunk(vdev {}, start {}, {} extents)",
            self.vdev,
            self.start,
            self.len()
        )
    }
}

fn narrow_fits(start: u64, off: u64, size: u64) -> bool {
    let unit = (1u64 << UNIT_SHIFT) - 1;
    off >= start
        && (off - start) & unit == 0
        && size & unit == 0
        && (off - start) >> UNIT_SHIFT <= u32::MAX as u64
        && size >> UNIT_SHIFT <= u32::MAX as u64
}

impl Chunk {
    /// Encode `extents` (`(offset, size)`, the first one's offset is the
    /// key) of `vdev`; narrow when every entry fits.
    pub fn encode(vdev: u32, extents: &[(u64, u64)]) -> Chunk {
        let start = extents.first().map_or(0, |e| e.0);
        let narrow = extents
            .iter()
            .all(|&(off, size)| narrow_fits(start, off, size));
        let width = if narrow { NARROW } else { WIDE };
        let mut data = Vec::with_capacity(extents.len() * width as usize);
        for &(off, size) in extents {
            if narrow {
                data.extend_from_slice(&(((off - start) >> UNIT_SHIFT) as u32).to_le_bytes());
                data.extend_from_slice(&((size >> UNIT_SHIFT) as u32).to_le_bytes());
            } else {
                data.extend_from_slice(&off.to_le_bytes());
                data.extend_from_slice(&size.to_le_bytes());
            }
        }
        Chunk {
            vdev,
            start,
            width,
            data,
        }
    }

    /// A chunk read back from the store, checked to be decodable.
    pub fn new(vdev: u32, start: u64, width: u8, data: Vec<u8>) -> Result<Chunk, String> {
        if width != NARROW && width != WIDE {
            return Err(format!(
                "space map chunk of vdev {vdev} at {start}: unknown entry width {width}"
            ));
        }
        if data.is_empty() || !data.len().is_multiple_of(width as usize) {
            return Err(format!(
                "space map chunk of vdev {vdev} at {start}: {} bytes is not a whole number of {width}-byte entries",
                data.len()
            ));
        }
        let c = Chunk {
            vdev,
            start,
            width,
            data,
        };
        // The key is the first extent's offset (narrow: a zero offset).
        let first_ok = if width == NARROW {
            c.data[..4] == [0; 4]
        } else {
            c.iter().next().map(|e| e.0) == Some(start)
        };
        if !first_ok {
            return Err(format!(
                "space map chunk of vdev {vdev} at {start}: its first extent does not start there"
            ));
        }
        Ok(c)
    }

    pub fn len(&self) -> usize {
        self.data.len() / self.width as usize
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// `(offset, size)` of each entry, in stored order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + '_ {
        (0..self.len()).map(|i| entry(self.start, self.width, &self.data, i))
    }

    pub fn extents(&self) -> impl Iterator<Item = Extent> + '_ {
        let vdev = self.vdev;
        self.iter()
            .map(move |(offset, size)| Extent { vdev, offset, size })
    }
}

/// Entry `i` of a chunk's data (`start` its key, `width` its entry size).
fn entry(start: u64, width: u8, data: &[u8], i: usize) -> (u64, u64) {
    let b = &data[i * width as usize..(i + 1) * width as usize];
    if width == NARROW {
        let off = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")) as u64;
        let size = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as u64;
        (start + (off << UNIT_SHIFT), size << UNIT_SHIFT)
    } else {
        let off = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        let size = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        (off, size)
    }
}

/// The entries of a stored chunk (borrowed from the row, not decoded as a
/// whole) that overlap `[off, end)`, found by binary search: the lookup
/// Claim and Free make per extent. Refuses data that is not whole entries.
pub fn overlapping_in(
    start: u64,
    width: u8,
    data: &[u8],
    off: u64,
    end: u64,
) -> Result<Vec<(u64, u64)>, String> {
    if (width != NARROW && width != WIDE) || !data.len().is_multiple_of(width as usize) {
        return Err(format!(
            "space map chunk at {start}: {} bytes of {width}-byte entries",
            data.len()
        ));
    }
    let n = data.len() / width as usize;
    // First entry starting at or after `off`; the one before may reach in.
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if entry(start, width, data, mid).0 < off {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let mut out = Vec::new();
    let mut i = lo.saturating_sub(1);
    while i < n {
        let (o, l) = entry(start, width, data, i);
        if o >= end {
            break;
        }
        if o.saturating_add(l) > off {
            out.push((o, l));
        }
        i += 1;
    }
    Ok(out)
}

/// The extents of `vdev` overlapping `[off, end)` in stored chunk rows
/// `(start, width, data)`, as a store's lookup for Claim and Free found
/// them (the chunk starting last at or before `off`, then those inside).
pub fn overlapping_rows<'a>(
    vdev: u32,
    rows: impl IntoIterator<Item = (i64, i64, &'a [u8])>,
    off: u64,
    end: u64,
) -> Result<Vec<Extent>, String> {
    let mut out = Vec::new();
    for (start, width, data) in rows {
        let hits = overlapping_in(
            start as u64,
            u8::try_from(width).unwrap_or(0),
            data,
            off,
            end,
        )?;
        out.extend(
            hits.into_iter()
                .map(|(offset, size)| Extent { vdev, offset, size }),
        );
    }
    Ok(out)
}

/// The extents of `vdev` overlapping each of `probes` (`(offset, end)`) in
/// chunk rows `(start, width, data)` in start order that cover every probe
/// (fetched for the span of them all): per probe, only its own rows are
/// searched (the last starting at or before it, then those starting inside
/// it, found by binary search), so a batch of Frees costs one query for
/// their span, not one each.
pub fn overlapping_each(
    vdev: u32,
    rows: &[(i64, i64, Vec<u8>)],
    probes: &[(u64, u64)],
) -> Result<Vec<Vec<Extent>>, String> {
    probes
        .iter()
        .map(|&(off, end)| {
            let first = rows
                .partition_point(|r| (r.0 as u64) <= off)
                .saturating_sub(1);
            let mine = rows[first..]
                .iter()
                .take_while(|r| (r.0 as u64) < end)
                .map(|(start, width, data)| (*start, *width, data.as_slice()));
            overlapping_rows(vdev, mine, off, end)
        })
        .collect()
}

/// The `limit` largest extents of chunks pushed in order (largest first,
/// then lowest offset): the candidates of a rebalance plan, kept in a
/// bounded heap so a scan of a vdev never holds more than `limit`.
pub struct Largest {
    limit: usize,
    /// Max-heap of the kept, worst (smallest, then highest offset) on top.
    best: std::collections::BinaryHeap<(std::cmp::Reverse<u64>, u64)>,
}

impl Largest {
    pub fn new(limit: u32) -> Largest {
        Largest {
            limit: limit as usize,
            best: Default::default(),
        }
    }

    pub fn push_chunk(&mut self, c: &Chunk) {
        for (offset, size) in c.iter() {
            self.push(offset, size);
        }
    }

    pub fn push(&mut self, offset: u64, size: u64) {
        self.best.push((std::cmp::Reverse(size), offset));
        if self.best.len() > self.limit {
            self.best.pop();
        }
    }

    pub fn into_extents(self, vdev: u32) -> Vec<Extent> {
        self.best
            .into_sorted_vec()
            .into_iter()
            .map(|(std::cmp::Reverse(size), offset)| Extent { vdev, offset, size })
            .collect()
    }
}

/// Chunks loaded at start, with the store's own check: every chunk's vdev
/// is recorded, and each vdev's extents sum to the `allocated` it records.
pub struct Loading<'a> {
    recorded: &'a BTreeMap<u32, u64>,
    sums: BTreeMap<u32, u64>,
    pub extents: Extents,
}

impl<'a> Loading<'a> {
    pub fn new(recorded: &'a BTreeMap<u32, u64>) -> Loading<'a> {
        Loading {
            recorded,
            sums: BTreeMap::new(),
            extents: Extents::default(),
        }
    }

    pub fn push(&mut self, c: Chunk) -> Result<(), String> {
        if !self.recorded.contains_key(&c.vdev) {
            return Err(format!(
                "space map chunk at {}: no vdev {}",
                c.start, c.vdev
            ));
        }
        *self.sums.entry(c.vdev).or_default() += c.iter().map(|e| e.1).sum::<u64>();
        self.extents.push_chunk(c);
        Ok(())
    }

    /// Extents counted outside chunks (an older layout's rows).
    pub fn count(&mut self, vdev: u32, bytes: u64) {
        *self.sums.entry(vdev).or_default() += bytes;
    }

    /// Replay log changes of `vdev` (in order) onto the chunks pushed so
    /// far (`crate::spacemap_log`): the chunks they fall in are rewritten,
    /// with [`apply`]'s checks, and the vdev's sum moves by what they
    /// allocated and freed.
    pub fn replay(&mut self, vdev: u32, changes: &[Change]) -> Result<(), String> {
        if !self.recorded.contains_key(&vdev) {
            return Err(format!("space map log: no vdev {vdev}"));
        }
        self.extents.apply_vdev(vdev, changes)?;
        let sum = self.sums.entry(vdev).or_default();
        for &(kind, _, size) in changes {
            match kind {
                SpaceChangeKind::Alloc => *sum += size,
                SpaceChangeKind::Free => *sum = sum.wrapping_sub(size),
            }
        }
        Ok(())
    }

    /// Check the sums; the extents on success.
    pub fn finish(self) -> Result<Extents, String> {
        for (vid, want) in self.recorded {
            let got = self.sums.get(vid).copied().unwrap_or(0);
            if got != *want {
                return Err(format!(
                    "vdev {vid}: its extents sum to {got} bytes but the vdev records {want} allocated"
                ));
            }
        }
        Ok(self.extents)
    }
}

/// Cut a vdev's extents (in offset order) into chunks of at most
/// [`CHUNK_EXTENTS`], evenly sized.
pub fn rechunk(vdev: u32, extents: &[(u64, u64)]) -> Vec<Chunk> {
    if extents.is_empty() {
        return Vec::new();
    }
    let n = extents.len().div_ceil(CHUNK_EXTENTS);
    let per = extents.len().div_ceil(n);
    extents
        .chunks(per)
        .map(|c| Chunk::encode(vdev, c))
        .collect()
}

/// The durable extents as loaded: chunks in store order, decoded on
/// iteration (8 bytes an extent in memory instead of a row of ~400).
#[derive(Clone, Default)]
pub struct Extents {
    chunks: Vec<Chunk>,
    len: usize,
}

impl Extents {
    pub fn push_chunk(&mut self, c: Chunk) {
        self.len += c.len();
        self.chunks.push(c);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every extent, chunk by chunk (the store's `(vdev, offset)` order).
    pub fn iter(&self) -> impl Iterator<Item = Extent> + '_ {
        self.chunks.iter().flat_map(Chunk::extents)
    }

    /// Apply changes of `vdev` (in order) to its chunks, rewriting only
    /// the runs they fall in ([`plan_runs`], [`apply`]); chunks stay in
    /// `(vdev, start)` order.
    pub fn apply_vdev(&mut self, vdev: u32, changes: &[Change]) -> Result<(), String> {
        if changes.is_empty() {
            return Ok(());
        }
        let lo = self.chunks.partition_point(|c| c.vdev < vdev);
        let hi = self.chunks.partition_point(|c| c.vdev <= vdev);
        let keys: Vec<u64> = self.chunks[lo..hi].iter().map(|c| c.start).collect();
        let mut out: Vec<Chunk> = Vec::with_capacity(keys.len());
        if keys.is_empty() {
            out = rechunk(vdev, &apply(Vec::new(), changes)?);
        } else {
            let mine = &self.chunks[lo..hi];
            let mut k = 0;
            for ((first, last), ch) in plan_runs(&keys, changes) {
                while keys[k] < first {
                    out.push(mine[k].clone());
                    k += 1;
                }
                let mut cur = Vec::new();
                while k < keys.len() && keys[k] <= last {
                    cur.extend(mine[k].iter());
                    k += 1;
                }
                out.extend(rechunk(vdev, &apply(cur, &ch)?));
            }
            out.extend(mine[k..].iter().cloned());
        }
        let old: usize = self.chunks[lo..hi].iter().map(Chunk::len).sum();
        self.len = self.len - old + out.iter().map(Chunk::len).sum::<usize>();
        self.chunks.splice(lo..hi, out);
        Ok(())
    }

    /// Bytes the chunks take (what a restart holds besides the pool).
    pub fn encoded_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.data.len()).sum()
    }
}

impl<'a> IntoIterator for &'a Extents {
    type Item = Extent;
    type IntoIter = Box<dyn Iterator<Item = Extent> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl From<Vec<Extent>> for Extents {
    /// Chunk a list as it is (runs of one vdev; order kept).
    fn from(v: Vec<Extent>) -> Extents {
        let mut out = Extents::default();
        let mut run: Vec<(u64, u64)> = Vec::new();
        let mut vdev = None;
        for e in v {
            if vdev != Some(e.vdev) || run.len() == CHUNK_EXTENTS {
                if let Some(d) = vdev.filter(|_| !run.is_empty()) {
                    out.push_chunk(Chunk::encode(d, &run));
                }
                run.clear();
                vdev = Some(e.vdev);
            }
            run.push((e.offset, e.size));
        }
        if let Some(d) = vdev.filter(|_| !run.is_empty()) {
            out.push_chunk(Chunk::encode(d, &run));
        }
        out
    }
}

impl PartialEq for Extents {
    fn eq(&self, other: &Extents) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for Extents {}

impl std::fmt::Debug for Extents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.len <= 16 {
            f.debug_list().entries(self.iter()).finish()
        } else {
            write!(f, "Extents({} in {} chunks)", self.len, self.chunks.len())
        }
    }
}

/// Apply one txg's changes of one vdev, in order, to `cur` (its stored
/// extents in the affected chunks, offset order). An allocation must not
/// overlap a stored extent; a free must cover stored space exactly, and
/// splits the extents it covers in part. Errors name the change.
pub fn apply(
    cur: Vec<(u64, u64)>,
    changes: &[(SpaceChangeKind, u64, u64)],
) -> Result<Vec<(u64, u64)>, String> {
    match apply_exact(&cur, changes) {
        Some(out) => Ok(out),
        None => apply_in_order(cur, changes),
    }
}

/// The common case in one merge pass: allocations that overlap nothing
/// and frees that each name one stored (or just allocated) extent exactly.
/// `None` for anything else (then [`apply_in_order`] rules, change by
/// change). Applying all allocations before all frees is the in-order
/// result whenever this succeeds: a free can only precede an overlapping
/// allocation in the same txg by making its space free, and then the
/// merge sees the overlap and gives up.
fn apply_exact(
    cur: &[(u64, u64)],
    changes: &[(SpaceChangeKind, u64, u64)],
) -> Option<Vec<(u64, u64)>> {
    let mut allocs: Vec<(u64, u64)> = Vec::new();
    let mut frees: Vec<(u64, u64)> = Vec::new();
    for &(kind, off, size) in changes {
        match kind {
            SpaceChangeKind::Alloc => allocs.push((off, size)),
            SpaceChangeKind::Free => frees.push((off, size)),
        }
    }
    allocs.sort_unstable();
    frees.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(cur.len() + allocs.len());
    let (mut i, mut j) = (0, 0);
    while i < cur.len() || j < allocs.len() {
        let next = if j == allocs.len() || (i < cur.len() && cur[i].0 <= allocs[j].0) {
            i += 1;
            cur[i - 1]
        } else {
            j += 1;
            allocs[j - 1]
        };
        if let Some(&(po, ps)) = merged.last()
            && po.checked_add(ps)? > next.0
        {
            return None;
        }
        merged.push(next);
    }
    let mut out = Vec::with_capacity(merged.len().saturating_sub(frees.len()));
    let mut k = 0;
    for e in merged {
        if k < frees.len() {
            if frees[k] == e {
                k += 1;
                continue;
            }
            if frees[k].0 <= e.0 {
                return None;
            }
        }
        out.push(e);
    }
    (k == frees.len()).then_some(out)
}

/// Change by change, with splits; the reference semantics.
fn apply_in_order(
    cur: Vec<(u64, u64)>,
    changes: &[(SpaceChangeKind, u64, u64)],
) -> Result<Vec<(u64, u64)>, String> {
    let mut map: BTreeMap<u64, u64> = cur.into_iter().collect();
    for &(kind, off, size) in changes {
        let end = off
            .checked_add(size)
            .ok_or_else(|| format!("extent at {off} of {size} bytes ends past 2^64"))?;
        // Stored extents overlapping [off, end): the one starting last at
        // or before `off`, and those starting inside.
        let first = match map.range(..=off).next_back() {
            Some((&s, &l)) if s + l > off => s,
            _ => off,
        };
        let hits: Vec<(u64, u64)> = map.range(first..end).map(|(&s, &l)| (s, l)).collect();
        match kind {
            SpaceChangeKind::Alloc => {
                if let Some(&(s, l)) = hits.first() {
                    return Err(format!(
                        "allocation of [{off}, +{size}) overlaps stored extent [{s}, +{l}) (the store already holds it)"
                    ));
                }
                map.insert(off, size);
            }
            SpaceChangeKind::Free => {
                let covered: u64 = hits
                    .iter()
                    .map(|&(s, l)| (s + l).min(end) - s.max(off))
                    .sum();
                if covered != size {
                    return Err(format!(
                        "free of [{off}, +{size}) covers {covered} of its {size} bytes in the store"
                    ));
                }
                for (s, l) in hits {
                    map.remove(&s);
                    if s < off {
                        map.insert(s, off - s);
                    }
                    if s + l > end {
                        map.insert(end, s + l - end);
                    }
                }
            }
        }
    }
    Ok(map.into_iter().collect())
}

/// One space change of a vdev: kind, offset, size.
pub type Change = (SpaceChangeKind, u64, u64);

/// The chunks one txg's changes of a vdev must rewrite, given the vdev's
/// chunk keys in order (not empty): runs `(first key, last key)` of
/// consecutive chunks, each with the changes that fall in it, in order.
/// Chunks are rewritten one at a time unless a change spans several, which
/// are then joined into one run (so a sync of a million frees never holds
/// more than a few chunks decoded). Shared by every store.
pub fn plan_runs(keys: &[u64], changes: &[Change]) -> Vec<((u64, u64), Vec<Change>)> {
    // Chunk `le` holds what may overlap a change (the last key at or
    // before its offset; the first chunk for one before every key), and
    // every chunk whose key lies inside it; `joined[k]`: chunks k and k + 1
    // must be rewritten together.
    let n = keys.len();
    let mut owner: Vec<usize> = Vec::with_capacity(changes.len());
    let mut need = vec![false; n];
    let mut joined = vec![false; n];
    for &(_, off, size) in changes {
        let le = keys.partition_point(|&k| k <= off).saturating_sub(1);
        let hi = keys.partition_point(|&k| k < off + size).max(le + 1);
        need[le..hi].iter_mut().for_each(|x| *x = true);
        joined[le..hi - 1].iter_mut().for_each(|x| *x = true);
        owner.push(le);
    }
    // Runs of needed chunks, and each chunk's run.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut run_of = vec![usize::MAX; n];
    let mut k = 0;
    while k < n {
        if !need[k] {
            k += 1;
            continue;
        }
        let first = k;
        while joined[k] {
            k += 1;
        }
        for r in &mut run_of[first..=k] {
            *r = runs.len();
        }
        runs.push((first, k));
        k += 1;
    }
    let mut per_run: Vec<Vec<(SpaceChangeKind, u64, u64)>> = vec![Vec::new(); runs.len()];
    for (c, le) in changes.iter().zip(owner) {
        per_run[run_of[le]].push(*c);
    }
    runs.into_iter()
        .map(|(first, last)| (keys[first], keys[last]))
        .zip(per_run)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use SpaceChangeKind::{Alloc, Free};

    #[test]
    fn chunks_round_trip_narrow_and_wide() {
        let ext = vec![(4096, 4096), (1 << 20, 512), (3 << 40, 8192)];
        // The third is 3 TiB past the key: beyond the narrow form.
        let c = Chunk::encode(2, &ext);
        assert_eq!(c.width, WIDE);
        assert_eq!(c.iter().collect::<Vec<_>>(), ext);
        let c = Chunk::encode(2, &ext[..2]);
        assert_eq!((c.width, c.len(), c.start), (NARROW, 2, 4096));
        assert_eq!(c.iter().collect::<Vec<_>>(), &ext[..2]);
        let back = Chunk::new(2, c.start, c.width, c.data.clone()).unwrap();
        assert_eq!(back, c);
        // The lookup by binary search agrees with a scan.
        let many: Vec<(u64, u64)> = (0..100u64)
            .map(|k| (k * 16384, 4096 * (1 + k % 3)))
            .collect();
        for w in [
            Chunk::encode(3, &many),
            Chunk::encode(3, &[&many[..], &[(5 << 40, 4096)]].concat()),
        ] {
            for (off, len) in [
                (0, 1),
                (16384, 4096),
                (20000, 30000),
                (1, 16383),
                (1 << 30, 4096),
                (0, u64::MAX / 2),
            ] {
                let end = off + len;
                let scan: Vec<(u64, u64)> =
                    w.iter().filter(|&(o, l)| o < end && o + l > off).collect();
                assert_eq!(
                    overlapping_in(w.start, w.width, &w.data, off, end).unwrap(),
                    scan
                );
            }
        }
        assert!(overlapping_in(0, NARROW, &[0; 12], 0, 1).is_err());
        // Misaligned: wide.
        assert_eq!(Chunk::encode(0, &[(100, 7)]).width, WIDE);
        // Damaged rows are refused.
        assert!(Chunk::new(2, 4096, NARROW, c.data[..12].to_vec()).is_err());
        assert!(Chunk::new(2, 4096, 12, c.data.clone()).is_err());
        let mut shifted = c.data.clone();
        shifted[0] = 1;
        assert!(Chunk::new(2, 4096, NARROW, shifted).is_err());
        let w = Chunk::encode(2, &ext);
        assert!(Chunk::new(2, 8192, WIDE, w.data.clone()).is_err());
        assert_eq!(Chunk::new(2, 4096, WIDE, w.data.clone()).unwrap(), w);
        assert!(Chunk::new(2, 4096, NARROW, Vec::new()).is_err());
    }

    #[test]
    fn rechunk_splits_evenly_and_extents_iterate_in_order() {
        let ext: Vec<(u64, u64)> = (0..CHUNK_EXTENTS as u64 * 2 + 1)
            .map(|k| (k * 8192, 4096))
            .collect();
        let chunks = rechunk(1, &ext);
        assert_eq!(chunks.len(), 3);
        assert!(
            chunks
                .iter()
                .all(|c| c.len() <= CHUNK_EXTENTS && c.len() >= 2731)
        );
        let mut all = Extents::default();
        for c in chunks {
            assert_eq!(c.start, c.iter().next().unwrap().0);
            all.push_chunk(c);
        }
        assert_eq!(all.len(), ext.len());
        assert!(
            all.iter()
                .map(|e| (e.offset, e.size))
                .eq(ext.iter().copied())
        );
        assert!(rechunk(1, &[]).is_empty());
        let v: Vec<Extent> = ext
            .iter()
            .map(|&(offset, size)| Extent {
                vdev: 1,
                offset,
                size,
            })
            .collect();
        assert_eq!(Extents::from(v.clone()).iter().collect::<Vec<_>>(), v);
    }

    #[test]
    fn exact_changes_merge_and_others_apply_in_order() {
        let cur = vec![(0, 4096), (8192, 4096), (16384, 8192)];
        // Exact frees and fresh allocations, in any order within the txg.
        let out = apply(
            cur.clone(),
            &[
                (Free, 8192, 4096),
                (Alloc, 4096, 4096),
                (Alloc, 40960, 4096),
                (Free, 40960, 4096),
            ],
        )
        .unwrap();
        assert_eq!(out, vec![(0, 4096), (4096, 4096), (16384, 8192)]);
        // A free of part of an extent splits it (the in-order path).
        let out = apply(cur.clone(), &[(Free, 20480, 4096)]).unwrap();
        assert_eq!(out, vec![(0, 4096), (8192, 4096), (16384, 4096)]);
        // A free across two extents and the gap between them is refused;
        // one covering both exactly (no gap) is not.
        let err = apply(cur.clone(), &[(Free, 0, 12288)]).unwrap_err();
        assert!(err.contains("covers 8192 of its 12288"), "{err}");
        let out = apply(vec![(0, 4096), (4096, 4096)], &[(Free, 0, 8192)]).unwrap();
        assert!(out.is_empty());
        // An allocation over stored space is refused, even across the end.
        let err = apply(cur.clone(), &[(Alloc, 12288, 8192)]).unwrap_err();
        assert!(err.contains("already holds"), "{err}");
        // A free twice is refused; a free then a reallocation of the same
        // space in one txg is applied in order.
        assert!(apply(cur.clone(), &[(Free, 0, 4096), (Free, 0, 4096)]).is_err());
        let out = apply(cur.clone(), &[(Free, 0, 4096), (Alloc, 0, 8192)]).unwrap();
        assert_eq!(out, vec![(0, 8192), (8192, 4096), (16384, 8192)]);
        // The two paths agree wherever the merge succeeds.
        let changes = [(Alloc, 12288, 4096), (Free, 16384, 8192)];
        assert_eq!(
            apply_exact(&cur, &changes).unwrap(),
            apply_in_order(cur.clone(), &changes).unwrap()
        );
    }
}
