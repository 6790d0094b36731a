//! Places where the policy used to decide differently from
//! OpenZFS, each checked against what OpenZFS does (`metaslab.c@zfs-2.4.0`:
//! `metaslab_group_alloc`, `find_valid_metaslab`, `metaslab_group_allocatable`,
//! `metaslab_alloc_dva`).

use metaslab::testing::{disk, place, place_busy, req};
use metaslab::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn raidz1(capacity: u64) -> VdevSpec {
    VdevSpec {
        children: 5,
        parity: 1,
        ..disk(capacity)
    }
}

fn metaslab_of(pool: &Pool, e: &Extent) -> u64 {
    e.offset >> pool.stats().vdevs[e.vdev as usize].metaslab_shift
}

/// Ditto copies on a one-vdev pool land on distinct metaslabs of
/// vdev 0 (SECONDARY activation for the second, CLAIM for the third).
#[test]
fn copies_share_a_vdev_but_never_a_metaslab() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    for copies in [2u8, 3] {
        for _ in 0..50 {
            let a = place(&mut pool, req(AllocKind::Data, 128 << 10, copies)).unwrap();
            assert_eq!(a.extents.len(), copies as usize);
            assert!(a.extents.iter().all(|e| e.vdev == 0));
            let mut ms: Vec<u64> = a.extents.iter().map(|e| metaslab_of(&pool, e)).collect();
            ms.sort();
            ms.dedup();
            assert_eq!(ms.len(), copies as usize, "{:?}", a.extents);
            pool.commit(a.id).unwrap();
        }
    }
    pool.verify().unwrap();
}

/// A ditto copy needs a metaslab of its own only while an
/// inactive one can take it. On a one-vdev pool whose only free space is in
/// the metaslab the first copy went to (the allocator's active primary),
/// OpenZFS places the second copy there too: `find_valid_metaslab` skips
/// `metaslab_is_unique` for an already-active candidate
/// (`metaslab.c:find_valid_metaslab@zfs-2.4.0`, "desperate enough to steal
/// another allocator's metaslab, so we still don't care about
/// distances"). The crate used to refuse it as FRAGMENTED with 200 MiB free
/// in one piece.
#[test]
fn a_ditto_copy_shares_the_active_metaslab_when_nothing_else_fits() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    let shift = pool.stats().vdevs[0].metaslab_shift;
    let count = (4 * GIB) >> shift;
    assert!(count >= 4, "{count} metaslabs");
    // Fill metaslab after metaslab with 1 MiB blocks, leaving 200 MiB free,
    // all of it in the last one (more than the 128 MiB slop + 2 MiB).
    let mut last = None;
    for _ in 0..(4096 - 200) {
        let a = place(&mut pool, req(AllocKind::Data, MIB, 1)).unwrap();
        last = Some(metaslab_of(&pool, &a.extents[0]));
        pool.commit(a.id).unwrap();
    }
    pool.sync();
    assert_eq!(last, Some(count - 1), "the metaslabs filled in turn");
    let a = place(&mut pool, req(AllocKind::Data, MIB, 2))
        .expect("OpenZFS places both copies in the active metaslab");
    assert_eq!((a.extents[0].vdev, a.extents[1].vdev), (0, 0));
    assert_eq!(
        metaslab_of(&pool, &a.extents[0]),
        metaslab_of(&pool, &a.extents[1]),
        "{:?}",
        a.extents
    );
    assert_eq!(Some(metaslab_of(&pool, &a.extents[0])), last);
    pool.commit(a.id).unwrap();
    pool.verify().unwrap();
}

/// With two vdevs, the second copy still goes to the other vdev
/// while it can; with that vdev offline it shares vdev 0.
#[test]
fn copies_prefer_the_next_vdev_and_share_when_alone() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    for _ in 0..100 {
        let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 2)).unwrap();
        assert_ne!(a.extents[0].vdev, a.extents[1].vdev);
        pool.commit(a.id).unwrap();
    }
    pool.set_online(1, false).unwrap();
    let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 2)).unwrap();
    assert_eq!((a.extents[0].vdev, a.extents[1].vdev), (0, 0));
    assert_ne!(
        metaslab_of(&pool, &a.extents[0]),
        metaslab_of(&pool, &a.extents[1])
    );
}

/// A degraded RAIDZ still takes first copies (OpenZFS skips only a
/// degraded leaf); a degraded leaf takes none while another vdev can.
#[test]
fn degraded_redundant_vdev_keeps_its_share() {
    for (make, expect_even) in [(raidz1 as fn(u64) -> VdevSpec, true), (disk, false)] {
        let mut pool = Pool::new(Tunables::default());
        pool.add_vdev(make(16 * GIB)).unwrap();
        pool.add_vdev(make(16 * GIB)).unwrap();
        pool.sync();
        pool.set_health(1, Health::Degraded).unwrap();
        let mut on = [0u64; 2];
        for _ in 0..2000 {
            let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 1)).unwrap();
            on[a.extents[0].vdev as usize] += 1;
            pool.commit(a.id).unwrap();
        }
        if expect_even {
            let share = on[1] as f64 / 2000.0;
            assert!((0.45..=0.55).contains(&share), "raidz split {on:?}");
        } else {
            assert_eq!(on, [2000, 0], "leaf split");
        }
    }
}

