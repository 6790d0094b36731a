//! The balancer's allocator side over real gRPC: Relocate places a move's
//! new extent off its source (and the vdevs it is told to avoid), its
//! Commit frees the source in the same txg, a second move or a Free of a
//! moving extent is refused, BalancerStatus tells a resuming mover what
//! became of its relocations (across a restart too, on SQLite), and
//! RemoveVdev of a vdev holding blocks records its evacuation (one at a
//! time; refused for the last vdev and when the blocks do not fit), which
//! forgets the vdev durably once it is empty.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::{SqliteStore, sqlite_store};
use aliquot_proto::v1 as pb;
use common::*;
use pb::RelocationState as S;
use tonic::Code;

fn reason(s: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

fn reloc(e: pb::Extent, avoid: Vec<u32>) -> pb::RelocateRequest {
    pb::RelocateRequest {
        extent: Some(e),
        avoid_vdevs: avoid,
        ..Default::default()
    }
}

async fn written(h: &mut Harness, n: usize, size: u64) -> Vec<pb::Extent> {
    let mut out = Vec::new();
    for _ in 0..n {
        let a = h.allocate(size).await.unwrap();
        h.commit(vec![a.allocation_id]).await.unwrap();
        out.push(a.extents[0]);
    }
    h.sync().await;
    out
}

async fn status(h: &mut Harness, ids: Vec<u64>) -> pb::BalancerStatusReply {
    h.alloc
        .balancer_status(pb::BalancerStatusRequest {
            allocation_ids: ids,
        })
        .await
        .unwrap()
        .into_inner()
}

async fn plan(h: &mut Harness) -> pb::RebalancePlan {
    h.alloc
        .plan_rebalance(pb::PlanRebalanceRequest::default())
        .await
        .unwrap()
        .into_inner()
}

async fn balancer(h: &mut Harness) -> pb::BalancerStatusReply {
    status(h, vec![]).await
}

async fn state(h: &mut Harness, id: u64) -> pb::Relocation {
    status(h, vec![id]).await.relocations.remove(0)
}

async fn abort(h: &mut Harness, id: u64) {
    h.alloc
        .abort(pb::AbortRequest {
            allocation_ids: vec![id],
        })
        .await
        .unwrap();
}

async fn free(h: &mut Harness, e: pb::Extent) -> Result<u64, tonic::Status> {
    h.alloc
        .free(pb::FreeRequest { extents: vec![e] })
        .await
        .map(|r| r.into_inner().txg)
}

fn total_alloc(p: &pb::PoolStatus) -> u64 {
    p.vdevs.iter().map(|v| v.alloc).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_commit_swaps_the_extents_in_one_txg() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    let b = h.add_vdev(2, GIB).await;
    let blocks = written(&mut h, 16, MIB).await;
    let from = *blocks.iter().find(|e| e.vdev == a).expect("a block on a");
    let before = total_alloc(&h.pool().await);

    let r = h
        .alloc
        .relocate(reloc(from, vec![]))
        .await
        .expect("relocate")
        .into_inner();
    assert_eq!(r.extents.len(), 1);
    let to = r.extents[0];
    assert_eq!(to.vdev, b, "never on its source vdev");
    assert!(to.size >= from.size);
    assert_eq!(r.endpoints.len(), 1);
    let s = state(&mut h, r.allocation_id).await;
    assert_eq!(s.state, S::RelocationInFlight as i32, "{s:?}");
    let st = balancer(&mut h).await;
    assert_eq!((st.in_flight, st.in_flight_bytes), (1, MIB));

    let c = h.commit(vec![r.allocation_id]).await.unwrap();
    let s = state(&mut h, r.allocation_id).await;
    assert_eq!(s.state, S::RelocationCommitted as i32, "{s:?}");
    assert_eq!(s.txg, c.txg);
    assert_eq!((s.from, s.to), (Some(from), Some(to)));
    // The source's free is deferred like any free (counted as allocated
    // until TXG_DEFER_SIZE more txgs synced); then the pool holds exactly
    // as much as before: moved, not copied.
    assert_eq!(total_alloc(&h.pool().await), before + to.size);
    h.sync().await;
    let s = state(&mut h, r.allocation_id).await;
    assert_eq!(s.state, S::RelocationDurable as i32, "{s:?}");
    h.sync().await;
    h.sync().await;
    assert_eq!(total_alloc(&h.pool().await), before - from.size + to.size);
    let st = balancer(&mut h).await;
    assert_eq!((st.durable_moves, st.durable_bytes), (1, MIB));
    assert_eq!(st.in_flight, 0);
    // The source is free now, the new extent is a committed extent.
    let e = free(&mut h, from).await.unwrap_err();
    assert_eq!(reason(&e), "NOT_ALLOCATED", "{e:?}");
    free(&mut h, to)
        .await
        .expect("the new extent frees exactly");
}

/// A move sizes the new copy for the block's logical size
/// on its own vdev, not from the old extent's asize (which on RAIDZ holds
/// parity and padding). A 128K block moved RAIDZ1(5) → plain → RAIDZ1(3)
/// → RAIDZ1(5), three laps: 160K, 128K, 192K, 160K every time (it grew
/// 160K → 200K → 256K → 320K before). Given as the manifest's length or
/// left to the allocator (0), the same; a psize the extent cannot hold is
/// INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_moved_between_raidz_and_plain_vdevs_keeps_its_size() {
    let mut h = start(config()).await;
    let raidz = |guid, children| pb::RegisterRequest {
        children,
        parity: 1,
        ..common::register_req(guid, GIB)
    };
    let r5 = h
        .registry
        .register(raidz(1, 5))
        .await
        .unwrap()
        .into_inner()
        .vdev;
    let plain = h.add_vdev(2, GIB).await;
    let r3 = h
        .registry
        .register(raidz(3, 3))
        .await
        .unwrap()
        .into_inner()
        .vdev;
    let asize = |v: u32| match v {
        v if v == r5 => 160 << 10,
        v if v == r3 => 192 << 10,
        _ => 128 << 10,
    };
    let mut on_r5 = None;
    for _ in 0..2000 {
        let a = h.allocate(128 << 10).await.unwrap();
        h.commit(vec![a.allocation_id]).await.unwrap();
        if a.extents[0].vdev == r5 {
            on_r5 = Some(a.extents[0]);
            break;
        }
    }
    h.sync().await;
    let mut at = on_r5.expect("a block on the RAIDZ1(5)");
    assert_eq!(at.size, asize(r5));
    let others = |v: u32| -> Vec<u32> { [r5, plain, r3].into_iter().filter(|&o| o != v).collect() };
    for lap in 0..3 {
        for (i, to) in [plain, r3, r5].into_iter().enumerate() {
            // Everything but the target is avoided (the source always is).
            let avoid: Vec<u32> = others(to).into_iter().filter(|&o| o != at.vdev).collect();
            let req = pb::RelocateRequest {
                psize: if (lap + i) % 2 == 0 { 128 << 10 } else { 0 },
                ..reloc(at, avoid)
            };
            let r = h.alloc.relocate(req).await.expect("relocate").into_inner();
            let new = r.extents[0];
            assert_eq!(new.vdev, to, "lap {lap}: {at:?} -> {new:?}");
            assert_eq!(
                new.size,
                asize(to),
                "lap {lap}: moved to vdev {to} as {new:?}"
            );
            h.commit(vec![r.allocation_id]).await.unwrap();
            h.sync().await;
            at = new;
        }
    }
    // A block larger than its extent holds is refused, naming both.
    let e = h
        .alloc
        .relocate(pb::RelocateRequest {
            psize: (128 << 10) + 1,
            ..reloc(at, vec![])
        })
        .await
        .expect_err("psize beyond the extent");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("holds at most 131072"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_extent_cannot_be_moved_again_or_freed() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    h.add_vdev(3, GIB).await;
    let blocks = written(&mut h, 8, MIB).await;
    let from = blocks[0];
    let r = h
        .alloc
        .relocate(reloc(from, vec![]))
        .await
        .unwrap()
        .into_inner();
    let e = h.alloc.relocate(reloc(from, vec![])).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), "RELOCATION_CONFLICT", "{e:?}");
    let e = free(&mut h, from).await.unwrap_err();
    assert_eq!(reason(&e), "RELOCATION_CONFLICT", "{e:?}");
    // Not a committed extent: half of one, or free space.
    let half = pb::Extent {
        size: from.size / 2,
        ..from
    };
    let e = h.alloc.relocate(reloc(half, vec![])).await.unwrap_err();
    assert_eq!(reason(&e), "NOT_ALLOCATED", "{e:?}");
    let nowhere = pb::Extent {
        offset: 900 * MIB,
        ..from
    };
    let e = h.alloc.relocate(reloc(nowhere, vec![])).await.unwrap_err();
    assert_eq!(reason(&e), "NOT_ALLOCATED", "{e:?}");
    let e = h
        .alloc
        .relocate(pb::RelocateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // Aborted: the block stays where it was, and can be moved again.
    abort(&mut h, r.allocation_id).await;
    let s = state(&mut h, r.allocation_id).await;
    assert_eq!(s.state, S::RelocationNotCommitted as i32, "{s:?}");
    let again = h
        .alloc
        .relocate(reloc(from, vec![]))
        .await
        .unwrap()
        .into_inner();
    abort(&mut h, again.allocation_id).await;
    free(&mut h, from).await.expect("still a committed extent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relocation_avoids_the_blocks_other_copies_and_offline_vdevs() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    let b = h.add_vdev(2, GIB).await;
    let c = h.add_vdev(3, GIB).await;
    let blocks = written(&mut h, 24, MIB).await;
    for from in blocks.iter().filter(|e| e.vdev == a).take(4) {
        let r = h
            .alloc
            .relocate(reloc(*from, vec![b]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.extents[0].vdev, c, "only c is neither source nor avoided");
        h.commit(vec![r.allocation_id]).await.unwrap();
    }
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: c,
            online: false,
            drain: false,
        })
        .await
        .unwrap();
    let from = *blocks.iter().find(|e| e.vdev == a).unwrap();
    let from = if blocks.iter().filter(|e| e.vdev == a).count() > 4 {
        *blocks.iter().filter(|e| e.vdev == a).nth(4).unwrap()
    } else {
        from
    };
    let e = h.alloc.relocate(reloc(from, vec![b])).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(reason(&e), "VDEVS_OFFLINE", "{e:?}");
}

