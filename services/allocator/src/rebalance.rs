//! PlanRebalance: the allocator's side of the balancer. It knows the fill
//! of every vdev and (in its store) every durable extent, so it plans; the
//! client, which owns the references to the data, moves it. The plan itself
//! is `metaslab::move_plan::plan` (pure); here: refuse while the pool is not
//! whole, gather candidates, convert.

use metaslab::balance_score::VdevFill;
use metaslab::move_plan::{PlanLimits, PlanVdev, plan_with_copies};
use metaslab::{ClassKind, Extent, Health};

use crate::error::{Error, Result};
use crate::state::{Shared, VdevInfo};
use aliquot_proto::v1 as pb;

/// Candidates read per over-full vdev (largest first): enough for any plan
/// bounded at 5 % of the class, without reading millions of rows.
const CANDIDATES_PER_VDEV: u32 = 20_000;

/// Why a vdev keeps the pool from counting as whole, in words an operator
/// can act on: offline, the registry's verdict, or the health its agent
/// reported.
fn why_not_whole(info: Option<&VdevInfo>, online: bool, health: Health) -> String {
    let Some(i) = info else {
        return "no agent has registered it".into();
    };
    if !online {
        return "offline".into();
    }
    i.unavailable_reason().unwrap_or_else(|| {
        format!(
            "its agent reports it {}",
            format!("{health:?}").to_lowercase()
        )
    })
}

pub async fn plan_rebalance(
    shared: &Shared,
    req: &pb::PlanRebalanceRequest,
) -> Result<pb::RebalancePlan> {
    let max_misplaced = if req.max_misplaced == 0.0 {
        0.05
    } else {
        req.max_misplaced
    };
    if !(max_misplaced > 0.0 && max_misplaced <= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "max_misplaced {} is out of range: 0 < x <= 1 (0 = 0.05)",
            req.max_misplaced
        )));
    }
    let (vdevs, frees) = {
        let g = shared.lock();
        let stats = g.pool.stats();
        let mut not_ok = Vec::new();
        let mut vdevs = Vec::new();
        for &d in &req.drain {
            match stats.vdevs.iter().find(|v| v.id == d) {
                None => return Err(Error::Pool(metaslab::Error::UnknownVdev(d))),
                Some(v) if v.online => {
                    return Err(Error::InvalidArgument(format!(
                        "vdev {d} is still allocatable: a drained vdev is offline first \
                         (`aliquotctl vdev drain` does both)"
                    )));
                }
                Some(_) => {}
            }
        }
        for v in &stats.vdevs {
            if req.drain.contains(&v.id) {
                continue;
            }
            if !v.online || v.health != Health::Healthy {
                let info = g.vdevs.get(&v.id);
                let name = info.map(|i| i.name.as_str()).unwrap_or_default();
                let why = why_not_whole(info, v.online, v.health);
                not_ok.push(format!("{name} ({}): {why}", v.id));
            }
        }
        if !not_ok.is_empty() {
            return Err(Error::PoolDegraded(not_ok));
        }
        if let Some(c) = stats.classes.iter().find(|c| c.kind == ClassKind::Normal) {
            for gr in &c.groups {
                let drain = req.drain.contains(&gr.vdev);
                vdevs.push(PlanVdev {
                    id: gr.vdev,
                    fill: VdevFill {
                        capacity: gr.capacity,
                        alloc: gr.alloc,
                    },
                    target_ok: gr.allocatable && !drain,
                    drain,
                });
            }
        }
        // Freed but not yet persisted: still in the store, not to be moved.
        let frees: Vec<Extent> = g.recent_frees.keys().copied().collect();
        (vdevs, frees)
    };
    let fills: Vec<VdevFill> = vdevs.iter().map(|v| v.fill).collect();
    let mut candidates = Vec::new();
    // The blocks of several copies among them: a move never joins another
    // copy of its block (the copies as the store links them, each followed
    // through moves not yet persisted).
    let mut copies = Vec::new();
    for v in &vdevs {
        let over = metaslab::balance_score::cmp_to_class(&v.fill, &fills).is_gt();
        if over || v.drain {
            let store_err = |e: crate::store::StoreError| Error::Store(e.to_string());
            let mine = shared
                .store
                .largest_extents(v.id, CANDIDATES_PER_VDEV)
                .await
                .map_err(store_err)?;
            // Only the candidates' blocks: the plan moves nothing else.
            let starts: Vec<u64> = mine.iter().map(|e| e.offset).collect();
            let sets = shared.store.copies_on(v.id, &starts).await;
            copies.extend(sets.map_err(store_err)?);
            candidates.extend(mine);
        }
    }
    candidates.retain(|e| !frees.contains(e));
    {
        let g = shared.lock();
        // A moved block's old address (its mapping entry holds it) is no
        // block to move: Relocate refuses it until it is remapped.
        candidates.retain(|e| g.indirect.get(e).is_none());
        for set in &mut copies {
            // A copy on its way elsewhere: where it goes counts too (as a
            // copy no candidate is: offset u64::MAX).
            let elsewhere: Vec<(u32, u64)> = set
                .iter()
                .flat_map(|&c| g.relocations.homes(c).into_iter().skip(1))
                .map(|v| (v, u64::MAX))
                .collect();
            set.extend(elsewhere);
        }
    }
    let p = plan_with_copies(
        &vdevs,
        &candidates,
        &copies,
        PlanLimits {
            max_misplaced,
            byte_budget: req.byte_budget,
        },
    );
    let predicted_ms = if req.bytes_per_sec > 0 {
        (p.bytes as u128 * 1000 / u128::from(req.bytes_per_sec)) as u64
    } else {
        0
    };
    Ok(pb::RebalancePlan {
        moves: p
            .moves
            .iter()
            .map(|m| pb::PlannedMove {
                extent: Some(crate::convert::extent_to_pb(&m.extent)),
                to_vdev: m.to,
            })
            .collect(),
        bytes: p.bytes,
        limit_bytes: p.limit,
        score_before: p.score_before,
        score_after: p.score_after,
        predicted_ms,
        generation: shared.fencing.generation,
        // Given by the caller once the plan is recorded.
        plan_id: 0,
        lower_bound_bytes: p.lower_bound,
    })
}
