//! Mutual-TLS configs for tonic (rustls with the ring provider: it builds
//! with only a C compiler, no system library). Servers demand a client
//! certificate from the pool CA; clients verify the server against the pool
//! CA *and* the role they expect to reach (`<role>.aliquot` in the server's
//! certificate), so an agent's certificate cannot pose as the allocator.
//! Channels must use `https://` URIs for tonic to speak TLS.

use std::path::{Path, PathBuf};

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

    /// Client side, to a server of `server_role`.
    pub fn client_config(&self, server_role: Role) -> Result<ClientTlsConfig, AuthError> {
        Ok(ClientTlsConfig::new()
            .ca_certificate(self.ca()?)
            .identity(self.identity()?)
            .domain_name(server_role.server_name()))
    }
}
