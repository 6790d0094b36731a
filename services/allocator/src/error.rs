//! The allocator's errors, and their one mapping to `tonic::Status` at the
//! gRPC edge: each code tells an operator what to do next, and each status
//! carries a `google.rpc.ErrorInfo` whose reason (an `ErrorReason` name of
//! the proto) a client can branch and retry on.

use std::collections::HashMap;

use aliquot_proto::v1::ErrorReason;
use metaslab::{NoSpaceReason, Txg};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every reason.
pub const DOMAIN: &str = "aliquot.v1";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy refused; every such error left the pool unchanged.
    #[error(transparent)]
    Pool(#[from] metaslab::Error),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// RenewLease past `--max-lease-lifetime`.
    #[error(
        "allocation {id} has been in flight for the longest an allocation may \
         ({lifetime_ms} ms, --max-lease-lifetime): commit or abort it, and allocate again"
    )]
    LeaseLifetime { id: u64, lifetime_ms: u64 },
    /// An Allocate past the caller's `--max-leased-per-client`.
    #[error(
        "{caller} holds {held} bytes allocated and not committed; this allocation of {asked} \
         bytes would pass its quota of {quota} bytes (--max-leased-per-client): commit or abort \
         some first"
    )]
    LeaseQuota {
        caller: String,
        held: u64,
        asked: u64,
        quota: u64,
    },
    /// The normal class has no room for the request above its slop
    /// reserve: a pool can be "full" well below 100 % (spec §5.6, OpenZFS's
    /// spa_get_slop_space, which keeps at least 128 MiB or half the pool).
    #[error("{}", full_message(*.size, *.copies, *.space, *.alloc, *.slop, *.deferred))]
    PoolFull {
        size: u64,
        copies: u8,
        space: u64,
        alloc: u64,
        slop: u64,
        deferred: u64,
    },
    /// An allocation in a pool that has no vdev at all.
    #[error(
        "the pool has no vdevs yet: start an agent for each device (aliquot-agent --allocator \
         URL ...) and allocate once it has registered"
    )]
    NoVdevs,
    /// A registration or report that conflicts with what the pool knows.
    #[error("{0}")]
    VdevConflict(String),
    #[error(
        "allocation {0}'s lease expired before its commit: it was aborted and its space deferred; \
         allocate again and rewrite the block"
    )]
    LeaseExpired(u64),
    #[error("{}", restarted_message(*.seen, *.current, *.txg, *.synced, *.window_ms))]
    AllocatorRestarted {
        seen: u64,
        current: u64,
        txg: Txg,
        synced: Txg,
        window_ms: u64,
    },
    #[error(
        "this allocator keeps the pool in SQLite (--data-dir): no standby can take it over; \
         run allocators with --store postgres://… to hand leadership over"
    )]
    NoStandby,
    #[error(
        "claim of {0}: another block was given that extent after the claimed block's txg was \
         lost (an allocation after the claim window closed, or another client owns it); the \
         block claimed is lost (claim within the window, or ask SyncTxg with your txg and \
         generation whether it synced)"
    )]
    ClaimGivenOut(metaslab::Extent),
    #[error(
        "claim of {requested}: {committed} was committed over it in this generation, after the \
         claimed block's txg was lost (it never synced); the claimed block is lost, whoever \
         committed that space"
    )]
    ClaimOverwritten {
        requested: metaslab::Extent,
        committed: metaslab::Extent,
    },
    /// A standby, or a leader whose lease ran out or that was replaced.
    #[error("this allocator does not lead the pool ({why}){}", leader_hint(.leader))]
    NotLeader {
        why: String,
        leader: String,
        generation: u64,
        /// The time left on the leader's lease as this allocator last
        /// read it (0: unknown or ended): when a takeover can start.
        lease_left_ms: u64,
    },
    #[error(
        "generation {seen} is newer than this allocator's ({current}): another allocator serves this pool?"
    )]
    GenerationAhead { seen: u64, current: u64 },
    #[error(
        "claim of {requested} overlaps allocated extents {} and is not exactly one of them: \
         a claim names exactly the extent it was given",
        fmt_extents(.overlapping)
    )]
    ClaimOverlaps {
        requested: metaslab::Extent,
        overlapping: Vec<metaslab::Extent>,
    },
    #[error(
        "free of {requested} is not exactly one committed extent (it overlaps {}): a free names \
         exactly an extent its Allocate or Claim gave, never part of one or a span over several",
        fmt_extents(.overlapping)
    )]
    FreeNotExact {
        requested: metaslab::Extent,
        overlapping: Vec<metaslab::Extent>,
    },
    #[error(
        "no read token for {extent}: it is no committed block ({}); read tokens are granted \
         for exactly a committed block's extent, to its owner or an admin",
        match .freed_txg {
            Some(t) => format!("it was freed in txg {t}: its data belongs to nobody"),
            None => "free space, never allocated or freed, or an allocation not committed".into(),
        }
    )]
    ReadNotCommitted {
        extent: metaslab::Extent,
        freed_txg: Option<Txg>,
    },
    #[error(
        "no read token for {requested}: it overlaps committed blocks {} without being exactly \
         one; ask for each block's own extent",
        fmt_extents(.overlapping)
    )]
    ReadNotExact {
        requested: metaslab::Extent,
        overlapping: Vec<metaslab::Extent>,
    },
    #[error(
        "allocation {id} was made by another identity; only the certificate that allocated it \
         ({caller} is not it) may {action} it"
    )]
    NotOwnerAllocation {
        id: u64,
        caller: String,
        action: &'static str,
    },
    #[error("{message}")]
    NotOwnerDevice { device: u64, message: String },
    #[error(
        "extent {extent} was committed by {owner}; {caller} may not {action} it (only its owner \
         or an admin may)"
    )]
    NotOwnerExtent {
        extent: metaslab::Extent,
        owner: String,
        caller: String,
        action: &'static str,
    },
    #[error("the allocator is shutting down; retry against its successor")]
    ShuttingDown,
    #[error(
        "no rebalance plan while vdevs are not healthy and online ({}): bring them back \
         (or remove them) first",
        .0.join("; ")
    )]
    PoolDegraded(Vec<String>),
    #[error(
        "extent {extent} is being moved by the balancer (relocation {allocation}); wait until \
         that relocation is committed, aborted or expired"
    )]
    RelocationConflict {
        extent: metaslab::Extent,
        allocation: u64,
    },
    #[error("store: {0}")]
    Store(String),
    /// A txg has been persisting longer than a label check may wait for it.
    #[error(
        "a txg sync has been persisting for over {waited_ms} ms; the device's label is \
         checked against the store once it lands: retry"
    )]
    SyncPending { waited_ms: u64 },
    /// A device's label names another pool.
    #[error("{message}")]
    PoolMismatch {
        label_pool_guid: u64,
        pool_guid: u64,
        message: String,
    },
    /// A device's label saw a synced txg this store does not hold: the
    /// store went back in time. Sticky: every data call answers it.
    #[error("{message}")]
    StoreRolledBack {
        vdev: u32,
        label_txg: u64,
        store_txg: u64,
        message: String,
    },
}

