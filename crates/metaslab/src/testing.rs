//! Shorthands for the tests and benches of the policy and of the crates
//! built on it (feature `testing`, which their dev-dependencies enable):
//! the plain single-disk vdev most of them use, a request, a synced pool
//! of such vdevs, an extent, and placing a request that must not queue.

use crate::{
    AllocKind, AllocRequest, Allocation, Extent, Pool, Result, Submitted, Tunables, VdevId,
    VdevRole, VdevSpec,
};

/// A single-disk normal vdev of `capacity` bytes, 4 KiB sectors, the
/// metaslab size left to the policy.
pub fn disk(capacity: u64) -> VdevSpec {
    VdevSpec {
        capacity,
        ashift: 12,
        children: 1,
        parity: 0,
        rotational: false,
        role: VdevRole::Normal,
        metaslab_shift: None,
    }
}

/// A request of `kind` for `size` bytes in `copies` copies, no affinity.
pub fn req(kind: AllocKind, size: u64, copies: u8) -> AllocRequest {
    AllocRequest {
        kind,
        size,
        copies,
        max_size: None,
        affinity: None,
    }
}

/// A data request (see [`req`]).
pub fn data(size: u64, copies: u8) -> AllocRequest {
    req(AllocKind::Data, size, copies)
}

/// A pool of default tunables with one [`disk`] per capacity, synced once
/// so their metaslabs are usable.
pub fn pool_of(capacities: &[u64]) -> Pool {
    let mut p = Pool::new(Tunables::default());
    for &c in capacities {
        p.add_vdev(disk(c)).expect("a valid vdev");
    }
    p.sync();
    p
}

/// Bytes `offset..offset + size` of `vdev`.
pub fn ext(vdev: VdevId, offset: u64, size: u64) -> Extent {
    Extent { vdev, offset, size }
}

/// Submit and place at once, not busy; panics if the throttle queues it.
pub fn place(pool: &mut Pool, r: AllocRequest) -> Result<Allocation> {
    place_busy(pool, r, false)
}

/// Submit and place at once (`busy` as the caller would pass it); panics if
/// the throttle queues it.
pub fn place_busy(pool: &mut Pool, r: AllocRequest, busy: bool) -> Result<Allocation> {
    match pool.submit(r)? {
        Submitted::Ready(t) => pool.allocate(t, busy),
        Submitted::Queued(t) => panic!("ticket {t} queued"),
    }
}
