//! How balanced a class's vdevs are, as one number an operator can watch
//! and a balancer can drive down: the balance score (Aliquot's, after Ceph's
//! `ceph balancer eval`), and each vdev's VAR (`ceph osd df`).
//!
//! OpenZFS balances only at allocation time, by steering new blocks toward
//! emptier vdevs (`metaslab.c:metaslab_class_balance@zfs-2.4.0`); this measures
//! how far the space already allocated is from the balance that steering aims
//! at: every vdev with the same used fraction.
//!
//! Definitions (in the proto and README too):
//! * used fraction of a vdev: allocated / capacity; of the class: the sum of
//!   allocated over the sum of capacity;
//! * VAR of a vdev: its used fraction over the class's (1 = on target);
//! * score: Σ over over-full vdevs (VAR > 1) of capacity share ×
//!   erf((VAR − 1) / √2). 0 is perfect balance; it stays below 1 (erf < 1,
//!   shares sum to 1). Ceph weighs each OSD's relative excess the same way,
//!   so a vdev 10 % above target costs about 0.08 of its share, and one
//!   twice as full as the class about 0.68.

/// One vdev's space, in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VdevFill {
    pub capacity: u64,
    pub alloc: u64,
}

impl VdevFill {
    pub fn used(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.alloc as f64 / self.capacity as f64
        }
    }
}

/// The class's used fraction: total allocated / total capacity.
pub fn class_used(vdevs: &[VdevFill]) -> f64 {
    let cap: u128 = vdevs.iter().map(|v| u128::from(v.capacity)).sum();
    let alloc: u128 = vdevs
        .iter()
        .filter(|v| v.capacity > 0)
        .map(|v| u128::from(v.alloc))
        .sum();
    if cap == 0 {
        0.0
    } else {
        alloc as f64 / cap as f64
    }
}

/// How `v`'s used fraction compares with the class's (`vdevs`, `v` among
/// them), exactly: integer cross-multiplication, no rounding. In a class
/// without capacity every vdev ranks below. Plans move off the vdevs
/// above; a move's new copy goes to the vdevs below.
pub fn cmp_to_class(v: &VdevFill, vdevs: &[VdevFill]) -> std::cmp::Ordering {
    let cap: u128 = vdevs.iter().map(|v| u128::from(v.capacity)).sum();
    let alloc: u128 = vdevs.iter().map(|v| u128::from(v.alloc)).sum();
    if cap == 0 {
        return std::cmp::Ordering::Less;
    }
    (u128::from(v.alloc) * cap).cmp(&(alloc * u128::from(v.capacity)))
}

/// VAR of each vdev (same order); `None` for a vdev without capacity or
/// while the class holds nothing.
pub fn vars(vdevs: &[VdevFill]) -> Vec<Option<f64>> {
    let cu = class_used(vdevs);
    vdevs
        .iter()
        .map(|v| (v.capacity > 0 && cu > 0.0).then(|| v.used() / cu))
        .collect()
}

/// The balance score in [0, 1): 0 when every vdev is equally full (or the
/// class is empty). See the module's definition.
pub fn score(vdevs: &[VdevFill]) -> f64 {
    let cap: u128 = vdevs.iter().map(|v| u128::from(v.capacity)).sum();
    if cap == 0 {
        return 0.0;
    }
    vdevs
        .iter()
        .zip(vars(vdevs))
        .filter_map(|(v, var)| {
            let over = var? - 1.0;
            (over > 0.0).then(|| {
                let share = v.capacity as f64 / cap as f64;
                share * erf(over / std::f64::consts::SQRT_2)
            })
        })
        .sum::<f64>()
        .clamp(0.0, 1.0 - f64::EPSILON)
}

