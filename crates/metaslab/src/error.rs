//! The crate's one error enum. Every error leaves the pool exactly as it
//! was: operations validate fully before they mutate.

use std::fmt;

use crate::vdev::Psize;
use crate::{AllocationId, Extent, Ticket, Txg, VdevId};

/// Every error leaves the pool exactly as it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("size must be at least 1 byte")]
    ZeroSize,
    #[error("size {0} is above the 16 MiB maximum block size")]
    TooLarge(u64),
    #[error("copies must be 1, 2 or 3, not {0}")]
    BadCopies(u8),
    #[error(
        "a size range ({size} to {max_size} bytes) is for intent-log blocks only, with max_size at least size and at most 16 MiB"
    )]
    BadSizeRange { size: u64, max_size: u64 },
    #[error(
        "a block of {psize} bytes does not fit extent {extent}: its allocation holds at most {most}"
    )]
    PsizeTooLarge {
        psize: u64,
        extent: Extent,
        most: u64,
    },
    #[error("extent {0} is not aligned to its vdev's ashift")]
    Misaligned(Extent),
    #[error("extent {0} lies outside its vdev")]
    OutOfRange(Extent),
    #[error("no vdev {0}")]
    UnknownVdev(VdevId),
    #[error("no allocation {0} in flight")]
    UnknownAllocation(AllocationId),
    #[error("no ticket {0}")]
    UnknownTicket(Ticket),
    #[error("ticket {0} has not been admitted by the throttle")]
    NotAdmitted(Ticket),
    #[error("no space for {size} bytes x{copies}: {reason}")]
    NoSpace {
        size: u64,
        copies: u8,
        reason: NoSpaceReason,
    },
    /// Log allocation failed in every class while deferred frees are
    /// pending: wait until `until` has synced (OpenZFS's txg_wait_synced
    /// fallback, open txg + TXG_DEFER_SIZE). When no sync can free space
    /// the answer is `NoSpace` instead.
    #[error("no log space: wait for txg {until} to sync")]
    TxgWaitRequired { until: Txg },
    #[error("extent {0} is not allocated (double free?)")]
    NotAllocated(Extent),
    #[error("extent {0} is only partly allocated")]
    PartlyAllocated(Extent),
    #[error("claim of {requested} conflicts with allocated {conflicting}")]
    ClaimConflict {
        requested: Extent,
        conflicting: Extent,
    },
    #[error("unknown tunable {0}")]
    UnknownTunable(String),
    #[error("bad value {value:?} for {name}: {reason}")]
    BadTunableValue {
        name: String,
        value: String,
        reason: String,
    },
    #[error("bad vdev: {0}")]
    BadVdev(String),
    #[error("inconsistent state: {0}")]
    Inconsistent(String),
    #[error("vdev {0} was removed from the pool")]
    VdevRemoved(VdevId),
    /// Offline of the only normal vdev still taking allocations.
    #[error(
        "vdev {0} is the last normal vdev that takes allocations: taking it offline would leave \
         nowhere to allocate; add or bring online another vdev first"
    )]
    LastAllocatingVdev(VdevId),
    /// Removal of the only normal vdev still taking allocations.
    #[error(
        "vdev {0} cannot be removed: it is the last normal vdev that takes allocations, so its \
         blocks would have nowhere to go; add another vdev first"
    )]
    LastVdev(VdevId),
    /// A drain whose data the rest of the pool could not hold.
    #[error(
        "vdev {vdev} cannot start draining: the pool has {available} bytes available and the \
         vdev's {need} bytes must fit in them (add space, or free data, first)"
    )]
    NoRoomToDrain {
        vdev: VdevId,
        need: u64,
        available: u64,
    },
    /// `remove_vdev` of a vdev that still takes or holds space.
    #[error("vdev {vdev} cannot be removed: {why}")]
    VdevNotEmpty {
        vdev: VdevId,
        /// Bytes it still holds, deferred frees included.
        alloc: u64,
        online: bool,
        why: String,
    },
}

/// Why an allocation found no space, so a client knows what would help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoSpaceReason {
    /// No vdev of the class is online and healthy enough to allocate.
    VdevsOffline,
    /// The class is full (or within the slop space kept back for data).
    Full,
    /// Free space exists but not in pieces this large: where OpenZFS would
    /// write a gang block, Aliquot (which has none) fails so the client can
    /// retry smaller. `largest_free` is the largest block (psize) one free
    /// segment holds: a retry at that size fits.
    Fragmented { largest_free: Psize },
}

impl fmt::Display for NoSpaceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoSpaceReason::VdevsOffline => write!(
                f,
                "no vdev is allocatable (offline, faulted or unavailable)"
            ),
            NoSpaceReason::Full => write!(f, "the pool is full"),
            NoSpaceReason::Fragmented { largest_free } => write!(
                f,
                "free space is fragmented: the largest block a free segment holds is {largest_free} bytes; retry with smaller blocks"
            ),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
