//! Write capability tokens. The allocator signs, per extent of an Allocate
//! reply, a [`WriteGrant`]: pool guid, generation, vdev, offset, size,
//! allocation id and expiry (the lease deadline, unix ms). Agents hold only
//! the public key and write only what a valid grant covers, so a client
//! writes only where it was sent, and a late writer whose lease ran out (or
//! whose allocator restarted) cannot land on space that has moved on.
//!
//! Ed25519 (ring, already in the tree for TLS) rather than a shared HMAC key:
//! an agent that is taken over cannot mint tokens for other agents' devices.
//!
//! Wire format, 117 bytes ([`TOKEN_LEN`]), opaque to clients (they pass it through):
//! `version(1)=1 | pool_guid | generation | vdev(u32) | offset | size |
//! allocation_id | expires_ms` (u64 big-endian unless marked) `| signature(64)`,
//! the signature over a domain-separation prefix and the 53 bytes before it.

use std::path::Path;

use aliquot_proto::error::Refusal;
use aliquot_proto::v1::ErrorReason;
use ring::rand::SystemRandom;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};
use tonic::Code;

use crate::ca::{read, write_new};
use crate::error::AuthError;

pub const TOKEN_KEY: &str = "token.key";
pub const TOKEN_PUB: &str = "token.pub";

const VERSION: u8 = 1;
/// The first byte of a read capability: the same fields, signed
/// under its own prefix, so a write token never reads and a read token never
/// writes (HDFS block tokens' access modes).
const READ_VERSION: u8 = 2;
const READ_CONTEXT: &[u8] = b"aliquot read token v1\0";
pub(crate) const BODY: usize = 1 + 8 + 8 + 4 + 8 + 8 + 8 + 8;
const SIG: usize = 64;
pub const TOKEN_LEN: usize = BODY + SIG;
const CONTEXT: &[u8] = b"aliquot write token v1\0";

/// What a token allows: writing `[offset, offset + size)` of `vdev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteGrant {
    pub pool_guid: u64,
    pub generation: u64,
    pub vdev: u32,
    pub offset: u64,
    pub size: u64,
    pub allocation_id: u64,
    pub expires_ms: u64,
}

impl WriteGrant {
    fn body(&self) -> [u8; BODY] {
        self.body_as(VERSION)
    }

    pub(crate) fn body_as(&self, version: u8) -> [u8; BODY] {
        let mut b = [0u8; BODY];
        b[0] = version;
        b[1..9].copy_from_slice(&self.pool_guid.to_be_bytes());
        b[9..17].copy_from_slice(&self.generation.to_be_bytes());
        b[17..21].copy_from_slice(&self.vdev.to_be_bytes());
        b[21..29].copy_from_slice(&self.offset.to_be_bytes());
        b[29..37].copy_from_slice(&self.size.to_be_bytes());
        b[37..45].copy_from_slice(&self.allocation_id.to_be_bytes());
        b[45..53].copy_from_slice(&self.expires_ms.to_be_bytes());
        b
    }

    fn parse_as(b: &[u8], version: u8) -> Option<WriteGrant> {
        (b.len() == TOKEN_LEN).then(|| Self::parse_body(b, version))?
    }

    /// The grant in a token's first `BODY` bytes, if they are of `version`.
    pub(crate) fn parse_body(b: &[u8], version: u8) -> Option<WriteGrant> {
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        (b.len() >= BODY && b[0] == version).then(|| WriteGrant {
            pool_guid: u64_at(1),
            generation: u64_at(9),
            vdev: u32::from_be_bytes([b[17], b[18], b[19], b[20]]),
            offset: u64_at(21),
            size: u64_at(29),
            allocation_id: u64_at(37),
            expires_ms: u64_at(45),
        })
    }
}

fn signed_message(body: &[u8]) -> Vec<u8> {
    signed_message_in(CONTEXT, body)
}

fn signed_message_in(context: &[u8], body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(context.len() + body.len());
    m.extend_from_slice(context);
    m.extend_from_slice(body);
    m
}