/// A plan never puts two copies of a block on one vdev: the store gives
/// the copy sets of the plan's candidates (and only theirs), and the plan
/// keeps each block's copies apart. Blocks of two copies on two vdevs, a
/// third vdev added: moves come from both, never both copies of a block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_keeps_the_copies_of_a_block_apart() {
    use std::collections::HashMap;
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    let b = h.add_vdev(2, GIB).await;
    // Each copy's (vdev, offset) -> its block's copies.
    let mut block_of: HashMap<(u32, u64), usize> = HashMap::new();
    let mut blocks: Vec<Vec<(u32, u64)>> = Vec::new();
    for _ in 0..48 {
        let r = h
            .alloc
            .allocate(pb::AllocateRequest {
                copies: 2,
                ..data(MIB)
            })
            .await
            .unwrap()
            .into_inner();
        h.commit(vec![r.allocation_id]).await.unwrap();
        let homes: Vec<(u32, u64)> = r.extents.iter().map(|e| (e.vdev, e.offset)).collect();
        assert!(homes.len() == 2 && homes[0].0 != homes[1].0, "{homes:?}");
        for &k in &homes {
            block_of.insert(k, blocks.len());
        }
        blocks.push(homes);
    }
    h.sync().await;
    let c = h.add_vdev(3, GIB).await;
    let p = h
        .alloc
        .plan_rebalance(pb::PlanRebalanceRequest::default())
        .await
        .unwrap()
        .into_inner();
    let from: Vec<u32> = p.moves.iter().map(|m| m.extent.unwrap().vdev).collect();
    assert!(from.contains(&a) && from.contains(&b), "{p:?}");
    for m in &p.moves {
        let e = m.extent.unwrap();
        let b = block_of[&(e.vdev, e.offset)];
        let copy = blocks[b].iter_mut().find(|k| **k == (e.vdev, e.offset));
        copy.unwrap().0 = m.to_vdev;
        assert_eq!(m.to_vdev, c);
    }
    for homes in &blocks {
        assert_ne!(homes[0].0, homes[1].0, "two copies on one vdev: {p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_progress_counts_the_plans_relocations() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    written(&mut h, 128, MIB).await;
    h.add_vdev(3, GIB).await;
    let p = h
        .alloc
        .plan_rebalance(pb::PlanRebalanceRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_ne!(p.plan_id, 0);
    // Three equal vdevs, the new one empty and the others each over their
    // third: the least that must move is the new vdev's third of it all.
    let all = total_alloc(&h.pool().await);
    assert!(
        p.lower_bound_bytes.abs_diff(all / 3) <= 1,
        "lower bound {} of {all} allocated: {p:?}",
        p.lower_bound_bytes
    );
    assert!(p.moves.len() >= 2, "{p:?}");
    for m in p.moves.iter().take(2) {
        let r = h
            .alloc
            .relocate(pb::RelocateRequest {
                extent: m.extent,
                plan_id: p.plan_id,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        h.commit(vec![r.allocation_id]).await.unwrap();
    }
    let st = balancer(&mut h).await;
    assert_eq!(st.plan_id, p.plan_id);
    assert_eq!(st.plan_moves, p.moves.len() as u64);
    assert_eq!(st.plan_bytes, p.bytes);
    assert_eq!(st.plan_done_moves, 2);
    assert_eq!(st.plan_done_bytes, 2 * MIB);
    assert!(
        st.score > 0.0 && st.score <= p.score_before + 1e-9,
        "{st:?}"
    );
}

async fn open(dir: &Path) -> Arc<SqliteStore> {
    Arc::new(
        SqliteStore::open(&dir.join(sqlite_store::DB_FILE), "aliquot", None)
            .await
            .expect("open store"),
    )
}

fn restart_config() -> aliquot_allocator::Config {
    let mut c = config();
    c.claim_window = Duration::ZERO;
    c
}

/// Drain then remove, on SQLite across restarts: offline persists; RemoveVdev
/// of a vdev holding data records its evacuation (durably: another removal
/// is refused across the restart), and once the blocks are moved (here by
/// hand, the allocator's mover paused by `move_rate` 0) and their frees
/// synced, the vdev is forgotten and stays removed; its device cannot
/// rejoin unnoticed, and a relocation's fate is still known after the
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_remove_survive_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let paused = || {
        let mut c = restart_config();
        c.tunables.push("move_rate=0".into());
        c
    };
    let mut h = start_with(paused(), open(dir.path()).await).await;
    let a = h.add_vdev(1, GIB).await;
    let b = h.add_vdev(2, GIB).await;
    let blocks = written(&mut h, 16, MIB).await;
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: false,
        })
        .await
        .unwrap();
    let on_a: u64 = blocks.iter().filter(|e| e.vdev == a).map(|e| e.size).sum();
    let r = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: a })
        .await
        .unwrap()
        .into_inner();
    assert!(r.evacuating, "{r:?}");
    assert_eq!(r.bytes, on_a, "{r:?}");
    let e = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: b })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "EVACUATION_RUNNING", "{e:?}");
    // Restart: still offline.
    h.server.shutdown().await.unwrap();
    let mut h = start_with(paused(), open(dir.path()).await).await;
    assert_eq!(h.rejoin(1, GIB).await, a);
    assert_eq!(h.rejoin(2, GIB).await, b);
    let p = h.pool().await;
    assert!(!p.vdevs.iter().find(|v| v.vdev == a).unwrap().online);
    let e = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: b })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "EVACUATION_RUNNING", "after a restart: {e:?}");
    let ev = h.pool().await.evacuation.expect("the evacuation, restored");
    assert_eq!(
        (ev.vdev, ev.total_bytes, ev.move_rate),
        (a, on_a, 0),
        "{ev:?}"
    );
    // Move everything off a.
    let mut ids = Vec::new();
    for from in blocks.iter().filter(|e| e.vdev == a) {
        let r = h
            .alloc
            .relocate(reloc(*from, vec![]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.extents[0].vdev, b);
        h.commit(vec![r.allocation_id]).await.unwrap();
        ids.push(r.allocation_id);
    }
    assert!(!ids.is_empty());
    // Frees defer: the vdev is forgotten once they synced twice more.
    let mut tries = 0;
    while h.pool().await.vdevs.iter().any(|v| v.vdev == a) {
        h.sync().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        tries += 1;
        assert!(
            tries < 40,
            "never forgotten: {:?}",
            h.pool().await.evacuation
        );
    }
    assert_eq!(h.pool().await.evacuation, None);
    assert!(h.pool().await.vdevs.iter().all(|v| v.vdev != a));
    h.server.shutdown().await.unwrap();

    let mut h = start_with(paused(), open(dir.path()).await).await;
    let p = h.pool().await;
    assert_eq!(p.vdevs.iter().map(|v| v.vdev).collect::<Vec<_>>(), vec![b]);
    for id in ids {
        let s = state(&mut h, id).await;
        assert_eq!(s.state, S::RelocationDurable as i32, "{s:?}");
    }
    let e = h.registry.register(register_req(1, GIB)).await.unwrap_err();
    assert_eq!(reason(&e), "VDEV_CONFLICT", "{e:?}");
    // A new device takes a new id.
    assert_eq!(h.add_vdev(9, GIB).await, 2);
    let e = h
        .alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: true,
            drain: false,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "VDEV_REMOVED", "{e:?}");
    h.server.shutdown().await.unwrap();
}

