//! The allocator's errors, and their one table (`Error::refusal`) mapping
//! each to a `tonic::Status` at the gRPC edge: each code tells an operator
//! what to do next, and each status carries a `google.rpc.ErrorInfo` whose
//! reason (an `ErrorReason` of the proto) and values a client can branch on,
//! with a `google.rpc.RetryInfo` when the same call may be repeated.

use std::time::Duration;

use aliquot_proto::error::Refusal;
use aliquot_proto::v1::ErrorReason;
use metaslab::{NoSpaceReason, Txg};
use tonic::{Code, Status};

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
    /// reserve: a pool can be "full" well below 100 % (OpenZFS's
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
    #[error(
        "claim of {requested} for allocation {allocation_id}: that allocation is of generation \
         {generation}, older than generation {previous} whose lost txgs this window serves (its \
         space may have been committed to another block since); the block is lost"
    )]
    ClaimTooOld {
        requested: metaslab::Extent,
        allocation_id: u64,
        generation: u64,
        previous: u64,
    },
    #[error(
        "claim of {requested} for allocation {allocation_id}: it was claimed in this generation \
         for allocation {claimed_for} (another writer, perhaps with the same identity, was given \
         the same extent); the block of allocation {allocation_id} is lost"
    )]
    ClaimedForAnother {
        requested: metaslab::Extent,
        allocation_id: u64,
        claimed_for: u64,
    },
    #[error(
        "claim of {requested} for allocation {allocation_id}: the vdev's agent says allocation \
         {writer} wrote {written} last (the extent was given again after this allocation's lease \
         ended); the block of allocation {allocation_id} is lost, its bytes are another block's"
    )]
    ClaimWrittenByAnother {
        requested: metaslab::Extent,
        allocation_id: u64,
        written: metaslab::Extent,
        writer: u64,
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
    /// A new device registered by an agent certificate no operator admitted.
    #[error("{message}")]
    VdevPending {
        device: u64,
        name: String,
        message: String,
    },
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
        "extent {extent} is being moved (relocation {allocation}: the balancer's, or a vdev \
         removal's mover); retry once that move is committed, aborted or expired (moves take \
         seconds)"
    )]
    RelocationConflict {
        extent: metaslab::Extent,
        allocation: u64,
    },
    #[error(
        "extent {0} is not the old address of a moved block (nothing to remap: it was never \
         moved, already remapped, or freed)"
    )]
    NotMapped(metaslab::Extent),
    #[error(
        "extent {0} is a moved block's old address, or its new home moved by a Relocate that \
         would free it: Remap it (or free it) before moving it, or move the new home with \
         keep_address"
    )]
    MappedExtent(metaslab::Extent),
    /// RemoveVdev while the mover evacuates another vdev.
    #[error(
        "vdev {running} is being removed (its blocks are being moved): one removal at a time; \
         remove vdev {asked} once `aliquotctl status` shows vdev {running}'s evacuation done"
    )]
    EvacuationRunning { running: u32, asked: u32 },
    /// RemoveVdev of a vdev whose blocks the other vdevs cannot hold.
    #[error(
        "vdev {vdev} cannot be removed: its {} of blocks do not fit on the other vdevs, which \
         can take {} more (slop kept back): {} missing; add a vdev or free blocks first \
         (nothing was moved)",
        units::format_bytes(*need),
        units::format_bytes(*available),
        units::format_bytes(need - available)
    )]
    NoRoomToEvacuate {
        vdev: u32,
        need: u64,
        available: u64,
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

/// Agents report once a second: a vdev back online, a new leader or a
/// finished sync is known within about this long.
const RETRY_SOON: Duration = Duration::from_secs(1);

impl Error {
    /// The one table: each error's code, reason, values and whether the
    /// same call may be repeated (the message is `Display`).
    pub fn refusal(&self) -> Refusal {
        use ErrorReason as R;
        use metaslab::Error as M;
        let r = Refusal::new;
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
                | M::BadVdev(_) => r(Code::InvalidArgument, R::InvalidArgument),
                M::UnknownAllocation(id) => {
                    r(Code::NotFound, R::UnknownAllocation).with("allocation_id", id)
                }
                M::UnknownVdev(_) | M::UnknownTicket(_) | M::UnknownTunable(_) => {
                    r(Code::NotFound, R::NotFound)
                }
                M::NotAllocated(e) | M::PartlyAllocated(e) => {
                    r(Code::FailedPrecondition, R::NotAllocated).with("extent", e)
                }
                M::ClaimConflict {
                    requested,
                    conflicting,
                } => r(Code::FailedPrecondition, R::ClaimConflict)
                    .with("requested", requested)
                    .with("conflicting", conflicting),
                M::NoSpace { reason, .. } => match reason {
                    NoSpaceReason::VdevsOffline => {
                        r(Code::Unavailable, R::VdevsOffline).retry_after(RETRY_SOON)
                    }
                    NoSpaceReason::Full => r(Code::ResourceExhausted, R::NoSpace),
                    NoSpaceReason::Fragmented { largest_free } => {
                        r(Code::ResourceExhausted, R::Fragmented).with("largest_free", largest_free)
                    }
                },
                // Not a plain retry: SyncTxg(until) first.
                M::TxgWaitRequired { until } => {
                    r(Code::Unavailable, R::TxgWait).with("until", until)
                }
                M::NotAdmitted(_) | M::Inconsistent(_) => r(Code::Internal, R::Internal),
                M::VdevRemoved(v) => r(Code::FailedPrecondition, R::VdevRemoved).with("vdev", v),
                M::LastVdev(v) => r(Code::FailedPrecondition, R::LastVdev).with("vdev", v),
                M::LastAllocatingVdev(v) => {
                    r(Code::FailedPrecondition, R::LastAllocatingVdev).with("vdev", v)
                }
                M::NoRoomToDrain {
                    vdev,
                    need,
                    available,
                } => r(Code::FailedPrecondition, R::NoRoomToDrain)
                    .with("vdev", vdev)
                    .with("need", need)
                    .with("available", available),
                M::VdevNotEmpty {
                    vdev,
                    alloc,
                    online,
                    ..
                } => r(Code::FailedPrecondition, R::VdevNotEmpty)
                    .with("vdev", vdev)
                    .with("alloc", alloc)
                    .with("online", online),
            },
            Error::InvalidArgument(_) => r(Code::InvalidArgument, R::InvalidArgument),
            Error::NotFound(_) => r(Code::NotFound, R::NotFound),
            Error::VdevConflict(_) => r(Code::FailedPrecondition, R::VdevConflict),
            Error::ClaimOverlaps {
                requested,
                overlapping,
            } => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", requested)
                .with("conflicting", fmt_extents(overlapping)),
            Error::FreeNotExact {
                requested,
                overlapping,
            } => r(Code::FailedPrecondition, R::NotAllocated)
                .with("requested", requested)
                .with("overlapping", fmt_extents(overlapping)),
            Error::ReadNotCommitted { extent, freed_txg } => {
                let x =
                    r(Code::FailedPrecondition, R::ReadTokenNotCommitted).with("extent", extent);
                match freed_txg {
                    Some(t) => x.with("freed_txg", t),
                    None => x,
                }
            }
            Error::ReadNotExact {
                requested,
                overlapping,
            } => r(Code::FailedPrecondition, R::ReadTokenNotExact)
                .with("requested", requested)
                .with("overlapping", fmt_extents(overlapping)),
            Error::LeaseExpired(id) => r(Code::Aborted, R::LeaseExpired).with("allocation_id", id),
            Error::AllocatorRestarted {
                seen,
                current,
                txg,
                synced,
                window_ms,
            } => r(Code::Aborted, R::AllocatorRestarted)
                .with("seen_generation", seen)
                .with("generation", current)
                .with("txg", txg)
                .with("synced_txg", synced)
                .with("claim_window_remaining_ms", window_ms),
            Error::LeaseLifetime { id, lifetime_ms } => {
                r(Code::FailedPrecondition, R::LeaseLifetime)
                    .with("allocation_id", id)
                    .with("lifetime_ms", lifetime_ms)
            }
            Error::LeaseQuota {
                held, asked, quota, ..
            } => r(Code::ResourceExhausted, R::LeaseQuota)
                .with("held", held)
                .with("asked", asked)
                .with("quota", quota),
            Error::GenerationAhead { current, .. } => {
                r(Code::FailedPrecondition, R::GenerationMismatch).with("generation", current)
            }
            Error::NotOwnerAllocation { id, .. } => {
                r(Code::PermissionDenied, R::NotOwner).with("allocation", id)
            }
            Error::NotOwnerExtent { extent, .. } => {
                r(Code::PermissionDenied, R::NotOwner).with("extent", extent)
            }
            Error::NotOwnerDevice { device, .. } => {
                r(Code::PermissionDenied, R::NotOwner).with("device", format!("{device:#x}"))
            }
            Error::VdevPending { device, name, .. } => r(Code::FailedPrecondition, R::VdevPending)
                .with("device_guid", format!("{device:#x}"))
                .with("name", name),
            Error::ShuttingDown => r(Code::Unavailable, R::ShuttingDown).retry_after(RETRY_SOON),
            Error::NoStandby => r(Code::FailedPrecondition, R::NoStandby),
            Error::NoVdevs => r(Code::Unavailable, R::VdevsOffline)
                .with("vdevs", 0)
                .retry_after(RETRY_SOON),
            Error::PoolFull {
                space, alloc, slop, ..
            } => r(Code::ResourceExhausted, R::NoSpace)
                .with("space", space)
                .with("alloc", alloc)
                .with("slop", slop)
                .with("usable", space.saturating_sub(*alloc).saturating_sub(*slop)),
            Error::ClaimGivenOut(e) => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", e)
                .with("conflicting", e),
            Error::ClaimOverwritten {
                requested,
                committed,
            } => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", requested)
                .with("conflicting", committed),
            Error::ClaimTooOld {
                requested,
                allocation_id,
                generation,
                previous,
            } => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", requested)
                .with("allocation_id", allocation_id)
                .with("allocation_generation", generation)
                .with("oldest_claimable_generation", previous),
            Error::ClaimedForAnother {
                requested,
                allocation_id,
                claimed_for,
            } => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", requested)
                .with("conflicting", requested)
                .with("allocation_id", allocation_id)
                .with("claimed_for", claimed_for),
            Error::ClaimWrittenByAnother {
                requested,
                allocation_id,
                written,
                writer,
            } => r(Code::FailedPrecondition, R::ClaimConflict)
                .with("requested", requested)
                .with("conflicting", written)
                .with("allocation_id", allocation_id)
                .with("writer", writer),
            // At the leader at once; without one, once its lease runs out.
            Error::NotLeader {
                leader,
                generation,
                lease_left_ms,
                ..
            } => r(Code::Unavailable, R::NotLeader)
                .with("leader", leader)
                .with("generation", generation)
                .with("lease_left_ms", lease_left_ms)
                .retry_after(if leader.is_empty() {
                    Duration::from_millis(*lease_left_ms).max(RETRY_SOON)
                } else {
                    Duration::ZERO
                }),
            Error::PoolDegraded(v) => {
                r(Code::FailedPrecondition, R::PoolDegraded).with("vdevs", v.join("; "))
            }
            Error::RelocationConflict { extent, allocation } => {
                r(Code::FailedPrecondition, R::RelocationConflict)
                    .with("extent", extent)
                    .with("allocation", allocation)
            }
            Error::NotMapped(e) => r(Code::FailedPrecondition, R::NotMapped).with("extent", e),
            Error::MappedExtent(e) => {
                r(Code::FailedPrecondition, R::MappedExtent).with("extent", e)
            }
            Error::EvacuationRunning { running, asked } => {
                r(Code::FailedPrecondition, R::EvacuationRunning)
                    .with("vdev", running)
                    .with("asked", asked)
            }
            Error::NoRoomToEvacuate {
                vdev,
                need,
                available,
            } => r(Code::FailedPrecondition, R::NoRoomToDrain)
                .with("vdev", vdev)
                .with("need", need)
                .with("available", available)
                .with("missing", need.saturating_sub(*available)),
            Error::Store(_) => r(Code::Internal, R::Store),
            Error::SyncPending { waited_ms } => r(Code::Unavailable, R::Store)
                .with("waited_ms", waited_ms)
                .retry_after(RETRY_SOON),
            Error::PoolMismatch {
                label_pool_guid,
                pool_guid,
                ..
            } => r(Code::FailedPrecondition, R::PoolMismatch)
                .with("label_pool_guid", format!("{label_pool_guid:#x}"))
                .with("pool_guid", format!("{pool_guid:#x}")),
            Error::StoreRolledBack {
                vdev,
                label_txg,
                store_txg,
                ..
            } => r(Code::FailedPrecondition, R::StoreRolledBack)
                .with("vdev", vdev)
                .with("label_txg", label_txg)
                .with("store_txg", store_txg),
        }
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
        e.refusal().status(e.to_string())
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
}