/// Why a write was refused. Each maps to PERMISSION_DENIED at the agent's
/// edge (reason `WRITE_TOKEN_*`), except `Missing` (UNAUTHENTICATED).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("write without a token: writes need the token of the Allocate reply's extent")]
    Missing,
    #[error("malformed write token ({0} bytes, expected {TOKEN_LEN} of version {VERSION})")]
    Malformed(usize),
    #[error("write token signature does not verify (not signed by this pool's allocator)")]
    Forged,
    #[error("write token is for pool {token:#x}, this agent is in pool {agent:#x}")]
    OtherPool { token: u64, agent: u64 },
    #[error("write token is for vdev {token}, this agent is vdev {agent}")]
    OtherVdev { token: u32, agent: u32 },
    #[error(
        "write token is of allocator generation {token}, older than generation {known}: the allocator restarted since; allocate again"
    )]
    OlderGeneration { token: u64, known: u64 },
    #[error(
        "write token expired at {expires_ms} ms (now {now_ms} ms): the lease ended; allocate again"
    )]
    Expired { expires_ms: u64, now_ms: u64 },
    #[error(
        "write [{offset}, +{len}) is outside the token's extent [{token_offset}, +{token_size})"
    )]
    OutOfRange {
        offset: u64,
        len: u64,
        token_offset: u64,
        token_size: u64,
    },
}

impl TokenError {
    /// The write's refusal: code, `WRITE_TOKEN_*` reason, the token's values.
    pub fn refusal(&self) -> Refusal {
        self.refusal_of(Access::Write)
    }

    /// The one table of token refusals, of writes and of reads: the same
    /// code and values, each access its own reason.
    fn refusal_of(&self, access: Access) -> Refusal {
        use ErrorReason as R;
        let reason = |write, read| match access {
            Access::Write => write,
            Access::Read => read,
        };
        let denied = |write, read| Refusal::new(Code::PermissionDenied, reason(write, read));
        match *self {
            TokenError::Missing => Refusal::new(
                Code::Unauthenticated,
                reason(R::WriteTokenMissing, R::ReadTokenMissing),
            ),
            TokenError::Malformed(len) => {
                denied(R::WriteTokenMalformed, R::ReadTokenMalformed).with("len", len)
            }
            TokenError::Forged => denied(R::WriteTokenForged, R::ReadTokenForged),
            TokenError::OtherPool { token, agent } => {
                denied(R::WriteTokenOtherPool, R::ReadTokenOtherPool)
                    .with("token_pool_guid", format!("{token:#x}"))
                    .with("pool_guid", format!("{agent:#x}"))
            }
            TokenError::OtherVdev { token, agent } => {
                denied(R::WriteTokenOtherVdev, R::ReadTokenOtherVdev)
                    .with("token_vdev", token)
                    .with("vdev", agent)
            }
            TokenError::OlderGeneration { token, known } => {
                denied(R::WriteTokenOldGeneration, R::ReadTokenOldGeneration)
                    .with("token_generation", token)
                    .with("generation", known)
            }
            TokenError::Expired { expires_ms, now_ms } => {
                denied(R::WriteTokenExpired, R::ReadTokenExpired)
                    .with("expires_ms", expires_ms)
                    .with("now_ms", now_ms)
            }
            TokenError::OutOfRange {
                offset,
                len,
                token_offset,
                token_size,
            } => denied(R::WriteTokenOutOfRange, R::ReadTokenOutOfRange)
                .with("offset", offset)
                .with("len", len)
                .with("token_offset", token_offset)
                .with("token_size", token_size),
        }
    }
}

#[derive(Clone, Copy)]
enum Access {
    Write,
    Read,
}

/// A read refused by the same checks: said of reads, with `READ_TOKEN_*`
/// reasons (a read without a token must not be told about writes).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", read_message(.0))]
pub struct ReadTokenError(pub TokenError);

