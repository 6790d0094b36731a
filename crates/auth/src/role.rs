//! Roles and identities. A certificate from the pool CA names exactly one role
//! and one name in a SAN URI `aliquot://role/<role>/<name>`; servers also get
//! a DNS SAN `<role>.aliquot` so a client can insist on talking to, say, the
//! allocator (ordinary hostname verification) and not to an agent posing as it.

use std::fmt;
use std::str::FromStr;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

pub const URI_PREFIX: &str = "aliquot://role/";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A vdev agent: registers and reports its own device.
    Agent,
    /// A client: allocates, writes (with tokens), commits, frees, reads.
    Client,
    /// An operator: tunables and vdev state, plus everything a client does.
    Admin,
    /// The allocator: pushes balance snapshots to metrics.
    Allocator,
    /// The metrics service (server identity only).
    Metrics,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Agent,
        Role::Client,
        Role::Admin,
        Role::Allocator,
        Role::Metrics,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Client => "client",
            Role::Admin => "admin",
            Role::Allocator => "allocator",
            Role::Metrics => "metrics",
        }
    }

    /// The DNS name a server of this role presents and its clients verify.
    pub fn server_name(self) -> String {
        format!("{}.aliquot", self.as_str())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?} (agent, client, admin, allocator, metrics)"))
    }
}

/// Who is calling: the role and name from a verified peer certificate. The
/// role layer puts it in each request's extensions for handlers that bind
/// state to a caller (an agent to its device, an allocation to its client).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

impl Identity {
    pub fn uri(&self) -> String {
        format!("{URI_PREFIX}{}/{}", self.role, self.name)
    }

    /// Parse `aliquot://role/<role>/<name>`.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let rest = uri.strip_prefix(URI_PREFIX)?;
        let (role, name) = rest.split_once('/')?;
        if !valid_name(name) {
            return None;
        }
        Some(Identity {
            role: role.parse().ok()?,
            name: name.to_owned(),
        })
    }

    /// The identity in a DER certificate (already verified against the pool
    /// CA by the TLS handshake). None unless exactly one role URI is present:
    /// a certificate naming two roles is refused, not guessed at.
    pub fn from_cert_der(der: &[u8]) -> Option<Identity> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut found = san.value.general_names.iter().filter_map(|n| match n {
            GeneralName::URI(u) if u.starts_with(URI_PREFIX) => Some(Identity::from_uri(u)),
            _ => None,
        });
        let first = found.next()??;
        match found.next() {
            None => Some(first),
            Some(_) => None,
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.name)
    }
}

/// Names go into file names and URIs: keep them plain.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with('.')
}
