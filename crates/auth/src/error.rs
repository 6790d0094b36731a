//! Errors of the certificate and key files (set-up time, not the request path:
//! request-path refusals are tonic Statuses built in `layer`, token refusals
//! are `token::TokenError`).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} already exists; remove it first if you mean to replace the pool's CA")]
    Exists { path: PathBuf },
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid name {0:?}: use letters, digits, '-', '_' and '.' (1..=64 characters)")]
    BadName(String),
    #[error("{path} is not a valid Ed25519 key: {reason}")]
    BadKey { path: PathBuf, reason: String },
    #[error(
        "no TLS certificates: give --tls-ca/--tls-cert/--tls-key (from `aliquotctl certs`), \
         or --insecure to serve plaintext gRPC that anyone who reaches the port may call"
    )]
    NoServerTls,
    #[error(
        "no client certificate: {0} (run `aliquotctl up`, which writes them, give \
         --ca/--cert/--key or --certs-dir, or --insecure for a plaintext pool)"
    )]
    NoClientTls(String),
    #[error("{url:?} is not a gRPC endpoint URL: {reason}")]
    BadUrl { url: String, reason: String },
}