impl ReadTokenError {
    /// The read's refusal: as the write's, with `READ_TOKEN_*` reasons.
    pub fn refusal(&self) -> Refusal {
        self.0.refusal_of(Access::Read)
    }
}

fn read_message(e: &TokenError) -> String {
    match *e {
        TokenError::Missing => "read without a token: reads need the read token of the block's \
             extent (Allocator.ReadTokens, granted to its owner or an admin)"
            .into(),
        TokenError::Malformed(n) => {
            format!("malformed read token ({n} bytes, not a read token of Allocator.ReadTokens)")
        }
        TokenError::Forged => {
            "read token signature does not verify (not signed by this pool's allocator, or a \
             write token given for a read)"
                .into()
        }
        TokenError::OtherPool { token, agent } => {
            format!("read token is for pool {token:#x}, this agent is in pool {agent:#x}")
        }
        TokenError::OtherVdev { token, agent } => {
            format!("read token is for vdev {token}, this agent is vdev {agent}")
        }
        TokenError::OlderGeneration { token, known } => format!(
            "read token is of allocator generation {token}, older than generation {known}: the \
             allocator restarted since; ask ReadTokens again"
        ),
        TokenError::Expired { expires_ms, now_ms } => {
            format!("read token expired at {expires_ms} ms (now {now_ms} ms): ask ReadTokens again")
        }
        TokenError::OutOfRange {
            offset,
            len,
            token_offset,
            token_size,
        } => format!(
            "read [{offset}, +{len}) is outside the token's extent [{token_offset}, +{token_size})"
        ),
    }
}

/// The allocator's half: the private key, and the master key of the
/// per-vdev MAC keys derived from it (`crate::mac_token`).
pub struct TokenSigner {
    key: Ed25519KeyPair,
    pub(crate) master: [u8; 32],
}

impl TokenSigner {
    /// A fresh random key (tests, or a pool without a CA directory).
    pub fn generate() -> TokenSigner {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .expect("the system RNG is available");
        TokenSigner {
            key: Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("ring's own PKCS#8 parses"),
            master: crate::mac_token::master_key(pkcs8.as_ref()),
        }
    }

    /// Load `token.key` (hex PKCS#8) from a CA directory, or the file itself.
    pub fn load(path: &Path) -> Result<TokenSigner, AuthError> {
        let path = if path.is_dir() {
            path.join(TOKEN_KEY)
        } else {
            path.to_owned()
        };
        let bad = |reason: &str| AuthError::BadKey {
            path: path.clone(),
            reason: reason.to_owned(),
        };
        let der = unhex(read(&path)?.trim()).ok_or_else(|| bad("not hex"))?;
        let key = Ed25519KeyPair::from_pkcs8(&der).map_err(|e| bad(&e.to_string()))?;
        Ok(TokenSigner {
            key,
            master: crate::mac_token::master_key(&der),
        })
    }

    pub fn verifier(&self) -> TokenVerifier {
        let mut public = [0u8; 32];
        public.copy_from_slice(self.key.public_key().as_ref());
        TokenVerifier { public }
    }

    /// A read capability for the same fields (`allocation_id` 0: reads are
    /// of committed extents, not of an allocation in flight).
    pub fn sign_read(&self, grant: &WriteGrant) -> Vec<u8> {
        let body = grant.body_as(READ_VERSION);
        let sig = self.key.sign(&signed_message_in(READ_CONTEXT, &body));
        let mut t = Vec::with_capacity(TOKEN_LEN);
        t.extend_from_slice(&body);
        t.extend_from_slice(sig.as_ref());
        t
    }

    pub fn sign(&self, grant: &WriteGrant) -> Vec<u8> {
        let body = grant.body();
        let sig = self.key.sign(&signed_message(&body));
        let mut t = Vec::with_capacity(TOKEN_LEN);
        t.extend_from_slice(&body);
        t.extend_from_slice(sig.as_ref());
        t
    }
}

/// The agent's half: only the public key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenVerifier {
    public: [u8; 32],
}

