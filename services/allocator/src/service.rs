//! The `Allocator` gRPC service: validates requests, asks the pool, waits
//! where the policy says to wait, and maps errors once to `tonic::Status`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use aliquot_auth::Identity;
use aliquot_proto::v1 as pb;
use aliquot_proto::v1::allocator_server::Allocator;
use futures_util::Stream;
use metaslab::{AllocRequest, Allocation, TXG_DEFER_SIZE};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, Span};

use crate::convert;
use crate::error::{Error, Result};
use crate::ownership::Caller;
use crate::state::{Begun, Shared};
use crate::store::AdminState;

/// How long a claim naming an allocation waits for its vdev's agent to
/// report in a new generation (see `claim`): under clients' 10 s deadline.
const CLAIM_AWAITS_REPORT: Duration = Duration::from_secs(5);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Service tunables (not policy): owned here, listed beside the pool's.
pub const ZFS_TXG_TIMEOUT: &str = "zfs_txg_timeout";

#[derive(Clone)]
pub struct AllocatorService {
    pub shared: Arc<Shared>,
    /// The server's gRPC metrics: AllocateStream counts each message.
    pub rpc: Arc<telemetry::rpc_metrics::RpcMetrics>,
    /// Agent certificates bound to devices (AdmitVdev binds one).
    pub bindings: Arc<crate::binding::AgentBindings>,
}

/// [`parse_request`], then the caller's leased-bytes quota.
fn admit_request(
    shared: &Shared,
    r: &pb::AllocateRequest,
    caller: Option<&Caller>,
) -> Result<(AllocRequest, Duration)> {
    let parsed = parse_request(shared, r)?;
    let asked = r.size.saturating_mul(u64::from(parsed.0.copies));
    shared
        .owners
        .check_quota(caller, asked, shared.settings.max_leased_per_client)?;
    Ok(parsed)
}

fn parse_request(shared: &Shared, r: &pb::AllocateRequest) -> Result<(AllocRequest, Duration)> {
    let kind = convert::alloc_kind(r.class)?;
    let copies = convert::copies(r.copies)?;
    let lease = shared.lease(r.lease_ms)?;
    Ok((
        AllocRequest {
            kind,
            size: r.size,
            copies,
            max_size: (r.max_size != 0).then_some(r.max_size),
            affinity: r.affinity_key,
        },
        lease,
    ))
}

/// Tokens for `extents`: a MAC under the vdev's key where its agent holds
/// one (about a microsecond), an Ed25519 signature otherwise (~20 µs).
pub(crate) fn mint_tokens(
    shared: &Shared,
    id: u64,
    extents: &[metaslab::Extent],
    expires_ms: u64,
    read: bool,
) -> Vec<Vec<u8>> {
    let Some(signer) = &shared.settings.token_signer else {
        return Vec::new();
    };
    let keys = shared.mac_keys.read().unwrap_or_else(|p| p.into_inner());
    extents
        .iter()
        .map(|e| {
            let grant = aliquot_auth::WriteGrant {
                pool_guid: shared.pool_guid,
                generation: shared.fencing.generation,
                vdev: e.vdev,
                offset: e.offset,
                size: e.size,
                allocation_id: id,
                expires_ms,
            };
            match (keys.get(&e.vdev), read) {
                (Some(k), false) => k.sign(&grant),
                (Some(k), true) => k.sign_read(&grant),
                (None, false) => signer.sign(&grant),
                (None, true) => signer.sign_read(&grant),
            }
        })
        .collect()
}

/// The reply to a placed allocation; records `caller` as its owner first,
/// so no other identity can commit, abort or renew it once it is named.
fn allocate_reply(
    shared: &Shared,
    a: &Allocation,
    endpoints: Vec<String>,
    deadline: Instant,
    waited: Duration,
    caller: Option<&Caller>,
) -> pb::AllocateReply {
    let bytes = a.extents.iter().map(|e| e.size).sum();
    shared.owners.record(
        caller,
        a.id,
        bytes,
        shared.settings.max_leased_per_client > 0,
    );
    let expires_ms = convert::deadline_unix_ms(deadline);
    let tokens = mint_tokens(shared, a.id, &a.extents, expires_ms, false);
    pb::AllocateReply {
        tokens,
        allocation_id: a.id,
        extents: a.extents.iter().map(convert::extent_to_pb).collect(),
        txg: a.txg,
        tier: convert::tier(a.tier) as i32,
        throttle_wait_us: waited.as_micros() as u64,
        endpoints,
        generation: shared.fencing.generation,
        lease_deadline_ms: expires_ms,
        psize: a.psize,
    }
}

/// The verified identity of the caller (mutual TLS; None in plaintext),
/// put in the request by the role layer.
fn caller<T>(req: &Request<T>) -> Option<Caller> {
    req.extensions().get::<Identity>().map(Caller::of)
}

/// Only the identity that committed an extent (or an admin) may free or
/// move it. Without mutual TLS there is no caller and nothing is checked.
fn check_extent_owner(
    g: &crate::state::Inner,
    caller: Option<&Caller>,
    extents: &[metaslab::Extent],
    action: &'static str,
) -> Result<()> {
    let Some(c) = caller else { return Ok(()) };
    if c.is_admin() {
        return Ok(());
    }
    match g.extent_owners.foreign(&c.name, extents) {
        None => Ok(()),
        Some((extent, owner)) => Err(Error::NotOwnerExtent {
            extent,
            owner,
            caller: c.name.to_string(),
            action,
        }),
    }
}

