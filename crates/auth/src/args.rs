//! The security flags every service and client shares (flattened into each
//! clap config): the pool CA, our certificate and key, or an explicit
//! `--insecure` for plaintext.

use std::path::PathBuf;

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
}

impl TlsArgs {
    /// The files, when all three are given.
    pub fn files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            ca: self.tls_ca.clone()?,
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
        })
    }
}
