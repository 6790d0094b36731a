//! Owner maps: how the stores keep the owners of committed extents
//! (`crate::extent_owners`) compactly. One row per owner run cost a row
//! decode per run at restart (~1 µs each, 10 s at 10^7 runs when two
//! clients' blocks alternate); instead each vdev's runs are grouped by the
//! [`WINDOW`] their start falls in, and each window is one BLOB of varints
//! (protobuf's LEB128, as `prost` writes it): per run the gap from the end of
//! the previous run (or the window's start), the run's length and the
//! owner's number. With 4 KiB blocks that is 3–4 bytes a run instead of a
//! 32-byte row, the space maps' own scale (8 B an extent, `crate::spacemap`).
//!
//! A run may end past its window (one client's run can cover a whole vdev);
//! only its start decides the row. A txg rewrites the rows of the windows its
//! changes fall in: `ExtentOwners::take_changes` widens each changed range to
//! whole windows, so a row is always rewritten whole.
//!
//! Pure code (no I/O): the stores do the SQL.

use prost::bytes::Buf;
use prost::encoding::{decode_varint, encode_varint};

use crate::extent_owners::OwnerIdx;

/// Bytes of a vdev per owner-map row: 16 MiB holds at most 4096 blocks of
/// 4 KiB, the space maps' chunk size, so one txg's commit rewrites at most
/// ~16 KiB of owner map per window it touches.
pub const WINDOW: u64 = 16 << 20;

/// The first byte of a row: lengths and gaps count 512-byte units (every
/// run aligned to 512 B, as with any ashift) or bytes.
const UNITS_512: u8 = 9;
const UNITS_BYTE: u8 = 0;

/// The window `offset` falls in, by its start.
pub fn window_of(offset: u64) -> u64 {
    offset - offset % WINDOW
}

/// Encode `runs` (`(start, end, owner)`, in order, not overlapping, every
/// start inside the window at `window`).
pub fn encode(window: u64, runs: &[(u64, u64, OwnerIdx)]) -> Vec<u8> {
    let aligned = runs.iter().all(|&(s, e, _)| (s | e | window) & 511 == 0);
    let shift = if aligned { UNITS_512 } else { UNITS_BYTE };
    let mut out = Vec::with_capacity(1 + runs.len() * 4);
    out.push(shift);
    let mut at = window;
    for &(s, e, o) in runs {
        debug_assert!(s >= at && e > s && window_of(s) == window);
        encode_varint((s - at) >> shift, &mut out);
        encode_varint((e - s) >> shift, &mut out);
        encode_varint(o as u64, &mut out);
        at = e;
    }
    out
}

/// Decode one row into `out`. A row that does not decode, or whose runs
/// overlap, leave their window or have no owner, is an error naming why: the
/// store is then inconsistent and is refused.
pub fn decode(window: u64, data: &[u8], out: &mut Vec<(u64, u64, OwnerIdx)>) -> Result<(), String> {
    let mut buf = data;
    let shift = match buf.first() {
        Some(&UNITS_512) => UNITS_512,
        Some(&UNITS_BYTE) => UNITS_BYTE,
        Some(b) => return Err(format!("owner map at {window}: unknown unit {b}")),
        None => return Err(format!("owner map at {window}: empty row")),
    };
    buf.advance(1);
    let mut at = window;
    let bad = |what: &str| format!("owner map at {window}: {what}");
    while buf.has_remaining() {
        let mut next = || {
            decode_varint(&mut buf)
                .map_err(|e| bad(&e.to_string()))
                .and_then(|v| v.checked_shl(shift as u32).ok_or_else(|| bad("too large")))
        };
        let gap = next()?;
        let len = next()?;
        let owner = decode_varint(&mut buf).map_err(|e| bad(&e.to_string()))?;
        let s = at.checked_add(gap).ok_or_else(|| bad("offset overflows"))?;
        let e = s.checked_add(len).ok_or_else(|| bad("offset overflows"))?;
        if len == 0 || window_of(s) != window || owner == 0 || owner > OwnerIdx::MAX as u64 {
            return Err(bad(&format!(
                "run [{s}, {e}) of owner {owner} is not a valid run here"
            )));
        }
        out.push((s, e, owner as OwnerIdx));
        at = e;
    }
    Ok(())
}

/// Split `runs` (in order) into rows: `(window, encoded runs)`.
pub fn rows(runs: &[(u64, u64, OwnerIdx)]) -> Vec<(u64, Vec<u8>)> {
    let mut rows = Vec::new();
    let mut i = 0;
    while i < runs.len() {
        let w = window_of(runs[i].0);
        let j = i + runs[i..].partition_point(|r| window_of(r.0) == w);
        rows.push((w, encode(w, &runs[i..j])));
        i = j;
    }
    rows
}