fn record_allocation(span: &Span, a: &Allocation, waited: Duration) {
    let vdevs: Vec<String> = a.extents.iter().map(|e| e.vdev.to_string()).collect();
    span.record("allocation", a.id);
    span.record("throttle_wait_us", waited.as_micros() as u64);
    span.record("vdevs", vdevs.join(",").as_str());
    span.record("tier", convert::tier_name(a.tier));
}

/// Format `zfs_txg_timeout` as OpenZFS does (whole seconds) when it can.
pub fn format_txg_timeout(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        d.as_secs().to_string()
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Plain integers are seconds (OpenZFS's unit); "500ms" etc. also accepted.
pub fn parse_txg_timeout(v: &str) -> Result<Duration> {
    let bad = |reason: &str| {
        Error::Pool(metaslab::Error::BadTunableValue {
            name: ZFS_TXG_TIMEOUT.into(),
            value: v.into(),
            reason: reason.into(),
        })
    };
    let d = match v.trim().parse::<u64>() {
        Ok(s) => Duration::from_secs(s),
        Err(_) => units::parse_duration(v).map_err(|e| bad(&e.to_string()))?,
    };
    if d < Duration::from_millis(1) || d > Duration::from_secs(3600) {
        return Err(bad("must be between 1ms and 3600s"));
    }
    Ok(d)
}

impl AllocatorService {
    async fn commit_inner(
        &self,
        r: pb::CommitRequest,
        caller: Option<&Caller>,
    ) -> Result<pb::CommitReply> {
        self.shared.check_serving()?;
        // Ids of another generation name nothing here (they were lost with
        // the restart): say so rather than "unknown allocation".
        self.shared.check_generation(r.generation, 0)?;
        let txg = commit_locked(&self.shared, &r.allocation_ids, caller)?;
        let synced = if r.wait_synced {
            self.shared.wait_synced(txg).await?;
            true
        } else {
            self.shared.synced_txg() >= txg
        };
        Ok(pb::CommitReply {
            txg,
            synced,
            generation: self.shared.fencing.generation,
        })
    }

    /// Extend the leases and reissue the write tokens with the new expiry
    /// (the old ones expire at the old deadline, which agents enforce).
    fn renew_inner(
        &self,
        r: &pb::RenewLeaseRequest,
        caller: Option<&Caller>,
    ) -> Result<pb::RenewLeaseReply> {
        self.shared.check_serving()?;
        let lease = self.shared.lease(r.lease_ms)?;
        let (deadline, renewed) = {
            let mut g = self.shared.lock();
            self.shared
                .owners
                .check(&g, caller, &r.allocation_ids, "renew")?;
            let deadline = g.renew(
                &r.allocation_ids,
                lease,
                self.shared.settings.max_lease_lifetime,
            )?;
            let mut renewed = Vec::new();
            for &id in &r.allocation_ids {
                if g.is_inflight(id) {
                    renewed.push((id, g.pool.extents_of(id)?));
                }
            }
            (deadline, renewed)
        };
        let expires_ms = convert::deadline_unix_ms(deadline);
        let tokens = renewed
            .iter()
            .flat_map(|(id, extents)| mint_tokens(&self.shared, *id, extents, expires_ms, false))
            .collect();
        Ok(pb::RenewLeaseReply {
            lease_deadline_ms: expires_ms,
            generation: self.shared.fencing.generation,
            tokens,
        })
    }

    fn abort_inner(&self, r: &pb::AbortRequest, caller: Option<&Caller>) -> Result<pb::AbortReply> {
        self.shared.check_serving()?;
        {
            let mut g = self.shared.lock();
            self.shared
                .owners
                .check(&g, caller, &r.allocation_ids, "abort")?;
            g.abort(&r.allocation_ids)?;
        }
        self.shared.owners.forget(&r.allocation_ids);
        Ok(pb::AbortReply {})
    }

    /// The client's writes of `ids` are done: their throttle reservations
    /// end here rather than at Commit.
    fn written_inner(
        &self,
        r: &pb::WrittenRequest,
        caller: Option<&Caller>,
    ) -> Result<pb::WrittenReply> {
        self.shared.check_serving()?;
        self.shared.check_generation(r.generation, 0)?;
        let mut g = self.shared.lock();
        self.shared
            .owners
            .check(&g, caller, &r.allocation_ids, "report written")?;
        g.written(&r.allocation_ids)?;
        Ok(pb::WrittenReply {
            generation: self.shared.fencing.generation,
        })
    }

    /// Run-time tunables survive restarts: durable before the reply.
    async fn persist_tunable(&self, name: &str, value: &str) -> Result<()> {
        self.shared
            .store
            .set_tunable(name, value)
            .await
            .map_err(|e| {
                Error::Store(format!(
                    "{name} = {value} is in effect but was not persisted ({e}); set it again"
                ))
            })
    }

    fn status(&self) -> pb::PoolStatus {
        let g = self.shared.lock();
        convert::pool_status(&self.shared, &g)
    }
}

/// Commit under the pool lock after the ownership check; the ids leave the
/// owner table once committed.
pub(crate) fn commit_locked(
    shared: &Shared,
    ids: &[u64],
    caller: Option<&Caller>,
) -> Result<metaslab::Txg> {
    let txg = {
        let mut g = shared.lock();
        shared.owners.check(&g, caller, ids, "commit")?;
        let txg = g.commit_as(ids, caller.map(|c| &*c.name))?;
        shared.kick_if_dirty(&g);
        txg
    };
    shared.owners.forget(ids);
    Ok(txg)
}

/// One request of an AllocateStream, handled inline when it cannot wait
/// (placed allocations, commits, aborts) so the stream keeps its pace; a
/// throttled allocate or a `wait_synced` commit is handed to its own task.
async fn stream_op(
    svc: &AllocatorService,
    req: pb::StreamRequest,
    out: &mpsc::Sender<Result<pb::StreamReply, Status>>,
    caller: Option<&Caller>,
) {
    let id = req.request_id;
    let reply = move |result| pb::StreamReply {
        request_id: id,
        result: Some(result),
    };
    // The same google.rpc.Status as the unary call's, details and all.
    let err = |e: Error| {
        pb::stream_reply::Result::Error(aliquot_proto::error::stream_error(&Status::from(e)))
    };
    use pb::stream_request::Op;
    // The block's own trace, when the client sent its context:
    // its messages' spans join it, not the stream's trace.
    let req_trace = req.trace_context;
    let result = match req.op {
        None => err(Error::InvalidArgument(format!(
            "stream request {id} has no operation"
        ))),
        Some(Op::Allocate(r)) => {
            // Same fields as the unary Allocate span, so a pipelined write reads
            // the same in a trace.
            let span = tracing::info_span!(
                "stream.allocate",
                request_id = id,
                class = r.class,
                size = r.size,
                copies = r.copies,
                allocation = tracing::field::Empty,
                throttle_wait_us = tracing::field::Empty,
                vdevs = tracing::field::Empty,
                tier = tracing::field::Empty,
            );
            telemetry::adopt(&span, &req_trace);
            let _e = span.enter();
            if svc.shared.waits_for_a_vdev() {
                // Right after a takeover: wait for a vdev off the stream.
                drop(_e);
                let shared = svc.shared.clone();
                let out = out.clone();
                let caller = caller.cloned();
                tokio::spawn(
                    async move {
                        let res = match admit_request(&shared, &r, caller.as_ref()) {
                            Ok((areq, lease)) => tokio::select! {
                                biased;
                                r = shared.allocate(areq, lease) => r,
                                _ = out.closed() => return,
                            },
                            Err(e) => Err(e),
                        };
                        let result = match res {
                            Ok((a, eps, deadline, waited)) => {
                                record_allocation(&Span::current(), &a, waited);
                                pb::stream_reply::Result::Allocate(allocate_reply(
                                    &shared,
                                    &a,
                                    eps,
                                    deadline,
                                    waited,
                                    caller.as_ref(),
                                ))
                            }
                            Err(e) => err(e),
                        };
                        let _ = out.send(Ok(reply(result))).await;
                    }
                    .instrument(span.clone()),
                );
                return;
            }
            let begun = admit_request(&svc.shared, &r, caller)
                .and_then(|(areq, lease)| Ok((svc.shared.begin_allocate(areq, lease)?, lease)));
            match begun {
                Err(e) => err(e),
                Ok((Begun::Placed(a, eps, deadline), _)) => {
                    record_allocation(&span, &a, Duration::ZERO);
                    pb::stream_reply::Result::Allocate(allocate_reply(
                        &svc.shared,
                        &a,
                        eps,
                        deadline,
                        Duration::ZERO,
                        caller,
                    ))
                }
                Ok((Begun::Queued(ticket, rx), lease)) => {
                    let shared = svc.shared.clone();
                    let out = out.clone();
                    let start = Instant::now();
                    let caller = caller.cloned();
                    drop(_e);
                    tokio::spawn(
                        async move {
                            let res = tokio::select! {
                                biased;
                                r = shared.finish_allocate(ticket, rx, lease) => r,
                                // Client gone: dropping the wait cancels the ticket.
                                _ = out.closed() => return,
                            };
                            let result = match res {
                                Ok((a, eps, deadline)) => {
                                    record_allocation(&Span::current(), &a, start.elapsed());
                                    let id_a = a.id;
                                    let msg =
                                        reply(pb::stream_reply::Result::Allocate(allocate_reply(
                                            &shared,
                                            &a,
                                            eps,
                                            deadline,
                                            start.elapsed(),
                                            caller.as_ref(),
                                        )));
                                    if out.send(Ok(msg)).await.is_err() {
                                        // Nobody will write or commit it.
                                        let _ = shared.lock().abort(&[id_a]);
                                        shared.owners.forget(&[id_a]);
                                    }
                                    return;
                                }
                                Err(e) => err(e),
                            };
                            let _ = out.send(Ok(reply(result))).await;
                        }
                        .instrument(span.clone()),
                    );
                    return;
                }
            }
        }
        Some(Op::Commit(r)) if r.wait_synced => {
            let svc = svc.clone();
            let out = out.clone();
            let caller = caller.cloned();
            let span = tracing::info_span!(
                "stream.commit",
                request_id = id,
                ids = r.allocation_ids.len(),
                wait_synced = true
            );
            telemetry::adopt(&span, &req_trace);
            tokio::spawn(
                async move {
                    let result = match svc.commit_inner(r, caller.as_ref()).await {
                        Ok(c) => pb::stream_reply::Result::Commit(c),
                        Err(e) => err(e),
                    };
                    let _ = out.send(Ok(reply(result))).await;
                }
                .instrument(span),
            );
            return;
        }
        Some(Op::Commit(r)) => {
            let span = tracing::info_span!(
                "stream.commit",
                request_id = id,
                ids = r.allocation_ids.len(),
                txg = tracing::field::Empty
            );
            telemetry::adopt(&span, &req_trace);
            let _e = span.enter();
            let res = svc.shared.check_serving().and_then(|_| {
                svc.shared.check_generation(r.generation, 0)?;
                let txg = commit_locked(&svc.shared, &r.allocation_ids, caller)?;
                span.record("txg", txg);
                Ok(pb::CommitReply {
                    txg,
                    synced: svc.shared.synced_txg() >= txg,
                    generation: svc.shared.fencing.generation,
                })
            });
            match res {
                Ok(c) => pb::stream_reply::Result::Commit(c),
                Err(e) => err(e),
            }
        }
        Some(Op::Abort(r)) => match tracing::info_span!(
            "stream.abort",
            request_id = id,
            ids = r.allocation_ids.len()
        )
        .in_scope(|| svc.abort_inner(&r, caller))
        {
            Ok(a) => pb::stream_reply::Result::Abort(a),
            Err(e) => err(e),
        },
        Some(Op::Renew(r)) => match tracing::info_span!(
            "stream.renew",
            request_id = id,
            ids = r.allocation_ids.len()
        )
        .in_scope(|| svc.renew_inner(&r, caller))
        {
            Ok(a) => pb::stream_reply::Result::Renew(a),
            Err(e) => err(e),
        },
        Some(Op::Written(r)) => match tracing::info_span!(
            "stream.written",
            request_id = id,
            ids = r.allocation_ids.len()
        )
        .in_scope(|| svc.written_inner(&r, caller))
        {
            Ok(a) => pb::stream_reply::Result::Written(a),
            Err(e) => err(e),
        },
    };
    let _ = out.send(Ok(reply(result))).await;
}

#[tonic::async_trait]
impl Allocator for AllocatorService {
    #[tracing::instrument(skip_all, fields(
        class = req.get_ref().class, size = req.get_ref().size, copies = req.get_ref().copies,
        allocation, throttle_wait_us, vdevs, tier
    ))]
    async fn allocate(
        &self,
        req: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateReply>, Status> {
        let (areq, lease) = admit_request(&self.shared, req.get_ref(), caller(&req).as_ref())?;
        let (a, eps, deadline, waited) = self.shared.allocate(areq, lease).await?;
        record_allocation(&Span::current(), &a, waited);
        Ok(Response::new(allocate_reply(
            &self.shared,
            &a,
            eps,
            deadline,
            waited,
            caller(&req).as_ref(),
        )))
    }

    type AllocateStreamStream = BoxStream<pb::StreamReply>;

    #[tracing::instrument(skip_all)]
    async fn allocate_stream(
        &self,
        req: Request<Streaming<pb::StreamRequest>>,
    ) -> Result<Response<Self::AllocateStreamStream>, Status> {
        // One identity for the whole stream (its TLS connection's).
        let who = caller(&req);
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(1024);
        let svc = self.clone();
        // Per-message metrics: each request's arrival, until its reply.
        let arrived: Arc<
            std::sync::Mutex<std::collections::HashMap<u64, (Instant, &'static str)>>,
        > = Default::default();
        let seen = arrived.clone();
        tokio::spawn(
            async move {
                loop {
                    let next = tokio::select! {
                        n = inbound.next() => n,
                        _ = tx.closed() => break,
                        _ = svc.shared.stopping() => break,
                    };
                    match next {
                        Some(Ok(r)) => {
                            use pb::stream_request::Op;
                            let op = match &r.op {
                                Some(Op::Allocate(_)) => "allocate",
                                Some(Op::Commit(_)) => "commit",
                                Some(Op::Abort(_)) => "abort",
                                Some(Op::Renew(_)) => "renew",
                                Some(Op::Written(_)) => "written",
                                None => "none",
                            };
                            seen.lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(r.request_id, (Instant::now(), op));
                            stream_op(&svc, r, &tx, who.as_ref()).await
                        }
                        Some(Err(status)) => {
                            tracing::debug!(%status, "allocate stream ended by the client");
                            break;
                        }
                        None => break,
                    }
                }
            }
            .in_current_span(),
        );
        let rpc = self.rpc.clone();
        let replies = ReceiverStream::new(rx).map(move |item| {
            if let Ok(rep) = &item
                && let Some((at, op)) = arrived
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rep.request_id)
            {
                let code = match &rep.result {
                    Some(pb::stream_reply::Result::Error(e)) => e.code,
                    _ => 0,
                };
                rpc.observe_stream(
                    "/aliquot.v1.Allocator/AllocateStream",
                    op,
                    code,
                    at.elapsed(),
                );
            }
            item
        });
        Ok(Response::new(Box::pin(replies)))
    }

    #[tracing::instrument(skip_all, fields(ids = req.get_ref().allocation_ids.len(), wait_synced = req.get_ref().wait_synced, txg))]
    async fn commit(
        &self,
        req: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitReply>, Status> {
        let who = caller(&req);
        let reply = self.commit_inner(req.into_inner(), who.as_ref()).await?;
        Span::current().record("txg", reply.txg);
        Ok(Response::new(reply))
    }

    #[tracing::instrument(skip_all, fields(ids = req.get_ref().allocation_ids.len()))]
    async fn abort(
        &self,
        req: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortReply>, Status> {
        Ok(Response::new(
            self.abort_inner(req.get_ref(), caller(&req).as_ref())?,
        ))
    }

    #[tracing::instrument(skip_all, fields(ids = req.get_ref().allocation_ids.len()))]
    async fn renew_lease(
        &self,
        req: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseReply>, Status> {
        Ok(Response::new(
            self.renew_inner(req.get_ref(), caller(&req).as_ref())?,
        ))
    }

    #[tracing::instrument(skip_all, fields(ids = req.get_ref().allocation_ids.len()))]
    async fn written(
        &self,
        req: Request<pb::WrittenRequest>,
    ) -> Result<Response<pb::WrittenReply>, Status> {
        Ok(Response::new(
            self.written_inner(req.get_ref(), caller(&req).as_ref())?,
        ))
    }

    #[tracing::instrument(skip_all, fields(extents = req.get_ref().extents.len(), txg))]
    async fn free(&self, req: Request<pb::FreeRequest>) -> Result<Response<pb::FreeReply>, Status> {
        self.shared.check_serving()?;
        let extents = convert::extents_from_pb(&req.get_ref().extents)?;
        // A moved block's old address frees its new extent too (and the
        // reverse): what is checked and freed is the resolved list.
        let resolved = self.shared.lock().resolve_free(&extents);
        crate::claim::check_free_exact(&self.shared, &resolved.0).await?;
        let txg = {
            let mut g = self.shared.lock();
            check_extent_owner(&g, caller(&req).as_ref(), &extents, "free")?;
            let txg = g.free_resolved(&extents, &resolved)?;
            self.shared.kick_if_dirty(&g);
            txg
        };
        Span::current().record("txg", txg);
        Ok(Response::new(pb::FreeReply {
            txg,
            generation: self.shared.fencing.generation,
        }))
    }

    #[tracing::instrument(skip_all, fields(extents = req.get_ref().extents.len()))]
    async fn read_tokens(
        &self,
        req: Request<pb::ReadTokensRequest>,
    ) -> Result<Response<pb::ReadTokensReply>, Status> {
        self.shared.check_serving()?;
        let extents = convert::extents_from_pb(&req.get_ref().extents)?;
        // Whatever writes over these bytes after a Free is of an allocation
        // at or above this id: the agent then refuses the token there.
        let watermark = crate::read_grant::watermark(&self.shared);
        // A moved block's old address reads at its new extent.
        let locations: Vec<metaslab::Extent> = {
            let g = self.shared.lock();
            extents
                .iter()
                .map(|e| g.indirect.get(e).unwrap_or(*e))
                .collect()
        };
        // Exactly committed blocks, of the caller (or an admin): the new
        // extent carries the old one's owner.
        crate::read_grant::check_committed(&self.shared, &locations).await?;
        check_extent_owner(
            &self.shared.lock(),
            caller(&req).as_ref(),
            &locations,
            "read",
        )?;
        let deadline = Instant::now() + self.shared.settings.max_lease;
        let expires_ms = convert::deadline_unix_ms(deadline);
        let tokens = mint_tokens(&self.shared, watermark, &locations, expires_ms, true);
        Ok(Response::new(pb::ReadTokensReply {
            tokens,
            expires_ms,
            generation: self.shared.fencing.generation,
            locations: locations.iter().map(convert::extent_to_pb).collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(extents = req.get_ref().extents.len(), txg))]
    async fn claim(
        &self,
        req: Request<pb::ClaimRequest>,
    ) -> Result<Response<pb::ClaimReply>, Status> {
        self.shared.check_serving()?;
        let extents = convert::extents_from_pb(&req.get_ref().extents)?;
        let per_extent = req.get_ref().per_extent;
        // The allocation each extent was given by (0 or none: unknown).
        let ids = &req.get_ref().allocation_ids;
        if !ids.is_empty() && ids.len() != extents.len() {
            return Err(Error::InvalidArgument(format!(
                "{} allocation ids for {} extents: name one per extent (0: unknown), or none",
                ids.len(),
                extents.len()
            ))
            .into());
        }
        let id_of = |i: usize| ids.get(i).copied().unwrap_or(0);
        let previous = crate::takeover::previous_generation(&self.shared.fencing);
        // The last-writer rule needs each vdev's older writes, which its
        // agent names in its first report of this generation: while the
        // window is open, a claim naming an allocation on a vdev not yet
        // heard from waits for that report (agents re-register within about
        // a report interval), at most `CLAIM_AWAITS_REPORT`, after which
        // only the other rules apply (its agent is away).
        let given_up = Instant::now() + CLAIM_AWAITS_REPORT;
        loop {
            // Listening before the check: a report landing in between
            // still wakes this claim.
            let acked = self.shared.vdev_acked.notified();
            tokio::pin!(acked);
            acked.as_mut().enable();
            let left = self
                .shared
                .claim_window_remaining()
                .min(given_up.saturating_duration_since(Instant::now()));
            let waits = !left.is_zero() && {
                let g = self.shared.lock();
                extents.iter().enumerate().any(|(i, e)| {
                    id_of(i) != 0 && g.vdevs.get(&e.vdev).is_some_and(|v| !v.generation_acked)
                })
            };
            if !waits {
                break;
            }
            let _ = tokio::time::timeout(left, acked).await;
        }
        // Free space is claimed; space allocated as exactly that extent is
        // already theirs; anything else is refused naming what it overlaps.
        let mut checked = crate::claim::check_each(&self.shared, &extents).await?;
        let claimant = caller(&req).map(|c| c.name.to_string());
        let generation = self.shared.fencing.generation;
        let mut results = Vec::new();
        let txg = {
            let mut g = self.shared.lock();
            // The extents claimed, with the allocation each names: its
            // copies are linked again below.
            let mut claimed: Vec<(u64, metaslab::Extent)> = Vec::new();
            let txg = if per_extent {
                let mut txg = 0;
                for (i, (e, pre)) in extents.iter().zip(checked).enumerate() {
                    let r =
                        pre.and_then(|()| g.claim_one(*e, claimant.as_deref(), id_of(i), previous));
                    results.push(match r {
                        Ok(t) => {
                            txg = txg.max(t);
                            claimed.push((id_of(i), *e));
                            pb::ClaimResult {
                                extent: Some(convert::extent_to_pb(e)),
                                claimed: true,
                                ..Default::default()
                            }
                        }
                        Err(err) => {
                            tracing::warn!(extent = %e, error = %err, "claim refused");
                            pb::ClaimResult {
                                extent: Some(convert::extent_to_pb(e)),
                                claimed: false,
                                reason: err.refusal().reason as i32,
                                message: err.to_string(),
                            }
                        }
                    });
                }
                txg
            } else {
                // All or nothing: check every extent before claiming any.
                if let Some(i) = checked.iter().position(Result::is_err) {
                    return Err(checked.swap_remove(i).unwrap_err().into());
                }
                for (i, e) in extents.iter().enumerate() {
                    crate::claim::check_allocation(&g, previous, e, id_of(i))
                        .map_err(Status::from)?;
                    if let Some(committed) = g.gen_committed.overlapping(e) {
                        return Err(Error::ClaimOverwritten {
                            requested: *e,
                            committed,
                        }
                        .into());
                    }
                }
                if let Some(c) = &claimant
                    && let Some((extent, _)) = g.extent_owners.foreign(c, &extents)
                {
                    return Err(Error::ClaimGivenOut(extent).into());
                }
                let txg = g.claim(&extents, claimant.as_deref())?;
                for (i, e) in extents.iter().enumerate() {
                    g.gen_claims.entry(*e).or_insert(id_of(i));
                    claimed.push((id_of(i), *e));
                }
                txg
            };
            // A block of several copies lost its copies' link with the txg
            // that committed it: the copies a claim names under one
            // allocation are that block's, linked again in the claim's txg
            // so a later move keeps them apart. (Copies claimed with id 0,
            // or in separate claims, stay unlinked: nothing says they are
            // one block's.)
            claimed.sort_unstable_by_key(|&(id, e)| (id, e.vdev, e.offset));
            for block in claimed.chunk_by(|a, b| a.0 == b.0) {
                if block[0].0 != 0 && block.len() > 1 {
                    let copies: Vec<metaslab::Extent> = block.iter().map(|&(_, e)| e).collect();
                    g.pending_copies.committed(txg, block[0].0, &copies);
                }
            }
            self.shared.kick_if_dirty(&g);
            txg
        };
        Span::current().record("txg", txg);
        Ok(Response::new(pb::ClaimReply {
            txg,
            generation,
            results,
        }))
    }

    #[tracing::instrument(skip_all, fields(txg = req.get_ref().txg, synced_txg))]
    async fn sync_txg(
        &self,
        req: Request<pb::SyncTxgRequest>,
    ) -> Result<Response<pb::SyncTxgReply>, Status> {
        self.shared.check_serving()?;
        // "The txg open now" needs no generation: it is this one's.
        if req.get_ref().txg != 0 || req.get_ref().generation != 0 {
            self.shared
                .check_generation(req.get_ref().generation, req.get_ref().txg)?;
        }
        let open = self.shared.lock().pool.open_txg();
        let txg = match req.get_ref().txg {
            0 => open,
            t if t > open + TXG_DEFER_SIZE => {
                return Err(Error::InvalidArgument(format!(
                    "txg {t} is too far ahead: the open txg is {open} (wait for at most {})",
                    open + TXG_DEFER_SIZE
                ))
                .into());
            }
            t => t,
        };
        let synced = self.shared.wait_synced(txg).await?;
        Span::current().record("synced_txg", synced);
        Ok(Response::new(pb::SyncTxgReply {
            synced_txg: synced,
            generation: self.shared.fencing.generation,
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn get_pool(
        &self,
        _req: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::PoolStatus>, Status> {
        // An allocator whose lease ran out does not speak for the pool.
        self.shared.check_lease()?;
        Ok(Response::new(self.status()))
    }

    #[tracing::instrument(skip_all, fields(extents = req.get_ref().extents.len(), txg))]
    async fn remap(
        &self,
        req: Request<pb::RemapRequest>,
    ) -> Result<Response<pb::RemapReply>, Status> {
        self.shared.check_serving()?;
        let extents = convert::extents_from_pb(&req.get_ref().extents)?;
        let (to, txg) = {
            let mut g = self.shared.lock();
            check_extent_owner(&g, caller(&req).as_ref(), &extents, "remap")?;
            let r = g.remap(&extents)?;
            self.shared.kick_if_dirty(&g);
            r
        };
        Span::current().record("txg", txg);
        Ok(Response::new(pb::RemapReply {
            locations: to.iter().map(convert::extent_to_pb).collect(),
            txg,
            generation: self.shared.fencing.generation,
        }))
    }
    #[tracing::instrument(skip_all)]
    async fn step_down(
        &self,
        _req: Request<pb::StepDownRequest>,
    ) -> Result<Response<pb::StepDownReply>, Status> {
        let Some(l) = self.shared.lease.get() else {
            return Err(Error::NoStandby.into());
        };
        l.check()?;
        tracing::warn!(generation = l.generation(), standbys = ?l.standbys(), "asked to step down");
        l.request_step_down();
        Ok(Response::new(pb::StepDownReply {
            generation: l.generation(),
            standbys: l.standbys(),
        }))
    }

    type WatchPoolStream = BoxStream<pb::PoolStatus>;

    #[tracing::instrument(skip_all, fields(interval_ms = req.get_ref().interval_ms))]
    async fn watch_pool(
        &self,
        req: Request<pb::WatchPoolRequest>,
    ) -> Result<Response<Self::WatchPoolStream>, Status> {
        let ms = match req.get_ref().interval_ms {
            0 => 1000,
            ms => ms.max(10),
        };
        self.shared.check_lease()?;
        let (tx, rx) = mpsc::channel(4);
        let svc = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(ms as u64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = tx.closed() => return,
                    _ = svc.shared.stopping() => return,
                    e = svc.shared.lease_lost() => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                }
                if svc.shared.shutting_down.load(Ordering::Relaxed) {
                    return;
                }
                if tx.send(Ok(svc.status())).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    #[tracing::instrument(skip_all)]
    async fn get_tunables(
        &self,
        _req: Request<pb::GetTunablesRequest>,
    ) -> Result<Response<pb::TunableList>, Status> {
        let g = self.shared.lock();
        let mut tunables: Vec<pb::Tunable> = g
            .pool
            .tunables()
            .list()
            .into_iter()
            .map(|(info, value)| pb::Tunable {
                name: info.name.into(),
                value,
                default: info.default,
                description: info.description.into(),
            })
            .collect();
        tunables.push(pb::Tunable {
            name: ZFS_TXG_TIMEOUT.into(),
            value: format_txg_timeout(self.shared.txg_timeout()),
            default: "5".into(),
            description: "seconds (or a duration such as 500ms) after which the open txg is synced"
                .into(),
        });
        drop(g);
        // The log space map's bounds: the store's, set at start (--tunable).
        if let Some(t) = self.shared.store.log_tunables() {
            for (name, value, default, description) in t.list() {
                tunables.push(pb::Tunable {
                    name: name.into(),
                    value,
                    default,
                    description: description.into(),
                });
            }
        }
        tunables.push(pb::Tunable {
            name: crate::mover::MOVE_RATE.into(),
            value: crate::mover::format_rate(self.shared.mover.rate()),
            default: crate::mover::format_rate(crate::mover::DEFAULT_MOVE_RATE),
            description: "bytes/s the allocator's mover (vdev removal) copies at most; 0 pauses it"
                .into(),
        });
        tunables.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::TunableList { tunables }))
    }

    #[tracing::instrument(skip_all, fields(name = %req.get_ref().name, value = %req.get_ref().value))]
    async fn set_tunable(
        &self,
        req: Request<pb::SetTunableRequest>,
    ) -> Result<Response<pb::Tunable>, Status> {
        let pb::SetTunableRequest { name, value } = req.into_inner();
        let name = name.trim().to_string();
        if name == ZFS_TXG_TIMEOUT {
            let d = parse_txg_timeout(&value)?;
            let old = self.shared.txg_timeout();
            self.shared
                .settings
                .txg_timeout_us
                .store(d.as_micros() as u64, Ordering::Relaxed);
            self.shared.txg_timeout_changed.notify_one();
            self.persist_tunable(&name, &format_txg_timeout(d)).await?;
            tracing::info!(name = %name, old = %format_txg_timeout(old), new = %format_txg_timeout(d), "tunable changed");
            return Ok(Response::new(pb::Tunable {
                name,
                value: format_txg_timeout(d),
                default: "5".into(),
                description: String::new(),
            }));
        }
        if name == crate::mover::MOVE_RATE {
            let r = crate::mover::parse_rate(&value)?;
            let old = self.shared.mover.rate();
            self.shared.mover.set_rate(r);
            let shown = crate::mover::format_rate(r);
            self.persist_tunable(&name, &shown).await?;
            tracing::info!(name = %name, old = %crate::mover::format_rate(old), new = %shown, "tunable changed");
            return Ok(Response::new(pb::Tunable {
                name,
                value: shown,
                default: crate::mover::format_rate(crate::mover::DEFAULT_MOVE_RATE),
                description: String::new(),
            }));
        }
        let (old, new, info) = {
            let mut g = self.shared.lock();
            let old = g.pool.tunables().get(&name).map_err(Error::from)?;
            g.pool.set_tunable(&name, &value).map_err(Error::from)?;
            // A larger limit or a policy change can admit waiters.
            g.wake_admitted();
            let new = g.pool.tunables().get(&name).map_err(Error::from)?;
            let info = g
                .pool
                .tunables()
                .list()
                .into_iter()
                .find(|(i, _)| i.name == name);
            (old, new, info)
        };
        self.persist_tunable(&name, &new).await?;
        tracing::info!(name = %name, old = %old, new = %new, "tunable changed");
        Ok(Response::new(pb::Tunable {
            name,
            value: new,
            default: info
                .as_ref()
                .map(|(i, _)| i.default.clone())
                .unwrap_or_default(),
            description: info
                .map(|(i, _)| i.description.to_string())
                .unwrap_or_default(),
        }))
    }

    #[tracing::instrument(skip_all, fields(vdev = req.get_ref().vdev, capacity = req.get_ref().capacity))]
    async fn expand_vdev(
        &self,
        req: Request<pb::ExpandVdevRequest>,
    ) -> Result<Response<pb::VdevStatus>, Status> {
        self.shared.check_serving()?;
        let pb::ExpandVdevRequest { vdev, capacity } = *req.get_ref();
        let txg = crate::registry::expand(&mut self.shared.lock(), vdev, capacity)?;
        if let Some(txg) = txg {
            // Durable before the reply: a crash must not shrink it back
            // under extents handed out on the new space.
            self.shared.wait_synced(txg).await?;
            tracing::info!(vdev, capacity, txg, "vdev expanded");
        }
        let status = convert::pool_status(&self.shared, &self.shared.lock());
        status
            .vdevs
            .into_iter()
            .find(|v| v.vdev == vdev)
            .map(Response::new)
            .ok_or_else(|| Error::Pool(metaslab::Error::UnknownVdev(vdev)).into())
    }

    #[tracing::instrument(skip_all, fields(moves, bytes))]
    async fn plan_rebalance(
        &self,
        req: Request<pb::PlanRebalanceRequest>,
    ) -> Result<Response<pb::RebalancePlan>, Status> {
        self.shared.check_serving()?;
        let mut p = crate::rebalance::plan_rebalance(&self.shared, req.get_ref()).await?;
        p.plan_id = self
            .shared
            .lock()
            .relocations
            .new_plan(self.shared.fencing.generation, &p);
        Span::current().record("moves", p.moves.len());
        Span::current().record("bytes", p.bytes);
        Ok(Response::new(p))
    }

    #[tracing::instrument(skip_all, fields(vdev = req.get_ref().vdev, online = req.get_ref().online))]
    async fn set_vdev_state(
        &self,
        req: Request<pb::SetVdevStateRequest>,
    ) -> Result<Response<pb::VdevStatus>, Status> {
        self.shared.check_serving()?;
        let pb::SetVdevStateRequest {
            vdev,
            online,
            drain,
        } = req.into_inner();
        let txg = {
            let mut g = self.shared.lock();
            if drain && !online {
                g.pool.check_drain_room(vdev).map_err(Error::from)?;
            }
            g.pool.set_online(vdev, online).map_err(Error::from)?;
            g.wake_admitted();
            let kind = if online {
                "vdev_online"
            } else {
                "vdev_offline"
            };
            g.event(kind, vdev, "administrative".into());
            let state = if online {
                AdminState::Online
            } else {
                AdminState::Offline
            };
            g.pending_vdev_states.push((vdev, state));
            g.pool.open_txg()
        };
        // Durable before the reply: a drained vdev stays offline across a
        // restart of the allocator.
        self.shared.wait_synced(txg).await?;
        let status = convert::pool_status(&self.shared, &self.shared.lock());
        tracing::info!(vdev, online, "vdev state changed");
        status
            .vdevs
            .into_iter()
            .find(|v| v.vdev == vdev)
            .map(Response::new)
            .ok_or_else(|| Error::Pool(metaslab::Error::UnknownVdev(vdev)).into())
    }

    #[tracing::instrument(skip_all, fields(
        extent = ?req.get_ref().extent, plan = req.get_ref().plan_id,
        allocation, throttle_wait_us, vdevs, tier
    ))]
    async fn relocate(
        &self,
        req: Request<pb::RelocateRequest>,
    ) -> Result<Response<pb::AllocateReply>, Status> {
        if let Some(from) = req.get_ref().extent.as_ref() {
            let from = convert::extent_from_pb(from)?;
            check_extent_owner(&self.shared.lock(), caller(&req).as_ref(), &[from], "move")?;
        }
        let (a, eps, deadline, waited) =
            crate::balancer::relocate(&self.shared, req.get_ref()).await?;
        record_allocation(&Span::current(), &a, waited);
        Ok(Response::new(allocate_reply(
            &self.shared,
            &a,
            eps,
            deadline,
            waited,
            caller(&req).as_ref(),
        )))
    }

    #[tracing::instrument(skip_all, fields(ids = req.get_ref().allocation_ids.len()))]
    async fn balancer_status(
        &self,
        req: Request<pb::BalancerStatusRequest>,
    ) -> Result<Response<pb::BalancerStatusReply>, Status> {
        Ok(Response::new(
            crate::balancer::status(&self.shared, req.get_ref()).await?,
        ))
    }

    #[tracing::instrument(skip_all, fields(name = %req.get_ref().name, guid = req.get_ref().device_guid))]
    async fn admit_vdev(
        &self,
        req: Request<pb::AdmitVdevRequest>,
    ) -> Result<Response<pb::VdevStatus>, Status> {
        self.shared.check_serving()?;
        let r = req.into_inner();
        let (id, txg, claim) = {
            let mut g = self.shared.lock();
            let w = crate::admission::take(&mut g, &r.name, r.device_guid)?;
            let reg = w.request;
            if let Some(&known) = g.by_guid.get(&reg.device_guid) {
                return Err(Error::VdevConflict(format!(
                    "device {:#x} is vdev {known} already",
                    reg.device_guid
                ))
                .into());
            }
            let endpoint = reg.endpoint.trim().to_string();
            crate::registry::endpoint_free(&g, &endpoint, reg.device_guid)?;
            // Bound to the certificate that registered it: no other agent
            // certificate may register the admitted device.
            let agent = aliquot_auth::Identity {
                role: aliquot_auth::Role::Agent,
                name: w.shown.agent.clone(),
            };
            let claim = self.bindings.claim(Some(&agent), reg.device_guid)?;
            let (id, txg) =
                match crate::registry::add_device(&mut g, &reg, &endpoint, Instant::now()) {
                    Ok(v) => v,
                    Err(e) => {
                        self.bindings.release(claim);
                        return Err(e.into());
                    }
                };
            // Nothing is placed there until its agent registers again and
            // learns this generation (its next try, within seconds).
            if let Some(info) = g.vdevs.get_mut(&id) {
                info.silent = true;
            }
            let _ = g.pool.set_health(id, metaslab::Health::Unavailable);
            (id, txg, claim)
        };
        self.bindings
            .persist(self.shared.store.as_ref(), claim)
            .await?;
        // Durable before the reply, as a Register's new vdev is.
        self.shared.wait_synced(txg).await?;
        tracing::info!(vdev = id, name = %r.name, txg, "pending device admitted by an operator");
        let status = convert::pool_status(&self.shared, &self.shared.lock());
        status
            .vdevs
            .into_iter()
            .find(|v| v.vdev == id)
            .map(Response::new)
            .ok_or_else(|| Error::Pool(metaslab::Error::UnknownVdev(id)).into())
    }

    #[tracing::instrument(skip_all, fields(vdev = req.get_ref().vdev))]
    async fn remove_vdev(
        &self,
        req: Request<pb::RemoveVdevRequest>,
    ) -> Result<Response<pb::RemoveVdevReply>, Status> {
        Ok(Response::new(
            crate::balancer::remove_vdev(&self.shared, req.get_ref().vdev).await?,
        ))
    }
}
