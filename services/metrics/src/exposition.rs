//! Prometheus/OpenMetrics exposition (`GET /metrics`): the latest snapshot of
//! each pool as gauges (per vdev, per class, per pool), plus this service's
//! own gRPC counts and latencies ([`telemetry::rpc_metrics`]).
//!
//! Pool gauges are rebuilt from the latest snapshot on every scrape, so a vdev
//! that leaves the pool leaves the output too. Derived values use the
//! definitions `ceph osd df` uses: VAR = a vdev's used fraction / the pool's
//! (total allocated / total capacity); STDDEV is the population standard
//! deviation of the used fractions; spread = max - min used fraction (the
//! same as the store's `current_spread`). Vdevs with no capacity are left out
//! of these, as in the store.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use aliquot_proto::v1::{PoolSnapshot, VdevHealth, VdevSample};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub use telemetry::rpc_metrics::{CONTENT_TYPE, RpcMetrics, RpcMetricsLayer};

type Labels = Vec<(String, String)>;
type FGauge = Family<Labels, Gauge<f64, AtomicU64>>;
type FCounter = Family<Labels, Counter<f64, AtomicU64>>;

/// The newest snapshot seen for each pool (filled by `Store::ingest`).
#[derive(Default)]
pub struct Latest(Mutex<BTreeMap<String, PoolSnapshot>>);

impl Latest {
    /// Keep `s` if it is newer than what is held for its pool (a backlog
    /// arriving after a restart must not replace the present).
    pub fn offer(&self, s: &PoolSnapshot) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(&s.pool) {
            Some(old) if old.time_ms > s.time_ms => {}
            _ => {
                m.insert(s.pool.clone(), s.clone());
            }
        }
    }

    fn snapshot(&self) -> Vec<PoolSnapshot> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.values().cloned().collect()
    }
}

/// Pool health rolled up from its vdevs, as `zpool status` names it:
/// ONLINE when every vdev is healthy and online, SUSPENDED when none is,
/// else DEGRADED (an offline vdev takes no allocations: the pool runs on
/// less than it has, as a pool with an offline device does).
pub fn pool_health(s: &PoolSnapshot) -> &'static str {
    let healthy = s.vdevs.iter().filter(|v| vdev_state(v) == "ONLINE").count();
    if healthy == 0 {
        "SUSPENDED"
    } else if healthy == s.vdevs.len() {
        "ONLINE"
    } else {
        "DEGRADED"
    }
}

const POOL_STATES: [&str; 3] = ["ONLINE", "DEGRADED", "SUSPENDED"];
const VDEV_STATES: [(VdevHealth, &str); 5] = [
    (VdevHealth::Unspecified, "UNKNOWN"),
    (VdevHealth::Healthy, "ONLINE"),
    (VdevHealth::Degraded, "DEGRADED"),
    (VdevHealth::Faulted, "FAULTED"),
    (VdevHealth::Unavailable, "UNAVAIL"),
];
/// An operator's `vdev offline` outranks the health the agent reports, as
/// `zpool status` shows OFFLINE for a device taken offline however sound.
const OFFLINE: &str = "OFFLINE";

/// The vdev's state as `zpool status` would name it.
pub fn vdev_state(v: &VdevSample) -> &'static str {
    if v.offline {
        return OFFLINE;
    }
    VDEV_STATES
        .iter()
        .find(|(h, _)| *h == v.health())
        .map_or("UNKNOWN", |(_, st)| *st)
}

/// Balance figures of one snapshot (ratios, 0.0 ..= 1.0).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Balance {
    pub used: f64,
    pub spread: f64,
    pub stddev: f64,
}

fn used(allocated: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        0.0
    } else {
        allocated as f64 / capacity as f64
    }
}

