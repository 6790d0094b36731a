//! The agent's one error type, mapped to `tonic::Status` once, here.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

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

impl From<AgentError> for Status {
    fn from(e: AgentError) -> Status {
        let msg = e.to_string();
        match e {
            // The refused write's own code and ErrorInfo, the message naming it.
            AgentError::InBatch { source, .. } => {
                let inner = Status::from(*source);
                Status::with_details(inner.code(), msg, inner.details().to_vec().into())
            }
            AgentError::InvalidArgument(_) => Status::invalid_argument(msg),
            AgentError::Config(_) | AgentError::Label(_) => Status::failed_precondition(msg),
            AgentError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
                Status::resource_exhausted(msg)
            }
            // The device itself failed: another copy or vdev may serve.
            AgentError::Io { .. } => Status::unavailable(msg),
            AgentError::ShuttingDown
            | AgentError::Removed
            | AgentError::NotRegistered
            | AgentError::TokenKeyUnknown { .. } => Status::unavailable(msg),
            AgentError::BodyTimeout(_) => Status::with_error_details(
                Code::DeadlineExceeded,
                msg,
                ErrorDetails::with_error_info(
                    "BODY_TIMEOUT",
                    aliquot_auth::DOMAIN,
                    HashMap::<String, String>::new(),
                ),
            ),
            AgentError::Fenced(f) => Status::with_error_details(
                Code::PermissionDenied,
                msg,
                ErrorDetails::with_error_info(
                    match f {
                        crate::fence::Fenced::Superseded { .. } => "WRITE_TOKEN_SUPERSEDED",
                        crate::fence::Fenced::BeforeStart { .. } => {
                            "WRITE_TOKEN_BEFORE_AGENT_START"
                        }
                        crate::fence::Fenced::Revoked { .. } => "WRITE_TOKEN_REVOKED",
                        crate::fence::Fenced::ReadSuperseded { .. } => "READ_TOKEN_SUPERSEDED",
                        crate::fence::Fenced::ReadBeforeStart { .. } => {
                            "READ_TOKEN_BEFORE_AGENT_START"
                        }
                        // As the token check says it once the generation is
                        // learned: the same for a client.
                        crate::fence::Fenced::OlderGeneration { .. } => {
                            "WRITE_TOKEN_OLD_GENERATION"
                        }
                    },
                    aliquot_auth::DOMAIN,
                    HashMap::<String, String>::new(),
                ),
            ),
            AgentError::ReadToken(t) => {
                let code = match t.0 {
                    aliquot_auth::TokenError::Missing => Code::Unauthenticated,
                    _ => Code::PermissionDenied,
                };
                Status::with_error_details(
                    code,
                    msg,
                    ErrorDetails::with_error_info(
                        t.reason(),
                        aliquot_auth::DOMAIN,
                        HashMap::<String, String>::new(),
                    ),
                )
            }
            AgentError::Token(t) => {
                let code = match t {
                    aliquot_auth::TokenError::Missing => Code::Unauthenticated,
                    _ => Code::PermissionDenied,
                };
                Status::with_error_details(
                    code,
                    msg,
                    ErrorDetails::with_error_info(
                        t.reason(),
                        aliquot_auth::DOMAIN,
                        HashMap::<String, String>::new(),
                    ),
                )
            }
        }
    }
}