/// Legacy pools use the aliquot of the legacy code (1 MiB).
#[test]
fn legacy_policy_defaults_to_a_1mib_aliquot() {
    let mut t = Tunables::default();
    t.set("throttle_policy", "legacy").unwrap();
    assert_eq!(t.aliquot(), MIB);
    let mut t = Tunables::default();
    assert_eq!(t.aliquot(), 2 * MIB);
    t.set("metaslab_aliquot", "3MiB").unwrap();
    t.set("throttle_policy", "legacy").unwrap();
    assert_eq!(t.aliquot(), 3 * MIB, "an explicit value holds");
}

/// Fill a one-vdev pool with 4 KiB blocks (log blocks: they may use the
/// slop space), free three of every four and let the frees mature: every
/// free segment is 12 KiB (88 % fragmented), 3/4 of the pool free.
fn fragmented_pool(t: Tunables) -> Pool {
    let mut pool = Pool::new(t);
    pool.add_vdev(disk(256 * MIB)).unwrap();
    pool.sync();
    let mut blocks = vec![];
    loop {
        match place(&mut pool, req(AllocKind::Log, 4096, 1)) {
            Ok(a) => {
                pool.commit(a.id).unwrap();
                blocks.push(a.extents[0]);
            }
            Err(Error::NoSpace { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    pool.sync();
    blocks.sort();
    let freed: Vec<Extent> = blocks
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 0)
        .map(|(_, e)| *e)
        .collect();
    pool.free(&freed).unwrap();
    for _ in 0..4 {
        pool.sync();
    }
    pool
}

/// Without gang blocks, a 1 MiB data block that does not fit
/// fails as FRAGMENTED with the largest free segment (no try-hard pass),
/// while a log block and a minimum-size block are placed.
#[test]
fn fragmented_pool_fails_large_data_as_fragmented() {
    let mut t = Tunables::default();
    // Free segments of 12 KiB read 88 %; make that "too fragmented".
    t.set("zfs_mg_fragmentation_threshold", "80").unwrap();
    let mut pool = fragmented_pool(t);
    let frag = pool.stats().classes[0].groups[0].fragmentation;
    assert!(frag.is_some_and(|f| f > 80), "{frag:?}");
    match place(&mut pool, req(AllocKind::Data, MIB, 1)) {
        Err(Error::NoSpace {
            reason: NoSpaceReason::Fragmented { largest_free },
            ..
        }) => assert_eq!(largest_free, Psize(12288)),
        other => panic!("{other:?}"),
    }
    let log = place(&mut pool, req(AllocKind::Log, 4096, 1)).unwrap();
    assert_eq!(log.tier, Some(LogTier::Normal));
    place(&mut pool, req(AllocKind::Data, 4096, 1)).unwrap();
    pool.verify().unwrap();
}

/// A block that fails the group checks but fits whole in a free
/// segment is placed trying hard (OpenZFS would gang it and place the
/// members trying hard): a lone degraded leaf still takes data.
#[test]
fn a_block_that_fits_whole_is_placed_trying_hard() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    pool.set_health(0, Health::Degraded).unwrap();
    place(&mut pool, req(AllocKind::Data, 128 << 10, 1)).unwrap();
    place(&mut pool, req(AllocKind::Data, 4096, 1)).unwrap();
}

/// No vdev allocatable says so. (The last normal vdev
/// cannot be taken offline by an admin, `vdev_passivate`; an unreachable
/// one is not allocatable either.)
#[test]
fn no_space_says_vdevs_offline() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    pool.set_health(0, Health::Unavailable).unwrap();
    match place(&mut pool, req(AllocKind::Data, 128 << 10, 1)) {
        Err(Error::NoSpace {
            reason: NoSpaceReason::VdevsOffline,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

/// A vdev the store could not bring back is refused when
/// it is added, not after a restart.
#[test]
fn huge_capacity_is_refused_at_add() {
    let mut pool = Pool::new(Tunables::default());
    assert!(matches!(
        pool.add_vdev(disk(1 << 63)),
        Err(Error::BadVdev(_))
    ));
    assert_eq!(pool.stats().vdevs.len(), 0);
}

/// An expired allocation's space is deferred like a free,
/// so nothing else is placed there before TXG_DEFER_SIZE syncs.
#[test]
fn expired_space_is_deferred() {
    let mut t = Tunables::default();
    // Fill without the throttle queueing the in-flight allocations.
    t.set("zio_dva_throttle_enabled", "0").unwrap();
    let mut pool = Pool::new(t);
    pool.add_vdev(disk(256 * MIB)).unwrap();
    pool.sync();
    let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 1)).unwrap();
    let e = a.extents[0];
    pool.expire(a.id).unwrap();
    assert_eq!(pool.commit(a.id), Err(Error::UnknownAllocation(a.id)));
    let overlaps = |x: &Extent| {
        x.vdev == e.vdev && x.offset < e.offset + e.size && e.offset < x.offset + x.size
    };
    let mut first_reuse = None;
    for round in 0..=TXG_DEFER_SIZE + 1 {
        let mut placed = vec![];
        while let Ok(b) = place(&mut pool, req(AllocKind::Data, 128 << 10, 1)) {
            placed.push(b);
        }
        if first_reuse.is_none() && placed.iter().any(|b| overlaps(&b.extents[0])) {
            first_reuse = Some(round);
        }
        for b in placed {
            pool.abort(b.id).unwrap();
        }
        pool.sync();
    }
    // Not before TXG_DEFER_SIZE syncs, as a free.
    assert!(
        first_reuse.is_some_and(|r| r >= TXG_DEFER_SIZE),
        "{first_reuse:?}"
    );
    pool.verify().unwrap();
}

/// A metaslab never allocated from has no space map: 0 %
/// fragmented (it used to read 3–17 % for its one big free segment).
#[test]
fn a_fresh_metaslab_reads_zero_fragmentation() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(GIB)).unwrap();
    pool.sync();
    assert_eq!(pool.stats().classes[0].groups[0].fragmentation, Some(0));
    // One block: its metaslab now has a space map, the others still none.
    let a = place(&mut pool, req(AllocKind::Data, 4096, 1)).unwrap();
    pool.commit(a.id).unwrap();
    pool.sync();
    let f = pool.stats().classes[0].groups[0].fragmentation.unwrap();
    assert!(f <= 3, "{f}");
}

/// Frees still deferred count as free segments in the histogram
/// (OpenZFS adds the freed and both defer trees), so fragmentation moves
/// as soon as the free syncs, not two txgs later.
#[test]
fn deferred_frees_count_in_fragmentation() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(256 * MIB)).unwrap();
    pool.sync();
    let mut blocks = vec![];
    for _ in 0..2000 {
        let a = place(&mut pool, req(AllocKind::Log, 4096, 1)).unwrap();
        pool.commit(a.id).unwrap();
        blocks.push(a.extents[0]);
    }
    pool.sync();
    let before = pool.stats().classes[0].groups[0].fragmentation.unwrap();
    blocks.sort();
    let freed: Vec<Extent> = blocks.iter().step_by(2).copied().collect();
    pool.free(&freed).unwrap();
    pool.sync(); // the frees are now deferred, not allocatable
    let deferred = pool.stats().classes[0].groups[0].fragmentation.unwrap();
    assert!(
        deferred > before,
        "4 KiB deferred holes raise fragmentation at once: {before} -> {deferred}"
    );
}

