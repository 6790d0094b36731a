//! Conversions between the wire types (`aliquot.v1`) and the policy's types.
//! Network input is validated here and never trusted to be in range.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use aliquot_proto::v1 as pb;
use metaslab::{AllocKind, ClassKind, Extent, Health, LogTier, ThrottlePolicy};

use crate::error::{Error, Result};
use crate::state::{Inner, Shared};

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn alloc_kind(class: i32) -> Result<AllocKind> {
    match pb::AllocationClass::try_from(class) {
        // An unset class is a client bug, not a guess at DATA.
        Ok(pb::AllocationClass::Unspecified) => Err(Error::InvalidArgument(
            "allocation class is unset: ask for DATA=1 or LOG=2".into(),
        )),
        Ok(pb::AllocationClass::Data) => Ok(AllocKind::Data),
        Ok(pb::AllocationClass::Log) => Ok(AllocKind::Log),
        Err(_) => Err(Error::InvalidArgument(format!(
            "unknown allocation class {class} (expected DATA=1 or LOG=2)"
        ))),
    }
}

pub fn copies(c: u32) -> Result<u8> {
    match c {
        0 => Ok(1),
        1..=255 => Ok(c as u8),
        _ => Err(Error::InvalidArgument(format!(
            "copies must be 1, 2 or 3, not {c}"
        ))),
    }
}

pub fn tier(t: Option<LogTier>) -> pb::LogTier {
    match t {
        None => pb::LogTier::Unspecified,
        Some(LogTier::Log) => pb::LogTier::Log,
        Some(LogTier::EmbeddedLog) => pb::LogTier::EmbeddedLog,
        Some(LogTier::Normal) => pb::LogTier::Normal,
    }
}

pub fn tier_name(t: Option<LogTier>) -> &'static str {
    match t {
        None => "",
        Some(LogTier::Log) => "log",
        Some(LogTier::EmbeddedLog) => "embedded_log",
        Some(LogTier::Normal) => "normal",
    }
}

pub fn extent_to_pb(e: &Extent) -> pb::Extent {
    pb::Extent {
        vdev: e.vdev,
        offset: e.offset,
        size: e.size,
    }
}

pub fn extent_from_pb(e: &pb::Extent) -> Result<Extent> {
    if e.size == 0 {
        return Err(Error::InvalidArgument(format!(
            "extent {}:{:#x}+0 has no size",
            e.vdev, e.offset
        )));
    }
    if e.offset.checked_add(e.size).is_none() {
        return Err(Error::InvalidArgument(format!(
            "extent {}:{:#x}+{:#x} overflows",
            e.vdev, e.offset, e.size
        )));
    }
    Ok(Extent {
        vdev: e.vdev,
        offset: e.offset,
        size: e.size,
    })
}

/// Extents one Free, Claim or ReadTokens may name (one Free of
/// 100 000 extents held the allocator for 13.7 s). Clients send more in
/// several requests; the bound is stated in the proto.
pub const MAX_EXTENTS_PER_REQUEST: usize = 4096;

pub fn extents_from_pb(es: &[pb::Extent]) -> Result<Vec<Extent>> {
    if es.is_empty() {
        return Err(Error::InvalidArgument("no extents given".into()));
    }
    if es.len() > MAX_EXTENTS_PER_REQUEST {
        return Err(Error::InvalidArgument(format!(
            "{} extents in one request; at most {MAX_EXTENTS_PER_REQUEST}: send them in several",
            es.len()
        )));
    }
    es.iter().map(extent_from_pb).collect()
}

pub fn health_to_pb(h: Health) -> pb::VdevHealth {
    match h {
        Health::Healthy => pb::VdevHealth::Healthy,
        Health::Degraded => pb::VdevHealth::Degraded,
        Health::Faulted => pb::VdevHealth::Faulted,
        Health::Unavailable => pb::VdevHealth::Unavailable,
    }
}

/// An agent's reported health; unset means it did not say, i.e. healthy.
pub fn health_from_pb(h: i32) -> Health {
    match pb::VdevHealth::try_from(h) {
        Ok(pb::VdevHealth::Degraded) => Health::Degraded,
        Ok(pb::VdevHealth::Faulted) => Health::Faulted,
        Ok(pb::VdevHealth::Unavailable) => Health::Unavailable,
        _ => Health::Healthy,
    }
}

pub fn class_name(k: ClassKind) -> &'static str {
    match k {
        ClassKind::Normal => "normal",
        ClassKind::Log => "log",
        ClassKind::EmbeddedLog => "embedded_log",
    }
}

pub fn policy_name(p: ThrottlePolicy) -> &'static str {
    match p {
        ThrottlePolicy::Unified => "unified",
        ThrottlePolicy::Legacy => "legacy",
        ThrottlePolicy::Off => "off",
    }
}

