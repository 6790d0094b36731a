//! The balancer's RPCs besides PlanRebalance: Relocate (an allocation for a
//! move, whose commit frees the old extent in the same txg), BalancerStatus
//! (plan progress, moves in flight and durable, drains, and the fate of
//! given relocations for a mover resuming after a crash) and RemoveVdev
//! (the end of a drain). The allocator plans and accounts; the client that
//! owns the references copies the data.

use std::sync::Arc;
use std::time::Duration;

use aliquot_proto::v1 as pb;
use metaslab::{AllocKind, AllocRequest, Allocation, ClassKind};

use crate::convert;
use crate::error::{Error, Result};
use crate::relocation::{Known, RelocateIntent};
use crate::state::Shared;
use crate::store::AdminState;

/// Validate a Relocate and place its new extent.
pub async fn relocate(
    shared: &Arc<Shared>,
    req: &pb::RelocateRequest,
) -> Result<(Allocation, Vec<String>, std::time::Instant, Duration)> {
    shared.check_serving()?;
    let from = req
        .extent
        .as_ref()
        .ok_or_else(|| Error::InvalidArgument("extent is required: the block copy to move".into()))
        .and_then(convert::extent_from_pb)?;
    let lease = shared.lease(req.lease_ms)?;
    // The crate's placement rule; it also refuses an unknown, removed or
    // log source vdev, before the store is asked about the extent.
    let avoid = shared
        .lock()
        .pool
        .relocation_avoid(from.vdev, &req.avoid_vdevs)?;
    crate::claim::check_relocatable(shared, &from).await?;
    // The block's logical size, not the old asize: sized again for the
    // new vdev, a block moved between RAIDZ and plain vdevs keeps its size.
    let psize = shared.lock().pool.relocation_psize(&from, req.psize)?;
    let intent = RelocateIntent {
        from,
        plan_id: req.plan_id,
        avoid,
    };
    let areq = AllocRequest {
        kind: AllocKind::Data,
        size: psize,
        copies: 1,
        max_size: None,
        affinity: None,
    };
    shared.relocate(areq, lease, intent).await
}

/// BalancerStatus: what the balancer is doing, and the requested relocations.
pub async fn status(
    shared: &Shared,
    req: &pb::BalancerStatusRequest,
) -> Result<pb::BalancerStatusReply> {
    let (durable_moves, durable_bytes) = shared
        .store
        .relocation_totals()
        .await
        .map_err(|e| Error::Store(e.to_string()))?;
    let mut reply = pb::BalancerStatusReply {
        durable_moves,
        durable_bytes,
        generation: shared.fencing.generation,
        ..Default::default()
    };
    let mut unknown = Vec::new();
    {
        let g = shared.lock();
        if let Some(p) = &g.relocations.plan {
            reply.plan_id = p.id;
            reply.plan_moves = p.moves;
            reply.plan_bytes = p.bytes;
            reply.plan_done_moves = p.done_moves;
            reply.plan_done_bytes = p.done_bytes;
            reply.plan_score_before = p.score_before;
            reply.plan_score_after = p.score_after;
        }
        let (n, bytes) = g.relocations.in_flight();
        reply.in_flight = n;
        reply.in_flight_bytes = bytes;
        let stats = g.pool.stats();
        if let Some(c) = stats.classes.iter().find(|c| c.kind == ClassKind::Normal) {
            reply.score = c.balance_score();
        }
        for v in stats.vdevs.iter().filter(|v| !v.online && v.alloc > 0) {
            reply.draining.push(pb::DrainingVdev {
                vdev: v.id,
                name: g
                    .vdevs
                    .get(&v.id)
                    .map(|i| i.name.clone())
                    .unwrap_or_default(),
                alloc: v.alloc,
            });
        }
        let synced = shared.synced_txg();
        for (i, &id) in req.allocation_ids.iter().enumerate() {
            let r = match g.relocations.known(id) {
                Some(Known::InFlight { from, to, plan_id }) => pb::Relocation {
                    allocation_id: id,
                    state: pb::RelocationState::RelocationInFlight as i32,
                    from: Some(convert::extent_to_pb(&from)),
                    to: Some(convert::extent_to_pb(&to)),
                    txg: 0,
                    plan_id,
                },
                Some(Known::Committed(rec)) => pb::Relocation {
                    allocation_id: id,
                    state: if rec.txg <= synced {
                        pb::RelocationState::RelocationDurable
                    } else {
                        pb::RelocationState::RelocationCommitted
                    } as i32,
                    from: Some(convert::extent_to_pb(&rec.from)),
                    to: Some(convert::extent_to_pb(&rec.to)),
                    txg: rec.txg,
                    plan_id: rec.plan_id,
                },
                None => {
                    unknown.push(i);
                    pb::Relocation {
                        allocation_id: id,
                        state: pb::RelocationState::RelocationNotCommitted as i32,
                        ..Default::default()
                    }
                }
            };
            reply.relocations.push(r);
        }
    }
    // Not in memory: durable if the store has it, else never committed
    // (aborted, expired, lost in a restart, or never made).
    for i in unknown {
        let id = reply.relocations[i].allocation_id;
        if let Some(rec) = shared
            .store
            .relocation(id)
            .await
            .map_err(|e| Error::Store(e.to_string()))?
        {
            reply.relocations[i] = pb::Relocation {
                allocation_id: id,
                state: pb::RelocationState::RelocationDurable as i32,
                from: Some(convert::extent_to_pb(&rec.from)),
                to: Some(convert::extent_to_pb(&rec.to)),
                txg: rec.txg,
                plan_id: rec.plan_id,
            };
        }
    }
    Ok(reply)
}

/// RemoveVdev: forget an empty offline vdev, durably.
pub async fn remove_vdev(shared: &Shared, vdev: u32) -> Result<pb::RemoveVdevReply> {
    shared.check_serving()?;
    let (name, txg) = {
        let mut g = shared.lock();
        g.pool.remove_vdev(vdev)?;
        let name = g.vdevs.remove(&vdev).map(|i| i.name).unwrap_or_default();
        g.pending_vdev_states.push((vdev, AdminState::Removed));
        g.event("vdev_removed", vdev, "RemoveVdev".into());
        g.wake_admitted();
        (name, g.pool.open_txg())
    };
    // Durable before the reply: after a crash it must stay removed.
    let synced = shared.wait_synced(txg).await?;
    tracing::info!(vdev, name = %name, txg, "vdev removed");
    Ok(pb::RemoveVdevReply {
        vdev,
        name,
        txg: synced,
        generation: shared.fencing.generation,
    })
}