/// A faulted vdev stays in the ring and the class balance: its
/// group keeps its aliquot and the class limit does not move; it is
/// skipped at each allocation.
#[test]
fn a_faulted_vdev_keeps_its_aliquot_and_is_skipped() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    let before = pool.stats().classes[0].clone();
    pool.set_health(1, Health::Faulted).unwrap();
    let during = pool.stats().classes[0].clone();
    assert_eq!(during.alloc_max, before.alloc_max);
    assert_eq!(during.groups[1].aliquot, before.groups[1].aliquot);
    for _ in 0..50 {
        let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 1)).unwrap();
        assert_eq!(a.extents[0].vdev, 0);
        pool.commit(a.id).unwrap();
    }
    // Administrative offline (OpenZFS noalloc) does leave the ring.
    pool.set_health(1, Health::Healthy).unwrap();
    pool.set_online(1, false).unwrap();
    assert_ne!(pool.stats().classes[0].alloc_max, before.alloc_max);
}

/// After a sync the best `metaslab_preload_limit` metaslabs of a
/// group are loaded; an inactive one unloads only once both 32 txgs and
/// `metaslab_unload_delay_ms` (600 s of the caller's time) have passed.
#[test]
fn metaslabs_preload_and_unload_only_after_600_seconds() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(64 * GIB)).unwrap();
    pool.sync_at(0);
    pool.sync_at(1000);
    let loaded = |p: &Pool| p.stats().vdevs[0].loaded_metaslabs;
    // 10 of the normal group, and the embedded log metaslab (its own group).
    assert!(pool.stats().vdevs[0].embedded_log_metaslab.is_some());
    assert_eq!(loaded(&pool), 11, "preloaded");
    let a = place(&mut pool, req(AllocKind::Data, 128 << 10, 1)).unwrap();
    assert_eq!(
        a.metaslab_loads, 0,
        "the allocation found its metaslab loaded"
    );
    pool.commit(a.id).unwrap();
    // No more preloading, then 40 txgs within 40 s: nothing unloads.
    pool.set_tunable("metaslab_preload_limit", "0").unwrap();
    for i in 0..40 {
        pool.sync_at(2_000 + i * 1000);
    }
    assert_eq!(loaded(&pool), 11, "32 txgs passed but not 600 s");
    // 600 s later (and 32 more txgs) the inactive ones go; the active one
    // and the embedded log metaslab (never evicted) stay.
    for i in 0..40 {
        pool.sync_at(700_000 + i * 1000);
    }
    assert_eq!(loaded(&pool), 2, "only the active and embedded log stay");
}