/// What the agent knows when it checks a write.
#[derive(Clone, Copy, Debug)]
pub struct WriteCheck {
    pub pool_guid: u64,
    pub vdev: u32,
    /// The newest allocator generation the agent has seen (RegisterReply,
    /// ReportAck): tokens of older generations are refused.
    pub known_generation: u64,
    pub now_ms: u64,
    pub offset: u64,
    pub len: u64,
}

impl TokenVerifier {
    /// Load `token.pub` (hex, 32 bytes) from a CA directory, or the file itself.
    pub fn load(path: &Path) -> Result<TokenVerifier, AuthError> {
        let path = if path.is_dir() {
            path.join(TOKEN_PUB)
        } else {
            path.to_owned()
        };
        let bytes = unhex(read(&path)?.trim())
            .filter(|b| b.len() == 32)
            .ok_or_else(|| AuthError::BadKey {
                path: path.clone(),
                reason: "expected 64 hex digits (an Ed25519 public key)".into(),
            })?;
        let mut public = [0u8; 32];
        public.copy_from_slice(&bytes);
        Ok(TokenVerifier { public })
    }

    /// Verify a read token as [`Self::verify`] does a write token (the
    /// `WriteCheck` then describes the read).
    pub fn verify_read(
        &self,
        token: &[u8],
        check: &WriteCheck,
    ) -> Result<WriteGrant, ReadTokenError> {
        self.verify_as(token, check, READ_VERSION, READ_CONTEXT)
            .map_err(ReadTokenError)
    }

    /// Verify the signature first (nothing unsigned is looked at), then pool,
    /// vdev, generation, expiry and range.
    pub fn verify(&self, token: &[u8], check: &WriteCheck) -> Result<WriteGrant, TokenError> {
        self.verify_as(token, check, VERSION, CONTEXT)
    }

    fn verify_as(
        &self,
        token: &[u8],
        check: &WriteCheck,
        version: u8,
        context: &[u8],
    ) -> Result<WriteGrant, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Missing);
        }
        let grant =
            WriteGrant::parse_as(token, version).ok_or(TokenError::Malformed(token.len()))?;
        UnparsedPublicKey::new(&ED25519, &self.public)
            .verify(&signed_message_in(context, &token[..BODY]), &token[BODY..])
            .map_err(|_| TokenError::Forged)?;
        check_grant(grant, check)
    }
}

/// A genuine token's grant against what the agent knows: pool, vdev,
/// generation, expiry and range, in that order.
pub(crate) fn check_grant(grant: WriteGrant, check: &WriteCheck) -> Result<WriteGrant, TokenError> {
    if grant.pool_guid != check.pool_guid {
        return Err(TokenError::OtherPool {
            token: grant.pool_guid,
            agent: check.pool_guid,
        });
    }
    if grant.vdev != check.vdev {
        return Err(TokenError::OtherVdev {
            token: grant.vdev,
            agent: check.vdev,
        });
    }
    if grant.generation < check.known_generation {
        return Err(TokenError::OlderGeneration {
            token: grant.generation,
            known: check.known_generation,
        });
    }
    if check.now_ms >= grant.expires_ms {
        return Err(TokenError::Expired {
            expires_ms: grant.expires_ms,
            now_ms: check.now_ms,
        });
    }
    let inside = check.offset >= grant.offset
        && check
            .offset
            .checked_add(check.len)
            .zip(grant.offset.checked_add(grant.size))
            .is_some_and(|(end, token_end)| end <= token_end);
    if !inside {
        return Err(TokenError::OutOfRange {
            offset: check.offset,
            len: check.len,
            token_offset: grant.offset,
            token_size: grant.size,
        });
    }
    Ok(grant)
}