pub fn balance(s: &PoolSnapshot) -> Balance {
    let fr: Vec<f64> = s
        .vdevs
        .iter()
        .filter(|v| v.capacity > 0)
        .map(|v| used(v.allocated, v.capacity))
        .collect();
    if fr.is_empty() {
        return Balance::default();
    }
    let cap: u128 = s.vdevs.iter().map(|v| u128::from(v.capacity)).sum();
    let alloc: u128 = s
        .vdevs
        .iter()
        .filter(|v| v.capacity > 0)
        .map(|v| u128::from(v.allocated))
        .sum();
    let mean = fr.iter().sum::<f64>() / fr.len() as f64;
    let var = fr.iter().map(|f| (f - mean).powi(2)).sum::<f64>() / fr.len() as f64;
    let hi = fr.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lo = fr.iter().copied().fold(f64::INFINITY, f64::min);
    Balance {
        used: alloc as f64 / cap as f64,
        spread: hi - lo,
        stddev: var.sqrt(),
    }
}

fn gauge(reg: &mut Registry, name: &str, help: &str) -> FGauge {
    let g = FGauge::default();
    reg.register(name, help, g.clone());
    g
}

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Gauges for every pool's latest snapshot, registered into `reg`.
fn register_pools(reg: &mut Registry, pools: &[PoolSnapshot]) {
    let cap = gauge(reg, "aliquot_vdev_capacity_bytes", "Vdev capacity");
    let alloc = gauge(
        reg,
        "aliquot_vdev_allocated_bytes",
        "Bytes allocated on the vdev",
    );
    let usedg = gauge(reg, "aliquot_vdev_used_ratio", "Allocated / capacity");
    let varg = gauge(
        reg,
        "aliquot_vdev_var_ratio",
        "Used fraction / the pool's used fraction (ceph osd df VAR)",
    );
    let frag = gauge(
        reg,
        "aliquot_vdev_fragmentation_ratio",
        "Free-space fragmentation (absent when not known)",
    );
    let qd = gauge(
        reg,
        "aliquot_vdev_queue_depth_bytes",
        "Bytes queued at the vdev",
    );
    let qt = gauge(
        reg,
        "aliquot_vdev_queue_target_bytes",
        "Queue depth the allocator aims for",
    );
    let aliq = gauge(
        reg,
        "aliquot_vdev_aliquot_bytes",
        "Bytes allocated before rotating to the next vdev",
    );
    let wbps = gauge(
        reg,
        "aliquot_vdev_write_bytes_per_second",
        "Agent write throughput",
    );
    let rbps = gauge(
        reg,
        "aliquot_vdev_read_bytes_per_second",
        "Agent read throughput",
    );
    let p50 = gauge(
        reg,
        "aliquot_vdev_latency_p50_seconds",
        "Agent I/O latency, median",
    );
    let p99 = gauge(
        reg,
        "aliquot_vdev_latency_p99_seconds",
        "Agent I/O latency, 99th percentile",
    );
    let vh = gauge(
        reg,
        "aliquot_vdev_health",
        "1 for the vdev's state, 0 for the others",
    );
    let pused = gauge(
        reg,
        "aliquot_pool_used_ratio",
        "Total allocated / total capacity",
    );
    let spread = gauge(
        reg,
        "aliquot_pool_spread_ratio",
        "Max - min vdev used fraction",
    );
    let sd = gauge(
        reg,
        "aliquot_pool_used_stddev_ratio",
        "Population standard deviation of vdev used fractions",
    );
    let score = gauge(
        reg,
        "aliquot_pool_balance_score",
        "Balance score in [0, 1): 0 when every vdev is equally full (aliquotctl balancer eval)",
    );
    let minvar = gauge(reg, "aliquot_pool_min_var_ratio", "Lowest vdev VAR");
    let maxvar = gauge(reg, "aliquot_pool_max_var_ratio", "Highest vdev VAR");
    let txg = gauge(reg, "aliquot_pool_txg", "Open txg of the latest snapshot");
    let synced = gauge(
        reg,
        "aliquot_pool_synced_txg",
        "Last txg whose changes are durable",
    );
    let ts = gauge(
        reg,
        "aliquot_pool_snapshot_timestamp_seconds",
        "Unix time of the latest snapshot",
    );
    // A counter (the allocator's running count): `rate()` and `increase()`
    // apply; `_total` is added by the encoder.
    let dropped = FCounter::default();
    reg.register(
        "aliquot_pool_dropped_snapshots",
        "Snapshots the allocator had to drop since it started",
        dropped.clone(),
    );
    let ph = gauge(
        reg,
        "aliquot_pool_health",
        "1 for the pool's rolled-up state, 0 for the others",
    );
    let climit = gauge(
        reg,
        "aliquot_class_limit_bytes",
        "Class allocation limit (throttle); absent for a class with no limit",
    );
    let cres = gauge(
        reg,
        "aliquot_class_reserved_bytes",
        "Bytes reserved against the class limit",
    );
    let cwait = gauge(
        reg,
        "aliquot_class_waiting",
        "Allocations waiting in the throttle",
    );
    let cwaitb = gauge(
        reg,
        "aliquot_class_waiting_bytes",
        "Bytes the waiting allocations ask for",
    );
    let cbusy = gauge(
        reg,
        "aliquot_class_busy",
        "1 when the class is at its limit",
    );

    for s in pools {
        let pool = s.pool.as_str();
        let b = balance(s);
        let pl = l(&[("pool", pool)]);
        pused.get_or_create(&pl).set(b.used);
        spread.get_or_create(&pl).set(b.spread);
        sd.get_or_create(&pl).set(b.stddev);
        let fills: Vec<metaslab::balance_score::VdevFill> = s
            .vdevs
            .iter()
            .map(|v| metaslab::balance_score::VdevFill {
                capacity: v.capacity,
                alloc: v.allocated,
            })
            .collect();
        score
            .get_or_create(&pl)
            .set(metaslab::balance_score::score(&fills));
        txg.get_or_create(&pl).set(s.txg as f64);
        synced.get_or_create(&pl).set(s.synced_txg as f64);
        ts.get_or_create(&pl).set(s.time_ms as f64 / 1000.0);
        let d = dropped.get_or_create(&pl);
        d.inc_by(s.dropped_snapshots as f64);
        let health = pool_health(s);
        for st in POOL_STATES {
            let v = if st == health { 1.0 } else { 0.0 };
            ph.get_or_create(&l(&[("pool", pool), ("state", st)]))
                .set(v);
        }
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in &s.vdevs {
            let id = v.vdev.to_string();
            let vl = l(&[("pool", pool), ("vdev", &id), ("name", &v.name)]);
            let u = used(v.allocated, v.capacity);
            cap.get_or_create(&vl).set(v.capacity as f64);
            alloc.get_or_create(&vl).set(v.allocated as f64);
            usedg.get_or_create(&vl).set(u);
            if v.capacity > 0 && b.used > 0.0 {
                let var = u / b.used;
                lo = lo.min(var);
                hi = hi.max(var);
                varg.get_or_create(&vl).set(var);
            }
            if v.fragmentation >= 0 {
                frag.get_or_create(&vl)
                    .set(f64::from(v.fragmentation) / 100.0);
            }
            qd.get_or_create(&vl).set(v.queue_depth as f64);
            qt.get_or_create(&vl).set(v.queue_target as f64);
            aliq.get_or_create(&vl).set(v.aliquot as f64);
            wbps.get_or_create(&vl).set(v.write_bytes_per_sec);
            rbps.get_or_create(&vl).set(v.read_bytes_per_sec);
            p50.get_or_create(&vl).set(v.latency_p50_us as f64 / 1e6);
            p99.get_or_create(&vl).set(v.latency_p99_us as f64 / 1e6);
            let state = vdev_state(v);
            for st in VDEV_STATES.iter().map(|(_, st)| *st).chain([OFFLINE]) {
                let on = if st == state { 1.0 } else { 0.0 };
                let mut hl = vl.clone();
                hl.push(("state".into(), st.into()));
                vh.get_or_create(&hl).set(on);
            }
        }
        if lo.is_finite() {
            minvar.get_or_create(&pl).set(lo);
            maxvar.get_or_create(&pl).set(hi);
        }
        for c in &s.classes {
            let cl = l(&[("pool", pool), ("class", &c.name)]);
            // A class the throttle does not bound has no limit: no sample,
            // rather than a figure nothing enforces on a dashboard.
            if c.throttle_enabled {
                climit.get_or_create(&cl).set(c.alloc_max as f64);
            }
            cres.get_or_create(&cl).set(c.reserved as f64);
            cbusy.get_or_create(&cl).set(if c.busy { 1.0 } else { 0.0 });
            cwait.get_or_create(&cl).set(f64::from(c.waiting));
            cwaitb.get_or_create(&cl).set(c.waiting_bytes as f64);
        }
    }
}

