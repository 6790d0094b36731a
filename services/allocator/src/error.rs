//! The allocator's errors, and their one mapping to `tonic::Status` at the
//! gRPC edge: each code tells an operator what to do next.

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
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("the allocator is shutting down; retry against its successor")]
    ShuttingDown,
    #[error("store: {0}")]
    Store(String),
    #[error("{0} is not served by this allocator yet")]
    Unimplemented(&'static str),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn code(&self) -> Code {
        use metaslab::Error as M;
        match self {
            Error::Pool(e) => match e {
                M::ZeroSize
                | M::TooLarge(_)
                | M::BadCopies(_)
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
                M::NoSpace { .. } => Code::ResourceExhausted,
                M::TxgWaitRequired { .. } => Code::Unavailable,
                M::NotAdmitted(_) | M::Inconsistent(_) => Code::Internal,
            },
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::ShuttingDown => Code::Unavailable,
            Error::Store(_) => Code::Internal,
            Error::Unimplemented(_) => Code::Unimplemented,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code(), e.to_string())
    }
}
