//! CopyFrom, the destination agent's half of a move the allocator drives
//! (a vdev removal): read the source agent with the allocator's read token,
//! write here under its write token, so the bytes go agent to agent and
//! never through the allocator. Every chunk's length and Fletcher-4 (the
//! source's, computed on what it read) are checked on arrival, and the whole
//! extent's checksum again on what this device gives back after a flush:
//! the answer the allocator commits on is what is durably here.
//!
//! Moves are the low-priority class (OpenZFS's removal I/O class,
//! `vdev_queue.c`): one copy at a time per agent, and each chunk, here and
//! at the source (ReadForCopy), first waits, for a bounded time, while
//! client I/O is queued; client I/O never waits for a move.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{CopyFromReply, CopyFromRequest, ReadRequest};
use tonic::transport::Channel;

use crate::agent::{Agent, MAX_IO};
use crate::error::AgentError;

/// Bytes read from the source per request.
const CHUNK: u64 = 1 << 20;
/// The longest a move chunk waits for client I/O to drain: a device busy
/// without pause still moves, slowly.
pub(crate) const YIELD_AT_MOST: Duration = Duration::from_millis(50);
pub(crate) const YIELD_STEP: Duration = Duration::from_millis(1);
/// The longest a source read may take (connect included).
const SOURCE_WITHIN: Duration = Duration::from_secs(30);

/// OpenZFS's default checksum, over little-endian 32-bit words
/// (`zfs_fletcher.c:fletcher_4_native@zfs-2.4.0` describes it); computed
/// incrementally over chunks whose sizes are multiples of 4.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fletcher4([u64; 4]);

impl Fletcher4 {
    pub fn update(&mut self, data: &[u8]) {
        let [mut a, mut b, mut c, mut d] = self.0;
        let mut words = data.chunks_exact(4);
        for w in &mut words {
            a = a.wrapping_add(u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64);
            b = b.wrapping_add(a);
            c = c.wrapping_add(b);
            d = d.wrapping_add(c);
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let mut w = [0u8; 4];
            w[..tail.len()].copy_from_slice(tail);
            a = a.wrapping_add(u32::from_le_bytes(w) as u64);
            b = b.wrapping_add(a);
            c = c.wrapping_add(b);
            d = d.wrapping_add(c);
        }
        self.0 = [a, b, c, d];
    }

    pub fn of(data: &[u8]) -> Fletcher4 {
        let mut f = Fletcher4::default();
        f.update(data);
        f
    }

    pub fn to_bytes(self) -> Vec<u8> {
        self.0.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

/// Copies from other agents: their connections, and the one-at-a-time gate.
pub struct Copier {
    tls: aliquot_auth::ClientTls,
    channels: std::sync::Mutex<HashMap<String, Channel>>,
    moves: tokio::sync::Semaphore,
}

impl Copier {
    pub fn new(tls: Option<aliquot_auth::TlsFiles>) -> Copier {
        Copier {
            tls: tls.into(),
            channels: Default::default(),
            moves: tokio::sync::Semaphore::new(1),
        }
    }

    fn channel(&self, endpoint: &str) -> Result<Channel, AgentError> {
        let mut ch = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = ch.get(endpoint) {
            return Ok(c.clone());
        }
        let c = self
            .tls
            .endpoint(endpoint, aliquot_auth::Role::Agent)
            .map_err(|e| AgentError::InvalidArgument(format!("source_endpoint: {e}")))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .connect_lazy();
        ch.insert(endpoint.to_string(), c.clone());
        Ok(c)
    }

    /// Copy `req.size` bytes from the source agent to `req.offset` here.
    pub async fn copy(
        &self,
        agent: &Agent,
        req: CopyFromRequest,
    ) -> Result<CopyFromReply, AgentError> {
        let CopyFromRequest {
            source_endpoint,
            source_offset,
            source_token,
            offset,
            size,
            token,
        } = req;
        if size == 0 || size > MAX_IO {
            return Err(AgentError::InvalidArgument(format!(
                "size {size}: a copy moves one block of 1 byte to {MAX_IO} bytes"
            )));
        }
        // The whole destination under its write token before any byte moves.
        agent.gate().check(&token, agent.vdev(), offset, size)?;
        agent.check_range("write", offset, size)?;
        let _one = self
            .moves
            .acquire()
            .await
            .map_err(|_| AgentError::ShuttingDown)?;
        let mut client = VdevAgentClient::new(self.channel(&source_endpoint)?)
            .max_decoding_message_size((CHUNK as usize) + (64 << 10));
        let source_failed = |message: String| AgentError::CopySource {
            endpoint: source_endpoint.clone(),
            message,
        };
        let mut sent = Fletcher4::default();
        let mut yielded = Duration::ZERO;
        let mut done = 0;
        while done < size {
            let len = CHUNK.min(size - done);
            yielded += agent.yield_to_clients(YIELD_AT_MOST, YIELD_STEP).await;
            let reply = tokio::time::timeout(
                SOURCE_WITHIN,
                client.read_for_copy(ReadRequest {
                    offset: source_offset + done,
                    size: len,
                    token: source_token.clone(),
                }),
            )
            .await
            .map_err(|_| source_failed(format!("no answer within {SOURCE_WITHIN:?}")))?
            .map_err(|s| source_failed(format!("{}: {}", s.code(), s.message())))?
            .into_inner();
            if reply.data.len() as u64 != len {
                return Err(AgentError::CopyMismatch(format!(
                    "the source sent {} bytes at offset {} for {len}",
                    reply.data.len(),
                    source_offset + done
                )));
            }
            if reply.fletcher4 != Fletcher4::of(&reply.data).to_bytes() {
                return Err(AgentError::CopyMismatch(format!(
                    "the {len} bytes from source offset {} arrived with another checksum than \
                     the source read",
                    source_offset + done
                )));
            }
            sent.update(&reply.data);
            agent
                .as_move(agent.write(offset + done, reply.data))
                .await?;
            done += len;
        }
        // Durable before the allocator commits the move on this answer.
        agent.flush().await?;
        let mut here = Fletcher4::default();
        let mut at = 0;
        while at < size {
            let len = CHUNK.min(size - at);
            here.update(&agent.as_move(agent.read(offset + at, len)).await?);
            at += len;
        }
        if here != sent {
            return Err(AgentError::CopyMismatch(format!(
                "the {size} bytes read back at offset {offset} differ from those the source sent"
            )));
        }
        Ok(CopyFromReply {
            bytes: size,
            fletcher4: here.to_bytes(),
            yielded_us: yielded.as_micros() as u64,
        })
    }
}

/// Wait while `queued()` says client I/O is queued, at most `limit`.
pub(crate) async fn wait_idle(
    queued: impl Fn() -> bool,
    limit: Duration,
    step: Duration,
) -> Duration {
    let start = Instant::now();
    while queued() && start.elapsed() < limit {
        tokio::time::sleep(step).await;
    }
    start.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Incremental over 4-byte-aligned chunks equals one pass, and a
    /// swapped pair of words changes it (the position-weighted sums).
    #[test]
    fn fletcher4_is_incremental_and_order_sensitive() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut f = Fletcher4::default();
        f.update(&data[..1024]);
        f.update(&data[1024..]);
        assert_eq!(f, Fletcher4::of(&data));
        let mut swapped = data.clone();
        swapped[..4].copy_from_slice(&data[4..8]);
        swapped[4..8].copy_from_slice(&data[..4]);
        assert_ne!(Fletcher4::of(&swapped), Fletcher4::of(&data));
        assert_eq!(Fletcher4::of(&data).to_bytes().len(), 32);
    }
}
