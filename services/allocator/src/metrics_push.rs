//! Balance snapshots for the metrics service: every `--snapshot-interval`
//! a `PoolSnapshot` is built from `pool.stats()` and the agents' latest
//! reports (throughput from the delta of their cumulative byte counters) and
//! handed to `aliquot_metrics::pusher::SnapshotPusher`, which never blocks:
//! a metrics outage cannot slow allocation. Events (vdev add, offline,
//! unavailable, online) ride along in the next snapshot.

use std::sync::Arc;
use std::time::Duration;

use aliquot_metrics::pusher::SnapshotPusher;
use aliquot_proto::v1 as pb;

use crate::convert;
use crate::state::{Inner, Shared};

/// Snapshots buffered while the metrics service is unreachable.
const BUFFER: usize = 600;

/// Per-second rate between two cumulative counters `dt` apart.
fn rate(new: u64, old: u64, dt: Duration) -> f64 {
    if dt.is_zero() || new < old {
        return 0.0;
    }
    (new - old) as f64 / dt.as_secs_f64()
}

pub fn snapshot(shared: &Shared, g: &mut Inner) -> pb::PoolSnapshot {
    let stats = g.pool.stats();
    let mut vdevs = Vec::new();
    for c in &stats.classes {
        // The main groups: one per vdev in normal or log (embedded_log
        // groups share their vdev with a normal group).
        if c.kind == metaslab::ClassKind::EmbeddedLog {
            continue;
        }
        for m in &c.groups {
            let info = g.vdevs.get(&m.vdev);
            let last = info.and_then(|i| i.last_report.as_ref());
            let (wr, rd) = match (info.and_then(|i| i.prev_report.as_ref()), last, info) {
                (Some((t0, prev)), Some(cur), Some(i)) => {
                    let dt = i
                        .last_report_at
                        .map_or(Duration::ZERO, |t1| t1.duration_since(*t0));
                    (
                        rate(cur.bytes_written, prev.bytes_written, dt),
                        rate(cur.bytes_read, prev.bytes_read, dt),
                    )
                }
                _ => (0.0, 0.0),
            };
            vdevs.push(pb::VdevSample {
                vdev: m.vdev,
                name: info.map(|i| i.name.clone()).unwrap_or_default(),
                capacity: m.capacity,
                allocated: m.alloc,
                free_fraction: m.free_fraction,
                fragmentation: m.fragmentation.map_or(-1, |f| f as i32),
                aliquot: m.aliquot,
                queue_target: m.queue_target,
                queue_depth: m.queue_depth,
                write_bytes_per_sec: wr,
                read_bytes_per_sec: rd,
                latency_p50_us: last.map_or(0, |r| r.latency_p50_us),
                latency_p99_us: last.map_or(0, |r| r.latency_p99_us),
                health: convert::health_to_pb(m.health) as i32,
                offline: !m.online,
            });
        }
    }
    let classes = stats
        .classes
        .iter()
        .map(|c| pb::ClassSample {
            name: convert::class_name(c.kind).into(),
            alloc_max: c.alloc_max,
            reserved: c.reserved,
            busy: c.kind == metaslab::ClassKind::Normal && g.busy(),
            waiting: c.waiting,
            waiting_bytes: c.waiting_bytes,
            throttle_enabled: c.throttle_enabled,
        })
        .collect();
    pb::PoolSnapshot {
        pool: shared.settings.pool_name.clone(),
        time_ms: convert::unix_ms() as i64,
        txg: stats.open_txg,
        vdevs,
        classes,
        events: std::mem::take(&mut g.events),
        dropped_snapshots: 0,
        synced_txg: shared.synced_txg(),
    }
}

pub async fn run(
    shared: Arc<Shared>,
    url: String,
    tls: aliquot_auth::ClientTls,
    interval: Duration,
) {
    let pusher = SnapshotPusher::spawn_with(url.clone(), tls, BUFFER);
    tracing::info!(metrics = %url, interval_ms = interval.as_millis() as u64, "pushing balance snapshots");
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.stopping() => break,
        }
        let snap = {
            let mut g = shared.lock();
            snapshot(&shared, &mut g)
        };
        pusher.push(snap);
    }
    // One last snapshot with the final state and events.
    let snap = {
        let mut g = shared.lock();
        snapshot(&shared, &mut g)
    };
    pusher.push(snap);
    let left = pusher.shutdown(Duration::from_secs(2)).await;
    if left > 0 {
        tracing::warn!(left, "metrics snapshots not sent at shutdown");
    }
}