/// Busy switches where OpenZFS's dirty-data rule says, at
/// `zfs_dirty_data_max × (30 + 60) / 200` = 45 % of it, or with a sync
/// task pending; the percentages are the tunables of those names.
#[test]
fn busy_switches_at_the_dirty_threshold() {
    let mut pool = Pool::new(Tunables::default());
    let max = 4 * GIB;
    let at = max * 45 / 100;
    assert!(!pool.busy_dirty(at, max, false));
    assert!(pool.busy_dirty(at + 1, max, false));
    assert!(pool.busy_dirty(0, max, true), "a pending sync task");
    // The placement rule is the same, without a sync task.
    assert!(!pool.busy_with_dirty(at, max));
    assert!(pool.busy_with_dirty(at + 1, max));
    pool.set_tunable("zfs_vdev_async_write_active_max_dirty_percent", "80")
        .unwrap();
    assert!(
        !pool.busy_dirty(at + 1, max, false),
        "threshold moved to 55 %"
    );
}

/// A key whose requests allocator `k` places.
fn key_for(pool: &Pool, k: usize) -> u64 {
    (0..).find(|&key| pool.allocator_for(key) == k).unwrap()
}

/// A data block of allocator `k` (by its affinity key), placed `busy`.
fn place_by(pool: &mut Pool, k: usize, size: u64, busy: bool) -> Allocation {
    let r = AllocRequest {
        affinity: Some(key_for(pool, k)),
        ..req(AllocKind::Data, size, 1)
    };
    place_busy(pool, r, busy).unwrap()
}

/// `spa_alloc_count = max(1, min(spa_num_allocators, cpus /
/// spa_cpus_per_allocator))`; each allocator keeps its own rotor and
/// aliquot counter. A group being activated becomes
/// allocator 0's rotor and the next allocators' rotors follow it round the
/// ring (`metaslab.c:metaslab_group_activate@zfs-2.4.0`: `mca_rotor = mg;
/// mg = mg->mg_next` per allocator), so allocators start on different
/// groups, not all on the newest.
#[test]
fn allocators_start_staggered_and_keep_their_own_rotors() {
    let mut pool = Pool::new(Tunables::default());
    assert_eq!(pool.set_cpus(2), 1, "2 CPUs: one allocator");
    assert_eq!(pool.set_cpus(64), 4, "at most spa_num_allocators");
    assert_eq!(pool.set_cpus(8), 2);
    pool.add_vdev(disk(16 * GIB)).unwrap();
    pool.add_vdev(disk(16 * GIB)).unwrap();
    pool.sync();
    let first = |pool: &mut Pool, k: usize| {
        let a = place_by(pool, k, 128 << 10, false);
        pool.commit(a.id).unwrap();
        a.extents[0].vdev
    };
    // Vdev 1 was activated after allocator 0's rotor (vdev 0): allocator 0
    // starts on it, allocator 1 on the group after it, vdev 0.
    assert_eq!(first(&mut pool, 0), 1);
    assert_eq!(first(&mut pool, 1), 0);
    // Allocator 0 fills its visit (aliquot 2 MiB per data child over 2
    // groups, at least 4 × io size) and moves on ...
    let mut moved = false;
    for _ in 0..64 {
        if first(&mut pool, 0) != 1 {
            moved = true;
            break;
        }
    }
    assert!(moved, "allocator 0's rotor moved on");
    // ... allocator 1's rotor stays where its own visit left it.
    assert_eq!(first(&mut pool, 1), 0, "allocator 1 has its own rotor");
    pool.verify().unwrap();
}

/// Allocators created after the groups were activated (an allocator
/// restored from its store learns the CPU count after its vdevs) start
/// spread round the ring as if they had been there at activation.
#[test]
fn allocators_added_after_the_vdevs_start_spread() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(16 * GIB)).unwrap();
    pool.add_vdev(disk(16 * GIB)).unwrap();
    pool.sync();
    assert_eq!(pool.set_cpus(8), 2);
    let a = place_by(&mut pool, 0, 128 << 10, false);
    let b = place_by(&mut pool, 1, 128 << 10, false);
    assert_ne!(a.extents[0].vdev, b.extents[0].vdev);
    pool.verify().unwrap();
}

/// Queue depth is kept per allocator
/// (`mga_queue_depth@zfs-2.4.0`, what `metaslab_class_rotate` compares with
/// the group's queue target). Another allocator's bytes in flight on a
/// group do not turn this allocator's rotor: on a busy pool allocator 1
/// keeps its group for as many blocks whether or not allocator 0 has filled
/// that group's queue.
#[test]
fn another_allocators_queue_does_not_turn_this_rotor() {
    let run = |others_first: bool| {
        let mut pool = Pool::new(Tunables::default());
        pool.set_cpus(8);
        pool.add_vdev(disk(16 * GIB)).unwrap();
        pool.add_vdev(disk(16 * GIB)).unwrap();
        pool.sync();
        if others_first {
            // Allocator 0 (starting on vdev 1) goes on to vdev 0 and fills
            // its queue there, nothing committed.
            let mut on_zero = 0;
            for _ in 0..400 {
                let a = place_by(&mut pool, 0, 128 << 10, true);
                if a.extents[0].vdev == 0 {
                    on_zero += 1;
                } else if on_zero > 0 {
                    break;
                }
            }
            assert!(on_zero > 8, "allocator 0 placed {on_zero} on vdev 0");
            let st = pool.stats();
            let depth = st.classes[0]
                .groups
                .iter()
                .find(|g| g.vdev == 0)
                .unwrap()
                .queue_depth;
            assert!(depth >= (on_zero - 1) * (128 << 10), "{depth}");
        }
        // Allocator 1 starts on vdev 0: how many blocks before it moves on.
        let mut n = 0;
        while place_by(&mut pool, 1, 128 << 10, true).extents[0].vdev == 0 {
            n += 1;
            assert!(n < 10_000);
        }
        pool.verify().unwrap();
        n
    };
    let alone = run(false);
    let beside = run(true);
    assert!(
        alone > 16,
        "{alone} blocks: past the aliquot, up to the queue target"
    );
    assert_eq!(
        alone, beside,
        "allocator 0's queue on vdev 0 is not allocator 1's"
    );
}

