//! The write gate: with the allocator's token key (`--token-key`, its
//! `token.pub`), every write must carry a valid write capability for this
//! pool, this vdev, the current allocator generation or newer, unexpired,
//! covering the bytes written. The pool guid, vdev and generation come from
//! the allocator (RegisterReply, ReportAck); until the agent has registered
//! it cannot tell a good token from a stale one, so it refuses writes.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{SystemTime, UNIX_EPOCH};

use aliquot_auth::token::{TokenVerifier, WriteCheck};

use crate::error::AgentError;

#[derive(Debug)]
pub struct WriteGate {
    verifier: Option<TokenVerifier>,
    pool_guid: AtomicU64,
    generation: AtomicU64,
    /// Tokens die once a newer allocation wrote their bytes.
    fence: crate::fence::WriteFence,
}

impl WriteGate {
    pub fn new(verifier: Option<TokenVerifier>) -> WriteGate {
        WriteGate {
            verifier,
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
    pub fn learn_fence(&self, first_allocation_id: u64, max_lease_ms: u64) {
        self.fence.learn_floor(first_allocation_id, max_lease_ms);
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

    /// Check a read of `len` bytes at `offset` of `vdev` against its read
    /// token (issue 25: reads need a capability as writes do).
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
        verifier
            .verify_read(
                token,
                &WriteCheck {
                    pool_guid,
                    vdev,
                    known_generation: self.generation(),
                    now_ms,
                    offset,
                    len,
                },
            )
            .map(|_| ())
            .map_err(AgentError::Token)
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
        verifier
            .verify(
                token,
                &WriteCheck {
                    pool_guid,
                    vdev,
                    known_generation: self.generation(),
                    now_ms,
                    offset,
                    len,
                },
            )
            // A genuine token of a newer generation proves the allocator
            // reached it: from now on refuse the older generation's tokens
            // even if the RegisterReply/ReportAck saying so is still on its
            // way (a late write of the old generation must not follow a
            // write of the new one onto the same extent).
            .map_err(AgentError::Token)
            .and_then(|grant| {
                self.fence
                    .admit(grant.allocation_id, offset, len, grant.expires_ms, now_ms)
                    .map_err(AgentError::Fenced)?;
                self.learn_generation(grant.generation);
                Ok(())
            })
    }
}
