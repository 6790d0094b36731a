//! End-to-end behaviour of the simple path: add vdevs, submit, allocate,
//! commit, free, sync, stats, restore.

use metaslab::testing::{data, disk, place};
use metaslab::*;

const GIB: u64 = 1 << 30;

#[test]
fn simple_path() {
    let mut pool = Pool::new(Tunables::default());
    let a = pool.add_vdev(disk(4 * GIB)).unwrap();
    let b = pool.add_vdev(disk(4 * GIB)).unwrap();
    assert_eq!((a, b), (0, 1));
    // New metaslabs are unusable until the next sync.
    assert!(matches!(
        place(&mut pool, data(4096, 1)),
        Err(Error::NoSpace { .. })
    ));
    let s = pool.sync();
    assert_eq!(s.txg, TXG_INITIAL);
    assert!(s.changes.is_empty());
    let x = place(&mut pool, data(128 << 10, 2)).unwrap();
    assert_eq!(x.extents.len(), 2);
    assert_ne!(x.extents[0].vdev, x.extents[1].vdev);
    assert_eq!(x.txg, TXG_INITIAL + 1);
    let txg = pool.commit(x.id).unwrap();
    assert_eq!(txg, TXG_INITIAL + 1);
    assert_eq!(pool.commit(x.id), Err(Error::UnknownAllocation(x.id)));
    pool.verify().unwrap();
    let st = pool.stats();
    assert_eq!(st.classes[0].alloc, 2 * (128 << 10));
    assert_eq!(st.classes[0].space, 8 * GIB);
    let s = pool.sync();
    assert_eq!(s.changes.len(), 2);
    assert!(s.changes.iter().all(|c| c.kind == SpaceChangeKind::Alloc));
    // Free, then double free.
    pool.free(&x.extents).unwrap();
    assert!(matches!(
        pool.free(&x.extents[..1]),
        Err(Error::NotAllocated(_))
    ));
    let s = pool.sync();
    assert_eq!(s.changes.len(), 2);
    assert_eq!(s.undeferred_bytes, 0);
    assert_eq!(pool.stats().classes[0].alloc, 2 * (128 << 10)); // deferred counts
    assert_eq!(pool.sync().undeferred_bytes, 0);
    assert_eq!(pool.sync().undeferred_bytes, 2 * (128 << 10));
    assert_eq!(pool.stats().classes[0].alloc, 0);
    pool.verify().unwrap();
}

#[test]
fn errors_leave_state_unchanged() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    assert_eq!(pool.submit(data(0, 1)), Err(Error::ZeroSize));
    assert_eq!(
        pool.submit(data(SPA_MAXBLOCKSIZE + 1, 1)),
        Err(Error::TooLarge(SPA_MAXBLOCKSIZE + 1))
    );
    assert_eq!(pool.submit(data(4096, 4)), Err(Error::BadCopies(4)));
    // One vdev: ditto copies go to distinct metaslabs of it (OpenZFS).
    let d = place(&mut pool, data(4096, 2)).unwrap();
    assert_eq!(d.extents[0].vdev, d.extents[1].vdev);
    pool.abort(d.id).unwrap();
    let x = place(&mut pool, data(8192, 1)).unwrap();
    pool.commit(x.id).unwrap();
    let e = x.extents[0];
    let bad = Extent {
        offset: e.offset + 512,
        ..e
    };
    assert_eq!(pool.free(&[bad]), Err(Error::Misaligned(bad)));
    let wide = Extent {
        size: e.size * 2,
        ..e
    };
    assert_eq!(pool.free(&[wide]), Err(Error::PartlyAllocated(wide)));
    assert_eq!(pool.free(&[e, wide]), Err(Error::PartlyAllocated(wide)));
    let out = Extent {
        vdev: 0,
        offset: 4 * GIB,
        size: 4096,
    };
    assert_eq!(pool.free(&[out]), Err(Error::OutOfRange(out)));
    assert_eq!(
        pool.free(&[Extent { vdev: 9, ..e }]),
        Err(Error::UnknownVdev(9))
    );
    let before = pool.stats();
    assert_eq!(before.classes[0].alloc, 8192);
    // Claim of already-allocated space is fine; of a partly allocated range a conflict.
    pool.claim(&[e]).unwrap();
    assert!(matches!(
        pool.claim(&[wide]),
        Err(Error::ClaimConflict { .. })
    ));
    assert_eq!(pool.stats(), before);
    pool.verify().unwrap();
}