/// `mc_alloc_max` bounds each allocator's reservations
/// (`mca_reserved`), not the class total, and each allocator has its own
/// queue: with 4 allocators the class admits about 4 × alloc_max before
/// anything waits, and a full allocator's waiters do not hold back another's.
#[test]
fn each_allocator_has_its_own_throttle_budget_and_queue() {
    let admitted_before_waiting = |cpus: u64| {
        let mut pool = Pool::new(Tunables::default());
        pool.set_cpus(cpus);
        pool.add_vdev(disk(64 * GIB)).unwrap();
        pool.add_vdev(disk(64 * GIB)).unwrap();
        pool.sync();
        let max = pool.stats().classes[0].alloc_max;
        let mut ready = 0u64;
        for i in 0..4096u64 {
            match pool.submit(req(AllocKind::Data, 128 << 10, 1)).unwrap() {
                Submitted::Ready(_) => ready += 1,
                // Requests take the allocators in turn: once every one is
                // full, everything waits.
                Submitted::Queued(_) if i > 64 * cpus => break,
                Submitted::Queued(_) => {}
            }
        }
        pool.verify().unwrap();
        (ready * (128 << 10), max, pool)
    };
    let (one, max1, _) = admitted_before_waiting(2);
    let (four, max4, mut pool) = admitted_before_waiting(64);
    assert_eq!(max1, max4, "the per-allocator limit is the same formula");
    // The test precedes the add: each budget overshoots by at most one
    // request.
    assert!(one >= max1 && one <= max1 + (128 << 10), "{one} vs {max1}");
    assert!(
        four >= 4 * max4 && four <= 4 * (max4 + (128 << 10)),
        "{four} vs 4 x {max4}"
    );
    let s = pool.stats();
    assert_eq!(s.classes[0].reserved, four);
    assert!(s.classes[0].waiting > 0);
    pool.verify().unwrap();
    let _ = pool.take_admitted();
}

/// `metaslab.c:metaslab_group_alloc@zfs-2.4.0`: each allocator has its own
/// active metaslab per group while the group has enough ready metaslabs
/// (`allocator < mg_ms_ready / 3`), so two allocators write two fronts on one
/// vdev; with few metaslabs they share slot 0's. LEGACY shares until `ready ≥
/// allocators × 3`.
fn fronts(policy: ThrottlePolicy, capacity: u64, shift: Option<u8>) -> (u32, Vec<u64>, Vec<u64>) {
    let mut pool = Pool::new(Tunables {
        throttle_policy: policy,
        ..Tunables::default()
    });
    pool.add_vdev(VdevSpec {
        metaslab_shift: shift,
        ..disk(capacity)
    })
    .unwrap();
    assert_eq!(pool.set_cpus(8), 2, "8 CPUs, 4 per allocator");
    pool.sync();
    let count = pool.stats().vdevs[0].metaslab_count;
    let mut by = [Vec::new(), Vec::new()];
    for i in 0..40 {
        let a = place_by(&mut pool, i % 2, 128 << 10, false);
        by[i % 2].push(metaslab_of(&pool, &a.extents[0]));
        pool.commit(a.id).unwrap();
    }
    pool.verify().unwrap();
    let [a, b] = by;
    (count, a, b)
}

#[test]
fn each_allocator_writes_its_own_front_when_the_vdev_has_enough_metaslabs() {
    for policy in [ThrottlePolicy::Unified, ThrottlePolicy::Legacy] {
        let (count, a, b) = fronts(policy, 4 * GIB, None);
        assert!(count >= 6, "{count} metaslabs");
        // Each allocator stays on one metaslab (its primary) ...
        assert!(
            a.iter().all(|&m| m == a[0]),
            "{policy:?} allocator 0: {a:?}"
        );
        assert!(
            b.iter().all(|&m| m == b[0]),
            "{policy:?} allocator 1: {b:?}"
        );
        // ... and the two are different metaslabs: two write fronts.
        assert_ne!(a[0], b[0], "{policy:?}");
    }
}

#[test]
fn allocators_share_one_front_on_a_vdev_with_few_metaslabs() {
    // 5 metaslabs of 64 MiB: 5 / 3 = 1, so allocator 1 uses slot 0
    // (and LEGACY: 5 < 2 × 3).
    for policy in [ThrottlePolicy::Unified, ThrottlePolicy::Legacy] {
        let (count, a, b) = fronts(policy, 5 * 64 * MIB + 8 * MIB, Some(26));
        assert_eq!(count, 5);
        let all: Vec<u64> = a.iter().chain(&b).copied().collect();
        assert!(all.iter().all(|&m| m == all[0]), "{policy:?}: {a:?} {b:?}");
    }
}

