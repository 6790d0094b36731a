//! The write gate: with the allocator's token key (`--token-key`, its
//! `token.pub`), every write must carry a valid write capability for this
//! pool, this vdev, the current allocator generation or newer, unexpired,
//! covering the bytes written. The pool guid, vdev and generation come from
//! the allocator (RegisterReply, ReportAck); until the agent has registered
//! it cannot tell a good token from a stale one, so it refuses writes.
//! Tokens come in two kinds: Ed25519-signed (checked with `token.pub`) and
//! MACs under this vdev's key of the generation (`aliquot_auth::mac_token`),
//! handed over by the allocator in the RegisterReply. Reads need a read
//! token the same way, which dies when a newer allocation writes over its
//! bytes (see [`crate::fence`]).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{SystemTime, UNIX_EPOCH};

use aliquot_auth::VdevKey;
use aliquot_auth::mac_token::{MAC_READ_VERSION, MAC_WRITE_VERSION, token_version};
use aliquot_auth::token::{TokenVerifier, WriteCheck};
use aliquot_auth::{ReadTokenError, TokenError};

use crate::error::AgentError;

#[derive(Debug)]
pub struct WriteGate {
    verifier: Option<TokenVerifier>,
    /// This vdev's MAC key for the newest generation it registered in.
    mac: std::sync::RwLock<Option<VdevKey>>,
    pool_guid: AtomicU64,
    generation: AtomicU64,
    /// Tokens die once a newer allocation wrote their bytes.
    fence: crate::fence::WriteFence,
}

impl WriteGate {
    pub fn new(verifier: Option<TokenVerifier>) -> WriteGate {
        WriteGate {
            verifier,
            mac: Default::default(),
            pool_guid: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            fence: Default::default(),
        }
    }

    pub fn enforcing(&self) -> bool {
        self.verifier.is_some()
    }

    /// The pool and generation of a registration.
    pub fn learn_pool(&self, pool_guid: u64, generation: u64) {
        self.pool_guid.store(pool_guid, Relaxed);
        self.learn_generation(generation);
    }

    /// Generations only move forward: a token older than the newest seen
    /// was signed before the allocator last restarted.
    pub fn learn_generation(&self, generation: u64) {
        self.generation.fetch_max(generation, Relaxed);
    }

    /// A registration's floor of honoured allocation ids and the
    /// allocator's longest lease (see [`crate::fence`]).
    pub fn learn_fence(&self, first_allocation_id: u64, max_lease_ms: u64, label_generation: u64) {
        self.fence
            .learn_floor(first_allocation_id, max_lease_ms, label_generation);
    }

    /// Fill `report` with what generations older than `generation` wrote
    /// (see `fence::WriteFence::older_writes`); without a token verifier,
    /// every write this process took before it joined `generation`.
    pub fn name_older_writes(&self, generation: u64, report: &mut aliquot_proto::v1::AgentReport) {
        report.older_writes_sent = true;
        let vdev = report.vdev;
        if let Some(ranges) = self.fence.older_writes(generation) {
            report.older_writes_known = true;
            report.records_since_allocation_id = self.fence.records_since();
            report.older_write_allocation_ids = ranges.iter().map(|r| r.2).collect();
            report.older_writes = ranges
                .into_iter()
                .map(|(offset, end, _)| aliquot_proto::v1::Extent {
                    vdev,
                    offset,
                    size: end - offset,
                })
                .collect();
        }
    }

    pub fn fence(&self) -> &crate::fence::WriteFence {
        &self.fence
    }

    /// Allocations the allocator says ended (ReportAck).
    pub fn revoke(&self, ids: &[u64], expires_ms: &[u64]) {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.fence.revoke(ids, expires_ms, now_ms);
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    /// The MAC key the allocator handed over at registration:
    /// kept when it is of the newest generation seen.
    pub fn learn_key(&self, generation: u64, bytes: &[u8]) {
        let Some(k) = VdevKey::from_bytes(generation, bytes) else {
            return;
        };
        let mut mac = self.mac.write().unwrap_or_else(|p| p.into_inner());
        if mac.as_ref().is_none_or(|m| m.generation() <= generation) {
            *mac = Some(k);
        }
    }

    /// Check a token of either kind: Ed25519 (versions 1 and 2, with
    /// `--token-key`) or MAC (3 and 4, with the key from the registration).
    fn verify(
        &self,
        verifier: &TokenVerifier,
        token: &[u8],
        check: &WriteCheck,
        read: bool,
    ) -> Result<aliquot_auth::WriteGrant, AgentError> {
        // A refused read is told about reads (`READ_TOKEN_*`).
        let refused = |e: TokenError| match read {
            true => AgentError::ReadToken(ReadTokenError(e)),
            false => AgentError::Token(e),
        };
        let version = token_version(token);
        if version != MAC_WRITE_VERSION && version != MAC_READ_VERSION {
            return if read {
                verifier.verify_read(token, check).map_err(|e| e.0)
            } else {
                verifier.verify(token, check)
            }
            .map_err(refused);
        }
        // The generation field says which key; unauthenticated until the
        // MAC is checked, so it only picks the key or the refusal.
        let generation = token
            .get(9..17)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_be_bytes);
        let mac = self.mac.read().unwrap_or_else(|p| p.into_inner());
        match mac.as_ref() {
            Some(k) if k.generation() == generation => if read {
                k.verify_read(token, check).map_err(|e| e.0)
            } else {
                k.verify(token, check)
            }
            .map_err(refused),
            Some(k) if k.generation() > generation => Err(refused(TokenError::OlderGeneration {
                token: generation,
                known: k.generation(),
            })),
            _ => Err(AgentError::TokenKeyUnknown { generation }),
        }
    }

