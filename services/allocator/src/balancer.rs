//! The balancer's RPCs besides PlanRebalance: Relocate (an allocation for a
//! move, whose commit frees the old extent in the same txg), BalancerStatus
//! (plan progress, moves in flight and durable, drains, and the fate of
//! given relocations for a mover resuming after a crash) and RemoveVdev
//! (the end of a drain, or the start of an evacuation by the allocator's
//! own mover, `crate::mover`). For Relocate the allocator plans and
//! accounts and the client that owns the references copies the data.

use std::sync::Arc;
use std::time::Duration;

use aliquot_proto::v1 as pb;
use metaslab::{AllocKind, AllocRequest, Allocation, ClassKind, Extent};

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
    relocate_as(shared, req, false).await
}

/// [`relocate`]; `removal`: the move must happen (a vdev removal's), so
/// the block's other copies' vdevs are avoided only while another vdev has
/// room (`Pool::removal_avoid`).
pub async fn relocate_as(
    shared: &Arc<Shared>,
    req: &pb::RelocateRequest,
    removal: bool,
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
    shared
        .lock()
        .pool
        .relocation_avoid(from.vdev, &req.avoid_vdevs)?;
    crate::claim::check_relocatable(shared, &from).await?;
    // A moved block's old address moves only after a Remap; its new home
    // moves only keeping its address (the entry then points at the newest
    // home: one hop of mapping, and no entry pointing at freed space).
    shared.lock().check_movable(&from, req.keep_address)?;
    // The block's other copies, wherever they are now: the new copy keeps
    // off their vdevs (the caller's avoid_vdevs are added to them).
    let mut others = copy_vdevs(shared, &from).await?;
    others.extend(req.avoid_vdevs.iter().copied());
    others.retain(|&v| v != from.vdev);
    others.sort_unstable();
    others.dedup();
    let avoid = {
        let g = shared.lock();
        if removal {
            let (avoid, apart) = g.pool.removal_avoid(from.vdev, &others, from.size)?;
            if !apart && !others.is_empty() {
                tracing::warn!(
                    extent = %from,
                    copies_on = ?others,
                    "no other vdev has room: this copy may share a vdev with another copy of its block"
                );
            }
            avoid
        } else {
            g.pool.relocation_avoid(from.vdev, &others)?
        }
    };
    // The block's logical size, not the old asize: sized again for the
    // new vdev, a block moved between RAIDZ and plain vdevs keeps its size.
    let psize = shared.lock().pool.relocation_psize(&from, req.psize)?;
    let intent = RelocateIntent {
        from,
        plan_id: req.plan_id,
        avoid,
        keep_address: req.keep_address,
    };
    if req.keep_address && req.psize != 0 {
        return Err(Error::InvalidArgument(
            "keep_address: the new extent is the old one's size (psize must be 0)".into(),
        ));
    }
    let keep = intent.keep_address;
    let areq = AllocRequest {
        kind: AllocKind::Data,
        size: psize,
        copies: 1,
        max_size: None,
        affinity: req.affinity_key,
    };
    let placed = shared.relocate(areq, lease, intent).await?;
    if keep && placed.0.extents[0].size != from.size {
        // Another ashift or layout sized it otherwise: an entry maps one
        // size to the same size, so this move cannot keep its address.
        let to = placed.0.extents[0];
        let _ = shared.lock().abort(&[placed.0.id]);
        return Err(Error::InvalidArgument(format!(
            "keep_address: the new extent {to} would not be {from}'s size on that vdev"
        )));
    }
    Ok(placed)
}

/// The vdevs of the other copies of the block whose copy is `from`: the
/// store's links, each copy followed through its moves not yet persisted
/// (and one in flight, both ends avoided).
pub async fn copy_vdevs(shared: &Shared, from: &Extent) -> Result<Vec<metaslab::VdevId>> {
    let at = (from.vdev, from.offset);
    let pending = shared.lock().pending_copies.copies_of(at);
    let copies = match pending {
        Some(c) => c,
        None => shared
            .store
            .copies_of(at)
            .await
            .map_err(|e| Error::Store(e.to_string()))?,
    };
    let g = shared.lock();
    let mut out = Vec::with_capacity(copies.len());
    for c in copies {
        out.extend(g.relocations.homes(c));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
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

/// RemoveVdev: an empty offline vdev is forgotten at once; any other
/// vdev is evacuated by the mover first (`crate::mover::start`).
pub async fn remove_vdev(shared: &Shared, vdev: u32) -> Result<pb::RemoveVdevReply> {
    shared.check_serving()?;
    let empty_offline = {
        let g = shared.lock();
        if g.pool.is_removed(vdev) {
            return Err(metaslab::Error::VdevRemoved(vdev).into());
        }
        let stats = g.pool.stats();
        let v = stats
            .vdevs
            .iter()
            .find(|v| v.id == vdev)
            .ok_or(metaslab::Error::UnknownVdev(vdev))?;
        v.alloc == 0 && !v.online
    };
    if empty_offline && shared.mover.evacuating().is_none() {
        return forget_vdev(shared, vdev).await;
    }
    crate::mover::start(shared, vdev).await
}

/// Forget an empty offline vdev, durably.
pub async fn forget_vdev(shared: &Shared, vdev: u32) -> Result<pb::RemoveVdevReply> {
    shared.check_serving()?;
    let (name, txg) = {
        let mut g = shared.lock();
        g.pool.remove_vdev(vdev)?;
        shared.mover.forgotten(vdev);
        let name = g.vdevs.remove(&vdev).map(|i| i.name).unwrap_or_default();
        g.pending_vdev_states.push((vdev, AdminState::Removed));
        g.event("vdev_removed", vdev, "RemoveVdev".into());
        g.wake_admitted();
        (name, g.pool.open_txg())
    };
    // A claim waiting for its report waits no more.
    shared.vdev_acked.notify_waiters();
    // Durable before the reply: after a crash it must stay removed.
    let synced = shared.wait_synced(txg).await?;
    tracing::info!(vdev, name = %name, txg, "vdev removed");
    Ok(pb::RemoveVdevReply {
        vdev,
        name,
        txg: synced,
        generation: shared.fencing.generation,
        ..Default::default()
    })
}
