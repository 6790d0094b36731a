//! Legacy (request-based) throttle arithmetic (`metaslab.c@zfs-2.3.0`): the
//! per-visit space bias, the class slot test (a true ceiling) and group
//! skipping.

/// `mg_aliquot` at activation: `metaslab_aliquot × max(1, data children)`.
pub fn group_aliquot(metaslab_aliquot: u64, data_children: u64) -> u64 {
    metaslab_aliquot * data_children.max(1)
}

/// The space bias computed at the first block of a visit
/// (`metaslab.c:metaslab_alloc_dva@zfs-2.3.0`): `ratio = vs_free × alloc_groups
/// × 100 / (mc_free + 1)` in percent, `bias = (ratio − 100) × aliquot / 100`.
/// Absolute free bytes, signed.
pub fn space_bias(vs_free: u64, mc_free: u64, alloc_groups: u64, aliquot: u64) -> i64 {
    let ratio = (vs_free as i128 * alloc_groups as i128 * 100) / (mc_free as i128 + 1);
    ((ratio - 100) * aliquot as i128 / 100) as i64
}

/// Whether the rotor moves on after a successful allocation of `asize`
/// (`visit_bytes` already includes it).
pub fn should_rotate(is_zil: bool, visit_bytes: u64, aliquot: u64, bias: i64) -> bool {
    is_zil || (visit_bytes as i128) >= aliquot as i128 + bias as i128
}

/// Slot admission: granted if `reserved + slots <= max_slots`.
pub fn reserve(reserved: &mut u64, max_slots: u64, slots: u64) -> bool {
    if *reserved + slots <= max_slots {
        *reserved += slots;
        true
    } else {
        false
    }
}

/// Per-group queue room for DVA `d` (ditto copies get 25 %/50 % more).
pub fn qmax(cur_max: u64, d: usize) -> u64 {
    cur_max * (4 + d as u64) / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn bias_example_from_spec() {
        // Two 128 GiB vdevs with 16 GiB and 64 GiB allocated: 127 % and 72 %.
        let mc_free = (128 - 16 + 128 - 64) * GIB;
        let a = 1 << 20;
        let b0 = space_bias(112 * GIB, mc_free, 2, a);
        let b1 = space_bias(64 * GIB, mc_free, 2, a);
        assert_eq!(b0, 27 * a as i64 / 100);
        assert_eq!(b1, -28 * a as i64 / 100);
        assert!(!should_rotate(false, a, a, b0));
        assert!(should_rotate(false, a * 127 / 100 + 1, a, b0));
        assert!(should_rotate(true, 0, a, b0));
    }

    #[test]
    fn slots_are_a_ceiling() {
        let mut r = 30;
        assert!(reserve(&mut r, 32, 2));
        assert!(!reserve(&mut r, 32, 1));
        assert_eq!(qmax(32, 0), 32);
        assert_eq!(qmax(32, 1), 40);
        assert_eq!(qmax(32, 2), 48);
        assert_eq!(group_aliquot(1 << 20, 4), 4 << 20);
    }
}
