//! The security flags every service and client shares (flattened into each
//! clap config): the pool CA, our certificate and key, or an explicit
//! `--insecure` for plaintext.

use std::path::PathBuf;

use crate::error::AuthError;
use crate::tls::TlsFiles;

#[derive(Clone, Debug, Default, clap::Args)]
pub struct TlsArgs {
    /// The pool CA certificate (PEM): peers must present a certificate it issued.
    #[arg(long, env = "ALIQUOT_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Our certificate (PEM), from `aliquotctl certs issue`.
    #[arg(long, env = "ALIQUOT_TLS_CERT", requires = "tls_ca")]
    pub tls_cert: Option<PathBuf>,
    /// Our private key (PEM).
    #[arg(long, env = "ALIQUOT_TLS_KEY", requires = "tls_ca")]
    pub tls_key: Option<PathBuf>,
    /// Plaintext without certificates: anyone who reaches the port may call
    /// anything. Logged as a warning at start.
    #[arg(long, env = "ALIQUOT_INSECURE", conflicts_with = "tls_ca",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
    /// Caps on the peers' connections (every server takes them).
    #[command(flatten)]
    pub listen: crate::listen::ListenArgs,
}

impl TlsArgs {
    /// The connection caps for a listener of this server.
    pub fn listen_limits(&self) -> crate::listen::ListenLimits {
        self.listen.limits()
    }

    /// What a server does: mutual TLS with the files (Some), plaintext only
    /// with an explicit `--insecure` (None, and a warning is logged), and
    /// otherwise it refuses to start. `what` names the server in the warning.
    /// Files win over `insecure` (a config built in code may hold both).
    pub fn server_mode(&self, what: &str) -> Result<Option<TlsFiles>, AuthError> {
        match self.files() {
            Some(f) => Ok(Some(f)),
            None if self.insecure => {
                tracing::warn!(
                    server = what,
                    "--insecure: plaintext gRPC without client certificates; anyone who reaches this port may call any method"
                );
                Ok(None)
            }
            None => Err(AuthError::NoServerTls),
        }
    }

    /// Refuse a server config with neither TLS files nor `--insecure`
    /// (a configuration error, checked before anything is opened).
    pub fn check(&self) -> Result<(), AuthError> {
        if self.files().is_none() && !self.insecure {
            return Err(AuthError::NoServerTls);
        }
        Ok(())
    }

    /// Plaintext, explicitly: for tests and embedding on loopback.
    pub fn insecure() -> TlsArgs {
        TlsArgs {
            insecure: true,
            ..TlsArgs::default()
        }
    }

    /// Mutual TLS with `files`.
    pub fn with_files(files: TlsFiles) -> TlsArgs {
        TlsArgs {
            tls_ca: Some(files.ca),
            tls_cert: Some(files.cert),
            tls_key: Some(files.key),
            insecure: false,
            listen: Default::default(),
        }
    }

    /// The files, when all three are given.
    pub fn files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            ca: self.tls_ca.clone()?,
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
        })
    }
}
