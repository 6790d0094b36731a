//! What a takeover keeps out of allocation, and for how long. After a
//! restart or a takeover (a new generation) clients re-assert with Claim,
//! during the claim window, the blocks they wrote in txgs that never synced.
//! Instead of holding every Allocate for the whole window, only the space a
//! claim may still take is kept out: each vdev's agent, fenced at its
//! registration (it refuses older tokens from then on), names in its first
//! report the ranges written under older generations' tokens; their free
//! parts are held (`metaslab::Pool::hold`) until claimed or until the window
//! ends, and the vdev serves new allocations at once. A vdev whose agent
//! cannot name them all (it verifies no tokens, or it started after the
//! older generation did) takes no allocation until the window ends. Space
//! handed out but never written needs nothing: its writes are refused by
//! the fenced agents, and their clients allocate again.

use std::time::Instant;

use aliquot_proto::v1 as pb;
use metaslab::Extent;

use crate::state::{Fencing, Inner, Shared};

/// Bit where an allocation id's generation starts (each generation numbers
/// its allocations from `generation << ALLOCATION_ID_GENERATION_SHIFT`).
pub const ALLOCATION_ID_GENERATION_SHIFT: u32 = 40;

/// The first allocation id of `generation`.
pub fn first_allocation_id(generation: u64) -> u64 {
    (generation << ALLOCATION_ID_GENERATION_SHIFT) | 1
}

/// The generation before this one: the one whose txgs may be lost, and
/// the oldest whose blocks a claim may name.
pub fn previous_generation(fencing: &Fencing) -> u64 {
    fencing
        .history
        .range(..fencing.generation)
        .next_back()
        .map_or(fencing.generation.saturating_sub(1), |(g, _)| *g)
}

/// Whether an agent's records cover every write the lost txgs can hold:
/// those of the generation before this one, from its first allocation.
pub fn records_cover(fencing: &Fencing, r: &pb::AgentReport) -> bool {
    let previous = previous_generation(fencing);
    r.older_writes_sent
        && r.older_writes_known
        && r.records_since_allocation_id <= first_allocation_id(previous)
}

/// The first report of `vdev` in this generation, while the claim window is
/// open: hold the ranges its agent names, or keep the vdev out of allocation
/// until the window ends. Returns whether the vdev may serve now.
pub fn first_report(g: &mut Inner, fencing: &Fencing, vdev: u32, r: &pb::AgentReport) -> bool {
    if !records_cover(fencing, r) {
        tracing::warn!(
            vdev,
            sent = r.older_writes_sent,
            known = r.older_writes_known,
            records_since = r.records_since_allocation_id,
            "the agent cannot name every write of the older generation: the vdev takes no \
             allocation until the claim window ends"
        );
        return false;
    }
    let (mut ranges, mut bytes) = (0u64, 0u64);
    // A report names every older write the agent knows, so it replaces
    // what an earlier one (before a re-registration) said: the ranges of a
    // vdev then never overlap, which `claim::check_allocation` relies on.
    g.older_writers.retain(|(v, _), _| *v != vdev);
    for (i, w) in r.older_writes.iter().enumerate() {
        let e = Extent {
            vdev,
            offset: w.offset,
            size: w.size,
        };
        // Who wrote it last, when the agent says (a claim by another
        // allocation is refused); an agent that does not is checked by
        // identity only.
        if let Some(&writer) = r.older_write_allocation_ids.get(i)
            && w.size > 0
        {
            g.older_writers
                .insert((vdev, w.offset), (w.offset.saturating_add(w.size), writer));
        }
        match g.pool.hold(&e) {
            Ok(b) => {
                ranges += 1;
                bytes += b;
            }
            // A range the vdev cannot hold (misaligned, beyond its end):
            // nothing can be claimed there either.
            Err(err) => tracing::warn!(vdev, extent = %e, error = %err, "older write not held"),
        }
    }
    tracing::info!(
        vdev,
        ranges,
        bytes,
        "serving at once; what older generations wrote here is kept for the claim window"
    );
    true
}

/// Called from housekeeping: once the claim window has closed, release
/// what was held and let the vdevs kept out serve.
pub fn check_window(shared: &Shared, now: Instant) {
    match shared.fencing.claim_window_until {
        Some(until) if until <= now => {}
        _ => return,
    }
    let mut g = shared.lock();
    if g.pool.held_bytes() > 0 {
        let bytes = g.pool.release_all_held();
        tracing::info!(bytes, "claim window closed: space kept for claims released");
        g.wake_admitted();
    }
    let out: Vec<u32> = g
        .vdevs
        .iter()
        .filter(|(_, v)| v.window_out)
        .map(|(id, _)| *id)
        .collect();
    for id in out {
        if let Some(v) = g.vdevs.get_mut(&id) {
            v.window_out = false;
        }
        crate::registry::mark_alive(&mut g, id, now, "claim window closed");
    }
}
