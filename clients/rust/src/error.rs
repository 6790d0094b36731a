//! The crate's one error type. A refusal keeps the server's `tonic::Status`
//! (its reason and ErrorInfo stay readable through
//! `aliquot_proto::error::reason`), with what was being done; the message
//! is one line an operator can act on.

use aliquot_proto::v1::Extent;

/// What went wrong, with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A server refused or failed a call.
    #[error("{}", status_line(what, status))]
    Status { what: String, status: tonic::Status },
    /// A server could not be reached, or the connection settings are wrong.
    #[error("{0}")]
    Connect(String),
    /// An agent advertises a host this machine cannot resolve.
    #[error(transparent)]
    Unresolvable(#[from] Unresolvable),
    /// The certificates could not be read.
    #[error(transparent)]
    Tls(#[from] aliquot_auth::AuthError),
    /// No answer within the deadline.
    #[error("{0}: no answer in {1:?}")]
    Timeout(String, std::time::Duration),
    /// Blocks committed in an allocator generation that ended before their
    /// txg synced, whose space the next generation gave out before they
    /// could be claimed: their data is lost.
    #[error(
        "{} extents committed before the allocator changed generation could not be claimed \
         in the new one (their space was given out first): those blocks are lost; first: {}",
        .0.len(), first_extents(.0)
    )]
    Lost(Vec<Extent>),
    /// A reply that breaks the protocol (a bug on one side).
    #[error("{0}")]
    Protocol(String),
    /// The data read back is not what was written, or the wrong size.
    #[error("{0}")]
    Corrupt(String),
}

impl Error {
    /// A refusal of `what`.
    pub fn status(what: impl Into<String>, status: tonic::Status) -> Error {
        Error::Status {
            what: what.into(),
            status,
        }
    }

    /// The server's status, when the server answered.
    pub fn as_status(&self) -> Option<&tonic::Status> {
        match self {
            Error::Status { status, .. } => Some(status),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn first_extents(e: &[Extent]) -> String {
    e.iter()
        .take(4)
        .map(|e| format!("{}:{}+{}", e.vdev, e.offset, e.size))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `Status` → one line: what, the server's words, the code, and a hint
/// when the connection broke in a way that usually means a TLS mismatch.
pub fn status_line(what: &str, s: &tonic::Status) -> String {
    // A plaintext client's HTTP/2 preface sent to a TLS server: the server
    // answers with a TLS alert, which h2 reads as a protocol error.
    if s.message().contains("h2 protocol error") {
        return format!(
            "{what}: the server speaks TLS and this client plaintext (--insecure): drop \
             --insecure and give the pool's certificates (--certs-dir, as `aliquotctl up` \
             printed, or --ca/--cert/--key)"
        );
    }
    let broken = matches!(s.code(), tonic::Code::Cancelled | tonic::Code::Unknown)
        && (s.message().contains("canceled") || s.message().contains("transport error"));
    let hint = if broken {
        " — the connection broke: is the server TLS and this client --insecure (or the \
         reverse)? a pool `aliquotctl up` started without --insecure needs its certificates"
    } else {
        ""
    };
    format!("{what}: {} ({:?}){hint}", s.message(), s.code())
}

/// An agent whose advertised host does not resolve here: retrying cannot
/// help (a compose stack's agents advertise names only its network knows).
#[derive(Debug, thiserror::Error)]
#[error(
    "agent {url} advertises host {host:?}, which does not resolve here: from outside its \
     network (e.g. a compose stack from the host) give --agent-host 127.0.0.1 to reach the \
     agents' published ports"
)]
pub struct Unresolvable {
    pub url: String,
    pub host: String,
}
