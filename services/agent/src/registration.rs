//! Registration with the allocator's `AgentRegistry`: register the vdev,
//! then keep the `Report` stream open with one report per interval. Any
//! failure (allocator down, stream closed, refused registration) ends the
//! session; the agent reconnects with exponential backoff capped at 5 s and
//! registers again. It never exits because the allocator is away. Given
//! several allocators (one leads, the others stand by), it follows a
//! NOT_LEADER refusal to the leader it names, or tries the next one.

use std::time::Duration;

use aliquot_proto::v1::agent_registry_client::AgentRegistryClient;
use aliquot_proto::v1::{RegisterRequest, VdevHealth};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::agent::Agent;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// With several allocators, one of them takes over within its lease: keep
/// looking often enough to report to it within a second of the takeover.
const BACKOFF_MAX_SEVERAL: Duration = Duration::from_millis(500);
const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// The longest a connect (TCP, TLS and HTTP/2) may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(3);
/// A report stream whose acks stop for this long (at least; three report
/// intervals when longer) is ended: the allocator stopped or lost the pool.
const ACK_PATIENCE: Duration = Duration::from_secs(3);

/// Why a session ended, and the leader a standby named, if any.
struct Ended {
    why: String,
    leader: Option<String>,
    /// The allocator removed this vdev (`aliquotctl vdev remove`): there
    /// is nothing left to register for.
    removed: bool,
    /// The pool refused this device (not a transient failure): an
    /// operator must act, and the agent's health says NOT_SERVING.
    refused: bool,
}

impl From<String> for Ended {
    fn from(why: String) -> Ended {
        Ended {
            why,
            leader: None,
            removed: false,
            refused: false,
        }
    }
}

/// Whether a refusal says the vdev was removed from the pool.
fn is_removed(s: &tonic::Status) -> bool {
    aliquot_proto::error::reason(s) == Some(aliquot_proto::v1::ErrorReason::VdevRemoved)
}

impl From<&str> for Ended {
    fn from(why: &str) -> Ended {
        Ended::from(why.to_string())
    }
}

/// The leader a NOT_LEADER refusal names (empty metadata: none known).
fn leader_of(s: &tonic::Status) -> Option<String> {
    use aliquot_proto::error::{metadata, reason};
    (reason(s) == Some(aliquot_proto::v1::ErrorReason::NotLeader))
        .then(|| metadata(s).remove("leader"))
        .flatten()
        .filter(|l| !l.is_empty())
}

