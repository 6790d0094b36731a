//! Claim's exact-boundary rule. The pool's space maps know which bytes are
//! allocated, not where one block ends and the next begins; the store (and,
//! for txgs not yet persisted, `Inner::recent_allocs`) does. A claim of
//! allocated space succeeds only when it names exactly one allocated extent
//! (a retry, or a block that did sync); a sub-range of an extent or a span
//! across extents fails naming the extents it overlaps.

use metaslab::Extent;

use crate::error::{Error, Result};
use crate::state::{Inner, Shared};

/// Refuse claims that overlap allocated extents other than exactly
/// themselves. Runs before the pool is asked, which then rules on free,
/// in-flight and deferred space.
pub async fn check_exact(shared: &Shared, extents: &[Extent]) -> Result<()> {
    for e in extents {
        // Exactly an extent an Allocate of THIS generation committed: the
        // claimed block's own txg was lost and its space given out again
        // (a claim after the claim window). A no-op here would tell the
        // claimant its block is safe while another block owns the bytes.
        let given_out = shared
            .lock()
            .recent_allocs
            .get(&(e.vdev, e.offset))
            .is_some_and(|&(size, _, claimed)| size == e.size && !claimed);
        if given_out {
            return Err(Error::ClaimGivenOut(*e));
        }
        let overlapping = committed_overlapping(shared, e).await?;
        if overlapping.is_empty() || overlapping == [*e] {
            continue;
        }
        return Err(Error::ClaimOverlaps {
            requested: *e,
            overlapping,
        });
    }
    Ok(())
}

/// Free's exact-boundary rule: a free of committed space names exactly one
/// committed (or claimed) extent. Without it a client could free a range
/// spanning other clients' blocks, or part of one, whose space would then be
/// handed out again while its data is live.
pub async fn check_free_exact(shared: &Shared, extents: &[Extent]) -> Result<()> {
    // Not yet persisted first, then the store: a txg that syncs in between
    // is then seen in one or both, never in neither.
    let recent: Vec<Vec<Extent>> = {
        let g = shared.lock();
        extents.iter().map(|e| recent_overlapping(&g, e)).collect()
    };
    // The store's part for the whole request at once: one query per span
    // of extents, not one per extent (a bulk Free of a run of blocks).
    let stored = shared
        .store
        .allocated_overlapping_many(extents)
        .await
        .map_err(|err| Error::Store(err.to_string()))?;
    for ((e, mut overlapping), stored) in extents.iter().zip(recent).zip(stored) {
        merge(&mut overlapping, stored);
        // None: not committed at all, which the pool rules on (a retried
        // free, free space, or an allocation in flight: NOT_ALLOCATED).
        if overlapping.is_empty() || overlapping == [*e] {
            continue;
        }
        return Err(Error::FreeNotExact {
            requested: *e,
            overlapping,
        });
    }
    Ok(())
}

/// Relocate's rule: the extent to move is exactly one committed (or
/// claimed) extent; anything else names nothing the mover may move.
pub async fn check_relocatable(shared: &Shared, e: &Extent) -> Result<()> {
    let overlapping = committed_overlapping(shared, e).await?;
    if overlapping == [*e] {
        return Ok(());
    }
    if overlapping.is_empty() {
        return Err(metaslab::Error::NotAllocated(*e).into());
    }
    Err(Error::FreeNotExact {
        requested: *e,
        overlapping,
    })
}

/// The committed (or claimed) extents `e` overlaps: the store's, as of the
/// last synced txg, and those of txgs not yet persisted.
async fn committed_overlapping(shared: &Shared, e: &Extent) -> Result<Vec<Extent>> {
    let mut overlapping = recent_overlapping(&shared.lock(), e);
    let stored = shared
        .store
        .allocated_overlapping(*e)
        .await
        .map_err(|err| Error::Store(err.to_string()))?;
    merge(&mut overlapping, stored);
    Ok(overlapping)
}

/// The extents of txgs not yet persisted that `e` overlaps (the caller
/// holds the lock: Free asks for a whole request under one).
pub(crate) fn recent_overlapping(g: &Inner, e: &Extent) -> Vec<Extent> {
    let end = e.offset.saturating_add(e.size);
    g.recent_allocs
        .range((e.vdev, 0)..(e.vdev, end))
        .filter(|((_, off), (size, _, _))| off + size > e.offset)
        .map(|(&(vdev, offset), &(size, _, _))| Extent { vdev, offset, size })
        .collect()
}

/// `stored` added to `overlapping`, in order, once each.
pub(crate) fn merge(overlapping: &mut Vec<Extent>, stored: Vec<Extent>) {
    overlapping.extend(stored);
    overlapping.sort();
    overlapping.dedup();
}
