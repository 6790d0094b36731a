//! The balancer's two pool primitives: placement that avoids given vdevs
//! (a move's new copy never lands on its source or the block's other
//! copies) and removal of an empty, offline vdev (the end of a drain).

use metaslab::testing::{data, disk, pool_of};
use metaslab::*;

const GIB: u64 = 1 << 30;
const K128: u64 = 128 << 10;

fn place_avoiding(pool: &mut Pool, avoid: &[VdevId]) -> Result<Allocation> {
    match pool.submit(data(K128, 1))? {
        Submitted::Ready(t) => pool.allocate_avoiding(t, false, avoid),
        Submitted::Queued(t) => panic!("ticket {t} queued"),
    }
}

fn pool3() -> Pool {
    pool_of(&[4 * GIB; 3])
}

#[test]
fn avoided_vdevs_never_get_a_copy() {
    let mut pool = pool3();
    for i in 0..600 {
        let avoid = [(i % 3) as VdevId];
        let a = place_avoiding(&mut pool, &avoid).unwrap();
        assert_ne!(a.extents[0].vdev, avoid[0], "allocation {i}");
        pool.commit(a.id).unwrap();
    }
    // The other two still share the load: both got some.
    let s = pool.stats();
    assert!(s.vdevs.iter().all(|v| v.alloc > 0));
    pool.verify().unwrap();
}

#[test]
fn avoiding_every_allocatable_vdev_fails_as_offline_and_changes_nothing() {
    let mut pool = pool3();
    let before = pool.stats();
    let err = place_avoiding(&mut pool, &[0, 1, 2]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NoSpace {
                reason: NoSpaceReason::VdevsOffline,
                ..
            }
        ),
        "{err:?}"
    );
    let after = pool.stats();
    assert_eq!(before.classes[0].reserved, after.classes[0].reserved);
    assert_eq!(before.classes[0].alloc, after.classes[0].alloc);
    // The avoid set does not outlive the call.
    let a = place_avoiding(&mut pool, &[]).unwrap();
    pool.commit(a.id).unwrap();
    pool.verify().unwrap();
}

#[test]
fn remove_needs_offline_empty_and_synced() {
    let mut pool = pool3();
    let a = place_avoiding(&mut pool, &[0, 1]).unwrap();
    assert_eq!(a.extents[0].vdev, 2);
    // Online: refused.
    let e = pool.remove_vdev(2).unwrap_err();
    assert!(
        matches!(e, Error::VdevNotEmpty { online: true, .. }),
        "{e:?}"
    );
    pool.set_online(2, false).unwrap();
    // In flight: refused.
    let e = pool.remove_vdev(2).unwrap_err();
    assert!(matches!(e, Error::VdevNotEmpty { .. }), "{e:?}");
    pool.commit(a.id).unwrap();
    // Holds a block: refused, naming the bytes.
    match pool.remove_vdev(2).unwrap_err() {
        Error::VdevNotEmpty { alloc, .. } => assert_eq!(alloc, K128),
        e => panic!("{e:?}"),
    }
    pool.sync();
    pool.free(&a.extents).unwrap();
    // Freed but deferred: still refused until the frees synced.
    assert!(pool.remove_vdev(2).is_err());
    let mut synced = 0;
    while pool.remove_vdev(2).is_err() {
        pool.sync();
        synced += 1;
        assert!(synced < 10, "the free never became reusable");
    }
    assert!(synced >= TXG_DEFER_SIZE as usize);
    assert!(pool.is_removed(2));
    pool.verify().unwrap();
}