/// The error function, to 1.5e-7 (Abramowitz & Stegun 7.1.26): enough for
/// a score shown to 3 decimals, without a maths dependency.
pub fn erf(x: f64) -> f64 {
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let x = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    sign * (1.0 - poly * (-x * x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn vdevs_rank_against_the_class_fill_exactly() {
        use std::cmp::Ordering::*;
        let f = |capacity, alloc| VdevFill { capacity, alloc };
        let v = [f(2 * GIB, GIB), f(4 * GIB, GIB), f(GIB, GIB)];
        // Class: 3 of 7 GiB used.
        let got: Vec<_> = v.iter().map(|x| cmp_to_class(x, &v)).collect();
        assert_eq!(got, vec![Greater, Less, Greater]);
        let even = [f(GIB, GIB / 2), f(2 * GIB, GIB)];
        assert_eq!(cmp_to_class(&even[0], &even), Equal);
        assert_eq!(cmp_to_class(&f(0, 0), &[f(0, 0)]), Less);
    }

    fn v(capacity: u64, alloc: u64) -> VdevFill {
        VdevFill { capacity, alloc }
    }

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_8),
            (1.0, 0.842_700_792_9),
            (2.0, 0.995_322_265),
            (-1.0, -0.842_700_792_9),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn balanced_and_empty_pools_score_zero() {
        assert_eq!(score(&[]), 0.0);
        assert_eq!(score(&[v(GIB, 0), v(2 * GIB, 0)]), 0.0);
        // Equal fractions on unequal sizes: balanced.
        assert!(score(&[v(GIB, GIB / 2), v(4 * GIB, 2 * GIB)]) < 1e-12);
    }

    #[test]
    fn the_issues_88_35_41_pool_scores_badly() {
        // 88 %, 35 %, 41 % on 1, 2 and 4 GiB (status's golden pool).
        let p = [
            v(GIB, 901 << 20),
            v(2 * GIB, 717 << 20),
            v(4 * GIB, 1679 << 20),
        ];
        let s = score(&p);
        let var0 = vars(&p)[0].unwrap();
        let want = (1.0 / 7.0) * erf((var0 - 1.0) / std::f64::consts::SQRT_2);
        assert!((s - want).abs() < 1e-12, "{s} vs {want}");
        assert!(s > 0.07 && s < 0.1, "{s}");
        // A new, empty vdev beside two 90 % full ones: VAR 1.5 on two
        // thirds of the pool, 2/3 × erf(0.5/√2) ≈ 0.255.
        let added = [v(GIB, GIB * 9 / 10), v(GIB, GIB * 9 / 10), v(GIB, 0)];
        assert!((score(&added) - 0.2553).abs() < 1e-3, "{}", score(&added));
    }

    proptest! {
        #[test]
        fn score_is_in_range_and_zero_only_when_balanced(
            fills in proptest::collection::vec((1u64..1 << 40, 0u32..=1000), 1..12)
        ) {
            let p: Vec<VdevFill> = fills
                .iter()
                .map(|&(c, permille)| v(c, c / 1000 * permille as u64))
                .collect();
            let s = score(&p);
            prop_assert!((0.0..1.0).contains(&s), "{s}");
            let vs = vars(&p);
            let spread = vs.iter().flatten().fold(0.0f64, |m, x| m.max((x - 1.0).abs()));
            if spread > 1e-6 {
                prop_assert!(s > 0.0);
            }
        }

        /// Moving bytes from the fullest vdev to the emptiest never raises
        /// the score while it does not overshoot: what a plan relies on.
        #[test]
        fn moving_from_fullest_to_emptiest_lowers_the_score(
            fills in proptest::collection::vec((1u64..1 << 30, 0u32..=1000), 2..8)
        ) {
            let mut p: Vec<VdevFill> = fills
                .iter()
                .map(|&(c, permille)| v(c << 12, (c << 12) / 1000 * permille as u64))
                .collect();
            let (hi, lo) = {
                let by = |a: &&VdevFill, b: &&VdevFill| a.used().total_cmp(&b.used());
                let hi = p.iter().enumerate().max_by(|a, b| by(&a.1, &b.1)).unwrap().0;
                let lo = p.iter().enumerate().min_by(|a, b| by(&a.1, &b.1)).unwrap().0;
                (hi, lo)
            };
            prop_assume!(hi != lo);
            // Move a little: at most a tenth of the gap, in bytes of the smaller vdev.
            let cu = class_used(&p);
            let room_hi = ((p[hi].used() - cu) * p[hi].capacity as f64) as u64;
            let room_lo = ((cu - p[lo].used()) * p[lo].capacity as f64) as u64;
            let step = room_hi.min(room_lo) / 10;
            prop_assume!(step > 0);
            let before = score(&p);
            p[hi].alloc -= step;
            p[lo].alloc += step;
            prop_assert!(score(&p) <= before + 1e-12, "{} -> {}", before, score(&p));
        }
    }
}