    /// Check a read of `len` bytes at `offset` of `vdev` against its read
    /// token (reads need a capability as writes do).
    pub fn check_read(
        &self,
        token: &[u8],
        vdev: Option<u32>,
        offset: u64,
        len: u64,
    ) -> Result<(), AgentError> {
        let Some(verifier) = &self.verifier else {
            return Ok(());
        };
        let pool_guid = self.pool_guid.load(Relaxed);
        let (Some(vdev), true) = (vdev, pool_guid != 0) else {
            return Err(AgentError::NotRegistered);
        };
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let check = WriteCheck {
            pool_guid,
            vdev,
            known_generation: self.generation(),
            now_ms,
            offset,
            len,
        };
        // A token dies with its block: refused where a newer allocation
        // wrote since it was granted (the block was freed, the space given
        // again).
        self.verify(verifier, token, &check, true)
            .and_then(|grant| {
                self.fence
                    .check_read(grant.allocation_id, offset, len)
                    .map_err(AgentError::Fenced)
            })
    }

    /// Check a write of `len` bytes at `offset` to `vdev` (None: not
    /// registered yet).
    pub fn check(
        &self,
        token: &[u8],
        vdev: Option<u32>,
        offset: u64,
        len: u64,
    ) -> Result<(), AgentError> {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let Some(verifier) = &self.verifier else {
            // Nothing to check; the range is remembered so that a new
            // allocator generation keeps out only what older ones wrote
            // during its claim window, not the whole vdev.
            self.fence
                .record_unchecked(self.generation(), offset, len, now_ms);
            return Ok(());
        };
        let pool_guid = self.pool_guid.load(Relaxed);
        let (Some(vdev), true) = (vdev, pool_guid != 0) else {
            return Err(AgentError::NotRegistered);
        };
        let check = WriteCheck {
            pool_guid,
            vdev,
            known_generation: self.generation(),
            now_ms,
            offset,
            len,
        };
        self.verify(verifier, token, &check, false)
            // A genuine token of a newer generation proves the allocator
            // reached it: from now on refuse the older generation's tokens
            // even if the RegisterReply/ReportAck saying so is still on its
            // way (a late write of the old generation must not follow a
            // write of the new one onto the same extent).
            .and_then(|grant| {
                self.fence
                    .admit(grant.allocation_id, offset, len, grant.expires_ms, now_ms)
                    .map_err(AgentError::Fenced)?;
                self.learn_generation(grant.generation);
                Ok(())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_auth::{TokenError, TokenSigner, WriteGrant};

    fn grant(generation: u64, allocation_id: u64) -> WriteGrant {
        WriteGrant {
            pool_guid: 7,
            generation,
            vdev: 1,
            offset: 0,
            size: 4096,
            allocation_id,
            expires_ms: u64::MAX / 2,
        }
    }

    /// Keys rotate with the generation: after the agent learns generation
    /// 2's key, a MAC token of generation 1 (replayed after a takeover) is
    /// refused as older, one of generation 3 waits for its key (retry),
    /// and Ed25519 tokens still verify with `token.pub`.
    #[test]
    fn mac_keys_rotate_with_the_generation() {
        let signer = TokenSigner::generate();
        let gate = WriteGate::new(Some(signer.verifier()));
        gate.learn_pool(7, 1);
        let k1 = signer.vdev_key(7, 0xd1, 1);
        gate.learn_key(1, k1.bytes());
        gate.check(&k1.sign(&grant(1, 1)), Some(1), 0, 4096)
            .expect("generation 1's token under generation 1's key");

        let k2 = signer.vdev_key(7, 0xd1, 2);
        gate.learn_pool(7, 2);
        gate.learn_key(2, k2.bytes());
        // An older key handed over late does not replace the newer one.
        gate.learn_key(1, k1.bytes());
        let replayed = gate.check(&k1.sign(&grant(1, 2)), Some(1), 0, 4096);
        assert!(
            matches!(
                replayed,
                Err(AgentError::Token(TokenError::OlderGeneration {
                    token: 1,
                    known: 2
                }))
            ),
            "{replayed:?}"
        );
        gate.check(&k2.sign(&grant(2, 3)), Some(1), 0, 4096)
            .expect("generation 2's token");
        let ahead = gate.check(
            &signer.vdev_key(7, 0xd1, 3).sign(&grant(3, 4)),
            Some(1),
            0,
            4096,
        );
        assert!(
            matches!(ahead, Err(AgentError::TokenKeyUnknown { generation: 3 })),
            "{ahead:?}"
        );
        gate.check(&signer.sign(&grant(2, 5)), Some(1), 0, 4096)
            .expect("an Ed25519 token of generation 2");
    }
}