/// The whole `/metrics` body: pool gauges from the store's latest
/// snapshots, whether the store writes, then `rpc`.
pub fn render(store: &crate::Store, rpc: &RpcMetrics) -> String {
    let mut reg = Registry::default();
    register_pools(&mut reg, &store.latest().snapshot());
    // While it is 0 the latest snapshot stops moving too: the snapshots
    // the allocator sends are refused (and kept by it) until writes work.
    let writable = Gauge::<f64, AtomicU64>::default();
    writable.set(if *store.writable().borrow() { 1.0 } else { 0.0 });
    reg.register(
        "aliquot_metrics_store_writable",
        "1 while the metrics store commits what it is sent; 0 after a write failed (a full disk), until one succeeds",
        writable,
    );
    rpc.register(&mut reg);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vdev(id: u32, alloc: u64, cap: u64, h: VdevHealth) -> VdevSample {
        VdevSample {
            vdev: id,
            name: format!("v{id}"),
            capacity: cap,
            allocated: alloc,
            health: h as i32,
            ..Default::default()
        }
    }

    #[test]
    fn balance_matches_ceph_definitions() {
        let s = PoolSnapshot {
            pool: "p".into(),
            vdevs: vec![
                vdev(0, 88, 100, VdevHealth::Healthy),
                vdev(1, 35, 100, VdevHealth::Healthy),
                vdev(2, 41, 100, VdevHealth::Unavailable),
            ],
            ..Default::default()
        };
        let b = balance(&s);
        assert!((b.used - 164.0 / 300.0).abs() < 1e-12);
        assert!((b.spread - 0.53).abs() < 1e-12);
        let mean = 1.64 / 3.0;
        let sd = (((0.88f64 - mean).powi(2) + (0.35f64 - mean).powi(2) + (0.41f64 - mean).powi(2))
            / 3.0)
            .sqrt();
        assert!((b.stddev - sd).abs() < 1e-12);
        assert_eq!(pool_health(&s), "DEGRADED");
    }

    #[test]
    fn an_offline_vdev_is_offline_and_degrades_the_pool() {
        let mut off = vdev(1, 0, 1, VdevHealth::Healthy);
        off.offline = true;
        assert_eq!(vdev_state(&off), "OFFLINE");
        let s = PoolSnapshot {
            pool: "p".into(),
            vdevs: vec![vdev(0, 0, 1, VdevHealth::Healthy), off],
            ..Default::default()
        };
        assert_eq!(pool_health(&s), "DEGRADED");
    }

    #[test]
    fn health_rolls_up() {
        let mut s = PoolSnapshot::default();
        assert_eq!(pool_health(&s), "SUSPENDED");
        s.vdevs = vec![vdev(0, 0, 1, VdevHealth::Healthy)];
        assert_eq!(pool_health(&s), "ONLINE");
        s.vdevs = vec![vdev(0, 0, 1, VdevHealth::Faulted)];
        assert_eq!(pool_health(&s), "SUSPENDED");
    }

    #[test]
    fn older_snapshot_does_not_replace_newer() {
        let l = Latest::default();
        let mk = |t, txg| PoolSnapshot {
            pool: "p".into(),
            time_ms: t,
            txg,
            ..Default::default()
        };
        l.offer(&mk(20, 2));
        l.offer(&mk(10, 1));
        assert_eq!(l.snapshot()[0].txg, 2);
    }
}
