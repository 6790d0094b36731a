//! Mutual-TLS configs for tonic (rustls with the ring provider: it builds
//! with only a C compiler, no system library). Servers demand a client
//! certificate from the pool CA; clients verify the server against the pool
//! CA *and* the role they expect to reach (`<role>.aliquot` in the server's
//! certificate), so an agent's certificate cannot pose as the allocator.
//! Channels must use `https://` URIs for tonic to speak TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

use tonic::transport::{Certificate, ClientTlsConfig, Identity as TlsIdentity, ServerTlsConfig};

use crate::ca::{CA_CERT, PoolCa, read};
use crate::error::AuthError;
use crate::role::Role;

/// The three PEM files a service or user presents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files `aliquotctl certs issue --role ROLE NAME` wrote into `dir`.
    pub fn in_dir(dir: &Path, role: Role, name: &str) -> TlsFiles {
        let issued = PoolCa {
            dir: dir.to_owned(),
        }
        .issued_paths(role, name);
        TlsFiles {
            ca: dir.join(CA_CERT),
            cert: issued.cert,
            key: issued.key,
        }
    }

    fn identity(&self) -> Result<TlsIdentity, AuthError> {
        Ok(TlsIdentity::from_pem(read(&self.cert)?, read(&self.key)?))
    }

    fn ca(&self) -> Result<Certificate, AuthError> {
        Ok(Certificate::from_pem(read(&self.ca)?))
    }

    /// Server side: present our certificate, require one from the pool CA.
    pub fn server_config(&self) -> Result<ServerTlsConfig, AuthError> {
        Ok(ServerTlsConfig::new()
            .identity(self.identity()?)
            .client_ca_root(self.ca()?))
    }

    /// Server side for [`crate::listen`], which runs the handshake itself
    /// (bounded in time and number): the same rules as [`Self::server_config`]
    /// (our certificate, a client certificate from the pool CA, ALPN h2).
    pub fn rustls_server_config(&self) -> Result<Arc<ServerConfig>, AuthError> {
        let bad = |what: &str, e: &dyn std::fmt::Display| AuthError::Tls(format!("{what}: {e}"));
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(read(&self.ca)?.as_bytes()) {
            let c = c.map_err(|e| bad(&format!("{}", self.ca.display()), &e))?;
            roots
                .add(c)
                .map_err(|e| bad(&format!("{}", self.ca.display()), &e))?;
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| bad("client verifier", &e))?;
        let certs = CertificateDer::pem_slice_iter(read(&self.cert)?.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&format!("{}", self.cert.display()), &e))?;
        let key = PrivateKeyDer::from_pem_slice(read(&self.key)?.as_bytes())
            .map_err(|e| bad(&format!("{}", self.key.display()), &e))?;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| bad(&format!("{}", self.cert.display()), &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// Client side, to a server of `server_role`.
    pub fn client_config(&self, server_role: Role) -> Result<ClientTlsConfig, AuthError> {
        Ok(ClientTlsConfig::new()
            .ca_certificate(self.ca()?)
            .identity(self.identity()?)
            .domain_name(server_role.server_name()))
    }
}
