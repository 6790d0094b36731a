//! The metrics service's one error type, mapped once at the gRPC edge to a
//! `Refusal` of the one error table (`aliquot_proto::error`: code, reason,
//! values, whether to retry), and to HTTP status codes by the chart server.

use std::time::Duration;

use aliquot_proto::error::Refusal;
use aliquot_proto::v1::ErrorReason;
use tonic::{Code, Status};

/// How long a caller waits before repeating a call the store could not
/// serve (busy, or its file system full): the allocator's pusher retries
/// about this often.
const STORE_RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A query or snapshot that can never succeed as sent; `field` names
    /// the request field at fault.
    #[error("{message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    /// No history for this pool.
    #[error("no history for pool {pool:?}")]
    NoPool { pool: String },
    /// The pool has history but no vdev of this id.
    #[error("pool {pool:?} has no vdev {vdev}")]
    NoVdev { pool: String, vdev: u32 },
    /// The `--db` file is not ours (not SQLite, a foreign schema, or a schema
    /// newer than this binary); it was left untouched.
    #[error("refusing database {path}: {reason}")]
    Refused { path: String, reason: String },
    /// A bad flag value, found before anything was bound or opened.
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("metrics database error: {0}")]
    Db(#[from] sqlx::Error),
    /// A write did not commit (a full disk, an I/O error): nothing of the
    /// request was stored.
    #[error(
        "the metrics store cannot write ({0}): nothing of this request was stored; retry \
         (the allocator does) once its file system has room"
    )]
    StoreFailing(String),
    #[error("metrics database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl MetricsError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> MetricsError {
        MetricsError::InvalidArgument {
            field,
            message: message.into(),
        }
    }

    /// True for errors the operator fixes by changing flags (exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(self, MetricsError::Refused { .. } | MetricsError::Config(_))
    }

    /// What the gRPC edge answers: the one table's code, reason and values.
    pub fn refusal(&self) -> Refusal {
        use ErrorReason as R;
        match self {
            MetricsError::InvalidArgument { field, .. } => {
                Refusal::new(Code::InvalidArgument, R::InvalidArgument).with("field", field)
            }
            MetricsError::NoPool { pool } => {
                Refusal::new(Code::NotFound, R::NotFound).with("pool", pool)
            }
            MetricsError::NoVdev { pool, vdev } => Refusal::new(Code::NotFound, R::NotFound)
                .with("pool", pool)
                .with("vdev", vdev),
            // The service's own files, not the caller's request: it cannot
            // serve until its operator acts (none reaches a call today: they
            // stop the service at start).
            MetricsError::Refused { path, .. } => {
                Refusal::new(Code::FailedPrecondition, R::Store).with("path", path)
            }
            MetricsError::Migrate(_) => Refusal::new(Code::FailedPrecondition, R::Store),
            MetricsError::Config(_) => Refusal::new(Code::Internal, R::Internal),
            // Busy or failing storage: the same call later may succeed.
            MetricsError::Db(_) | MetricsError::StoreFailing(_) => {
                Refusal::new(Code::Unavailable, R::Store).retry_after(STORE_RETRY)
            }
        }
    }
}

impl From<MetricsError> for Status {
    fn from(e: MetricsError) -> Status {
        let message = match &e {
            MetricsError::Db(_) => format!("{e}; the metrics store may be busy, retry"),
            _ => e.to_string(),
        };
        e.refusal().status(message)
    }
}

pub type Result<T, E = MetricsError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_proto::error::{reason, retry_after};

    /// Storage that is busy or failing is worth a retry (RetryInfo); the
    /// service's own files refused are not the caller's to retry.
    #[test]
    fn store_failures_say_when_to_retry() {
        let s = Status::from(MetricsError::StoreFailing("disk full".into()));
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(reason(&s), Some(ErrorReason::Store));
        assert_eq!(retry_after(&s), Some(STORE_RETRY));
        let s = Status::from(MetricsError::Db(sqlx::Error::PoolTimedOut));
        assert_eq!(
            (s.code(), reason(&s)),
            (Code::Unavailable, Some(ErrorReason::Store))
        );
        assert!(s.message().contains("retry"), "{s:?}");
        let s = Status::from(MetricsError::Refused {
            path: "m.db".into(),
            reason: "foreign schema".into(),
        });
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(retry_after(&s), None);
    }
}
