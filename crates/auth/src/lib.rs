//! Pool identity for Aliquot: who may talk to whom, and who may write where.
//!
//! * [`ca`]: the pool's certificate authority and the role certificates it
//!   issues (`rcgen`); the role travels in the certificate as a SAN URI
//!   `aliquot://role/<role>/<name>`.
//! * [`role`]: roles and reading an [`Identity`] out of a peer certificate.
//! * [`client`]: the client flags and one endpoint helper (TLS or `--insecure`).
//! * [`tls`]: mutual-TLS configs for tonic servers and channels (rustls, ring).
//! * [`policy`] + [`layer`]: which role may call which gRPC method, enforced
//!   once at the edge by a tower layer.
//! * [`token`]: Ed25519 write capabilities the allocator signs per extent and
//!   agents verify with only the public key.

pub mod args;
pub mod ca;
pub mod client;
pub mod error;
pub mod layer;
pub mod listen;
pub mod mac_token;
pub mod policy;
pub mod role;
pub mod tls;
pub mod token;

pub use args::TlsArgs;
pub use ca::PoolCa;
pub use client::{ClientTls, ClientTlsArgs};
pub use error::AuthError;
pub use layer::RoleLayer;
pub use mac_token::VdevKey;
pub use role::{Identity, Role};
pub use tls::TlsFiles;
pub use token::{ReadTokenError, TokenError, TokenSigner, TokenVerifier, WriteCheck, WriteGrant};
/// The rustls our TLS is built on, for callers that drive a connection
/// themselves (the `tls` bench): one version across the workspace.
pub use tokio_rustls::rustls;