#[test]
fn restore_rebuilds_and_rejects_overlaps() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    let x = place(&mut pool, data(1 << 20, 1)).unwrap();
    pool.commit(x.id).unwrap();
    pool.sync();
    let vdevs: Vec<_> = pool
        .stats()
        .vdevs
        .iter()
        .map(|v| (v.id, v.spec.clone()))
        .collect();
    let r = Pool::restore(Tunables::default(), vdevs.clone(), &x.extents, 10).unwrap();
    assert_eq!(r.open_txg(), 11);
    assert_eq!(r.stats().classes[0].alloc, 1 << 20);
    r.verify().unwrap();
    let e = x.extents[0];
    let overl = Extent {
        offset: e.offset + 4096,
        size: 4096,
        ..e
    };
    assert!(matches!(
        Pool::restore(Tunables::default(), vdevs.clone(), &[e, overl], 10),
        Err(Error::Inconsistent(m)) if m.contains(&overl.to_string())
    ));
    let out = Extent {
        vdev: 0,
        offset: 4 * GIB,
        size: 4096,
    };
    assert!(matches!(
        Pool::restore(Tunables::default(), vdevs, &[out], 10),
        Err(Error::Inconsistent(m)) if m.contains(&out.to_string())
    ));
}

#[test]
fn log_allocations_fall_back() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    pool.sync();
    let log = AllocRequest {
        kind: AllocKind::Log,
        size: 4096,
        copies: 1,
        max_size: None,
        affinity: None,
    };
    let Submitted::Ready(t) = pool.submit(log).unwrap() else {
        panic!()
    };
    let a = pool.allocate(t, false).unwrap();
    // ≤ 64 metaslabs: no embedded log metaslab, so the normal class serves it.
    assert_eq!(a.tier, Some(LogTier::Normal));
    assert_eq!(pool.stats().vdevs[0].embedded_log_metaslab, None);
}

#[test]
fn pool_is_send() {
    fn is_send<T: Send>() {}
    is_send::<Pool>();
}

/// A txg's changes are checked against the in-memory space maps as it
/// closes: the pool's own are marked checked; changes that do not fit them
/// (what a store would refuse) are named.
#[test]
fn a_txg_s_changes_are_checked_against_the_space_maps() {
    let mut pool = Pool::new(Tunables::default());
    pool.add_vdev(disk(4 * GIB)).unwrap();
    assert!(pool.sync().checked);
    let x = place(&mut pool, data(128 << 10, 1)).unwrap();
    pool.commit(x.id).unwrap();
    let e = x.extents[0];
    let s = pool.sync();
    assert!(s.checked && s.changes.len() == 1);
    let change = |kind, extent| SpaceChange { kind, extent };
    use SpaceChangeKind::{Alloc, Free};
    let next = Extent {
        offset: e.offset + e.size,
        ..e
    };
    // Space never allocated: neither allocated nor freed by a txg.
    assert_eq!(pool.txg_changes_fit(&[change(Alloc, next)]), Err(next));
    assert_eq!(pool.txg_changes_fit(&[change(Free, next)]), Err(next));
    // Allocated space not freed in this txg cannot be freed by it.
    assert_eq!(pool.txg_changes_fit(&[change(Free, e)]), Err(e));
    // A vdev the pool does not have.
    let elsewhere = Extent { vdev: 9, ..e };
    assert_eq!(
        pool.txg_changes_fit(&[change(Alloc, elsewhere)]),
        Err(elsewhere)
    );
    // Freed in this txg: fits once, not twice; and it is not allocated
    // again by the txg twice either.
    pool.free(&x.extents).unwrap();
    assert_eq!(pool.txg_changes_fit(&[change(Free, e)]), Ok(()));
    assert_eq!(
        pool.txg_changes_fit(&[change(Free, e), change(Free, e)]),
        Err(e)
    );
    assert_eq!(
        pool.txg_changes_fit(&[change(Alloc, e), change(Alloc, e)]),
        Err(e)
    );
    let s = pool.sync();
    assert!(s.checked && s.changes == vec![change(Free, e)]);
    // Deferred now: neither allocatable nor freeable by a txg.
    assert_eq!(pool.txg_changes_fit(&[change(Alloc, e)]), Err(e));
    assert_eq!(pool.txg_changes_fit(&[change(Free, e)]), Err(e));
}
