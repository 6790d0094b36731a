//! The `AgentRegistry` service: agents register their device (a new device
//! becomes a vdev; a known device guid gets its vdev id back) and keep a
//! report stream open. Reports carry health and capacity; a vdev whose agent
//! stays silent for `MISSED_REPORTS` intervals, or whose reports show its
//! queue not draining for as long (a hung device), is made unavailable
//! (allocation goes on elsewhere) until it recovers. Registrations are
//! checked by the store's own rules (`crate::vdev_rules`) before anything is
//! persisted; a report never resizes a vdev (`ExpandVdev` or a
//! re-registration by the device's owner does), and one report stream owns
//! a vdev at a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use aliquot_proto::v1 as pb;
use aliquot_proto::v1::agent_registry_server::AgentRegistry;
use metaslab::{Health, VdevId};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::convert;
use crate::error::{Error, Result};
use crate::state::{Inner, MISSED_REPORTS, Shared, VdevInfo};
use crate::store::VdevRecord;
use crate::vdev_rules;

/// Report streams get an id each, so a vdev knows which stream owns it.
static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

#[derive(Clone)]
pub struct RegistryService {
    pub shared: Arc<Shared>,
}

fn record_of(g: &Inner, id: VdevId) -> Option<VdevRecord> {
    let info = g.vdevs.get(&id)?;
    let stats = g.pool.stats();
    let v = stats.vdevs.iter().find(|v| v.id == id)?;
    let mut spec = v.spec.clone();
    spec.metaslab_shift = Some(v.metaslab_shift);
    Some(VdevRecord {
        id,
        guid: info.guid,
        name: info.name.clone(),
        endpoint: info.endpoint.clone(),
        spec,
    })
}

fn vdev_capacity(g: &Inner, id: VdevId) -> Option<u64> {
    g.pool
        .stats()
        .vdevs
        .iter()
        .find(|v| v.id == id)
        .map(|v| v.spec.capacity)
}

/// Is `endpoint` served by a live vdev other than `me`?
fn endpoint_owner(g: &Inner, endpoint: &str, me: Option<VdevId>) -> Option<VdevId> {
    g.vdevs
        .iter()
        .find(|(id, v)| Some(**id) != me && v.endpoint == endpoint && !v.silent)
        .map(|(id, _)| *id)
}

/// The health the pool should apply: forced unavailable while silent or hung.
fn effective_health(v: &VdevInfo) -> Health {
    if v.silent || v.stalled {
        Health::Unavailable
    } else {
        v.reported_health
    }
}

/// Grow vdev `vdev` to `capacity` (the operator's `aliquotctl vdev expand`,
/// or a re-registration by the device's owner): checked by the store's
/// rules first; never shrinks.
pub fn expand(g: &mut Inner, vdev: VdevId, capacity: u64) -> Result<()> {
    let stats = g.pool.stats();
    let v = stats
        .vdevs
        .iter()
        .find(|v| v.id == vdev)
        .ok_or(metaslab::Error::UnknownVdev(vdev))?;
    if capacity < v.spec.capacity {
        return Err(Error::ResizeRefused(format!(
            "vdev {vdev} cannot shrink from {} to {capacity} bytes",
            v.spec.capacity
        )));
    }
    if capacity == v.spec.capacity {
        return Ok(());
    }
    vdev_rules::check_capacity(capacity, v.metaslab_shift)?;
    g.pool.grow_vdev(vdev, capacity)?;
    if let Some(rec) = record_of(g, vdev) {
        g.pending_vdevs.push(rec);
    }
    g.event("vdev_expand", vdev, format!("capacity {capacity} bytes"));
    tracing::info!(vdev, capacity, "vdev expanded");
    Ok(())
}

/// A vdev heard from again: its reported health applies once more.
fn mark_alive(g: &mut Inner, id: VdevId, now: Instant, why: &str) {
    let Some(info) = g.vdevs.get_mut(&id) else {
        return;
    };
    info.last_seen = now;
    if info.silent {
        info.silent = false;
        let health = effective_health(info);
        let _ = g.pool.set_health(id, health);
        g.wake_admitted();
        g.event("vdev_online", id, why.to_string());
        tracing::info!(vdev = id, ?health, "vdev available again");
    }
}

impl RegistryService {
    async fn register_inner(&self, r: pb::RegisterRequest) -> Result<pb::RegisterReply> {
        let (reply, wait_for) = self.register_locked(r)?;
        if let Some(txg) = wait_for {
            // Its metaslabs are usable once the txg it joined in has synced.
            self.shared.wait_synced(txg).await?;
        }
        Ok(reply)
    }

