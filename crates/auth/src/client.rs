//! The client side of the pool's TLS, shared by every client (aliquotctl's
//! commands, `aliquotctl history`, the allocator's metrics push, agents'
//! registration): where the certificates come from, and one [`ClientTls::endpoint`]
//! that turns a URL into a tonic `Endpoint` speaking mutual TLS to a server
//! of the expected role — or plaintext, only when `--insecure` was asked for.
//!
//! Without flags a client uses the pool directory `aliquotctl up` wrote
//! (`aliquot-data/certs`: `ca.pem` and the operator's `admin-operator.pem`),
//! so `aliquotctl status` after `up` needs nothing.

use std::path::PathBuf;

use tonic::transport::Endpoint;

use crate::ca::{CA_CERT, PoolCa};
use crate::error::AuthError;
use crate::role::Role;
use crate::tls::TlsFiles;

/// The admin certificate `aliquotctl up` issues for the operator, and the
/// one clients use by default.
pub const OPERATOR: &str = "operator";

/// Client TLS flags, flattened into every client command.
#[derive(Clone, Debug, clap::Args)]
pub struct ClientTlsArgs {
    /// The pool CA certificate (PEM) the server must be issued by
    /// (default: `<certs-dir>/ca.pem`).
    #[arg(long = "ca", global = true, env = "ALIQUOT_TLS_CA")]
    pub ca: Option<PathBuf>,
    /// Our certificate (PEM) (default: `<certs-dir>/admin-operator.pem`).
    #[arg(
        long = "cert",
        global = true,
        env = "ALIQUOT_TLS_CERT",
        requires = "key"
    )]
    pub cert: Option<PathBuf>,
    /// Our private key (PEM) (default: `<certs-dir>/admin-operator.key`).
    #[arg(
        long = "key",
        global = true,
        env = "ALIQUOT_TLS_KEY",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,
    /// The pool's certificate directory (what `aliquotctl up` writes in its
    /// data dir, or `aliquotctl certs`).
    #[arg(
        long,
        global = true,
        env = "ALIQUOT_CERTS_DIR",
        default_value = "aliquot-data/certs"
    )]
    pub certs_dir: PathBuf,
    /// Plaintext gRPC, no certificates: only for a pool started with --insecure.
    #[arg(long, global = true, env = "ALIQUOT_INSECURE", conflicts_with_all = ["ca", "cert", "key"],
          value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
}

impl Default for ClientTlsArgs {
    fn default() -> Self {
        ClientTlsArgs {
            ca: None,
            cert: None,
            key: None,
            certs_dir: PathBuf::from("aliquot-data/certs"),
            insecure: false,
        }
    }
}

impl ClientTlsArgs {
    /// Flags that resolve to `tls` (for code that builds a command's args).
    pub fn from_tls(tls: &ClientTls) -> ClientTlsArgs {
        match tls {
            ClientTls::Insecure => ClientTlsArgs {
                insecure: true,
                ..Default::default()
            },
            ClientTls::Mutual(f) => ClientTlsArgs {
                ca: Some(f.ca.clone()),
                cert: Some(f.cert.clone()),
                key: Some(f.key.clone()),
                ..Default::default()
            },
        }
    }

    /// The files to present, checked to exist (a clear message beats a
    /// handshake failure), or plaintext when `--insecure`.
    pub fn resolve(&self) -> Result<ClientTls, AuthError> {
        if self.insecure {
            return Ok(ClientTls::Insecure);
        }
        let ca = self
            .ca
            .clone()
            .unwrap_or_else(|| self.certs_dir.join(CA_CERT));
        let (cert, key) = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => (c.clone(), k.clone()),
            _ => {
                let i = PoolCa {
                    dir: self.certs_dir.clone(),
                }
                .issued_paths(Role::Admin, OPERATOR);
                (i.cert, i.key)
            }
        };
        for p in [&ca, &cert, &key] {
            if !p.exists() {
                return Err(AuthError::NoClientTls(format!(
                    "{} does not exist",
                    p.display()
                )));
            }
        }
        Ok(ClientTls::Mutual(TlsFiles { ca, cert, key }))
    }
}

/// How a client connects: mutual TLS with these files, or plaintext.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientTls {
    Mutual(TlsFiles),
    Insecure,
}

impl ClientTls {
    pub fn is_tls(&self) -> bool {
        matches!(self, ClientTls::Mutual(_))
    }

    /// `url` with the scheme this mode speaks: tonic uses TLS only for
    /// `https://`, so `http://` URLs become `https://` under TLS (and the
    /// reverse for plaintext); a bare `host:port` gets one.
    pub fn url(&self, url: &str) -> String {
        let rest = url
            .strip_prefix("https://")
            .or_else(|| url.strip_prefix("http://"))
            .unwrap_or(url);
        match self {
            ClientTls::Mutual(_) => format!("https://{rest}"),
            ClientTls::Insecure => format!("http://{rest}"),
        }
    }

    /// An endpoint to a server of role `server` at `url` (not connected).
    pub fn endpoint(&self, url: &str, server: Role) -> Result<Endpoint, AuthError> {
        let url = self.url(url);
        let ep = Endpoint::from_shared(url.clone()).map_err(|e| AuthError::BadUrl {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        match self {
            ClientTls::Insecure => Ok(ep),
            ClientTls::Mutual(files) => {
                ep.tls_config(files.client_config(server)?)
                    .map_err(|e| AuthError::BadUrl {
                        url,
                        reason: e.to_string(),
                    })
            }
        }
    }
}

impl From<Option<TlsFiles>> for ClientTls {
    fn from(f: Option<TlsFiles>) -> ClientTls {
        match f {
            Some(f) => ClientTls::Mutual(f),
            None => ClientTls::Insecure,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        let files = TlsFiles {
            ca: "a".into(),
            cert: "b".into(),
            key: "c".into(),
        };
        let tls = ClientTls::Mutual(files);
        assert_eq!(tls.url("http://h:1"), "https://h:1");
        assert_eq!(tls.url("h:1"), "https://h:1");
        assert_eq!(ClientTls::Insecure.url("https://h:1"), "http://h:1");
    }

    #[test]
    fn missing_files_say_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let a = ClientTlsArgs {
            certs_dir: dir.path().to_owned(),
            ..Default::default()
        };
        let e = a.resolve().unwrap_err().to_string();
        assert!(
            e.contains("ca.pem does not exist") && e.contains("aliquotctl up"),
            "{e}"
        );
        let a = ClientTlsArgs {
            insecure: true,
            ..Default::default()
        };
        assert_eq!(a.resolve().unwrap(), ClientTls::Insecure);
    }
}