/// Register and report until `stop` turns true, or until the allocator
/// says the vdev was removed: then `removed` is notified (the agent stops).
/// `refused` holds why the pool refuses this device, while it does.
pub async fn run(
    agent: Agent,
    allocators: Vec<String>,
    endpoint: String,
    tls: Option<aliquot_auth::TlsFiles>,
    mut stop: watch::Receiver<bool>,
    removed: std::sync::Arc<tokio::sync::Notify>,
    refused: std::sync::Arc<watch::Sender<Option<String>>>,
) {
    let cap = if allocators.len() > 1 {
        BACKOFF_MAX_SEVERAL
    } else {
        BACKOFF_MAX
    };
    let mut backoff = telemetry::backoff::Backoff::new(BACKOFF_START, cap);
    let mut failures: u32 = 0;
    let mut current = 0usize;
    let mut allocator = allocators.first().cloned().unwrap_or_default();
    loop {
        let mut registered = false;
        let result = tokio::select! {
            r = session(&agent, &allocator, allocators.len() > 1, &endpoint, tls.as_ref(), &mut registered) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Err(Ended {
            why: e,
            leader,
            removed: gone,
            refused: by_pool,
        }) = result;
        if registered {
            refused.send_replace(None);
        }
        if by_pool {
            // Loudly, every time: retrying will not help until an operator
            // acts; the health check says NOT_SERVING meanwhile.
            tracing::error!(allocator = %allocator, error = %e, "the pool refuses this device");
            refused.send_replace(Some(e.clone()));
        }
        if gone {
            tracing::error!(allocator = %allocator, error = %e, "this vdev was removed from the pool (aliquotctl vdev remove): stopping the agent");
            removed.notify_one();
            return;
        }
        // Next: the leader a standby named, else the next allocator given.
        if let Some(l) = leader.filter(|l| *l != allocator) {
            tracing::info!(from = %allocator, to = %l, "following NOT_LEADER to the leader");
            allocator = l;
            backoff.reset();
            continue;
        }
        if allocators.len() > 1 {
            current = (current + 1) % allocators.len();
            allocator = allocators[current].clone();
        }
        if registered {
            // A working session ended: start over with a short backoff.
            tracing::warn!(allocator = %allocator, error = %e, "lost the allocator, reconnecting");
            backoff.reset();
            failures = 0;
        } else {
            failures += 1;
            if failures == 1 {
                tracing::warn!(allocator = %allocator, error = %e, "allocator unreachable, retrying with backoff");
            } else {
                tracing::debug!(allocator = %allocator, error = %e, failures, "still no allocator");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// One connection: register, then report until something fails.
async fn session(
    agent: &Agent,
    allocator: &str,
    several: bool,
    endpoint: &str,
    tls: Option<&aliquot_auth::TlsFiles>,
    registered: &mut bool,
) -> Result<std::convert::Infallible, Ended> {
    // Mutual TLS to a server whose certificate says "allocator" (the URL's
    // scheme follows: https), or plaintext under --insecure.
    let channel = aliquot_auth::ClientTls::from(tls.cloned())
        .endpoint(allocator, aliquot_auth::Role::Allocator)
        .map_err(|e| format!("allocator endpoint: {e}"))?;
    // Notice a vanished allocator even when no report is due; sooner when
    // another allocator may be taking over from a paused one.
    let (ping, patience) = if several {
        (Duration::from_secs(1), Duration::from_secs(2))
    } else {
        (Duration::from_secs(2), Duration::from_secs(3))
    };
    let channel = channel
        .connect_timeout(CONNECT_WITHIN)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(ping)
        .keep_alive_timeout(patience)
        .keep_alive_while_idle(true);
    // The whole connect, TLS handshake included: a stopped allocator
    // accepts TCP (the kernel does) and never finishes the handshake.
    let channel = tokio::time::timeout(CONNECT_WITHIN, channel.connect())
        .await
        .map_err(|_| format!("connect: no TLS/HTTP2 session within {CONNECT_WITHIN:?}"))?
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = AgentRegistryClient::with_interceptor(channel, telemetry::TraceInjector);
    let info = agent.info().clone();
    let mark = agent.uberblocks().current().unwrap_or_default();
    // A paused allocator accepts the connection and never answers.
    let registering = client.register(RegisterRequest {
        endpoint: endpoint.to_string(),
        device_guid: info.guid,
        name: info.name.clone(),
        capacity: info.capacity,
        ashift: info.ashift,
        rotational: info.rotational,
        children: agent.children(),
        parity: agent.parity(),
        log: agent.log(),
        backend: info.backend.as_str().into(),
        label_pool_guid: mark.pool_guid,
        label_generation: mark.generation,
        label_txg: mark.txg,
        label_state_digest: mark.digest,
    });
    let reply = tokio::time::timeout(Duration::from_secs(10), registering)
        .await
        .map_err(|_| Ended::from("register: no answer in 10 s"))?
        .map_err(|s| {
            let e = format!("register: {}: {}", s.code(), s.message());
            // A refusal an operator must act on: say it loudly every time.
            if s.code() == tonic::Code::FailedPrecondition {
                tracing::error!(allocator, "{e}");
            }
            Ended {
                why: e,
                leader: leader_of(&s),
                removed: is_removed(&s),
                refused: matches!(
                    s.code(),
                    tonic::Code::FailedPrecondition
                        | tonic::Code::PermissionDenied
                        | tonic::Code::AlreadyExists
                        | tonic::Code::InvalidArgument
                ),
            }
        })?
        .into_inner();
    // Never serve a pool other than the one the label names (an allocator
    // that does not check labels would otherwise take the device over).
    if mark.pool_guid != 0 && reply.pool_guid != mark.pool_guid {
        let e = format!(
            "the allocator at {allocator} serves pool {:#x}, but this device's label belongs to              pool {:#x} (last synced txg {}): refusing to join; point the agent at its own pool's              allocator, or give it a fresh device",
            reply.pool_guid, mark.pool_guid, mark.txg
        );
        tracing::error!("{e}");
        return Err(Ended {
            refused: true,
            ..Ended::from(e)
        });
    }
    agent.set_vdev(reply.vdev);
    agent.gate().learn_pool(reply.pool_guid, reply.generation);
    agent.gate().learn_key(reply.generation, &reply.token_key);
    agent.gate().learn_fence(
        reply.next_allocation_id,
        reply.max_lease_ms,
        mark.generation,
    );
    *registered = true;
    let interval = match reply.report_interval_ms {
        0 => DEFAULT_INTERVAL,
        ms => Duration::from_millis(ms as u64),
    };
    tracing::info!(
        vdev = reply.vdev,
        pool_guid = reply.pool_guid,
        guid = info.guid,
        endpoint,
        interval_ms = interval.as_millis() as u64,
        "registered with the allocator"
    );

    let (tx, rx) = mpsc::channel(4);
    // The first report goes out with the stream, before any ack is awaited.
    // It names what older generations wrote here (fencing them first), so
    // that after a takeover this vdev serves at once while those blocks can
    // still be claimed.
    let mut first = agent.report(reply.vdev);
    agent.gate().name_older_writes(reply.generation, &mut first);
    tx.send(first)
        .await
        .map_err(|_| "report stream closed".to_string())?;
    let mut acks = client
        .report(ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("report: {}: {}", s.code(), s.message()))?
        .into_inner();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate; that report is sent
    let mut seen: Option<(i32, bool)> = None;
    let patience = (interval * 3).max(ACK_PATIENCE);
    let mut last_ack = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(last_ack + patience) => {
                return Err(format!(
                    "report stream: no ack for {patience:?} (the allocator stopped answering)"
                )
                .into());
            }
            _ = tick.tick() => match tx.try_send(agent.report(reply.vdev)) {
                Ok(()) => {}
                // The allocator is not reading: skip this report rather than
                // stall; missed reports are how it notices a sick agent.
                Err(mpsc::error::TrySendError::Full(_)) => {
                    tracing::debug!(vdev = reply.vdev, "report stream full, report skipped");
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    return Err("report stream closed".into());
                }
            },
            ack = acks.message() => match ack {
                Ok(Some(ack)) => {
                    last_ack = tokio::time::Instant::now();
                    agent.gate().learn_generation(ack.generation);
                    agent
                        .gate()
                        .revoke(&ack.revoked_allocations, &ack.revoked_expires_ms);
                    record_mark(agent, &ack).await;
                    let now = (ack.health, ack.online);
                    if seen != Some(now) {
                        let health = VdevHealth::try_from(ack.health)
                            .map_or("unknown", |h| h.as_str_name());
                        tracing::info!(vdev = reply.vdev, health, online = ack.online, "allocator view of the vdev");
                        seen = Some(now);
                    }
                }
                Ok(None) => return Err("the allocator ended the report stream".into()),
                Err(s) => {
                    return Err(Ended {
                        why: format!("report stream: {}: {}", s.code(), s.message()),
                        leader: leader_of(&s),
                        removed: is_removed(&s),
                        refused: false,
                    })
                }
            },
        }
    }
}

/// Write what the allocator says of the pool to the device's label when it
/// changed (at most once per report; a txg sync is seconds apart). A failed
/// label write is logged and retried at the next ack; the check at the
/// allocator then rests on the other devices' labels.
async fn record_mark(agent: &Agent, ack: &aliquot_proto::v1::ReportAck) {
    if ack.pool_guid == 0 {
        return; // an allocator that does not send marks
    }
    let mark = crate::uberblock::PoolMark {
        pool_guid: ack.pool_guid,
        generation: ack.generation,
        txg: ack.synced_txg,
        digest: ack.state_digest,
    };
    if agent.uberblocks().current() == Some(mark) {
        return;
    }
    let u = std::sync::Arc::clone(agent.uberblocks());
    match tokio::task::spawn_blocking(move || u.record(mark)).await {
        Ok(Ok(_)) => {
            tracing::debug!(txg = mark.txg, generation = mark.generation, "label marked")
        }
        Ok(Err(e)) => tracing::error!(error = %e, "cannot write the pool mark to the label"),
        Err(e) => tracing::error!(error = %e, "label writer panicked"),
    }
}
