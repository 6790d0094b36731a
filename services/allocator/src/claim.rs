//! Claim's exact-boundary rule. The pool's space maps know which bytes are
//! allocated, not where one block ends and the next begins; the store (and,
//! for txgs not yet persisted, `Inner::recent_allocs`) does. A claim of
//! allocated space succeeds only when it names exactly one allocated extent
//! (a retry, or a block that did sync); a sub-range of an extent or a span
//! across extents fails naming the extents it overlaps. A claim overlapping
//! anything this generation committed fails too, exact or not
//! (`crate::gen_space`). Writers that share one identity are told apart
//! by the allocation id each claim names (`check_allocation`).

use metaslab::Extent;

use crate::error::{Error, Result};
use crate::state::{Inner, Shared};

/// Each extent's answer to the store's half of the rule: refused when it
/// overlaps committed extents other than exactly itself. Runs before the
/// pool is asked, which then rules on free, in-flight and deferred space;
/// what this generation committed is checked with the pool, under one lock
/// ([`Inner::claim_one`]). Err: the store could not answer at all.
pub async fn check_each(shared: &Shared, extents: &[Extent]) -> Result<Vec<Result<()>>> {
    let recent: Vec<Vec<Extent>> = {
        let g = shared.lock();
        extents.iter().map(|e| recent_overlapping(&g, e)).collect()
    };
    let stored = shared
        .store
        .allocated_overlapping_many(extents)
        .await
        .map_err(|err| Error::Store(err.to_string()))?;
    Ok(extents
        .iter()
        .zip(recent)
        .zip(stored)
        .map(|((e, mut overlapping), stored)| {
            merge(&mut overlapping, stored);
            if overlapping.is_empty() || overlapping == [*e] {
                Ok(())
            } else {
                Err(Error::ClaimOverlaps {
                    requested: *e,
                    overlapping,
                })
            }
        })
        .collect())
}

/// Whether allocation `allocation_id` may claim `e` (under the lock, with
/// the pool's half of the rule): refused when it is older than generation
/// `previous` (the window serves the lost txgs of the generation before
/// this one only; an older block's space may have been committed to
/// another in between), when `e` was claimed in this generation for
/// another allocation, or when another allocation wrote over part of `e`
/// last (its agent named it, `crate::takeover`): two writers that share
/// an identity then never both own the extent. 0 names no allocation and
/// is checked by identity only (unsafe for writers sharing one identity).
pub(crate) fn check_allocation(
    g: &Inner,
    previous: u64,
    e: &Extent,
    allocation_id: u64,
) -> Result<()> {
    use crate::takeover::ALLOCATION_ID_GENERATION_SHIFT as SHIFT;
    if allocation_id == 0 {
        return Ok(());
    }
    let generation = allocation_id >> SHIFT;
    if generation < previous {
        return Err(Error::ClaimTooOld {
            requested: *e,
            allocation_id,
            generation,
            previous,
        });
    }
    if let Some(&claimed_for) = g.gen_claims.get(e)
        && claimed_for != allocation_id
    {
        return Err(Error::ClaimedForAnother {
            requested: *e,
            allocation_id,
            claimed_for,
        });
    }
    let end = e.offset.saturating_add(e.size);
    // Ranges do not overlap each other (the agent's record splits them),
    // so only the last one starting before `e` can reach into it.
    let from = g
        .older_writers
        .range((e.vdev, 0)..(e.vdev, e.offset))
        .next_back()
        .map_or(e.offset, |(&(_, off), _)| off);
    let other = g
        .older_writers
        .range((e.vdev, from)..(e.vdev, end))
        .filter(|&(&(_, off), &(w_end, _))| w_end > e.offset && off < end)
        // Low bits zero: a write taken without a token, writer unknown.
        .find(|&(_, &(_, writer))| writer & ((1 << SHIFT) - 1) != 0 && writer != allocation_id);
    if let Some((&(vdev, offset), &(w_end, writer))) = other {
        return Err(Error::ClaimWrittenByAnother {
            requested: *e,
            allocation_id,
            written: Extent {
                vdev,
                offset,
                size: w_end - offset,
            },
            writer,
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
    // Only entries starting within the largest size below `e` can reach
    // it. Read from offset 0, a Free of 4096 blocks walked every pending
    // allocation below each of them under the lock: 50-70 ms during which
    // no other client could allocate or commit.
    let from = e.offset.saturating_sub(g.recent_alloc_max);
    g.recent_allocs
        .range((e.vdev, from)..(e.vdev, end))
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

#[cfg(test)]
#[path = "claim_tests.rs"]
mod tests;