#[test]
fn a_removed_vdev_is_forgotten_and_its_id_never_reused() {
    let mut pool = pool3();
    let space_before = pool.stats().classes[0].space;
    pool.set_online(1, false).unwrap();
    pool.remove_vdev(1).unwrap();
    let s = pool.stats();
    assert_eq!(s.vdevs.iter().map(|v| v.id).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(s.classes[0].groups.len(), 2);
    assert!(s.classes[0].space < space_before);
    assert_eq!(
        s.classes[0].space,
        s.classes[0].groups.iter().map(|g| g.capacity).sum::<u64>()
    );
    // It can be neither brought back nor removed twice.
    assert_eq!(pool.set_online(1, true), Err(Error::VdevRemoved(1)));
    assert_eq!(pool.remove_vdev(1), Err(Error::VdevRemoved(1)));
    assert_eq!(pool.grow_vdev(1, 8 * GIB), Err(Error::VdevRemoved(1)));
    // Allocation goes on over the others; a new vdev takes the next id.
    for _ in 0..200 {
        let a = place_avoiding(&mut pool, &[]).unwrap();
        assert_ne!(a.extents[0].vdev, 1);
        pool.commit(a.id).unwrap();
    }
    assert_eq!(pool.add_vdev(disk(4 * GIB)).unwrap(), 3);
    pool.sync();
    pool.verify().unwrap();
}

#[test]
fn a_move_avoids_its_source_and_over_full_vdevs_while_an_emptier_one_takes_it() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    for _ in 0..64 {
        let a = place_avoiding(&mut pool, &[]).unwrap();
        pool.commit(a.id).unwrap();
    }
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    assert_eq!(pool.relocation_avoid(0, &[]).unwrap(), vec![0, 1]);
    // The only emptier vdev holds another copy: no vdev below the fill is
    // left, so the over-full ones are allowed again (the source never).
    assert_eq!(pool.relocation_avoid(1, &[2]).unwrap(), vec![1, 2]);
    // The emptier vdev offline: nothing below the fill can take it, so only
    // the source (and the given copies) are avoided.
    pool.set_online(2, false).unwrap();
    assert_eq!(pool.relocation_avoid(0, &[]).unwrap(), vec![0]);
    assert_eq!(pool.relocation_avoid(7, &[]), Err(Error::UnknownVdev(7)));
}

#[test]
fn a_removal_keeps_copies_apart_unless_no_other_vdev_has_room() {
    let mut pool = Pool::new(Tunables::default());
    for _ in 0..3 {
        pool.add_vdev(disk(4 * GIB)).unwrap();
    }
    pool.sync();
    // Vdev 2 is free: the copy on vdev 1 is avoided.
    let (avoid, apart) = pool.removal_avoid(0, &[1], 1 << 20).unwrap();
    assert!(avoid.contains(&0) && avoid.contains(&1) && !avoid.contains(&2));
    assert!(apart);
    // Vdev 2 cannot take it: offline, or too small for the move.
    pool.set_online(0, false).unwrap();
    pool.set_online(2, false).unwrap();
    let (avoid, apart) = pool.removal_avoid(0, &[1], 1 << 20).unwrap();
    assert_eq!(avoid, vec![0]);
    assert!(!apart);
    pool.set_online(2, true).unwrap();
    let (avoid, apart) = pool.removal_avoid(0, &[1], 8 * GIB).unwrap();
    assert_eq!(avoid, vec![0]);
    assert!(!apart);
    // Vdev 2 unreachable for now (its agent away): it still counts, so the
    // copies stay apart and the move waits for it; faulted, it does not.
    pool.set_health(2, Health::Unavailable).unwrap();
    let (avoid, apart) = pool.removal_avoid(0, &[1], 1 << 20).unwrap();
    assert!(avoid.contains(&0) && avoid.contains(&1) && !avoid.contains(&2));
    assert!(apart);
    pool.set_health(2, Health::Faulted).unwrap();
    let (avoid, apart) = pool.removal_avoid(0, &[1], 1 << 20).unwrap();
    assert_eq!(avoid, vec![0]);
    assert!(!apart);
    pool.set_health(2, Health::Healthy).unwrap();
    // A block of one copy: only the source.
    assert_eq!(
        pool.removal_avoid(0, &[], 1 << 20).unwrap(),
        (vec![0], false)
    );
}