    /// The synchronous part of Register; a new vdev also returns the txg
    /// to wait for.
    fn register_locked(
        &self,
        r: pb::RegisterRequest,
    ) -> Result<(pb::RegisterReply, Option<metaslab::Txg>)> {
        self.shared.check_serving()?;
        let endpoint = r.endpoint.trim().to_string();
        let tunables = self.shared.lock().pool.tunables().clone();
        // Everything the store would refuse at the next open is refused now.
        let spec = vdev_rules::spec_of(&r, &tunables)?;
        let now = Instant::now();
        let reply = |vdev| pb::RegisterReply {
            vdev,
            pool_guid: self.shared.pool_guid,
            report_interval_ms: self.shared.settings.report_interval.as_millis() as u32,
            generation: self.shared.generation,
        };
        let mut g = self.shared.lock();
        if let Some(&id) = g.by_guid.get(&r.device_guid) {
            if let Some(owner) = endpoint_owner(&g, &endpoint, Some(id)) {
                return Err(Error::FailedPrecondition(format!(
                    "endpoint {endpoint} belongs to live vdev {owner}; a different device cannot take it over"
                )));
            }
            if let Some(info) = g.vdevs.get(&id)
                && info.endpoint != endpoint
                && info.stream.is_some()
                && !info.silent
            {
                return Err(Error::VdevConflict(format!(
                    "device guid {:#x} is vdev {id}, served live from {} (its report stream is open); \
                     it cannot move to {endpoint} until that agent stops",
                    r.device_guid, info.endpoint
                )));
            }
            let mut changed = false;
            if let Some(info) = g.vdevs.get_mut(&id) {
                changed |= info.endpoint != endpoint || info.name != r.name;
                info.endpoint = endpoint.clone();
                info.name = r.name.clone();
                info.backend = r.backend.clone();
            }
            // Growth by the device's owner: the guid comes from its label.
            if vdev_capacity(&g, id).is_some_and(|c| r.capacity > c) {
                expand(&mut g, id, r.capacity)?;
            }
            mark_alive(&mut g, id, now, "agent registered again");
            if changed && let Some(rec) = record_of(&g, id) {
                g.pending_vdevs.push(rec);
            }
            drop(g);
            tracing::info!(vdev = id, endpoint = %endpoint, guid = r.device_guid, "vdev re-registered");
            return Ok((reply(id), None));
        }
        // A new device where a known vdev (live or silent, e.g. just
        // recovered from the store) was last seen is refused: its extents
        // would be read from the wrong device. The known device frees the
        // endpoint by re-registering from elsewhere.
        if let Some((&owner, v)) = g.vdevs.iter().find(|(_, v)| v.endpoint == endpoint) {
            let state = if v.silent { "silent" } else { "live" };
            return Err(Error::FailedPrecondition(format!(
                "endpoint {endpoint} belongs to {state} vdev {owner} (device guid {:#x}); a different device (guid {:#x}) cannot take it over",
                v.guid, r.device_guid
            )));
        }
        let id = g.pool.add_vdev(spec)?;
        g.vdevs.insert(
            id,
            VdevInfo {
                guid: r.device_guid,
                name: r.name.clone(),
                endpoint: endpoint.clone(),
                backend: r.backend.clone(),
                last_report: None,
                last_seen: now,
                prev_report: None,
                last_report_at: None,
                silent: false,
                stalled: false,
                stuck_reports: 0,
                stream: None,
                reported_health: Health::Healthy,
            },
        );
        g.by_guid.insert(r.device_guid, id);
        if let Some(rec) = record_of(&g, id) {
            g.pending_vdevs.push(rec);
        }
        g.event(
            "vdev_add",
            id,
            format!(
                "{} {} at {endpoint}",
                r.name,
                units::format_bytes(r.capacity)
            ),
        );
        let txg = g.pool.open_txg();
        drop(g);
        tracing::info!(vdev = id, name = %r.name, endpoint = %endpoint, capacity = r.capacity,
            guid = r.device_guid, "vdev added");
        Ok((reply(id), Some(txg)))
    }