fn frag(f: Option<u32>) -> i32 {
    f.map_or(-1, |v| v as i32)
}

/// The pool as GetPool / WatchPool show it.
pub fn pool_status(shared: &Shared, g: &Inner) -> pb::PoolStatus {
    let stats = g.pool.stats();
    let now = Instant::now();
    let classes = stats
        .classes
        .iter()
        .map(|c| pb::ClassStatus {
            name: class_name(c.kind).into(),
            space: c.space,
            alloc: c.alloc,
            reserved: c.reserved,
            alloc_max: c.alloc_max,
            alloc_io_size: c.alloc_io_size,
            busy: c.kind == ClassKind::Normal && g.busy(),
            waiting: c.waiting,
            waiting_bytes: c.waiting_bytes,
            throttle_enabled: c.throttle_enabled,
            fragmentation: frag(c.fragmentation),
            balance_score: c.balance_score(),
            deferred: c.deferred,
            groups: c
                .groups
                .iter()
                .map(|m| pb::GroupStatus {
                    vdev: m.vdev,
                    capacity: m.capacity,
                    alloc: m.alloc,
                    children: m.children,
                    parity: m.parity,
                    aliquot: m.aliquot,
                    queue_target: m.queue_target,
                    queue_depth: m.queue_depth,
                    fragmentation: frag(m.fragmentation),
                    health: health_to_pb(m.health) as i32,
                    free_fraction: m.free_fraction,
                    allocatable: m.allocatable,
                })
                .collect(),
        })
        .collect();
    let vdevs = stats
        .vdevs
        .iter()
        .map(|v| {
            let info = g.vdevs.get(&v.id);
            pb::VdevStatus {
                vdev: v.id,
                guid: info.map_or(0, |i| i.guid),
                name: info.map(|i| i.name.clone()).unwrap_or_default(),
                endpoint: info.map(|i| i.endpoint.clone()).unwrap_or_default(),
                capacity: v.spec.capacity,
                ashift: v.spec.ashift as u32,
                metaslab_size: 1u64 << v.metaslab_shift,
                metaslab_count: v.metaslab_count,
                children: v.spec.children,
                parity: v.spec.parity,
                rotational: v.spec.rotational,
                class: match v.spec.role {
                    metaslab::VdevRole::Normal => "normal".into(),
                    metaslab::VdevRole::Log => "log".into(),
                },
                health: health_to_pb(v.health) as i32,
                online: v.online,
                embedded_log_metaslab: v.embedded_log_metaslab,
                alloc: v.alloc,
                last_report: info.and_then(|i| i.last_report.clone()),
                last_report_age_ms: info
                    .and_then(|i| i.last_report_at)
                    .map_or(0, |t| now.duration_since(t).as_millis() as u64),
                mapping_entries: g.indirect.entries_on(v.id) as u64,
            }
        })
        .collect();
    pb::PoolStatus {
        name: shared.settings.pool_name.clone(),
        guid: shared.pool_guid,
        open_txg: stats.open_txg,
        synced_txg: shared.synced_txg(),
        throttle_policy: policy_name(stats.policy).into(),
        classes,
        vdevs,
        slop_space: stats.slop,
        time_ms: unix_ms(),
        generation: shared.fencing.generation,
        claim_window_remaining_ms: shared.claim_window_remaining().as_millis() as u64,
        max_lease_ms: shared.settings.max_lease.as_millis() as u64,
        mapping_entries: g.indirect.len() as u64,
        mapping_bytes: g.indirect.mapped_bytes(),
        mapping_memory_bytes: g.indirect.memory_bytes() as u64,
        evacuation: shared.mover.status(g),
        leadership: Some(match shared.lease.get() {
            Some(l) => pb::Leadership {
                store: "postgres".into(),
                leader: l.address().to_string(),
                lease_left_ms: l.left().as_millis() as u64,
                standbys: l.standbys(),
                lease_ms: l.duration().as_millis() as u64,
            },
            None => pb::Leadership {
                store: "sqlite".into(),
                ..Default::default()
            },
        }),
        persist_failure: shared
            .persist_failure
            .borrow()
            .as_ref()
            .map(|f| pb::PersistFailure {
                txg: f.txg,
                error: f.error.clone(),
                since_ms: f.since_ms,
                attempts: f.attempts,
            }),
        pending_vdevs: g
            .awaiting_admission
            .values()
            .map(|w| w.shown.clone())
            .collect(),
    }
}

/// Unix ms of a monotonic deadline.
pub fn deadline_unix_ms(deadline: std::time::Instant) -> u64 {
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    unix_ms().saturating_add(left.as_millis() as u64)
}
