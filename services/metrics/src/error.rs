//! The metrics service's one error type, mapped to `tonic::Status` once, at
//! the gRPC edge (and to HTTP status codes by the chart server).

use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A query or snapshot that can never succeed as sent.
    #[error("{0}")]
    InvalidArgument(String),
    /// An unknown pool or vdev.
    #[error("{0}")]
    NotFound(String),
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
    /// True for errors the operator fixes by changing flags (exit code 2).
    pub fn is_config(&self) -> bool {
        matches!(self, MetricsError::Refused { .. } | MetricsError::Config(_))
    }
}

impl From<MetricsError> for Status {
    fn from(e: MetricsError) -> Status {
        match &e {
            MetricsError::InvalidArgument(m) => Status::invalid_argument(m.clone()),
            MetricsError::NotFound(m) => Status::not_found(m.clone()),
            MetricsError::Refused { .. } | MetricsError::Config(_) | MetricsError::Migrate(_) => {
                Status::failed_precondition(e.to_string())
            }
            MetricsError::Db(_) => {
                Status::unavailable(format!("{e}; the metrics store may be busy, retry"))
            }
            MetricsError::StoreFailing(_) => Status::unavailable(e.to_string()),
        }
    }
}

pub type Result<T, E = MetricsError> = std::result::Result<T, E>;
