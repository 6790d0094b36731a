//! Capabilities as MACs with per-vdev keys: what the allocator
//! mints per extent at memory speed, where an Ed25519 signature cost ~20 µs.
//!
//! The allocator holds a master key (derived from its `token.key`, so no new
//! file is needed). For each vdev and allocator generation it derives a key,
//! HKDF-SHA256 over (pool guid, device guid, generation), and hands it to
//! that vdev's agent in the RegisterReply, over mutual TLS only. A token is
//! the same 53-byte body as the Ed25519 token (pool, generation, vdev,
//! offset, size, allocation id, expiry) under version 3 (write) or 4
//! (read), followed by HMAC-SHA256 over a domain-separation prefix and the
//! body.
//!
//! What this bounds (HDFS's block access tokens work the same way, keys
//! handed to DataNodes by the NameNode): an agent holds only its own
//! device's key, so a stolen agent can mint tokens only for the device it
//! controls anyway; agents never see the master key; keys change with every
//! generation (each allocator start or takeover), so a key lives no longer
//! than the generation it was made for, and tokens of an older generation
//! are refused as before. An agent that has not yet re-registered with a
//! new generation does not know its key: it answers UNAVAILABLE (retry)
//! until its registration, as HDFS's DataNode that missed a key roll waits
//! for its next heartbeat's keys.

use ring::hmac;

use crate::token::{BODY, TokenError, TokenSigner, WriteCheck, WriteGrant, check_grant};

/// A MAC write token's first byte.
pub const MAC_WRITE_VERSION: u8 = 3;
/// A MAC read token's first byte.
pub const MAC_READ_VERSION: u8 = 4;
const TAG: usize = 32;
/// Bytes of a MAC token: the body and the tag.
pub const MAC_TOKEN_LEN: usize = BODY + TAG;
const WRITE_CONTEXT: &[u8] = b"aliquot mac write token v1\0";
const READ_CONTEXT: &[u8] = b"aliquot mac read token v1\0";
const MASTER_SALT: &[u8] = b"aliquot token master key v1";
const VDEV_KEY_INFO: &[u8] = b"aliquot vdev token key v1";

/// HKDF-Extract (RFC 5869) of the master key from the allocator's token key.
pub(crate) fn master_key(ikm: &[u8]) -> [u8; 32] {
    let prk = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, MASTER_SALT), ikm);
    let mut m = [0u8; 32];
    m.copy_from_slice(prk.as_ref());
    m
}

/// One vdev's key for one generation.
#[derive(Clone)]
pub struct VdevKey {
    generation: u64,
    bytes: [u8; 32],
    key: hmac::Key,
}

impl std::fmt::Debug for VdevKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        f.debug_struct("VdevKey")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl TokenSigner {
    /// The key of `device_guid`'s vdev in `generation`: HKDF-Expand (one
    /// block) of the master key over the pool guid, device guid and
    /// generation.
    pub fn vdev_key(&self, pool_guid: u64, device_guid: u64, generation: u64) -> VdevKey {
        let prk = hmac::Key::new(hmac::HMAC_SHA256, &self.master);
        let mut info = Vec::with_capacity(VDEV_KEY_INFO.len() + 25);
        info.extend_from_slice(VDEV_KEY_INFO);
        info.extend_from_slice(&pool_guid.to_be_bytes());
        info.extend_from_slice(&device_guid.to_be_bytes());
        info.extend_from_slice(&generation.to_be_bytes());
        info.push(1);
        let t = hmac::sign(&prk, &info);
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(t.as_ref());
        VdevKey::new(generation, bytes)
    }
}

impl VdevKey {
    fn new(generation: u64, bytes: [u8; 32]) -> VdevKey {
        VdevKey {
            generation,
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
            bytes,
        }
    }