/// `metaslab.c:metaslab_group_alloc_decrement@zfs-2.3.0`: LEGACY ramps each
/// allocator's slot limit by its own completions (`mca_alloc_max_slots` per
/// allocator): writes completed by allocator 0 raise allocator 0's limit, not
/// allocator 1's.
#[test]
fn legacy_slots_ramp_up_per_allocator() {
    let mut pool = Pool::new(Tunables {
        throttle_policy: ThrottlePolicy::Legacy,
        ..Tunables::default()
    });
    pool.add_vdev(disk(4 * GIB)).unwrap();
    assert_eq!(pool.set_cpus(8), 2);
    pool.sync();
    let def = Tunables::default().zfs_vdev_def_queue_depth;
    // Allocator 0 completes 10 writes: its limit becomes def + 10.
    for _ in 0..10 {
        let a = place_by(&mut pool, 0, 128 << 10, false);
        pool.commit(a.id).unwrap();
    }
    let admitted = |pool: &mut Pool, k: usize| {
        let mut n = 0;
        let key = key_for(pool, k);
        loop {
            let r = AllocRequest {
                affinity: Some(key),
                ..req(AllocKind::Data, 128 << 10, 1)
            };
            match pool.submit(r).unwrap() {
                Submitted::Ready(_) => n += 1,
                Submitted::Queued(_) => return n,
            }
        }
    };
    assert_eq!(admitted(&mut pool, 1), def, "allocator 1 keeps the default");
    assert_eq!(admitted(&mut pool, 0), def + 10, "allocator 0 ramped up");
}

fn log_range(size: u64, max_size: u64) -> AllocRequest {
    AllocRequest {
        kind: AllocKind::Log,
        size,
        copies: 1,
        max_size: Some(max_size),
        affinity: None,
    }
}

/// An intent-log block may be any size in `[min, max]`
/// (OpenZFS 2.4: `zio_alloc_zil` tries each class with
/// `metaslab_alloc_range`; `metaslab_df_alloc` takes `MIN(segment, max)`
/// from the first segment holding `min`, and the size tree gives the
/// largest segment below `max` that holds `min`,
/// `metaslab.c:metaslab_block_find@zfs-2.4.0`). A log block that fits
/// smaller stays in the embedded log metaslab where the fixed size falls
/// through to the normal class.
#[test]
fn a_log_block_with_a_size_range_stays_in_the_embedded_log_metaslab() {
    const K: u64 = 1024;
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(64 * GIB)).unwrap();
    pool.sync();
    // Fill the embedded log metaslab with 128K log blocks.
    let mut elog = Vec::new();
    loop {
        let a = place(&mut pool, req(AllocKind::Log, 128 * K, 1)).unwrap();
        if a.tier != Some(LogTier::EmbeddedLog) {
            pool.abort(a.id).unwrap();
            break;
        }
        pool.commit(a.id).unwrap();
        elog.push(a.extents[0]);
    }
    assert!(elog.len() > 100, "{} blocks", elog.len());
    // Free one, let the frees become allocatable, and take half of it back:
    // a single 64K hole is all the embedded log metaslab has.
    pool.free(&[elog[10]]).unwrap();
    for _ in 0..4 {
        pool.sync();
    }
    let half = place(&mut pool, req(AllocKind::Log, 64 * K, 1)).unwrap();
    assert_eq!(half.tier, Some(LogTier::EmbeddedLog));
    pool.commit(half.id).unwrap();

    // A fixed 128K block does not fit: the normal class takes it.
    let fixed = place(&mut pool, req(AllocKind::Log, 128 * K, 1)).unwrap();
    assert_eq!(fixed.tier, Some(LogTier::Normal));
    pool.abort(fixed.id).unwrap();
    // 32K..128K: the 64K hole, in the embedded log metaslab.
    let ranged = place(&mut pool, log_range(32 * K, 128 * K)).unwrap();
    assert_eq!(ranged.tier, Some(LogTier::EmbeddedLog));
    assert_eq!(ranged.extents[0].size, 64 * K, "{:?}", ranged.extents);
    assert_eq!(ranged.psize, 64 * K, "the block holds what was given");
    pool.commit(ranged.id).unwrap();
    // Now full: the normal class, where a free segment holds all of max.
    let next = place(&mut pool, log_range(32 * K, 128 * K)).unwrap();
    assert_eq!(next.tier, Some(LogTier::Normal));
    assert_eq!(next.extents[0].size, 128 * K);
    assert_eq!(next.psize, 128 * K);
    pool.commit(next.id).unwrap();
    pool.verify().unwrap();

    // A range is for log blocks only, and max must not be below size.
    let data_range = AllocRequest {
        kind: AllocKind::Data,
        ..log_range(4 * K, 8 * K)
    };
    assert!(matches!(
        pool.submit(data_range),
        Err(Error::BadSizeRange { .. })
    ));
    assert!(matches!(
        pool.submit(log_range(8 * K, 4 * K)),
        Err(Error::BadSizeRange { .. })
    ));
}

