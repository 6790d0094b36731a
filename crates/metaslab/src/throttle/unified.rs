//! Unified throttle arithmetic (`metaslab.c@zfs-2.4.0`): class balance with
//! OpenZFS's integer order of operations, the rotate rule, and the
//! byte reservation test (before the add).

/// One ring group's inputs to `balance`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupInput {
    pub data_children: u64,
    /// Top-level vdev `vs_space` / `vs_alloc` (embedded log metaslab included).
    pub vs_space: u64,
    pub vs_alloc: u64,
}

/// The class's inputs to `balance`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassInput {
    /// Initialized groups (`mc_groups`).
    pub groups: u64,
    pub space: u64,
    pub alloc: u64,
    pub alloc_io_size: u64,
    pub metaslab_aliquot: u64,
    pub bias_enabled: bool,
}

/// One group's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupQuota {
    pub aliquot: u64,
    pub queue_target: u64,
}

/// `metaslab_class_balance` without the onsync part (`metaslab.c@zfs-2.4.0`):
/// quotas per ring group, in ring order, and `mc_alloc_max`. With no
/// initialized group alloc_max is unlimited and no quotas are produced.
pub fn balance(mc: &ClassInput, ring: &[GroupInput], out: &mut Vec<GroupQuota>) -> u64 {
    out.clear();
    if mc.groups == 0 {
        return u64::MAX;
    }
    let children: u64 = ring.iter().map(|g| g.data_children).sum();
    let mut sum: u64 = 0;
    for g in ring {
        let mut a = (mc.metaslab_aliquot * children / mc.groups).max(4 * mc.alloc_io_size);
        if mc.space > 0 && g.vs_space > 0 {
            // Capacity ratio, Q8 (256 = an average-size group).
            let r = g.vs_space / (mc.space / (mc.groups * 256) + 1);
            a = a * r / 256;
        }
        let q = if mc.bias_enabled && mc.space > 0 && g.vs_space > 0 {
            let vs_free = g.vs_space.saturating_sub(g.vs_alloc);
            let mc_free = mc.space.saturating_sub(mc.alloc);
            let vs_fr = vs_free / (g.vs_space / 65536 + 1); // Q16
            let mc_fr = mc_free / (mc.space / 256 + 1); // Q8
            let r = vs_fr / (mc_fr + 1); // Q8
            let aliquot = a * r / 256;
            let q = (3 * vs_fr + 16384).min(163840);
            GroupQuota {
                aliquot,
                queue_target: aliquot.max(aliquot * q / 65536),
            }
        } else {
            GroupQuota {
                aliquot: a,
                queue_target: 2 * a,
            }
        };
        sum += q.aliquot;
        out.push(q);
    }
    4 * sum
}

/// The onsync move of `mc_alloc_io_size` a quarter of the way to
/// `metaslab_aliquot / 8` (`mc_alloc_io_size` in
/// `metaslab.c:metaslab_class_balance@zfs-2.4.0`).
pub fn io_size_onsync(alloc_io_size: u64, metaslab_aliquot: u64) -> u64 {
    (3 * alloc_io_size + metaslab_aliquot / 8) / 4
}

/// Inputs to the rotate decision after a DVA was tried on the rotor group.
#[derive(Clone, Copy, Debug)]
pub struct RotateInput {
    pub success: bool,
    pub is_log: bool,
    pub psize: u64,
    /// `mca_aliquot` after adding `psize` (on success).
    pub visit_bytes: u64,
    pub aliquot: u64,
    pub queue_target: u64,
    pub queue_depth: u64,
    pub perf_bias: u8,
    pub busy: bool,
}

/// `metaslab.c:metaslab_class_rotate@zfs-2.4.0` once the caller has checked
/// that the class has ≥ 2 groups and `mg` is the rotor: true = rotate.
pub fn should_rotate(r: &RotateInput) -> bool {
    if !r.success || r.is_log {
        return true;
    }
    let naq = r.visit_bytes + r.psize / 2;
    if naq < r.aliquot {
        return false;
    }
    if naq >= r.queue_target {
        return true;
    }
    if r.queue_depth + r.psize + r.psize / 2 >= r.queue_target {
        return true;
    }
    match r.perf_bias {
        0 => true,
        1 => !r.busy,
        _ => false,
    }
}

