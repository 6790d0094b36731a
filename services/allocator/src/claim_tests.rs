//! Claim's allocation rule (`check_allocation` via `Inner::claim_one`):
//! writers sharing one identity never both own an extent after a
//! takeover, and a retry of the same claim is still answered.

use metaslab::Extent;

use crate::error::Error;
use crate::state::tests::inner;
use crate::takeover::ALLOCATION_ID_GENERATION_SHIFT as SHIFT;

/// Allocation `n` of `generation`.
fn id(generation: u64, n: u64) -> u64 {
    (generation << SHIFT) | n
}

fn x() -> Extent {
    Extent {
        vdev: 0,
        offset: 1 << 20,
        size: 8192,
    }
}

/// Generation 5 lost its txgs; this one (6) serves their claims.
const PREVIOUS: u64 = 5;

/// Twins in one window: A and B (one identity) were both given X in the
/// previous generation, B wrote it last (its agent says so). B's claim is
/// accepted, before or after A's, and A's is refused; B's retry answers.
#[test]
fn only_the_last_writer_of_an_extent_named_by_its_agent_claims_it() {
    let (a, b) = (id(PREVIOUS, 7), id(PREVIOUS, 9));
    let mut g = inner();
    g.pool.hold(&x()).unwrap();
    g.older_writers
        .insert((0, x().offset), (x().offset + x().size, b));
    let r = g.claim_one(x(), Some("pool"), a, PREVIOUS);
    assert!(
        matches!(r, Err(Error::ClaimWrittenByAnother { writer, .. }) if writer == b),
        "{r:?}"
    );
    let t = g
        .claim_one(x(), Some("pool"), b, PREVIOUS)
        .expect("B wrote it");
    assert_eq!(g.claim_one(x(), Some("pool"), b, PREVIOUS).unwrap(), t);
    assert!(g.claim_one(x(), Some("pool"), a, PREVIOUS).is_err());
}

/// Part of the extent overwritten by another allocation is enough to
/// refuse; a range the agent names with a generation only (a write taken
/// without a token, writer unknown) refuses nobody.
#[test]
fn a_partial_overwrite_refuses_and_an_unknown_writer_does_not() {
    let (a, b) = (id(PREVIOUS, 7), id(PREVIOUS, 9));
    let mut g = inner();
    let off = x().offset;
    g.older_writers.insert((0, off - 4096), (off + 4096, a));
    g.older_writers.insert((0, off + 4096), (off + 8192, b));
    assert!(matches!(
        g.claim_one(x(), Some("pool"), a, PREVIOUS),
        Err(Error::ClaimWrittenByAnother { .. })
    ));
    let mut g = inner();
    g.older_writers
        .insert((0, off), (off + 8192, PREVIOUS << SHIFT));
    g.claim_one(x(), Some("pool"), a, PREVIOUS).unwrap();
}

/// Twins the agents cannot tell apart (nothing named): the first claim
/// takes the extent, a claim for another allocation is refused, the first
/// one's retry answers.
#[test]
fn an_extent_claimed_for_one_allocation_is_refused_to_another() {
    let (a, b) = (id(PREVIOUS, 7), id(PREVIOUS, 9));
    let mut g = inner();
    let t = g.claim_one(x(), Some("pool"), a, PREVIOUS).unwrap();
    let r = g.claim_one(x(), Some("pool"), b, PREVIOUS);
    assert!(
        matches!(r, Err(Error::ClaimedForAnother { claimed_for, .. }) if claimed_for == a),
        "{r:?}"
    );
    assert_eq!(g.claim_one(x(), Some("pool"), a, PREVIOUS).unwrap(), t);
    // Claimed without an id: a later claim naming one cannot be told to
    // be the same writer's.
    let y = Extent {
        offset: 4 << 20,
        ..x()
    };
    g.claim_one(y, Some("pool"), 0, PREVIOUS).unwrap();
    assert!(matches!(
        g.claim_one(y, Some("pool"), a, PREVIOUS),
        Err(Error::ClaimedForAnother { claimed_for: 0, .. })
    ));
}

/// Straddling generations: an allocation older than the generation
/// before this one is refused (its space may have been committed to
/// another block in between); the previous generation's is not.
#[test]
fn an_allocation_older_than_the_previous_generation_is_refused() {
    let mut g = inner();
    let r = g.claim_one(x(), Some("pool"), id(PREVIOUS - 1, 3), PREVIOUS);
    assert!(
        matches!(
            r,
            Err(Error::ClaimTooOld {
                generation: 4,
                previous: 5,
                ..
            })
        ),
        "{r:?}"
    );
    g.claim_one(x(), Some("pool"), id(PREVIOUS, 3), PREVIOUS)
        .unwrap();
}

/// No id (0): checked by identity only, as before ids were sent; two such
/// claims of one extent by one identity are both accepted, which is why
/// writers sharing an identity must name their allocations.
#[test]
fn claims_without_an_allocation_id_are_checked_by_identity_only() {
    let mut g = inner();
    g.older_writers
        .insert((0, x().offset), (x().offset + x().size, id(PREVIOUS, 9)));
    let t = g.claim_one(x(), Some("pool"), 0, PREVIOUS).unwrap();
    assert_eq!(g.claim_one(x(), Some("pool"), 0, PREVIOUS).unwrap(), t);
}

/// The path from an agent's first report: the ranges it names are held
/// with their last writers, and a later report replaces them.
#[test]
fn an_agents_first_report_names_the_writers_a_claim_is_checked_against() {
    use aliquot_proto::v1 as pb;
    let (a, b) = (id(PREVIOUS, 7), id(PREVIOUS, 9));
    let fencing = crate::state::Fencing {
        generation: PREVIOUS + 1,
        synced_at_open: 0,
        claim_window_until: None,
        history: Default::default(),
        rewind_generation: 0,
    };
    let report = |writer: u64| pb::AgentReport {
        vdev: 0,
        older_writes_sent: true,
        older_writes_known: true,
        records_since_allocation_id: 1,
        older_writes: vec![pb::Extent {
            vdev: 0,
            offset: x().offset,
            size: x().size,
        }],
        older_write_allocation_ids: vec![writer],
        ..Default::default()
    };
    let mut g = inner();
    assert!(crate::takeover::first_report(
        &mut g,
        &fencing,
        0,
        &report(a)
    ));
    assert!(crate::takeover::first_report(
        &mut g,
        &fencing,
        0,
        &report(b)
    ));
    assert_eq!(g.pool.held_bytes(), x().size);
    assert!(matches!(
        g.claim_one(x(), Some("pool"), a, PREVIOUS),
        Err(Error::ClaimWrittenByAnother { writer, .. }) if writer == b
    ));
    g.claim_one(x(), Some("pool"), b, PREVIOUS).unwrap();
}
