//! The allocator's errors, and their one mapping to `tonic::Status` at the
//! gRPC edge: each code tells an operator what to do next, and each carries
//! a `google.rpc.ErrorInfo` whose reason (an `ErrorReason` name) a client
//! can act on without parsing the message.

use std::collections::BTreeMap;

use aliquot_proto::error_info;
use aliquot_proto::v1::ErrorReason;
use metaslab::{AllocationId, Txg};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy refused; every such error left the pool unchanged.
    #[error(transparent)]
    Pool(#[from] metaslab::Error),
    /// A request field out of range; `field` names it.
    #[error("{msg}")]
    InvalidArgument { field: &'static str, msg: String },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("the allocator is shutting down; retry against its successor")]
    ShuttingDown,
    #[error("store: {0}")]
    Store(String),
    #[error(
        "allocation {0}: its lease expired before the commit, so its space was given back and \
         what was written under it is not durable; allocate and write again"
    )]
    LeaseExpired(AllocationId),
    /// The generation asked about ended before `what` became durable.
    #[error(
        "{what} belongs to generation {generation}, which ended (allocator restart) before it \
         synced; the last txg synced then was {last_synced}: Claim what you wrote after it, \
         then carry on with generation {current}"
    )]
    AllocatorRestarted {
        what: String,
        generation: u64,
        current: u64,
        last_synced: Txg,
    },
    #[error(
        "generation {asked} is unknown to this allocator (its store is at generation {current}): \
         wrong allocator, or a store restored from an older copy"
    )]
    GenerationMismatch { asked: u64, current: u64 },
    #[error("lease_ms {asked} is above this allocator's --max-lease of {max} ms")]
    LeaseTooLong { asked: u64, max: u64 },
    /// Register/Report values the store would not accept.
    #[error("{msg}")]
    VdevInvalid { field: &'static str, msg: String },
    #[error("{0}")]
    VdevConflict(String),
    #[error("{0}")]
    ResizeRefused(String),
    #[error("{0} is not served by this allocator yet")]
    Unimplemented(&'static str),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(field: &'static str, msg: impl Into<String>) -> Error {
        Error::InvalidArgument {
            field,
            msg: msg.into(),
        }
    }

    pub fn code(&self) -> Code {
        self.classify().0
    }

    pub fn reason(&self) -> ErrorReason {
        self.classify().1
    }

    /// Code and reason, in one place.
    fn classify(&self) -> (Code, ErrorReason) {
        use ErrorReason as R;
        use metaslab::Error as M;
        match self {
            Error::Pool(e) => match e {
                M::ZeroSize
                | M::TooLarge(_)
                | M::BadCopies(_)
                | M::Misaligned(_)
                | M::OutOfRange(_)
                | M::BadTunableValue { .. } => (Code::InvalidArgument, R::InvalidRequest),
                M::BadVdev(_) => (Code::InvalidArgument, R::VdevInvalid),
                M::UnknownVdev(_) => (Code::NotFound, R::UnknownVdev),
                M::UnknownAllocation(_) => (Code::NotFound, R::UnknownAllocation),
                M::UnknownTicket(_) | M::UnknownTunable(_) => (Code::NotFound, R::InvalidRequest),
                M::NotAllocated(_) => (Code::FailedPrecondition, R::DoubleFree),
                M::PartlyAllocated(_) | M::ClaimConflict { .. } => {
                    (Code::FailedPrecondition, R::ClaimConflict)
                }
                M::NoSpace { .. } => (Code::ResourceExhausted, R::NoSpace),
                M::TxgWaitRequired { .. } => (Code::Unavailable, R::TxgWaitRequired),
                M::NotAdmitted(_) | M::Inconsistent(_) => (Code::Internal, R::Unspecified),
            },
            Error::InvalidArgument { .. } => (Code::InvalidArgument, R::InvalidRequest),
            Error::NotFound(_) => (Code::NotFound, R::Unspecified),
            Error::FailedPrecondition(_) => (Code::FailedPrecondition, R::Unspecified),
            Error::ShuttingDown => (Code::Unavailable, R::ShuttingDown),
            Error::Store(_) => (Code::Internal, R::StoreFailure),
            Error::LeaseExpired(_) => (Code::FailedPrecondition, R::LeaseExpired),
            Error::AllocatorRestarted { .. } => (Code::Aborted, R::AllocatorRestarted),
            Error::GenerationMismatch { .. } => (Code::FailedPrecondition, R::GenerationMismatch),
            Error::LeaseTooLong { .. } => (Code::InvalidArgument, R::LeaseTooLong),
            Error::VdevInvalid { .. } => (Code::InvalidArgument, R::VdevInvalid),
            Error::VdevConflict(_) => (Code::FailedPrecondition, R::VdevConflict),
            Error::ResizeRefused(_) => (Code::FailedPrecondition, R::VdevResizeRefused),
            Error::Unimplemented(_) => (Code::Unimplemented, R::Unspecified),
        }
    }

    /// ErrorInfo metadata: the numbers a client acts on.
    fn metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        match self {
            Error::Pool(metaslab::Error::TxgWaitRequired { until }) => {
                put("txg", until.to_string())
            }
            Error::Pool(metaslab::Error::ClaimConflict { conflicting, .. }) => {
                put("conflicts", conflicting.to_string())
            }
            Error::Pool(metaslab::Error::UnknownAllocation(id)) | Error::LeaseExpired(id) => {
                put("allocation_id", id.to_string())
            }
            Error::AllocatorRestarted {
                generation,
                current,
                last_synced,
                ..
            } => {
                put("last_synced_txg", last_synced.to_string());
                put("generation", generation.to_string());
                put("current_generation", current.to_string());
            }
            Error::GenerationMismatch { current, .. } => {
                put("current_generation", current.to_string())
            }
            Error::LeaseTooLong { max, .. } => put("max_lease_ms", max.to_string()),
            Error::InvalidArgument { field, .. } | Error::VdevInvalid { field, .. } => {
                put("field", field.to_string())
            }
            _ => {}
        }
        m
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let (code, reason) = e.classify();
        error_info::status(code, reason, e.to_string(), e.metadata())
    }
}
