//! Vdev geometry (`vdev.c:vdev_metaslab_set_size@zfs-2.4.0`,
//! `vdev_raidz.c:vdev_raidz_psize_to_asize@zfs-2.4.0`): the metaslab size
//! OpenZFS picks for a top-level vdev, psize → asize rounding (plain and
//! RAIDZ), and the data children count that scales the aliquot.

use std::fmt;

use crate::range_tree::highbit;
use crate::{Tunables, VdevSpec};

/// A block's logical size as written (OpenZFS's psize): what a client asks
/// for and what a size hint must be given in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Psize(pub u64);

/// Bytes a block takes on one vdev (OpenZFS's asize): its psize rounded to
/// the vdev's sectors, with parity and padding on RAIDZ. Free segments and
/// extents are in asize. The two differ on RAIDZ, so one is never passed
/// where the other is meant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Asize(pub u64);

impl fmt::Display for Psize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Asize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The metaslab shift OpenZFS chooses for a vdev of `asize` bytes
/// (`vdev.c:vdev_metaslab_set_size@zfs-2.4.0`).
pub fn metaslab_shift(asize: u64, t: &Tunables) -> u8 {
    let default_shift = t.zfs_vdev_default_ms_shift as u32;
    let count0 = asize >> default_shift;
    let mut shift = if count0 < t.zfs_vdev_min_ms_count {
        highbit(asize / t.zfs_vdev_min_ms_count)
    } else if count0 > t.zfs_vdev_default_ms_count {
        highbit(asize / t.zfs_vdev_default_ms_count)
    } else {
        default_shift
    };
    let max_shift = t.zfs_vdev_max_ms_shift as u32;
    // Never below the maximum block size (SPA_MAXBLOCKSHIFT).
    if shift < 24 {
        shift = 24;
    } else if shift > max_shift {
        shift = max_shift;
        if (asize >> max_shift) > t.zfs_vdev_ms_count_limit {
            shift = highbit(asize / t.zfs_vdev_ms_count_limit);
        }
    }
    shift as u8
}

/// Metaslab count for `asize` at `shift`; the trailing partial metaslab is
/// unused.
pub fn metaslab_count(asize: u64, shift: u8) -> u64 {
    asize >> shift
}

/// Data children: children − parity, at least 1 (`vdev_raidz.c@zfs-2.4.0`).
pub fn data_children(spec: &VdevSpec) -> u64 {
    (spec.children.saturating_sub(spec.parity)).max(1) as u64
}

/// psize → asize (`vdev_raidz.c:vdev_raidz_psize_to_asize@zfs-2.4.0`). A vdev
/// with one data child (plain disk or a mirror: children − parity = 1) rounds
/// up to the sector; a RAIDZ-like vdev with parity adds parity sectors and
/// rounds to a multiple of parity + 1.
pub fn psize_to_asize(spec: &VdevSpec, Psize(psize): Psize) -> Asize {
    let a = spec.ashift as u32;
    let p = spec.parity as u64;
    let cols = spec.children as u64;
    if p == 0 || cols <= p + 1 {
        let sector = 1u64 << a;
        return Asize(psize.div_ceil(sector) * sector);
    }
    let mut s = psize.div_ceil(1 << a);
    s += p * s.div_ceil(cols - p);
    Asize((s.div_ceil(p + 1) * (p + 1)) << a)
}