/// OpenZFS refuses to passivate the last normal vdev that still takes
/// allocations (`vdev_removal.c:vdev_passivate@zfs-2.4.0`, EINVAL): it
/// counts only other concrete, not dead vdevs of the normal class that are
/// not noalloc. So a log vdev, an offline one and a faulted one do not
/// count, and the guard applies to normal vdevs only.
#[test]
fn the_last_allocating_normal_vdev_cannot_go_offline() {
    let mut pool = Pool::new(Tunables::default());
    let a = pool.add_vdev(disk(4 * GIB)).unwrap();
    let log = pool
        .add_vdev(VdevSpec {
            role: VdevRole::Log,
            ..disk(GIB)
        })
        .unwrap();
    pool.sync();
    // One normal vdev and a log: the normal one is the last.
    assert!(matches!(
        pool.set_online(a, false),
        Err(Error::LastAllocatingVdev(v)) if v == a
    ));
    // A log vdev may go offline (its class is not the normal one).
    pool.set_online(log, false).unwrap();
    pool.set_online(log, true).unwrap();

    let b = pool.add_vdev(disk(4 * GIB)).unwrap();
    let c = pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    // With others taking allocations, one goes offline...
    pool.set_online(a, false).unwrap();
    // ...a faulted one does not count (vdev_is_dead)...
    pool.set_health(c, Health::Faulted).unwrap();
    assert!(matches!(
        pool.set_online(b, false),
        Err(Error::LastAllocatingVdev(v)) if v == b
    ));
    // ...and once c is healthy again, b may go too; then c is the last.
    pool.set_health(c, Health::Healthy).unwrap();
    pool.set_online(b, false).unwrap();
    assert!(matches!(
        pool.set_online(c, false),
        Err(Error::LastAllocatingVdev(v)) if v == c
    ));
    // Offline again of an offline vdev changes nothing and is no error.
    pool.set_online(a, false).unwrap();
    // Allocations still succeed: nothing was passivated by a refusal.
    assert!(pool.submit(data(K128, 1)).is_ok());
}

/// An offline (non-allocating) vdev's space leaves the space writes are
/// admitted against and the slop base, allocated bytes included
/// (`spa_misc.c:spa_update_dspace@zfs-2.4.0`, `spa_get_slop_space`): with
/// one of two 1 GiB vdevs offline, writes stop when the other holds 1 GiB
/// less slop (max(1 GiB >> 5, min(512 MiB, 128 MiB)) = 128 MiB), about
/// 896 MiB, where counting the offline vdev let them fill it to 1 GiB.
#[test]
fn an_offline_vdevs_space_is_not_writable_space() {
    let mut pool = Pool::new(Tunables::default());
    let a = pool.add_vdev(disk(GIB)).unwrap();
    let b = pool.add_vdev(disk(GIB)).unwrap();
    pool.sync();
    pool.set_online(b, false).unwrap();
    let mib = 1u64 << 20;
    let mut placed = 0u64;
    loop {
        let t = match pool.submit(data(mib, 1)) {
            Ok(Submitted::Ready(t)) => t,
            Ok(Submitted::Queued(t)) => panic!("ticket {t} queued"),
            Err(e) => panic!("{e}"),
        };
        match pool.allocate_avoiding(t, false, &[]) {
            Ok(al) => {
                assert!(al.extents.iter().all(|e| e.vdev == a));
                pool.commit(al.id).unwrap();
                placed += mib;
                if placed.is_multiple_of(64 * mib) {
                    pool.sync();
                }
            }
            Err(Error::NoSpace {
                reason: NoSpaceReason::Full,
                ..
            }) => break,
            Err(e) => panic!("{e} after {placed} bytes"),
        }
    }
    let st = pool.stats();
    assert_eq!(st.slop, 128 * mib, "slop on the allocating space");
    assert!(
        (880 * mib..=896 * mib).contains(&placed),
        "placed {} MiB on the only allocating vdev",
        placed / mib
    );
}