/// Every run of the stored rows `(vdev, window, data)` and of `legacy`
/// runs (an older binary's table of one row per run), as
/// `(vdev, start, end, owner)` in order. Overlapping runs make the store
/// inconsistent: an error naming them.
pub fn load_runs(
    rows: Vec<(u32, u64, Vec<u8>)>,
    legacy: Vec<(u32, u64, u64, OwnerIdx)>,
) -> Result<Vec<(u32, u64, u64, OwnerIdx)>, String> {
    let mut all = legacy;
    let mut one = Vec::new();
    for (vdev, window, data) in rows {
        one.clear();
        decode(window, &data, &mut one).map_err(|e| format!("vdev {vdev}: {e}"))?;
        all.extend(one.iter().map(|&(s, e, o)| (vdev, s, e, o)));
    }
    // Rows come in key order; legacy rows (rare) need the sort.
    if !all.is_sorted() {
        all.sort_unstable();
    }
    if let Some(w) = all.windows(2).find(|w| w[0].0 == w[1].0 && w[0].2 > w[1].1) {
        return Err(format!(
            "owner runs overlap on vdev {}: [{}, {}) and [{}, {})",
            w[0].0, w[0].1, w[0].2, w[1].1, w[1].2
        ));
    }
    Ok(all)
}

/// One vdev's owner runs, `(start, end, owner)` in order.
pub type VdevRuns = (u32, Vec<(u64, u64, OwnerIdx)>);

/// `(vdev, start, end, owner)` runs in order, grouped per vdev.
pub fn by_vdev(all: &[(u32, u64, u64, OwnerIdx)]) -> Vec<VdevRuns> {
    let mut out: Vec<VdevRuns> = Vec::new();
    for &(v, s, e, o) in all {
        match out.last_mut() {
            Some((lv, runs)) if *lv == v => runs.push((s, e, o)),
            _ => out.push((v, vec![(s, e, o)])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_stay_small() {
        // Two clients' 4 KiB blocks alternating over 3 windows, one run
        // crossing into the next window, and a misaligned run.
        let mut runs: Vec<(u64, u64, OwnerIdx)> = (0..3 * 4096u64)
            .map(|k| (k * 4096, k * 4096 + 4096, 1 + (k % 2) as u32))
            .collect();
        runs.push((3 * WINDOW + 100, 5 * WINDOW, 7));
        let rows = rows(&runs);
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0].0, 0);
        assert_eq!(rows[3].0, 3 * WINDOW);
        // 4096 runs in 1 + 4096 * 3 bytes: gap 0, length 8 units, owner.
        assert_eq!(rows[0].1.len(), 1 + 4096 * 3);
        let mut back = Vec::new();
        for (w, data) in &rows {
            decode(*w, data, &mut back).unwrap();
        }
        assert_eq!(back, runs);
        // Loaded with an older binary's rows beside them, in order.
        let stored = rows.into_iter().map(|(w, d)| (2, w, d)).collect();
        let all = load_runs(stored, vec![(0, 0, 512, 3)]).unwrap();
        assert_eq!(all.len(), runs.len() + 1);
        assert_eq!(all[0], (0, 0, 512, 3));
        assert_eq!(all[1], (2, 0, 4096, 1));
        let overlap = load_runs(Vec::new(), vec![(0, 0, 8192, 1), (0, 4096, 8192, 2)]);
        assert!(overlap.unwrap_err().contains("overlap on vdev 0"));
    }

    #[test]
    fn a_damaged_row_is_refused_with_the_reason() {
        let mut out = Vec::new();
        assert!(decode(0, &[], &mut out).unwrap_err().contains("empty"));
        assert!(decode(0, &[3], &mut out).unwrap_err().contains("unit"));
        // Truncated varint.
        assert!(decode(0, &[9, 0x80], &mut out).is_err());
        // Owner 0.
        let bad = encode(0, &[(0, 4096, 1)]);
        let mut b = bad.clone();
        *b.last_mut().unwrap() = 0;
        assert!(decode(0, &b, &mut out).unwrap_err().contains("owner 0"));
        // A run starting in the next window.
        let mut b = vec![9];
        encode_varint(WINDOW >> 9, &mut b);
        encode_varint(8, &mut b);
        encode_varint(1, &mut b);
        assert!(
            decode(0, &b, &mut out)
                .unwrap_err()
                .contains("not a valid run")
        );
    }
}
