//! The agent's one error type, mapped to `tonic::Status` once, here.

use tonic::Status;

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
            AgentError::InvalidArgument(_) => Status::invalid_argument(msg),
            AgentError::Config(_) | AgentError::Label(_) => Status::failed_precondition(msg),
            AgentError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
                Status::resource_exhausted(msg)
            }
            // The device itself failed: another copy or vdev may serve.
            AgentError::Io { .. } => Status::unavailable(msg),
            AgentError::ShuttingDown => Status::unavailable(msg),
        }
    }
}
