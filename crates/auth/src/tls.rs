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
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};

use tonic::transport::{Certificate, ClientTlsConfig, Identity as TlsIdentity, ServerTlsConfig};

use crate::ca::{CA_CERT, PoolCa, read};
use crate::error::AuthError;
use crate::role::Role;

/// The provider with TLS 1.3's AES-128-GCM first (the others keep their
/// order). Every byte of the data path is sealed and opened once per hop;
/// AES-128 runs 10 rounds to AES-256's 14 (`openssl speed` here: 4.7 against
/// 4.1 GB/s at 16 KiB records), and it is the suite TLS 1.3 requires every
/// implementation to support (RFC 8446, 9.1).
fn aes128_first(
    mut p: tokio_rustls::rustls::crypto::CryptoProvider,
) -> tokio_rustls::rustls::crypto::CryptoProvider {
    use tokio_rustls::rustls::CipherSuite;
    p.cipher_suites
        .sort_by_key(|s| s.suite() != CipherSuite::TLS13_AES_128_GCM_SHA256);
    p
}

/// A TLS setup error naming what failed.
fn bad(what: &str, e: &dyn std::fmt::Display) -> AuthError {
    AuthError::Tls(format!("{what}: {e}"))
}

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

    /// The pool CA as a root store, our certificate chain and our key, read
    /// from the three files (each error names its file).
    fn pem_parts(
        &self,
    ) -> Result<
        (
            RootCertStore,
            Vec<CertificateDer<'static>>,
            PrivateKeyDer<'static>,
        ),
        AuthError,
    > {
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(read(&self.ca)?.as_bytes()) {
            let c = c.map_err(|e| bad(&format!("{}", self.ca.display()), &e))?;
            roots
                .add(c)
                .map_err(|e| bad(&format!("{}", self.ca.display()), &e))?;
        }
        let certs = CertificateDer::pem_slice_iter(read(&self.cert)?.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&format!("{}", self.cert.display()), &e))?;
        let key = PrivateKeyDer::from_pem_slice(read(&self.key)?.as_bytes())
            .map_err(|e| bad(&format!("{}", self.key.display()), &e))?;
        Ok((roots, certs, key))
    }

    /// Server side for [`crate::listen`], which runs the handshake itself
    /// (bounded in time and number): the same rules as [`Self::server_config`]
    /// (our certificate, a client certificate from the pool CA, ALPN h2).
    pub fn rustls_server_config(&self) -> Result<Arc<ServerConfig>, AuthError> {
        let provider = Arc::new(aes128_first(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ));
        let (roots, certs, key) = self.pem_parts()?;
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| bad("client verifier", &e))?;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| bad(&format!("{}", self.cert.display()), &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        // Our order, not the client's: rustls clients (tonic's) list
        // AES-256-GCM first.
        config.ignore_client_order = true;
        Ok(Arc::new(config))
    }

    /// Client side as a rustls config: the pool CA as the only root, our
    /// certificate, the provider's own suite order (as tonic's client has).
    /// tonic builds its own from [`Self::client_config`]; this one is for
    /// driving a connection in memory (the `tls` bench's rustls floor,
    /// tests).
    pub fn rustls_client_config(&self) -> Result<Arc<ClientConfig>, AuthError> {
        let (roots, certs, key) = self.pem_parts()?;
        let provider = tokio_rustls::rustls::crypto::ring::default_provider();
        let mut config = ClientConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_rustls::rustls::{CipherSuite, ClientConnection, Connection, ServerConnection};

    /// Everything `from` has to send, read and processed by `to`.
    fn pump(from: &mut Connection, to: &mut Connection) {
        let mut buf = Vec::new();
        while from.wants_write() {
            from.write_tls(&mut buf).unwrap();
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            to.read_tls(&mut rd).unwrap();
        }
        to.process_new_packets().unwrap();
    }

    /// A rustls client with the default order (AES-256-GCM first), as
    /// tonic's, gets AES-128-GCM from our servers.
    #[test]
    fn servers_choose_aes_128_gcm() {
        let dir = tempfile::tempdir().unwrap();
        let ca = PoolCa::init(dir.path(), "tank").unwrap();
        ca.issue(Role::Agent, "a0", &[]).unwrap();
        ca.issue(Role::Client, "c0", &[]).unwrap();
        let server = TlsFiles::in_dir(dir.path(), Role::Agent, "a0")
            .rustls_server_config()
            .unwrap();
        let provider = tokio_rustls::rustls::crypto::ring::default_provider();
        assert_eq!(
            provider.cipher_suites[0].suite(),
            CipherSuite::TLS13_AES_256_GCM_SHA384,
            "the client prefers AES-256"
        );
        let cc = TlsFiles::in_dir(dir.path(), Role::Client, "c0")
            .rustls_client_config()
            .unwrap();
        let name = Role::Agent.server_name().try_into().unwrap();
        let mut c = Connection::Client(ClientConnection::new(cc, name).unwrap());
        let mut s = Connection::Server(ServerConnection::new(server).unwrap());
        // The handshake in memory: each side's records to the other.
        for _ in 0..10 {
            pump(&mut c, &mut s);
            pump(&mut s, &mut c);
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        assert!(!s.is_handshaking(), "handshake did not finish");
        assert_eq!(
            s.negotiated_cipher_suite().unwrap().suite(),
            CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        assert_eq!(
            c.negotiated_cipher_suite().unwrap().suite(),
            CipherSuite::TLS13_AES_128_GCM_SHA256
        );
    }
}