/// `reserve` (`metaslab.c:metaslab_class_throttle_reserve@zfs-2.4.0`): admitted
/// when `must` or `reserved <= alloc_max` before the add. Returns (granted,
/// more).
pub fn reserve(reserved: &mut u64, alloc_max: u64, bytes: u64, must: bool) -> (bool, bool) {
    if must || *reserved <= alloc_max {
        *reserved += bytes;
        (true, *reserved <= alloc_max)
    } else {
        (false, false)
    }
}

/// `unreserve`: true when waiters should be woken.
pub fn unreserve(reserved: &mut u64, alloc_max: u64, bytes: u64) -> bool {
    *reserved = reserved.saturating_sub(bytes);
    *reserved <= alloc_max
}

/// OpenZFS's busy rule for `metaslab_perf_bias`
/// (`metaslab.c:metaslab_class_rotate@zfs-2.4.0`): the pool is busy when
/// its dirty data (`dp_dirty_total`: every txg not yet synced) passes
/// `zfs_dirty_data_max × (min% + max%) / 200`, the midpoint of the
/// async-write ramp (45 % at the defaults), or when a sync task is pending.
/// Nothing else: requests waiting in the throttle do not make it busy.
pub fn busy_dirty(dirty: u64, dirty_max: u64, pct_sum: u64, sync_pending: bool) -> bool {
    sync_pending || dirty as u128 > dirty_max as u128 * pct_sum as u128 / 200
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const TIB: u64 = 1 << 40;

    fn run(groups: &[(u64, u64, u64)]) -> (Vec<GroupQuota>, u64) {
        let ring: Vec<GroupInput> = groups
            .iter()
            .map(|&(c, s, a)| GroupInput {
                data_children: c,
                vs_space: s,
                vs_alloc: a,
            })
            .collect();
        let mc = ClassInput {
            groups: ring.len() as u64,
            space: ring.iter().map(|g| g.vs_space).sum(),
            alloc: ring.iter().map(|g| g.vs_alloc).sum(),
            alloc_io_size: 256 << 10,
            metaslab_aliquot: 2 << 20,
            bias_enabled: true,
        };
        let mut out = Vec::new();
        let max = balance(&mc, &ring, &mut out);
        (out, max)
    }

    fn q(aliquot: u64, queue_target: u64) -> GroupQuota {
        GroupQuota {
            aliquot,
            queue_target,
        }
    }

    #[test]
    fn example_a_empty_mirrors_1_to_2() {
        let (out, max) = run(&[(1, 128 * GIB, 0), (1, 256 * GIB, 0)]);
        assert_eq!(out, vec![q(1_387_200, 3_468_000), q(2_782_560, 6_956_400)]);
        assert_eq!(max, 4 * (1_387_200 + 2_782_560));
        // The spec's "15.9 MiB".
        assert_eq!(max / (1 << 20), 15);
    }

    #[test]
    fn example_b_uneven_fill() {
        let (out, max) = run(&[(1, 128 * GIB, 64 * GIB), (1, 256 * GIB, 64 * GIB)]);
        assert_eq!(out, vec![q(1_039_040, 1_818_272), q(3_131_744, 7_829_216)]);
        assert_eq!(max, 4 * (1_039_040 + 3_131_744));
    }

    #[test]
    fn example_c_raidz2_half_full() {
        let g = (8, 80 * TIB, 40 * TIB);
        let (out, max) = run(&[g, g, g, g]);
        assert_eq!(out, vec![q(16_646_400, 29_130_437); 4]);
        assert_eq!(max, 4 * 4 * 16_646_400);
        assert_eq!(max / (1 << 20), 254);
    }

    #[test]
    fn example_d_old_full_new_empty() {
        let (out, max) = run(&[(1, TIB, TIB - TIB / 10), (1, TIB, 0)]);
        assert_eq!(out[1], q(3_786_240, 9_465_600));
        assert_eq!(out[0], q(375_360, 375_360));
        assert_eq!(max / (1 << 20), 15);
    }

    #[test]
    fn queue_target_curve_points() {
        // One group: capacity and relative ratios ~1; the target factor is
        // min(2.5, 0.25 + 3 × free fraction) in Q16.
        let space = 100 * GIB;
        let factor = |alloc: u64| {
            let (out, _) = run(&[(1, space, alloc)]);
            out[0].queue_target * 1000 / out[0].aliquot
        };
        assert_eq!(factor(space / 4 * 3), 1000); // 25 % free → 1.0×
        assert_eq!(factor(space / 10 * 9), 1000); // below: clamped to 1.0×
        assert_eq!(factor(space / 2), 1749); // 50 % free → 1.75× (Q16 truncation)
        assert_eq!(factor(space / 4), 2499); // 75 % free → 2.5×
        assert_eq!(factor(0), 2500); // empty: capped at 2.5×
    }

    #[test]
    fn alloc_max_is_four_times_sum_and_unbounded_without_groups() {
        let (out, max) = run(&[(1, 10 * GIB, GIB), (2, 20 * GIB, 3 * GIB), (1, 5 * GIB, 0)]);
        assert_eq!(max, 4 * out.iter().map(|g| g.aliquot).sum::<u64>());
        let mc = ClassInput {
            groups: 0,
            space: 0,
            alloc: 0,
            alloc_io_size: 128 << 10,
            metaslab_aliquot: 2 << 20,
            bias_enabled: true,
        };
        assert_eq!(balance(&mc, &[], &mut Vec::new()), u64::MAX);
    }

    #[test]
    fn io_size_moving_average() {
        let mut s = 128 << 10;
        let mut seen = vec![];
        for _ in 0..3 {
            s = io_size_onsync(s, 2 << 20);
            seen.push(s >> 10);
        }
        assert_eq!(seen, vec![160, 184, 202]);
    }

    #[test]
    fn reserve_tests_before_adding() {
        let mut r = 0;
        assert_eq!(reserve(&mut r, 100, 1000, false), (true, false));
        assert_eq!(reserve(&mut r, 100, 1, false), (false, false));
        assert_eq!(reserve(&mut r, 100, 1, true), (true, false));
        assert!(!unreserve(&mut r, 100, 1));
        assert!(unreserve(&mut r, 100, 1000));
        assert_eq!(r, 0);
    }

    #[test]
    fn rotate_rules() {
        let base = RotateInput {
            success: true,
            is_log: false,
            psize: 128 << 10,
            visit_bytes: 128 << 10,
            aliquot: 1 << 20,
            queue_target: 4 << 20,
            queue_depth: 0,
            perf_bias: 1,
            busy: false,
        };
        assert!(!should_rotate(&base)); // under quota
        assert!(should_rotate(&RotateInput {
            success: false,
            ..base
        }));
        assert!(should_rotate(&RotateInput {
            is_log: true,
            ..base
        }));
        let over = RotateInput {
            visit_bytes: 1 << 20,
            ..base
        };
        assert!(should_rotate(&over)); // idle → strict quota
        assert!(!should_rotate(&RotateInput { busy: true, ..over })); // busy → run ahead
        assert!(should_rotate(&RotateInput {
            busy: true,
            queue_depth: 4 << 20,
            ..over
        }));
        assert!(should_rotate(&RotateInput {
            perf_bias: 0,
            busy: true,
            ..over
        }));
        assert!(!should_rotate(&RotateInput {
            perf_bias: 2,
            ..over
        }));
        assert!(should_rotate(&RotateInput {
            perf_bias: 2,
            visit_bytes: 4 << 20,
            ..over
        }));
    }
}