/// A drain needs the pool's available space to hold the whole vdev first
/// (`vdev_removal.c:spa_vdev_remove_top_check@zfs-2.4.0`: ENOSPC when
/// available < the device's `vs_dspace`, while it still allocates).
#[test]
fn a_drain_needs_room_for_the_whole_vdev() {
    let mut pool = Pool::new(Tunables::default());
    let a = pool.add_vdev(disk(GIB)).unwrap();
    let b = pool.add_vdev(disk(GIB)).unwrap();
    pool.sync();
    // Empty: 2 GiB less 128 MiB slop available, room for either vdev.
    pool.check_drain_room(a).unwrap();
    // Fill to about half: the other vdev alone no longer holds a whole one.
    let mut placed = 0u64;
    while placed < 900 << 20 {
        let t = match pool.submit(data(1 << 20, 1)).unwrap() {
            Submitted::Ready(t) => t,
            Submitted::Queued(t) => panic!("ticket {t} queued"),
        };
        let al = pool.allocate_avoiding(t, false, &[]).unwrap();
        pool.commit(al.id).unwrap();
        placed += 1 << 20;
        if placed.is_multiple_of(64 << 20) {
            pool.sync();
        }
    }
    match pool.check_drain_room(b) {
        Err(Error::NoRoomToDrain {
            vdev,
            need,
            available,
        }) => {
            assert_eq!(vdev, b);
            assert!(available < need, "{available} < {need}");
        }
        other => panic!("{other:?}"),
    }
    // Already offline (its space out of the writable space): no check.
    pool.set_online(b, false).unwrap();
    pool.check_drain_room(b).unwrap();
}

/// An offline vdev leaves the rotor and
/// `mc_groups`, but its space stays in the class's `mc_space` until
/// `metaslab_fini` (`metaslab.c:metaslab_group_passivate`,
/// `metaslab_group_alloc_update` and `metaslab_class_balance@zfs-2.4.0`).
/// With one of three equal empty vdevs offline, each remaining group's
/// capacity ratio is its space over the average of the whole class's space
/// per initialized group: 2/3 of an average group, so its aliquot is 2/3
/// of what it was (the crate gave 1.5× OpenZFS's, the full aliquot), and
/// `mc_alloc_max` is 4 × the two aliquots.
#[test]
fn an_offline_vdevs_space_stays_in_the_class_balance() {
    let mut pool = pool3();
    let aliquot_of = |p: &Pool, v: VdevId| {
        let n = p
            .stats()
            .classes
            .into_iter()
            .find(|c| c.kind == ClassKind::Normal)
            .expect("normal class");
        let g = n.groups.iter().find(|g| g.vdev == v).map(|g| g.aliquot);
        (g, n.alloc_max)
    };
    let (all3, _) = aliquot_of(&pool, 0);
    let all3 = all3.expect("vdev 0 in the ring");
    pool.set_online(2, false).unwrap();
    let (two, alloc_max) = aliquot_of(&pool, 0);
    let two = two.expect("vdev 0 in the ring");
    let want = all3 as f64 * 2.0 / 3.0;
    assert!(
        (two as f64 - want).abs() / want < 0.01,
        "aliquot {two} with a third of the class offline, want ~{want:.0} (all online: {all3})"
    );
    let (other, _) = aliquot_of(&pool, 1);
    assert_eq!(alloc_max, 4 * (two + other.expect("vdev 1")));
    // Back online, as before.
    pool.set_online(2, true).unwrap();
    assert_eq!(aliquot_of(&pool, 0).0, Some(all3));
}

/// A vdev that cannot be read may still drain (DESIGN.md, "A faulted vdev
/// may drain"): OpenZFS refuses to remove it (`EIO`), but Aliquot's mover
/// copies each block through its client from a readable copy, so draining
/// is how the blocks it held get a new copy elsewhere.
#[test]
fn a_faulted_vdev_may_drain() {
    let mut pool = pool3();
    for health in [Health::Faulted, Health::Unavailable] {
        pool.set_health(1, health).unwrap();
        pool.check_drain_room(1)
            .unwrap_or_else(|e| panic!("{health:?}: {e}"));
    }
}
