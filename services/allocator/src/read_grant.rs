//! ReadTokens' rule: a read capability is granted only for exactly a
//! committed block's extent (to its owner or an admin: the caller checks
//! that), never for free space, never-allocated space, a block whose Free
//! has not synced yet, or an allocation still in flight: a token there
//! would read whatever the space holds, someone else's next block included.
//!
//! A granted token also carries the first allocation id not yet given out
//! when it was minted (in the grant's `allocation_id` field). Space is given
//! out again only after the block was freed, so whatever writes over its
//! bytes later is of a newer allocation; an agent that saw such a write
//! refuses the older read token there (`READ_TOKEN_SUPERSEDED`), as write
//! tokens die with their block.

use metaslab::Extent;

use crate::claim::{merge, recent_overlapping};
use crate::error::{Error, Result};
use crate::state::Shared;

/// The floor to put in read tokens: read before the extents are checked,
/// so an allocation that reuses their space after a Free the check did not
/// see yet has an id at or above it.
pub fn watermark(shared: &Shared) -> u64 {
    shared.lock().pool.next_allocation_id()
}

/// Refuse anything but exactly committed blocks.
pub async fn check_committed(shared: &Shared, extents: &[Extent]) -> Result<()> {
    // Not yet persisted first, then the store: a txg that syncs in between
    // is then seen in one or both, never in neither (`claim`'s order).
    let recent: Vec<(Vec<Extent>, Option<metaslab::Txg>)> = {
        let g = shared.lock();
        extents
            .iter()
            .map(|e| (recent_overlapping(&g, e), g.recent_frees.get(e).copied()))
            .collect()
    };
    let stored = shared
        .store
        .allocated_overlapping_many(extents)
        .await
        .map_err(|err| Error::Store(err.to_string()))?;
    for ((e, (mut overlapping, freed)), stored) in extents.iter().zip(recent).zip(stored) {
        if freed.is_some() {
            // Freed in a txg not synced yet: the store still lists it.
            return Err(Error::ReadNotCommitted {
                extent: *e,
                freed_txg: freed,
            });
        }
        merge(&mut overlapping, stored);
        if overlapping == [*e] {
            continue;
        }
        if overlapping.is_empty() {
            return Err(Error::ReadNotCommitted {
                extent: *e,
                freed_txg: None,
            });
        }
        return Err(Error::ReadNotExact {
            requested: *e,
            overlapping,
        });
    }
    Ok(())
}