fn fmt_extents(v: &[metaslab::Extent]) -> String {
    v.iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// NO_SPACE for data: what is free, how much of it is the slop reserve,
/// and what helps.
fn full_message(size: u64, copies: u8, space: u64, alloc: u64, slop: u64, deferred: u64) -> String {
    let b = units::format_bytes;
    let free = space.saturating_sub(alloc);
    let usable = free.saturating_sub(slop);
    let mut m = format!(
        "no space for {} x{copies}: the pool is full for data: {} free of {} ({:.0} % used), \
         but {} of the free space is the slop reserve (1/2^spa_slop_shift of the pool, at least \
         min(128 MiB, half the pool), kept back as OpenZFS's spa_get_slop_space does), so {} is \
         usable",
        b(size),
        b(free),
        b(space),
        if space == 0 {
            100.0
        } else {
            alloc as f64 * 100.0 / space as f64
        },
        b(slop),
        b(usable)
    );
    if deferred > 0 {
        m.push_str(&format!(
            "; {} freed in the last txgs becomes usable once 2 more txgs sync",
            b(deferred)
        ));
    }
    m.push_str("; free blocks (`aliquotctl free`) or add a vdev");
    m
}

impl Error {
    pub fn code(&self) -> Code {
        use metaslab::Error as M;
        match self {
            Error::Pool(e) => match e {
                M::ZeroSize
                | M::TooLarge(_)
                | M::BadCopies(_)
                | M::PsizeTooLarge { .. }
                | M::BadSizeRange { .. }
                | M::Misaligned(_)
                | M::OutOfRange(_)
                | M::BadTunableValue { .. }
                | M::BadVdev(_) => Code::InvalidArgument,
                M::UnknownVdev(_)
                | M::UnknownAllocation(_)
                | M::UnknownTicket(_)
                | M::UnknownTunable(_) => Code::NotFound,
                M::NotAllocated(_) | M::PartlyAllocated(_) | M::ClaimConflict { .. } => {
                    Code::FailedPrecondition
                }
                M::NoSpace {
                    reason: NoSpaceReason::VdevsOffline,
                    ..
                } => Code::Unavailable,
                M::NoSpace { .. } => Code::ResourceExhausted,
                M::TxgWaitRequired { .. } => Code::Unavailable,
                M::NotAdmitted(_) | M::Inconsistent(_) => Code::Internal,
                M::VdevRemoved(_)
                | M::VdevNotEmpty { .. }
                | M::LastAllocatingVdev(_)
                | M::NoRoomToDrain { .. } => Code::FailedPrecondition,
            },
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::VdevConflict(_)
            | Error::ClaimOverlaps { .. }
            | Error::FreeNotExact { .. }
            | Error::ReadNotCommitted { .. }
            | Error::ReadNotExact { .. } => Code::FailedPrecondition,
            Error::LeaseExpired(_) | Error::AllocatorRestarted { .. } => Code::Aborted,
            Error::LeaseLifetime { .. } => Code::FailedPrecondition,
            Error::LeaseQuota { .. } => Code::ResourceExhausted,
            Error::GenerationAhead { .. } => Code::FailedPrecondition,
            Error::NotOwnerAllocation { .. }
            | Error::NotOwnerDevice { .. }
            | Error::NotOwnerExtent { .. } => Code::PermissionDenied,
            Error::ShuttingDown | Error::NotLeader { .. } | Error::NoVdevs => Code::Unavailable,
            Error::PoolFull { .. } => Code::ResourceExhausted,
            Error::NoStandby | Error::ClaimGivenOut(_) | Error::ClaimOverwritten { .. } => {
                Code::FailedPrecondition
            }
            Error::PoolDegraded(_) | Error::RelocationConflict { .. } => Code::FailedPrecondition,
            Error::Store(_) => Code::Internal,
            Error::SyncPending { .. } => Code::Unavailable,
            Error::PoolMismatch { .. } | Error::StoreRolledBack { .. } => Code::FailedPrecondition,
        }
    }

    /// The machine-readable reason and the values a client needs.
    pub fn reason(&self) -> (ErrorReason, Vec<(&'static str, String)>) {
        use metaslab::Error as M;
        match self {
            Error::Pool(e) => match e {
                M::ZeroSize
                | M::TooLarge(_)
                | M::BadCopies(_)
                | M::PsizeTooLarge { .. }
                | M::BadSizeRange { .. }
                | M::Misaligned(_)
                | M::OutOfRange(_)
                | M::BadTunableValue { .. }
                | M::BadVdev(_) => (ErrorReason::InvalidArgument, vec![]),
                M::UnknownAllocation(id) => (
                    ErrorReason::UnknownAllocation,
                    vec![("allocation_id", id.to_string())],
                ),
                M::UnknownVdev(_) | M::UnknownTicket(_) | M::UnknownTunable(_) => {
                    (ErrorReason::NotFound, vec![])
                }
                M::NotAllocated(e) | M::PartlyAllocated(e) => {
                    (ErrorReason::NotAllocated, vec![("extent", e.to_string())])
                }
                M::ClaimConflict {
                    requested,
                    conflicting,
                } => (
                    ErrorReason::ClaimConflict,
                    vec![
                        ("requested", requested.to_string()),
                        ("conflicting", conflicting.to_string()),
                    ],
                ),
                M::NoSpace { reason, .. } => match reason {
                    NoSpaceReason::VdevsOffline => (ErrorReason::VdevsOffline, vec![]),
                    NoSpaceReason::Full => (ErrorReason::NoSpace, vec![]),
                    NoSpaceReason::Fragmented { largest_free } => (
                        ErrorReason::Fragmented,
                        vec![("largest_free", largest_free.to_string())],
                    ),
                },
                M::TxgWaitRequired { until } => {
                    (ErrorReason::TxgWait, vec![("until", until.to_string())])
                }
                M::NotAdmitted(_) | M::Inconsistent(_) => (ErrorReason::Internal, vec![]),
                M::VdevRemoved(v) => (ErrorReason::VdevRemoved, vec![("vdev", v.to_string())]),
                M::LastAllocatingVdev(v) => (
                    ErrorReason::LastAllocatingVdev,
                    vec![("vdev", v.to_string())],
                ),
                M::NoRoomToDrain {
                    vdev,
                    need,
                    available,
                } => (
                    ErrorReason::NoRoomToDrain,
                    vec![
                        ("vdev", vdev.to_string()),
                        ("need", need.to_string()),
                        ("available", available.to_string()),
                    ],
                ),
                M::VdevNotEmpty {
                    vdev,
                    alloc,
                    online,
                    ..
                } => (
                    ErrorReason::VdevNotEmpty,
                    vec![
                        ("vdev", vdev.to_string()),
                        ("alloc", alloc.to_string()),
                        ("online", online.to_string()),
                    ],
                ),
            },
            Error::InvalidArgument(_) => (ErrorReason::InvalidArgument, vec![]),
            Error::NotFound(_) => (ErrorReason::NotFound, vec![]),
            Error::VdevConflict(_) => (ErrorReason::VdevConflict, vec![]),
            Error::ClaimOverlaps {
                requested,
                overlapping,
            } => (
                ErrorReason::ClaimConflict,
                vec![
                    ("requested", requested.to_string()),
                    ("conflicting", fmt_extents(overlapping)),
                ],
            ),
            Error::FreeNotExact {
                requested,
                overlapping,
            } => (
                ErrorReason::NotAllocated,
                vec![
                    ("requested", requested.to_string()),
                    ("overlapping", fmt_extents(overlapping)),
                ],
            ),
            Error::ReadNotCommitted { extent, freed_txg } => (
                ErrorReason::ReadTokenNotCommitted,
                std::iter::once(("extent", extent.to_string()))
                    .chain(freed_txg.map(|t| ("freed_txg", t.to_string())))
                    .collect(),
            ),
            Error::ReadNotExact {
                requested,
                overlapping,
            } => (
                ErrorReason::ReadTokenNotExact,
                vec![
                    ("requested", requested.to_string()),
                    ("overlapping", fmt_extents(overlapping)),
                ],
            ),
            Error::LeaseExpired(id) => (
                ErrorReason::LeaseExpired,
                vec![("allocation_id", id.to_string())],
            ),
            Error::AllocatorRestarted {
                seen,
                current,
                txg,
                synced,
                window_ms,
            } => (
                ErrorReason::AllocatorRestarted,
                vec![
                    ("seen_generation", seen.to_string()),
                    ("generation", current.to_string()),
                    ("txg", txg.to_string()),
                    ("synced_txg", synced.to_string()),
                    ("claim_window_remaining_ms", window_ms.to_string()),
                ],
            ),
            Error::GenerationAhead { current, .. } => (
                ErrorReason::GenerationMismatch,
                vec![("generation", current.to_string())],
            ),
            Error::NotOwnerAllocation { id, .. } => {
                (ErrorReason::NotOwner, vec![("allocation", id.to_string())])
            }
            Error::NotOwnerExtent { extent, .. } => {
                (ErrorReason::NotOwner, vec![("extent", extent.to_string())])
            }
            Error::NotOwnerDevice { device, .. } => (
                ErrorReason::NotOwner,
                vec![("device", format!("{device:#x}"))],
            ),
            Error::ShuttingDown => (ErrorReason::ShuttingDown, vec![]),
            Error::NoStandby => (ErrorReason::NoStandby, vec![]),
            Error::NoVdevs => (ErrorReason::VdevsOffline, vec![("vdevs", "0".into())]),
            Error::PoolFull {
                space, alloc, slop, ..
            } => (
                ErrorReason::NoSpace,
                vec![
                    ("space", space.to_string()),
                    ("alloc", alloc.to_string()),
                    ("slop", slop.to_string()),
                    (
                        "usable",
                        space
                            .saturating_sub(*alloc)
                            .saturating_sub(*slop)
                            .to_string(),
                    ),
                ],
            ),
            Error::LeaseLifetime { id, lifetime_ms } => (
                ErrorReason::LeaseLifetime,
                vec![
                    ("allocation_id", id.to_string()),
                    ("lifetime_ms", lifetime_ms.to_string()),
                ],
            ),
            Error::LeaseQuota {
                held, asked, quota, ..
            } => (
                ErrorReason::LeaseQuota,
                vec![
                    ("held", held.to_string()),
                    ("asked", asked.to_string()),
                    ("quota", quota.to_string()),
                ],
            ),
            Error::ClaimGivenOut(e) => (
                ErrorReason::ClaimConflict,
                vec![("requested", e.to_string()), ("conflicting", e.to_string())],
            ),
            Error::ClaimOverwritten {
                requested,
                committed,
            } => (
                ErrorReason::ClaimConflict,
                vec![
                    ("requested", requested.to_string()),
                    ("conflicting", committed.to_string()),
                ],
            ),
            Error::NotLeader {
                leader,
                generation,
                lease_left_ms,
                ..
            } => (
                ErrorReason::NotLeader,
                vec![
                    ("leader", leader.clone()),
                    ("generation", generation.to_string()),
                    ("lease_left_ms", lease_left_ms.to_string()),
                ],
            ),
            Error::PoolDegraded(v) => (ErrorReason::PoolDegraded, vec![("vdevs", v.join("; "))]),
            Error::RelocationConflict { extent, allocation } => (
                ErrorReason::RelocationConflict,
                vec![
                    ("extent", extent.to_string()),
                    ("allocation", allocation.to_string()),
                ],
            ),
            Error::Store(_) => (ErrorReason::Store, vec![]),
            Error::SyncPending { waited_ms } => (
                ErrorReason::Store,
                vec![("waited_ms", waited_ms.to_string())],
            ),
            Error::PoolMismatch {
                label_pool_guid,
                pool_guid,
                ..
            } => (
                ErrorReason::PoolMismatch,
                vec![
                    ("label_pool_guid", format!("{label_pool_guid:#x}")),
                    ("pool_guid", format!("{pool_guid:#x}")),
                ],
            ),
            Error::StoreRolledBack {
                vdev,
                label_txg,
                store_txg,
                ..
            } => (
                ErrorReason::StoreRolledBack,
                vec![
                    ("vdev", vdev.to_string()),
                    ("label_txg", label_txg.to_string()),
                    ("store_txg", store_txg.to_string()),
                ],
            ),
        }
    }

    /// The reason's proto name (ErrorInfo.reason, StreamError.reason).
    pub fn reason_name(&self) -> &'static str {
        self.reason().0.as_str_name()
    }
}

fn leader_hint(leader: &str) -> String {
    if leader.is_empty() {
        ": no allocator leads it now; retry shortly".into()
    } else {
        format!(": the leader is {leader}, retry there")
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let (reason, meta) = e.reason();
        let metadata: HashMap<String, String> = meta
            .into_iter()
            .map(|(k, v)| (k.to_string(), clip(v, METADATA_MAX)))
            .collect();
        Status::with_error_details(
            e.code(),
            clip(e.to_string(), MESSAGE_MAX),
            ErrorDetails::with_error_info(reason.as_str_name(), DOMAIN, metadata),
        )
    }
}

/// `AllocatorRestarted`'s message: a commit names no txg (0), so it says
/// what happened to the allocation instead of "before txg 0 synced".
fn restarted_message(seen: u64, current: u64, txg: Txg, synced: Txg, window_ms: u64) -> String {
    if txg == 0 {
        format!(
            "the allocator restarted (generation {current}, you saw {seen}): allocations that \
             were in flight in generation {seen} were lost with it; allocate again and rewrite \
             the block (what you committed after txg {synced}, the last synced in generation \
             {seen}, re-assert with Claim: the claim window is open for {window_ms} ms)"
        )
    } else {
        format!(
            "the allocator restarted (generation {current}, you saw {seen}) before txg {txg} \
             synced; the last txg synced in generation {seen} is {synced}: re-assert what you \
             wrote after it with Claim (the claim window is open for {window_ms} ms)"
        )
    }
}

/// Bytes of a message, and of one ErrorInfo value, sent back: errors echo
/// input (a tunable's name, an endpoint), and an echo of a megabyte would
/// overflow the response's metadata limit and hide the real error.
const MESSAGE_MAX: usize = 2048;
const METADATA_MAX: usize = 256;

/// `s` cut to at most `max` bytes (at a character boundary), marked.
fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let dropped = s.len() - end;
    s.truncate(end);
    s.push_str(&format!("… ({dropped} more bytes)"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_after_a_restart_names_no_txg_0() {
        let e = Error::AllocatorRestarted {
            seen: 1,
            current: 2,
            txg: 0,
            synced: 7,
            window_ms: 900,
        };
        let m = e.to_string();
        assert!(!m.contains("txg 0"), "{m}");
        assert!(m.contains("allocate again"), "{m}");
        assert!(m.contains("txg 7"), "{m}");
    }

    #[test]
    fn echoed_input_is_clipped() {
        let long = "é".repeat(5000);
        let c = clip(long.clone(), MESSAGE_MAX);
        assert!(c.len() < MESSAGE_MAX + 40, "{}", c.len());
        assert!(c.ends_with("more bytes)"));
        assert_eq!(clip("short".into(), 10), "short");
    }
}
