//! `aliquot-sim rebalance`: what-if for the balancer. Given the vdevs'
//! capacity and allocated bytes (e.g. two full vdevs and a new empty one),
//! run the very planner the allocator runs (`metaslab::move_plan::plan`)
//! plan after plan, applying each plan's moves, until the balance score is
//! at or below a target or a plan moves nothing; report per plan and in
//! total the bytes moved, the score, and the time at a bytes/s budget.
//!
//! The data on each vdev is modelled as blocks of one size from offset 0:
//! the planner moves whole committed extents, so the block size sets how
//! finely a plan can meet its bound. Mover overheads (RPCs, flushes) are not
//! modelled: the time is bytes / rate, a lower bound for `balancer execute`.

use metaslab::balance_score::VdevFill;
use metaslab::move_plan::{PlanLimits, PlanVdev, plan};
use metaslab::{Extent, VdevId};

/// More candidate extents than this makes each plan slow (the planner
/// rescans candidates per move): ask for a larger block size instead.
pub const MAX_EXTENTS: u64 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WhatIfVdev {
    pub capacity: u64,
    pub alloc: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub bytes: u64,
    pub moves: usize,
    pub limit: u64,
    pub score_before: f64,
    pub score_after: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WhatIf {
    pub steps: Vec<Step>,
    pub score_start: f64,
    pub score_end: f64,
    pub bytes: u64,
    /// Seconds at the rate: bytes / rate.
    pub seconds: f64,
    /// The score reached the target (else the planner found no further move).
    pub converged: bool,
    pub alloc_after: Vec<u64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WhatIfError {
    #[error("vdev {0}: allocated exceeds capacity")]
    Overfull(usize),
    #[error("block size must be > 0")]
    BlockSize,
    #[error("{0} blocks to model: use a larger --block-size (at most {MAX_EXTENTS})")]
    TooMany(u64),
    #[error("rate must be > 0 bytes/s")]
    Rate,
    #[error("no vdev {0} to drain (vdevs count from 0)")]
    NoVdev(usize),
}

/// Plan, apply, repeat: at most `max_plans` plans. Vdevs whose index is in
/// `drain` are drained (`vdev drain`): their blocks all move off, and the
/// score is judged among the others, as the allocator's planner does.
pub fn simulate(
    vdevs: &[WhatIfVdev],
    drain: &[usize],
    block: u64,
    limits: PlanLimits,
    rate: f64,
    target_score: f64,
    max_plans: usize,
) -> Result<WhatIf, WhatIfError> {
    if block == 0 {
        return Err(WhatIfError::BlockSize);
    }
    if rate.is_nan() || rate <= 0.0 {
        return Err(WhatIfError::Rate);
    }
    for (i, v) in vdevs.iter().enumerate() {
        if v.alloc > v.capacity {
            return Err(WhatIfError::Overfull(i));
        }
    }
    if let Some(&d) = drain.iter().find(|&&d| d >= vdevs.len()) {
        return Err(WhatIfError::NoVdev(d));
    }
    let blocks: u64 = vdevs.iter().map(|v| v.alloc / block).sum();
    if blocks > MAX_EXTENTS {
        return Err(WhatIfError::TooMany(blocks));
    }
    // Allocated bytes are whole blocks; a remainder stays put (it is not a
    // candidate) but counts in the fill.
    let mut extents: Vec<Extent> = Vec::new();
    let mut next_off: Vec<u64> = Vec::new();
    for (i, v) in vdevs.iter().enumerate() {
        let n = v.alloc / block;
        for k in 0..n {
            extents.push(Extent {
                vdev: i as VdevId,
                offset: k * block,
                size: block,
            });
        }
        next_off.push(v.alloc);
    }
    let mut alloc: Vec<u64> = vdevs.iter().map(|v| v.alloc).collect();
    let fills = |alloc: &[u64]| -> Vec<PlanVdev> {
        vdevs
            .iter()
            .zip(alloc)
            .enumerate()
            .map(|(i, (v, &a))| PlanVdev {
                id: i as VdevId,
                fill: VdevFill {
                    capacity: v.capacity,
                    alloc: a,
                },
                target_ok: !drain.contains(&i),
                drain: drain.contains(&i),
            })
            .collect()
    };
    let staying = |alloc: &[u64]| -> f64 {
        let f: Vec<VdevFill> = fills(alloc)
            .iter()
            .filter(|p| !p.drain)
            .map(|p| p.fill)
            .collect();
        metaslab::balance_score::score(&f)
    };
    // Drained: less than one block left (a remainder is not a candidate).
    let drained = |alloc: &[u64]| drain.iter().all(|&d| alloc[d] < block);
    let score_start = staying(&alloc);
    let mut steps = Vec::new();
    let mut current = score_start;
    let mut converged = current <= target_score && drained(&alloc);
    while !converged && steps.len() < max_plans {
        let p = plan(&fills(&alloc), &extents, limits);
        if p.moves.is_empty() {
            break;
        }
        for m in &p.moves {
            let pos = extents
                .iter()
                .position(|e| *e == m.extent)
                .expect("planned extents are candidates");
            let from = m.extent.vdev as usize;
            let to = m.to as usize;
            alloc[from] -= m.extent.size;
            alloc[to] += m.extent.size;
            // The moved block lands on the receiver at a fresh offset and
            // may move again in a later plan.
            extents[pos] = Extent {
                vdev: m.to,
                offset: next_off[to],
                size: m.extent.size,
            };
            next_off[to] += m.extent.size;
        }
        current = staying(&alloc);
        steps.push(Step {
            bytes: p.bytes,
            moves: p.moves.len(),
            limit: p.limit,
            score_before: p.score_before,
            score_after: p.score_after,
        });
        converged = current <= target_score && drained(&alloc);
    }
    let bytes = steps.iter().map(|s| s.bytes).sum();
    Ok(WhatIf {
        steps,
        score_start,
        score_end: current,
        bytes,
        seconds: bytes as f64 / rate,
        converged,
        alloc_after: alloc,
    })
}

/// A score as printed: erf's rounding can leave a balanced pool a hair
/// below 0, which would print as "-0.0000".
fn shown(x: f64) -> f64 {
    x.max(0.0) + 0.0
}

/// The table `aliquot-sim rebalance` prints: one row per plan, then totals
/// and bytes moved per point (0.01) of score.
pub fn print(r: &WhatIf, rate: f64) {
    println!(
        "{:>5} {:>10} {:>7} {:>10} {:>8} {:>8} {:>10}",
        "PLAN", "MOVED", "MOVES", "LIMIT", "BEFORE", "AFTER", "T_CUM"
    );
    let mut cum = 0u64;
    for (i, s) in r.steps.iter().enumerate() {
        cum += s.bytes;
        println!(
            "{:>5} {:>10} {:>7} {:>10} {:>8.4} {:>8.4} {:>9.1}s",
            i + 1,
            units::format_bytes_short(s.bytes),
            s.moves,
            units::format_bytes_short(s.limit),
            shown(s.score_before),
            shown(s.score_after),
            cum as f64 / rate
        );
    }
    let points = (r.score_start - r.score_end) * 100.0;
    println!(
        "score {:.4} -> {:.4} ({}) in {} plans: {} moved, {:.1}s at {}",
        shown(r.score_start),
        shown(r.score_end),
        if r.converged {
            "target reached"
        } else {
            "stopped before the target"
        },
        r.steps.len(),
        units::format_bytes(r.bytes),
        r.seconds,
        units::format_rate(rate),
    );
    if points > 0.0 {
        println!(
            "{} moved per point (0.01) of score",
            units::format_bytes((r.bytes as f64 / points) as u64)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn two_full_one_empty() -> Vec<WhatIfVdev> {
        vec![
            WhatIfVdev {
                capacity: 10 * GIB,
                alloc: 8 * GIB,
            },
            WhatIfVdev {
                capacity: 10 * GIB,
                alloc: 8 * GIB,
            },
            WhatIfVdev {
                capacity: 10 * GIB,
                alloc: 0,
            },
        ]
    }

    #[test]
    fn converges_within_bounds_and_conserves_bytes() {
        let v = two_full_one_empty();
        let limits = PlanLimits::default();
        let r = simulate(&v, &[], 16 * MIB, limits, 100.0 * MIB as f64, 0.01, 100).unwrap();
        assert!(r.score_start > 0.2, "{}", r.score_start);
        assert!(r.converged && r.score_end <= 0.01, "{r:?}");
        // Several plans: one plan may move at most 5 % of allocated.
        assert!(r.steps.len() > 1);
        for s in &r.steps {
            assert!(s.bytes <= s.limit && s.limit <= 16 * GIB / 20, "{s:?}");
            assert!(s.score_after < s.score_before);
        }
        assert_eq!(r.alloc_after.iter().sum::<u64>(), 16 * GIB);
        assert_eq!(r.bytes, r.steps.iter().map(|s| s.bytes).sum::<u64>());
        assert!((r.seconds - r.bytes as f64 / (100.0 * MIB as f64)).abs() < 1e-9);
        // Balanced means about 16/3 GiB moved onto the new vdev, not more.
        assert!(r.bytes <= 16 * GIB / 3 + 16 * MIB, "{}", r.bytes);
        assert!(r.alloc_after[2] >= 5 * GIB, "{:?}", r.alloc_after);
    }

    #[test]
    fn balanced_pool_moves_nothing() {
        let v = vec![
            WhatIfVdev {
                capacity: GIB,
                alloc: GIB / 2,
            };
            3
        ];
        let r = simulate(&v, &[], MIB, PlanLimits::default(), 1.0, 0.0, 10).unwrap();
        assert_eq!(r.score_start, 0.0);
        assert!(r.steps.is_empty() && r.converged && r.bytes == 0);
    }

    #[test]
    fn byte_budget_bounds_every_plan() {
        let limits = PlanLimits {
            max_misplaced: 0.05,
            byte_budget: 64 * MIB,
        };
        let r = simulate(&two_full_one_empty(), &[], 16 * MIB, limits, 1.0, 0.0, 5).unwrap();
        assert_eq!(r.steps.len(), 5);
        assert!(r.steps.iter().all(|s| s.bytes <= 64 * MIB && s.bytes > 0));
        assert!(!r.converged);
    }

    #[test]
    fn drain_empties_the_vdev_in_bounded_plans() {
        let v = vec![
            WhatIfVdev {
                capacity: 10 * GIB,
                alloc: 4 * GIB,
            };
            3
        ];
        let r = simulate(&v, &[1], 16 * MIB, PlanLimits::default(), 1.0, 0.01, 100).unwrap();
        assert!(r.converged, "{r:?}");
        assert_eq!(r.alloc_after[1], 0);
        assert_eq!(r.alloc_after.iter().sum::<u64>(), 12 * GIB);
        assert!(r.steps.len() > 1 && r.steps.iter().all(|s| s.bytes <= s.limit));
        assert!(r.bytes >= 4 * GIB);
        assert_eq!(
            simulate(&v, &[3], MIB, PlanLimits::default(), 1.0, 0.0, 1),
            Err(WhatIfError::NoVdev(3))
        );
    }

    #[test]
    fn refuses_bad_input() {
        let over = [WhatIfVdev {
            capacity: 1,
            alloc: 2,
        }];
        let lim = PlanLimits::default();
        assert_eq!(
            simulate(&over, &[], 1, lim, 1.0, 0.0, 1),
            Err(WhatIfError::Overfull(0))
        );
        let v = two_full_one_empty();
        assert_eq!(
            simulate(&v, &[], 0, lim, 1.0, 0.0, 1),
            Err(WhatIfError::BlockSize)
        );
        assert_eq!(
            simulate(&v, &[], MIB, lim, 0.0, 0.0, 1),
            Err(WhatIfError::Rate)
        );
        assert!(matches!(
            simulate(&v, &[], 4096, lim, 1.0, 0.0, 1),
            Err(WhatIfError::TooMany(_))
        ));
    }
}
