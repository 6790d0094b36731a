//! The pool CA: one self-signed root per pool, kept in a directory, which
//! issues one certificate per service or user. Layout of the directory:
//!
//! * `ca.pem`, `ca.key`: the root (the key only on the machine that issues);
//! * `<role>-<name>.pem`, `<role>-<name>.key`: an issued certificate;
//! * `token.key` (allocator only) / `token.pub` (agents): the Ed25519 pair
//!   for write capability tokens, made with the CA.
//!
//! Private keys are written 0600 and never overwritten.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::error::AuthError;
use crate::role::{Identity, Role, valid_name};
use crate::token;

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";

pub struct PoolCa {
    pub(crate) dir: PathBuf,
}

/// Paths of one issued certificate and its key.
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl PoolCa {
    /// The CA in `dir` (made by [`PoolCa::init`]).
    pub fn open(dir: &Path) -> Result<PoolCa, AuthError> {
        let ca = PoolCa {
            dir: dir.to_owned(),
        };
        read(&ca.dir.join(CA_CERT))?;
        Ok(ca)
    }

    /// True when `dir` already holds a CA certificate.
    pub fn exists(dir: &Path) -> bool {
        dir.join(CA_CERT).exists()
    }

    /// Make a new CA and the token key pair in `dir` (created if missing).
    /// Refuses to replace an existing CA: every certificate of the pool
    /// hangs on it.
    pub fn init(dir: &Path, pool: &str) -> Result<PoolCa, AuthError> {
        fs::create_dir_all(dir).map_err(|source| AuthError::Write {
            path: dir.to_owned(),
            source,
        })?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&format!("Aliquot pool CA {pool}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        write_new(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), true)?;
        write_new(&dir.join(CA_CERT), cert.pem().as_bytes(), false)?;
        token::write_key_pair(dir)?;
        Ok(PoolCa {
            dir: dir.to_owned(),
        })
    }

    /// The CA in `dir`, made first when absent: what `aliquotctl up` does
    /// at every start, so a pool keeps its CA (and its clients' certificates
    /// stay valid) across restarts.
    pub fn open_or_init(dir: &Path, pool: &str) -> Result<PoolCa, AuthError> {
        if PoolCa::exists(dir) {
            PoolCa::open(dir)
        } else {
            PoolCa::init(dir, pool)
        }
    }

    /// `issue`, unless that certificate and key are already there.
    pub fn ensure_issued(
        &self,
        role: Role,
        name: &str,
        hosts: &[String],
    ) -> Result<Issued, AuthError> {
        let paths = self.issued_paths(role, name);
        if paths.cert.exists() && paths.key.exists() {
            return Ok(paths);
        }
        self.issue(role, name, hosts)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join(CA_CERT)
    }

    /// Where `issue(role, name)` puts its files.
    pub fn issued_paths(&self, role: Role, name: &str) -> Issued {
        let base = format!("{role}-{name}");
        Issued {
            cert: self.dir.join(format!("{base}.pem")),
            key: self.dir.join(format!("{base}.key")),
        }
    }

    /// Issue a certificate for `name` in `role`, valid as TLS client and
    /// server. `hosts` are extra DNS names / IPs the holder serves on (the
    /// `<role>.aliquot` name is always there).
    pub fn issue(&self, role: Role, name: &str, hosts: &[String]) -> Result<Issued, AuthError> {
        if !valid_name(name) {
            return Err(AuthError::BadName(name.to_owned()));
        }
        let ca_key_pem = read(&self.dir.join(CA_KEY))?;
        let ca_pem = read(&self.dir.join(CA_CERT))?;
        let ca_key = KeyPair::from_pem(&ca_key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key)?;

        let id = Identity {
            role,
            name: name.to_owned(),
        };
        let mut params = CertificateParams::new(hosts.to_vec())?;
        params.distinguished_name = dn(&id.to_string());
        params
            .subject_alt_names
            .push(SanType::URI(id.uri().try_into()?));
        params
            .subject_alt_names
            .push(SanType::DnsName(role.server_name().try_into()?));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        let out = self.issued_paths(role, name);
        write_new(&out.key, key.serialize_pem().as_bytes(), true)?;
        write_new(&out.cert, cert.pem().as_bytes(), false)?;
        Ok(out)
    }
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Aliquot");
    dn.push(DnType::CommonName, common_name);
    dn
}

pub(crate) fn read(path: &Path) -> Result<String, AuthError> {
    fs::read_to_string(path).map_err(|source| AuthError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Create `path` (never replace it); private files get mode 0600.
pub(crate) fn write_new(path: &Path, data: &[u8], private: bool) -> Result<(), AuthError> {
    if path.exists() {
        return Err(AuthError::Exists {
            path: path.to_owned(),
        });
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .map_err(|source| AuthError::Write {
            path: path.to_owned(),
            source,
        })?;
    f.write_all(data).map_err(|source| AuthError::Write {
        path: path.to_owned(),
        source,
    })
}