/// RemoveVdev refusals, before anything moves: the last vdev (its blocks
/// would have nowhere to go), and a vdev whose blocks do not fit on the
/// others (saying how much is missing). The vdev stays online, no
/// evacuation is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_that_cannot_finish_is_refused_before_anything_moves() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    let blocks = written(&mut h, 24, 16 * MIB).await;
    let e = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: a })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "LAST_VDEV", "{e:?}");
    assert!(e.message().contains("nowhere to go"), "{e:?}");
    // A small second vdev cannot take a's 384 MiB.
    let b = h.add_vdev(2, 128 * MIB).await;
    let e = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: a })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "NO_ROOM_TO_DRAIN", "{e:?}");
    assert!(e.message().contains("missing"), "{e:?}");
    let info = tonic_types::StatusExt::get_details_error_info(&e).expect("error info");
    let meta = |k: &str| info.metadata[k].parse::<u64>().unwrap();
    assert_eq!(meta("need"), blocks.len() as u64 * 16 * MIB);
    assert_eq!(meta("missing"), meta("need") - meta("available"));
    let p = h.pool().await;
    assert!(p.vdevs.iter().all(|v| v.online), "{p:?}");
    assert_eq!(p.evacuation, None);
    // b, nearly empty, fits on a: its removal starts.
    let r = h
        .alloc
        .remove_vdev(pb::RemoveVdevRequest { vdev: b })
        .await
        .unwrap()
        .into_inner();
    assert!(r.evacuating || r.bytes == 0, "{r:?}");
    h.server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_never_names_a_moved_blocks_old_address() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    written(&mut h, 64, MIB).await;
    h.add_vdev(3, GIB).await;
    let p = plan(&mut h).await;
    assert!(p.moves.len() >= 2, "{p:?}");
    // Moved keeping their addresses: the old extents stay allocated behind
    // their entries, and cannot move again until remapped.
    let mut moved = Vec::new();
    for m in p.moves.iter().take(2) {
        let r = h
            .alloc
            .relocate(pb::RelocateRequest {
                extent: m.extent,
                keep_address: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        h.commit(vec![r.allocation_id]).await.unwrap();
        moved.push(m.extent.unwrap());
    }
    h.sync().await;
    let again = plan(&mut h).await;
    assert!(!again.moves.is_empty(), "{again:?}");
    for m in &again.moves {
        assert!(
            !moved.contains(&m.extent.unwrap()),
            "the plan names a moved block's old address: {again:?}"
        );
    }
}
