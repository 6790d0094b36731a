//! The agent's one error type, mapped to `tonic::Status` once, here, by one
//! table (`AgentError::refusal`) in the vocabulary every service shares
//! (`ErrorReason` of the proto, see `aliquot_proto::error`).

use std::time::Duration;

use aliquot_proto::error::Refusal;
use aliquot_proto::v1::ErrorReason;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Bad flags or environment: exit code 2.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The device exists but is not ours (or is corrupt): exit code 2.
    #[error("{0}")]
    Label(String),
    /// A request the device cannot honour as given.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{op} failed on the device: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent is shutting down")]
    ShuttingDown,
    /// The allocator removed this vdev (`aliquotctl vdev remove`): the agent
    /// stopped, as there is nothing left for it to serve.
    #[error(
        "this vdev was removed from the pool (aliquotctl vdev remove); the agent stopped: \
         its device can join a pool again only with a new file or a wiped label"
    )]
    Removed,
    /// Writes need the pool and generation the allocator gives at registration.
    #[error(
        "the agent has not registered with the allocator yet: reads and writes wait for its pool and generation; retry"
    )]
    NotRegistered,
    #[error("{0}")]
    Token(#[from] aliquot_auth::TokenError),
    #[error("{0}")]
    ReadToken(#[from] aliquot_auth::ReadTokenError),
    /// A genuine token whose allocation no longer owns the bytes.
    #[error("{0}")]
    Fenced(crate::fence::Fenced),
    /// A request body that did not arrive in time (a slow or stalled
    /// sender): its stream is reset and its buffers freed.
    #[error(
        "the request body did not arrive within {0:?} (--body-timeout); the stream was reset and \
         nothing was written: send the write again"
    )]
    BodyTimeout(std::time::Duration),
    /// A MAC token of a generation whose key the allocator has not handed
    /// this agent yet (it re-registers on a new generation).
    #[error(
        "the agent does not have the token key of allocator generation {generation} yet (it gets \
         it when it registers with that generation); retry"
    )]
    TokenKeyUnknown { generation: u64 },
    /// CopyFrom: the source agent refused or failed the read.
    #[error("copy from the source agent {endpoint}: {message}")]
    CopySource { endpoint: String, message: String },
    /// CopyFrom: length or checksum of the copied bytes differ.
    #[error("copy: {0}; nothing is committed, the move is retried")]
    CopyMismatch(String),
    /// One write of a WriteBatch was refused (so the whole batch was).
    #[error("write {index} of the batch (none written): {source}")]
    InBatch {
        index: usize,
        #[source]
        source: Box<AgentError>,
    },
}

impl AgentError {
    pub fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> AgentError {
        move |source| AgentError::Io { op, source }
    }

    /// Errors that mean "fix your command line", for exit code 2.
    pub fn is_usage(&self) -> bool {
        matches!(self, AgentError::Config(_) | AgentError::Label(_))
    }
}

impl AgentError {
    /// The one table: each error's code, reason, values and whether the
    /// same call may be repeated (the message is `Display`).
    pub fn refusal(&self) -> Refusal {
        use crate::fence::Fenced as F;
        use ErrorReason as R;
        let r = Refusal::new;
        match self {
            // The refused write's own refusal, naming which it was.
            AgentError::InBatch { index, source } => source.refusal().with("batch_index", index),
            AgentError::InvalidArgument(_) => r(Code::InvalidArgument, R::InvalidArgument),
            AgentError::Config(_) | AgentError::Label(_) => {
                r(Code::FailedPrecondition, R::DeviceLabel)
            }
            AgentError::Io { op, source } if source.kind() == std::io::ErrorKind::StorageFull => {
                r(Code::ResourceExhausted, R::DeviceIo).with("op", op)
            }
            // The device itself failed: another copy or vdev may serve.
            AgentError::Io { op, .. } => r(Code::Unavailable, R::DeviceIo).with("op", op),
            AgentError::ShuttingDown => r(Code::Unavailable, R::ShuttingDown),
            AgentError::CopySource { endpoint, .. } => {
                r(Code::Unavailable, R::CopySource).with("endpoint", endpoint)
            }
            AgentError::CopyMismatch(_) => r(Code::DataLoss, R::CopyMismatch),
            AgentError::Removed => r(Code::Unavailable, R::VdevRemoved),
            AgentError::NotRegistered => {
                r(Code::Unavailable, R::AgentNotRegistered).retry_after(RETRY_SOON)
            }
            AgentError::TokenKeyUnknown { generation } => r(Code::Unavailable, R::TokenKeyUnknown)
                .with("generation", generation)
                .retry_after(RETRY_SOON),
            AgentError::BodyTimeout(d) => r(Code::DeadlineExceeded, R::BodyTimeout)
                .with("timeout_ms", d.as_millis())
                .retry_after(Duration::ZERO),
            AgentError::Token(t) => t.refusal(),
            AgentError::ReadToken(t) => t.refusal(),
            AgentError::Fenced(f) => match *f {
                F::Superseded {
                    mine,
                    newer,
                    offset,
                    end,
                } => r(Code::PermissionDenied, R::WriteTokenSuperseded)
                    .with("allocation_id", mine)
                    .with("newer_allocation_id", newer)
                    .with("offset", offset)
                    .with("end", end),
                F::BeforeStart { mine, floor } => {
                    r(Code::PermissionDenied, R::WriteTokenBeforeAgentStart)
                        .with("allocation_id", mine)
                        .with("floor", floor)
                }
                // As the token check says it once the generation is
                // learned: the same for a client.
                F::OlderGeneration { mine, generation } => {
                    r(Code::PermissionDenied, R::WriteTokenOldGeneration)
                        .with("allocation_id", mine)
                        .with("generation", generation)
                }
                F::Revoked { mine } => {
                    r(Code::PermissionDenied, R::WriteTokenRevoked).with("allocation_id", mine)
                }
                F::ReadSuperseded { newer, offset, end } => {
                    r(Code::PermissionDenied, R::ReadTokenSuperseded)
                        .with("newer_allocation_id", newer)
                        .with("offset", offset)
                        .with("end", end)
                }
                F::ReadBeforeStart { granted_at, floor } => {
                    r(Code::PermissionDenied, R::ReadTokenBeforeAgentStart)
                        .with("granted_at", granted_at)
                        .with("floor", floor)
                }
            },
        }
    }
}

/// The allocator hands keys and registrations out within a report or two
/// (agents report once a second).
const RETRY_SOON: Duration = Duration::from_secs(1);

impl From<AgentError> for Status {
    fn from(e: AgentError) -> Status {
        e.refusal().status(e.to_string())
    }
}