/// Write `token.key` (0600) and `token.pub` into a CA directory.
pub(crate) fn write_key_pair(dir: &Path) -> Result<(), AuthError> {
    let pkcs8 =
        Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).map_err(|_| AuthError::BadKey {
            path: dir.join(TOKEN_KEY),
            reason: "the system RNG failed".into(),
        })?;
    let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|e| AuthError::BadKey {
        path: dir.join(TOKEN_KEY),
        reason: e.to_string(),
    })?;
    write_new(&dir.join(TOKEN_KEY), hex(pkcs8.as_ref()).as_bytes(), true)?;
    write_new(
        &dir.join(TOKEN_PUB),
        hex(key.public_key().as_ref()).as_bytes(),
        false,
    )
}

fn hex(b: &[u8]) -> String {
    let mut s: String = b.iter().map(|x| format!("{x:02x}")).collect();
    s.push('\n');
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> WriteGrant {
        WriteGrant {
            pool_guid: 7,
            generation: 3,
            vdev: 2,
            offset: 1 << 20,
            size: 128 << 10,
            allocation_id: 99,
            expires_ms: 10_000,
        }
    }

    fn check() -> WriteCheck {
        WriteCheck {
            pool_guid: 7,
            vdev: 2,
            known_generation: 3,
            now_ms: 5_000,
            offset: 1 << 20,
            len: 4096,
        }
    }

    #[test]
    fn each_refusal() {
        let s = TokenSigner::generate();
        let v = s.verifier();
        let t = s.sign(&grant());
        assert_eq!(v.verify(&t, &check()), Ok(grant()));
        // The last block of the extent is inside; one byte past is not.
        let end = WriteCheck {
            offset: (1 << 20) + (124 << 10),
            ..check()
        };
        assert!(v.verify(&t, &end).is_ok());
        let past = WriteCheck {
            offset: (1 << 20) + (125 << 10),
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &past),
            Err(TokenError::OutOfRange { .. })
        ));
        let before = WriteCheck {
            offset: (1 << 20) - 4096,
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &before),
            Err(TokenError::OutOfRange { .. })
        ));
        let wrap = WriteCheck {
            len: u64::MAX,
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &wrap),
            Err(TokenError::OutOfRange { .. })
        ));
        assert_eq!(v.verify(&[], &check()), Err(TokenError::Missing));
        assert_eq!(v.verify(&t[..40], &check()), Err(TokenError::Malformed(40)));
        let newer = WriteCheck {
            known_generation: 4,
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &newer),
            Err(TokenError::OlderGeneration { token: 3, known: 4 })
        ));
        let late = WriteCheck {
            now_ms: 10_000,
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &late),
            Err(TokenError::Expired { .. })
        ));
        let other_vdev = WriteCheck { vdev: 1, ..check() };
        assert!(matches!(
            v.verify(&t, &other_vdev),
            Err(TokenError::OtherVdev { .. })
        ));
        let other_pool = WriteCheck {
            pool_guid: 8,
            ..check()
        };
        assert!(matches!(
            v.verify(&t, &other_pool),
            Err(TokenError::OtherPool { .. })
        ));
    }

    #[test]
    fn tampering_and_other_keys_are_forgeries() {
        let s = TokenSigner::generate();
        let mut t = s.sign(&grant());
        // Widen the extent: the signature no longer matches.
        t[29..37].copy_from_slice(&(1u64 << 40).to_be_bytes());
        assert_eq!(s.verifier().verify(&t, &check()), Err(TokenError::Forged));
        let other = TokenSigner::generate().sign(&grant());
        assert_eq!(
            s.verifier().verify(&other, &check()),
            Err(TokenError::Forged)
        );
    }

    #[test]
    fn key_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        write_key_pair(dir.path()).unwrap();
        let s = TokenSigner::load(dir.path()).unwrap();
        let v = TokenVerifier::load(dir.path()).unwrap();
        assert_eq!(s.verifier(), v);
        assert!(v.verify(&s.sign(&grant()), &check()).is_ok());
        // Never overwritten.
        assert!(matches!(
            write_key_pair(dir.path()),
            Err(AuthError::Exists { .. })
        ));
    }
}