/// A refusal's reason is the true one. FRAGMENTED means
/// the free bytes would hold the block cut in pieces (OpenZFS would gang
/// it); when they would not, however cut, the pool is FULL, not fragmented.
#[test]
fn a_refusal_says_full_when_the_free_bytes_cannot_hold_the_block() {
    const K: u64 = 1024;
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(GIB)).unwrap();
    pool.sync();
    let mut blocks = Vec::new();
    while let Ok(a) = place(&mut pool, req(AllocKind::Log, 64 * K, 1)) {
        pool.commit(a.id).unwrap();
        blocks.push(a.extents[0]);
    }
    // Two 64K holes far apart.
    pool.free(&[blocks[10], blocks[100]]).unwrap();
    for _ in 0..4 {
        pool.sync();
    }
    let reason = |pool: &mut Pool, size: u64, copies: u8| match place(
        pool,
        req(AllocKind::Log, size, copies),
    ) {
        Err(Error::NoSpace { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    // 128K free in two pieces: a 128K block would fit cut in two.
    assert_eq!(
        reason(&mut pool, 128 * K, 1),
        NoSpaceReason::Fragmented {
            largest_free: Psize(64 * K)
        }
    );
    // Two copies of 96K need 192K: more than is free.
    assert_eq!(reason(&mut pool, 96 * K, 2), NoSpaceReason::Full);
    let a = place(&mut pool, req(AllocKind::Log, 64 * K, 1)).unwrap();
    pool.commit(a.id).unwrap();
    // 64K left: a 128K block does not fit however cut.
    assert_eq!(reason(&mut pool, 128 * K, 1), NoSpaceReason::Full);
    pool.verify().unwrap();
}

/// A 64 MiB vdev of four 16 MiB metaslabs, all allocated in 64 KiB
/// extents, nothing preloaded: every metaslab unloaded.
fn full_unloaded_pool() -> (Pool, Vec<Extent>) {
    let mut t = Tunables::default();
    t.set("metaslab_preload_limit", "0").unwrap();
    let spec = VdevSpec {
        metaslab_shift: Some(24),
        ..disk(64 * MIB)
    };
    let k64 = 64 << 10;
    let extents: Vec<Extent> = (0..(64 * MIB / k64))
        .map(|i| Extent {
            vdev: 0,
            offset: i * k64,
            size: k64,
        })
        .collect();
    let mut pool = Pool::restore_sorted(t, vec![(0, spec)], extents.clone(), 10).unwrap();
    pool.sync();
    assert_eq!(pool.stats().vdevs[0].loaded_metaslabs, 0);
    (pool, extents)
}

/// The normal class's fragmentation once `freed` are free and synced.
fn fragmentation_after_freeing(freed: &[Extent]) -> Option<u32> {
    let (mut pool, _) = full_unloaded_pool();
    pool.free(freed).unwrap();
    for _ in 0..4 {
        pool.sync();
    }
    assert_eq!(
        pool.stats().vdevs[0].loaded_metaslabs,
        0,
        "frees do not load"
    );
    let s = pool.stats();
    let normal = s
        .classes
        .iter()
        .find(|c| c.kind == ClassKind::Normal)
        .unwrap();
    normal.fragmentation
}

/// Fragmentation comes from the in-core trees (DESIGN.md, "Fragmentation
/// from the in-core trees, when reweighed"): two adjacent 64 KiB frees to
/// an unloaded metaslab count as the one 128 KiB segment they make, not as
/// two 64 KiB segments as OpenZFS's space map histogram counts them until
/// the metaslab is loaded and synced.
#[test]
fn frees_to_an_unloaded_metaslab_coalesce_in_its_fragmentation() {
    let (_, extents) = full_unloaded_pool();
    let adjacent = fragmentation_after_freeing(&extents[0..2]);
    // The same 128 KiB restored free from the start: one segment.
    let one_128k = {
        let (_, extents) = full_unloaded_pool();
        let mut t = Tunables::default();
        t.set("metaslab_preload_limit", "0").unwrap();
        let spec = VdevSpec {
            metaslab_shift: Some(24),
            ..disk(64 * MIB)
        };
        let mut pool = Pool::restore_sorted(t, vec![(0, spec)], extents[2..].to_vec(), 10).unwrap();
        for _ in 0..4 {
            pool.sync();
        }
        let s = pool.stats();
        s.classes
            .iter()
            .find(|c| c.kind == ClassKind::Normal)
            .unwrap()
            .fragmentation
    };
    let apart = fragmentation_after_freeing(&[extents[0], extents[2]]);
    assert!(adjacent.is_some() && apart.is_some());
    assert_eq!(adjacent, one_128k);
    assert!(
        adjacent < apart,
        "one 128K segment ({adjacent:?}) is less fragmented than two 64K ({apart:?})"
    );
}

/// An unloaded metaslab is judged by its largest free segment, as a loaded
/// one (DESIGN.md, "Weights of unloaded metaslabs"): with every free
/// segment 64 KiB, a 112 KiB block loads nothing and fails as FRAGMENTED.
/// OpenZFS would let each such metaslab try it (112K < 2 × the 64K bucket)
/// and load it to find out.
#[test]
fn an_unloaded_metaslab_too_fragmented_for_the_block_is_not_loaded() {
    let mut t = Tunables::default();
    t.set("metaslab_preload_limit", "0").unwrap();
    // 1 GiB in 64 metaslabs of 16 MiB, every other 64 KiB allocated: 512 MiB
    // free (above the 128 MiB slop) in 64 KiB segments.
    let spec = VdevSpec {
        metaslab_shift: Some(24),
        ..disk(GIB)
    };
    let k64 = 64 << 10;
    let extents: Vec<Extent> = (0..(GIB / k64))
        .filter(|i| i % 2 == 1)
        .map(|i| Extent {
            vdev: 0,
            offset: i * k64,
            size: k64,
        })
        .collect();
    let mut pool = Pool::restore_sorted(t, vec![(0, spec)], extents, 10).unwrap();
    pool.sync();
    assert_eq!(pool.stats().vdevs[0].loaded_metaslabs, 0);
    match place(&mut pool, req(AllocKind::Data, 112 << 10, 1)) {
        Err(Error::NoSpace {
            reason: NoSpaceReason::Fragmented { largest_free },
            ..
        }) => assert_eq!(largest_free, Psize(k64)),
        other => panic!("{other:?}"),
    }
    assert_eq!(pool.stats().vdevs[0].loaded_metaslabs, 0, "nothing loaded");
    // A block that fits loads the one metaslab it lands in.
    let a = place(&mut pool, req(AllocKind::Data, k64, 1)).unwrap();
    assert_eq!(a.metaslab_loads, 1);
}

/// A block's allocator is its affinity key's hash, always (DESIGN.md,
/// "Which allocator a data block uses"): no caller identity enters it, so
/// two pools agree on every key, and the keys spread over every allocator.
#[test]
fn a_blocks_allocator_is_its_affinity_keys() {
    let mut a = Pool::new(Tunables::default());
    let mut b = Pool::new(Tunables::default());
    assert_eq!(a.set_cpus(16), 4);
    assert_eq!(b.set_cpus(16), 4);
    let mut seen = [0u32; 4];
    for key in 0..1000u64 {
        let k = a.allocator_for(key);
        assert_eq!(k, b.allocator_for(key), "key {key}");
        seen[k] += 1;
    }
    assert!(seen.iter().all(|&n| n > 150), "{seen:?}");
}

/// Slop is a share of the raw space (DESIGN.md, "Raw, not deflated,
/// bytes"): on RAIDZ1 of 5 it is `space >> spa_slop_shift` of the raw
/// bytes, parity included, where OpenZFS takes it of the deflated 4/5.
#[test]
fn slop_is_a_share_of_raw_space_on_raidz() {
    let mut t = Tunables::default();
    // No embedded log metaslab, whose space would come off the slop.
    t.set("zfs_embedded_slog_min_ms", "100000").unwrap();
    let mut pool = Pool::new(t);
    pool.add_vdev(raidz1(64 * GIB)).unwrap();
    pool.sync();
    let s = pool.stats();
    let space = s
        .classes
        .iter()
        .find(|c| c.kind == ClassKind::Normal)
        .unwrap()
        .space;
    assert!(space > 60 * GIB, "{space}");
    assert_eq!(s.slop, space >> 5);
    assert_ne!(s.slop, (space / 5 * 4) >> 5, "not the deflated share");
}

/// The FRAGMENTED hint is a block size (psize), not a raw segment size: on
/// RAIDZ1 of 5 at 4 KiB sectors a 40 KiB free segment holds a 32 KiB block
/// (8 data + 2 parity sectors), and a 40 KiB block needs 56 KiB. A client
/// that retries at the hint must fit; the hint once said 40 KiB, and the
/// retry failed again.
#[test]
fn the_fragmented_hint_on_raidz_is_a_block_size_that_fits() {
    let mut t = Tunables::default();
    t.set("metaslab_preload_limit", "0").unwrap();
    let spec = VdevSpec {
        metaslab_shift: Some(24),
        ..raidz1(GIB)
    };
    let k40 = 40 << 10;
    // Every other 40 KiB allocated: 512 MiB free in 40 KiB segments.
    let extents: Vec<Extent> = (0..(GIB / k40))
        .filter(|i| i % 2 == 1)
        .map(|i| Extent {
            vdev: 0,
            offset: i * k40,
            size: k40,
        })
        .collect();
    let mut pool = Pool::restore_sorted(t, vec![(0, spec.clone())], extents, 10).unwrap();
    pool.sync();
    let hint = match place(&mut pool, req(AllocKind::Data, MIB, 1)) {
        Err(Error::NoSpace {
            reason: NoSpaceReason::Fragmented { largest_free },
            ..
        }) => largest_free,
        other => panic!("{other:?}"),
    };
    assert_eq!(hint, Psize(32 << 10));
    assert_eq!(
        vdev::psize_to_asize(&spec, hint),
        Asize(k40),
        "the hint fills one segment"
    );
    let a = place(&mut pool, req(AllocKind::Data, hint.0, 1)).expect("a retry at the hint fits");
    assert_eq!(a.extents[0].size, k40);
    pool.commit(a.id).unwrap();
    // One sector more does not fit anywhere.
    assert!(place(&mut pool, req(AllocKind::Data, hint.0 + 4096, 1)).is_err());
    pool.verify().unwrap();
}