    fn report_one(&self, stream: u64, r: pb::AgentReport) -> Result<pb::ReportAck> {
        let now = Instant::now();
        let mut g = self.shared.lock();
        let id = r.vdev;
        let Some(info) = g.vdevs.get_mut(&id) else {
            return Err(Error::NotFound(format!(
                "vdev {id} is not registered here; register first"
            )));
        };
        match info.stream {
            Some(owner) if owner != stream && !info.silent => {
                return Err(Error::VdevConflict(format!(
                    "vdev {id} already reports on another live stream (from {}); \
                     two agents claim one device",
                    info.endpoint
                )));
            }
            _ => info.stream = Some(stream),
        }
        // A hung device: I/Os queued and no write completed since the last
        // report, for MISSED_REPORTS reports in a row.
        let stuck = r.queue_depth_ios > 0
            && info
                .last_report
                .as_ref()
                .is_some_and(|p| p.writes == r.writes);
        info.stuck_reports = if stuck { info.stuck_reports + 1 } else { 0 };
        let was_stalled = info.stalled;
        info.stalled = info.stuck_reports >= MISSED_REPORTS;
        let health = convert::health_from_pb(r.health);
        let old_health = info.reported_health;
        info.reported_health = health;
        if let Some(prev) = info.last_report.take() {
            info.prev_report = Some((info.last_report_at.unwrap_or(now), prev));
        }
        let capacity = r.capacity;
        let (queued, writes) = (r.queue_depth_ios, r.writes);
        info.last_report = Some(r);
        info.last_report_at = Some(now);
        let stalled = info.stalled;
        let was_silent = info.silent;
        if was_silent {
            mark_alive(&mut g, id, now, "reports resumed");
        } else {
            g.vdevs.get_mut(&id).expect("present").last_seen = now;
            if stalled != was_stalled {
                let h = if stalled { Health::Unavailable } else { health };
                g.pool.set_health(id, h)?;
                g.wake_admitted();
                let (kind, detail) = if stalled {
                    (
                        "vdev_unavailable",
                        format!(
                            "queue not draining: {queued} I/Os queued, writes stuck at {writes}"
                        ),
                    )
                } else {
                    ("vdev_online", "queue draining again".to_string())
                };
                g.event(kind, id, detail.clone());
                tracing::warn!(vdev = id, stalled, "{detail}");
            } else if health != old_health && !stalled {
                g.pool.set_health(id, health)?;
                g.wake_admitted();
                tracing::info!(vdev = id, ?health, "vdev health changed");
            }
        }
        // A report never resizes a vdev: a wrong number in one message must
        // not move the device end for good (ExpandVdev does that).
        if vdev_capacity(&g, id).is_some_and(|c| capacity != c) {
            tracing::debug!(vdev = id, capacity, "reported capacity differs; ignored");
        }
        let stats = g.pool.stats();
        let v = stats.vdevs.iter().find(|v| v.id == id);
        Ok(pb::ReportAck {
            health: convert::health_to_pb(v.map_or(Health::Unavailable, |v| v.health)) as i32,
            online: v.is_some_and(|v| v.online),
            generation: self.shared.generation,
            allocatable: v.is_some_and(|v| {
                v.online && matches!(v.health, Health::Healthy | Health::Degraded)
            }),
        })
    }
}

/// Called from housekeeping: vdevs silent for too long become unavailable.
pub fn check_liveness(shared: &Shared, now: Instant) {
    let limit = shared.settings.report_interval * MISSED_REPORTS;
    let mut g = shared.lock();
    let silent: Vec<VdevId> = g
        .vdevs
        .iter()
        .filter(|(_, v)| !v.silent && now.duration_since(v.last_seen) > limit)
        .map(|(id, _)| *id)
        .collect();
    for id in silent {
        let age = now.duration_since(g.vdevs[&id].last_seen);
        g.vdevs.get_mut(&id).expect("present").silent = true;
        let _ = g.pool.set_health(id, Health::Unavailable);
        g.event(
            "vdev_unavailable",
            id,
            format!("no report for {} ms", age.as_millis()),
        );
        tracing::warn!(
            vdev = id,
            silent_ms = age.as_millis() as u64,
            "vdev unavailable: agent stopped reporting"
        );
    }
}

#[tonic::async_trait]
impl AgentRegistry for RegistryService {
    #[tracing::instrument(skip_all, fields(endpoint = %req.get_ref().endpoint, guid = req.get_ref().device_guid, name = %req.get_ref().name))]
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterReply>, Status> {
        Ok(Response::new(self.register_inner(req.into_inner()).await?))
    }

    type ReportStream = ReceiverStream<Result<pb::ReportAck, Status>>;

    #[tracing::instrument(skip_all)]
    async fn report(
        &self,
        req: Request<Streaming<pb::AgentReport>>,
    ) -> Result<Response<Self::ReportStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let svc = self.clone();
        let stream = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(
            async move {
                // Whatever ends the loop, the stream no longer owns its vdev.
                let _release = ReleaseStream {
                    shared: svc.shared.clone(),
                    stream,
                };
                loop {
                    let msg = tokio::select! {
                        m = inbound.next() => m,
                        _ = svc.shared.stopping() => break,
                    };
                    let Some(msg) = msg else { break };
                    let reply = match msg {
                        Ok(r) => svc.report_one(stream, r).map_err(Status::from),
                        Err(status) => {
                            tracing::debug!(%status, "report stream ended");
                            break;
                        }
                    };
                    let fatal = reply.is_err();
                    if tx.send(reply).await.is_err() || fatal {
                        break;
                    }
                }
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Clears a report stream's ownership of its vdev when the stream ends.
struct ReleaseStream {
    shared: Arc<Shared>,
    stream: u64,
}

impl Drop for ReleaseStream {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        for v in g.vdevs.values_mut() {
            if v.stream == Some(self.stream) {
                v.stream = None;
            }
        }
    }
}
