//! Virtual-time simulator of a pool on crates/metaslab.
//!
//! `aliquot-sim run SCENARIO.toml --out DIR` answers "how will this pool of
//! mixed devices fill?" in seconds: simulated devices, writers and txg syncs
//! drive the very `metaslab::Pool` the allocator service runs, once per
//! throttle policy (and block size, and variant) the scenario names, and the
//! results land in `DIR/summary.json`, `DIR/timeseries.csv` and SVG charts.
#![forbid(unsafe_code)]

pub mod calibration;
pub mod chart;
pub mod cli;
pub mod device;
pub mod engine;
pub mod leaf;
pub mod pool;
pub mod rebalance;
pub mod report;
pub mod scenario;

use std::path::Path;

use metaslab::{Pool, Tunables};

pub use engine::RunResult;
pub use report::Summary;
pub use scenario::{RunSpec, Scenario, ScenarioError};

/// A fresh pool with the run's policy, then the scenario's and the variant's
/// tunables (sim-level names excepted) applied by name, in file order.
pub fn build_pool(sc: &Scenario, run: &RunSpec) -> Result<Pool, ScenarioError> {
    let mut t = Tunables {
        throttle_policy: run.policy,
        ..Tunables::default()
    };
    let variant = &sc.variants[run.variant];
    let base = sc.tunables.iter().map(|kv| ("tunables".to_string(), kv));
    let extra = variant
        .tunables
        .iter()
        .map(|kv| (format!("variant {:?}: tunables", variant.name), kv));
    for (prefix, (k, v)) in base.chain(extra) {
        if scenario::SIM_TUNABLES.iter().any(|(n, _)| n == k) {
            continue;
        }
        t.set(k, v).map_err(|e| ScenarioError::Invalid {
            key: format!("{prefix}.{k}"),
            reason: e.to_string(),
        })?;
    }
    let mut pool = Pool::new(t);
    if let Some(cpus) = sc.cpus {
        pool.set_cpus(cpus);
    }
    Ok(pool)
}

/// Which vdevs (in id order) are dedicated log devices: they are left out of
/// the used-fraction spread.
pub fn log_vdevs(sc: &Scenario) -> Vec<bool> {
    let mut v: Vec<bool> = sc.vdevs.iter().map(|m| m.log).collect();
    for e in &sc.events {
        if let scenario::Action::AddVdev(m) = &e.action {
            v.push(m.log);
        }
    }
    v
}

/// Run one (policy, block size, variant) on a fresh `metaslab::Pool`.
pub fn run_one(
    sc: &Scenario,
    run: &RunSpec,
    progress: &mut dyn FnMut(f64),
) -> anyhow::Result<RunResult> {
    let pool = build_pool(sc, run)?;
    engine::run(pool, sc, run, progress)
}

/// Write `summary.json`, `timeseries.csv` and the charts into `dir`.
pub fn write_outputs(dir: &Path, sc: &Scenario, results: &[RunResult]) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(dir)?;
    let summary = report::summarize(sc, results, &log_vdevs(sc));
    report::write_summary(dir, &summary)?;
    report::write_csv(dir, &summary)?;
    chart::draw_all(dir, &summary)?;
    Ok(summary)
}