    /// A key as the RegisterReply carries it (None: not 32 bytes).
    pub fn from_bytes(generation: u64, bytes: &[u8]) -> Option<VdevKey> {
        let b: [u8; 32] = bytes.try_into().ok()?;
        Some(VdevKey::new(generation, b))
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.bytes
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn sign(&self, grant: &WriteGrant) -> Vec<u8> {
        self.mint(grant, MAC_WRITE_VERSION, WRITE_CONTEXT)
    }

    /// A read capability for the same fields.
    pub fn sign_read(&self, grant: &WriteGrant) -> Vec<u8> {
        self.mint(grant, MAC_READ_VERSION, READ_CONTEXT)
    }

    fn mint(&self, grant: &WriteGrant, version: u8, context: &'static [u8]) -> Vec<u8> {
        let body = grant.body_as(version);
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(context);
        ctx.update(&body);
        let tag = ctx.sign();
        let mut t = Vec::with_capacity(MAC_TOKEN_LEN);
        t.extend_from_slice(&body);
        t.extend_from_slice(tag.as_ref());
        t
    }

    /// Verify the MAC first (nothing unauthenticated is looked at), then
    /// the grant as an Ed25519 token's is checked.
    pub fn verify(&self, token: &[u8], check: &WriteCheck) -> Result<WriteGrant, TokenError> {
        self.check(token, check, MAC_WRITE_VERSION, WRITE_CONTEXT)
    }

    pub fn verify_read(
        &self,
        token: &[u8],
        check: &WriteCheck,
    ) -> Result<WriteGrant, crate::token::ReadTokenError> {
        self.check(token, check, MAC_READ_VERSION, READ_CONTEXT)
            .map_err(crate::token::ReadTokenError)
    }

    fn check(
        &self,
        token: &[u8],
        check: &WriteCheck,
        version: u8,
        context: &'static [u8],
    ) -> Result<WriteGrant, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Missing);
        }
        let grant = (token.len() == MAC_TOKEN_LEN)
            .then(|| WriteGrant::parse_body(token, version))
            .flatten()
            .ok_or(TokenError::Malformed(token.len()))?;
        let mut msg = Vec::with_capacity(context.len() + BODY);
        msg.extend_from_slice(context);
        msg.extend_from_slice(&token[..BODY]);
        hmac::verify(&self.key, &msg, &token[BODY..]).map_err(|_| TokenError::Forged)?;
        check_grant(grant, check)
    }
}

/// The version byte of a token (0 for an empty one): which key checks it.
pub fn token_version(token: &[u8]) -> u8 {
    token.first().copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> WriteGrant {
        WriteGrant {
            pool_guid: 7,
            generation: 3,
            vdev: 1,
            offset: 1 << 20,
            size: 4096,
            allocation_id: 42,
            expires_ms: 10_000,
        }
    }

    fn check() -> WriteCheck {
        WriteCheck {
            pool_guid: 7,
            vdev: 1,
            known_generation: 3,
            now_ms: 5_000,
            offset: 1 << 20,
            len: 4096,
        }
    }

    #[test]
    fn a_vdev_key_is_per_device_and_generation() {
        let s = TokenSigner::generate();
        let k = s.vdev_key(7, 0xd1, 3);
        assert_eq!(k.bytes(), s.vdev_key(7, 0xd1, 3).bytes());
        assert_ne!(k.bytes(), s.vdev_key(7, 0xd2, 3).bytes());
        assert_ne!(k.bytes(), s.vdev_key(7, 0xd1, 4).bytes());
        assert_ne!(k.bytes(), s.vdev_key(8, 0xd1, 3).bytes());
        assert_ne!(
            k.bytes(),
            TokenSigner::generate().vdev_key(7, 0xd1, 3).bytes()
        );
    }

    #[test]
    fn genuine_tokens_verify_and_tampered_ones_do_not() {
        let k = TokenSigner::generate().vdev_key(7, 0xd1, 3);
        let t = k.sign(&grant());
        assert_eq!(t.len(), MAC_TOKEN_LEN);
        assert_eq!(k.verify(&t, &check()), Ok(grant()));
        // Widened: the size byte changed, the tag not.
        let mut wide = t.clone();
        wide[36] ^= 0x10;
        assert_eq!(k.verify(&wide, &check()), Err(TokenError::Forged));
        // Another vdev's key.
        let other = TokenSigner::generate().vdev_key(7, 0xd1, 3);
        assert_eq!(other.verify(&t, &check()), Err(TokenError::Forged));
        // A write token does not read, a read token does not write.
        assert!(k.verify_read(&t, &check()).is_err());
        assert!(k.verify(&k.sign_read(&grant()), &check()).is_err());
        assert_eq!(k.verify_read(&k.sign_read(&grant()), &check()), Ok(grant()));
        // The grant's own checks still apply.
        let late = WriteCheck {
            now_ms: 10_000,
            ..check()
        };
        assert!(matches!(
            k.verify(&t, &late),
            Err(TokenError::Expired { .. })
        ));
        assert_eq!(k.verify(&[], &check()), Err(TokenError::Missing));
        assert_eq!(k.verify(&t[..40], &check()), Err(TokenError::Malformed(40)));
    }
}