/// The largest psize whose allocation on this vdev is `asize` bytes: the
/// reverse of [`psize_to_asize`] (OpenZFS's
/// `vdev_raidz.c:vdev_raidz_asize_to_psize@zfs-2.4.0` on RAIDZ; a plain
/// vdev only rounds to its sectors). A relocation that knows only the old
/// extent sizes its new copy from this, not from the old asize, so a block
/// moved off a RAIDZ vdev does not carry its parity along.
pub fn asize_to_psize(spec: &VdevSpec, Asize(asize): Asize) -> Psize {
    let a = spec.ashift as u32;
    let p = spec.parity as u64;
    let cols = spec.children as u64;
    let sectors = asize >> a;
    if p == 0 || cols <= p + 1 {
        return Psize(sectors << a);
    }
    // Rows that hold data; a partial row made of padding only (the round
    // up to a multiple of parity + 1) holds none.
    let rows = sectors / cols;
    let used = if sectors - rows * cols <= p {
        rows * cols
    } else {
        sectors
    };
    Psize((used - p * used.div_ceil(cols)) << a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `asize_to_psize` reverses `psize_to_asize` as OpenZFS's
    /// `vdev_raidz_asize_to_psize@zfs-2.4.0` does: the largest psize with
    /// that asize, so sizing again from it gives the same asize.
    #[test]
    fn asize_to_psize_is_the_largest_block_of_that_allocation() {
        for (children, parity, ashift) in [
            (1, 0, 9),
            (1, 0, 12),
            (5, 1, 12),
            (3, 1, 9),
            (6, 2, 12),
            (4, 1, 12),
        ] {
            let s = spec(children, parity, ashift);
            for psize in (1..=64u64)
                .map(|k| k * 2048)
                .chain([128 << 10, 1 << 20, 16 << 20])
            {
                let asize = psize_to_asize(&s, Psize(psize));
                let most = asize_to_psize(&s, asize);
                assert!(
                    most >= Psize(psize),
                    "{children}/{parity}@{ashift}: {psize} -> {asize} -> {most}"
                );
                assert_eq!(
                    psize_to_asize(&s, most),
                    asize,
                    "{children}/{parity}@{ashift}: {psize}"
                );
            }
        }
        // The case: 128K on a 5-wide RAIDZ1 at ashift 12 is 160K
        // allocated, and back to 128K, not 160K.
        let rz = spec(5, 1, 12);
        assert_eq!(psize_to_asize(&rz, Psize(128 << 10)), Asize(160 << 10));
        assert_eq!(asize_to_psize(&rz, Asize(160 << 10)), Psize(128 << 10));
    }
    use crate::VdevRole;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    const TIB: u64 = 1 << 40;
    const PIB: u64 = 1 << 50;

    fn check(asize: u64, count: u64, ms_size: u64) {
        let t = Tunables::default();
        let shift = metaslab_shift(asize, &t);
        assert_eq!(
            (metaslab_count(asize, shift), 1u64 << shift),
            (count, ms_size),
            "asize {asize}"
        );
    }

    #[test]
    fn metaslab_size_spec_examples() {
        check(4 * GIB, 8, 512 * MIB);
        check(4 * GIB - 4 * MIB - 512 * 1024, 15, 256 * MIB);
        check(6 * GIB, 12, 512 * MIB);
        check(123 * MIB + 512 * 1024, 7, 16 * MIB);
        check(8 * GIB, 16, 512 * MIB);
        check(100 * GIB, 200, 512 * MIB);
        check(TIB, 128, 8 * GIB);
        check(3 * TIB, 192, 16 * GIB);
        check(100 * TIB, 6400, 16 * GIB);
        check(3 * PIB, 98304, 32 * GIB);
        // The preface's small device: 1 GiB gives 8 × 128 MiB.
        check(GIB, 8, 128 * MIB);
    }

    fn spec(children: u32, parity: u32, ashift: u8) -> VdevSpec {
        VdevSpec {
            capacity: GIB,
            ashift,
            children,
            parity,
            rotational: false,
            role: VdevRole::Normal,
            metaslab_shift: None,
        }
    }

    #[test]
    fn asize_rounding() {
        assert_eq!(psize_to_asize(&spec(1, 0, 12), Psize(1)), Asize(4096));
        assert_eq!(psize_to_asize(&spec(1, 0, 12), Psize(4097)), Asize(8192));
        assert_eq!(psize_to_asize(&spec(2, 1, 12), Psize(4096)), Asize(4096)); // mirror
        // raidz1 of 5 (4 data): 128 KiB = 32 sectors + 8 parity = 40, round to 2 → 40.
        assert_eq!(
            psize_to_asize(&spec(5, 1, 12), Psize(128 << 10)),
            Asize(40 << 12)
        );
        // raidz2 of 6: 1 sector + 2 parity = 3, round up to 3 → 3 sectors.
        assert_eq!(psize_to_asize(&spec(6, 2, 12), Psize(4096)), Asize(3 << 12));
        assert_eq!(data_children(&spec(10, 2, 12)), 8);
        assert_eq!(data_children(&spec(1, 0, 12)), 1);
        assert_eq!(data_children(&spec(2, 1, 12)), 1);
    }
}
