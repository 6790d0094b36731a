//! What a run leaves behind: `summary.json` (per run: totals, per-vdev final
//! state, used-fraction spread, intent-log figures and the sampled time
//! series) and `timeseries.csv` (one row per sample and vdev).

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::engine::{LogResult, RunResult, Sample};
use crate::scenario::{Scenario, policy_name};

#[derive(Debug, Serialize)]
pub struct Summary {
    pub scenario: String,
    pub description: String,
    pub runs: Vec<RunSummary>,
}

#[derive(Debug, Serialize)]
pub struct RunSummary {
    pub label: String,
    pub policy: &'static str,
    pub block_size: u64,
    pub variant: String,
    pub stop_reason: String,
    pub total_time_s: f64,
    /// Data bytes committed (psize), every pass.
    pub bytes_written: u64,
    pub bytes_planned: u64,
    pub mean_throughput_bytes_per_s: f64,
    pub allocations: u64,
    /// Metaslab loads by data allocations (the sync path) and the seconds
    /// their writes waited (`metaslab_load_cost` each; 0 = free).
    pub data_metaslab_loads: u64,
    pub data_load_stall_s: f64,
    /// `[metadata]`: metadata blocks written and their device bytes.
    pub metadata_blocks: u64,
    pub metadata_bytes: u64,
    /// `[cpu]`: the CPUs' busy share of the run (near 1: CPU-bound).
    pub cpu_utilisation: Option<f64>,
    pub vdevs: Vec<VdevSummary>,
    /// Largest and final (max − min) of the data vdevs' used fractions.
    pub max_spread: f64,
    pub max_spread_at_s: f64,
    pub final_spread: f64,
    pub events: Vec<EventSummary>,
    pub log: Option<LogSummary>,
    pub samples: Vec<SampleSummary>,
}

#[derive(Debug, Serialize)]
pub struct VdevSummary {
    pub name: String,
    pub capacity: u64,
    pub final_used_fraction: f64,
    /// Bytes the device wrote (asize, parity included).
    pub bytes_written: u64,
    pub mean_write_bytes_per_s: f64,
    /// Device write I/Os (each leaf's, with the leaf model) and their mean
    /// size after aggregation.
    pub write_ios: u64,
    pub mean_io_bytes: f64,
    /// Leaf model, rotational: writes the disks served away from their
    /// head (a seek and half a revolution each).
    pub seeks: u64,
    pub start_fragmentation_pct: Option<u32>,
    pub final_fragmentation_pct: Option<u32>,
    /// Metaslabs at the end of the run, their shift, and the embedded log
    /// metaslab's index (None: this vdev has none).
    pub metaslab_count: u32,
    pub metaslab_shift: u8,
    pub embedded_log_metaslab: Option<u32>,
    /// Log blocks (copies) placed on this vdev, by tier; None without a
    /// log load.
    pub log_blocks: Option<LogTierCounts>,
}

/// Where a vdev's log blocks came from.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct LogTierCounts {
    pub log: u64,
    pub embedded_log: u64,
    pub normal: u64,
}

#[derive(Debug, Serialize)]
pub struct EventSummary {
    pub t_s: f64,
    pub what: String,
}

#[derive(Debug, Serialize)]
pub struct LogSummary {
    pub sync_writes: u64,
    pub sync_writes_per_s: f64,
    pub latency_mean_us: f64,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    pub latency_max_us: f64,
    pub txg_wait_fallbacks: u64,
    pub metaslab_loads: u64,
    /// Seconds the ZIL stalled on them.
    pub metaslab_load_stall_s: f64,
    /// Metaslabs preloaded during the run (each `metaslab_load_cost` on the
    /// preload taskq), log blocks that waited for one, and the waits' time.
    pub preloads: u64,
    pub preload_waits: u64,
    pub preload_wait_s: f64,
    pub log_blocks: u64,
    pub mean_log_block_bytes: f64,
    pub blocks_from_log_class: u64,
    pub blocks_from_embedded_log: u64,
    pub blocks_from_normal: u64,
    pub start_pool_fragmentation_pct: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct SampleSummary {
    pub t_s: f64,
    /// Per vdev, in summary order (absent vdevs: null).
    pub used_fraction: Vec<Option<f64>>,
    pub write_bytes_per_s: Vec<Option<f64>>,
    /// Per vdev: the normal group's aliquot and queue target, and the bytes
    /// placed and not yet committed (psize).
    pub aliquot: Vec<Option<u64>>,
    pub queue_target: Vec<Option<u64>>,
    pub queue_depth: Vec<Option<u64>>,
    pub spread: f64,
    pub throughput_bytes_per_s: f64,
    pub sync_writes_per_s: f64,
    pub sync_latency_mean_us: Option<f64>,
}

/// Used-fraction spread over the data vdevs present in `s`.
pub fn spread(s: &Sample, is_log: &[bool]) -> f64 {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for (i, v) in s.vdevs.iter().enumerate() {
        if is_log.get(i).copied().unwrap_or(false) || v.capacity == 0 {
            continue;
        }
        let u = v.used_fraction();
        lo = lo.min(u);
        hi = hi.max(u);
    }
    if hi >= lo { hi - lo } else { 0.0 }
}

/// Per sample and vdev: write bytes/s since the previous sample.
pub fn vdev_rates(samples: &[Sample], n: usize) -> Vec<Vec<Option<f64>>> {
    let mut out = Vec::with_capacity(samples.len());
    for (k, s) in samples.iter().enumerate() {
        let mut row = vec![None; n];
        for (i, v) in s.vdevs.iter().enumerate() {
            let rate = if k == 0 {
                0.0
            } else {
                let p = &samples[k - 1];
                let dt = (s.t - p.t) as f64 / 1e9;
                let prev = p.vdevs.get(i).map(|v| v.bytes_done).unwrap_or(0);
                if dt > 0.0 {
                    (v.bytes_done - prev) as f64 / dt
                } else {
                    0.0
                }
            };
            row[i] = Some(rate);
        }
        out.push(row);
    }
    out
}

pub fn summarize(sc: &Scenario, results: &[RunResult], is_log: &[bool]) -> Summary {
    let runs = results.iter().map(|r| run_summary(sc, r, is_log)).collect();
    Summary {
        scenario: sc.name.clone(),
        description: sc.description.clone(),
        runs,
    }
}

fn log_summary(l: &LogResult, r: &RunResult) -> LogSummary {
    LogSummary {
        sync_writes: l.ops,
        sync_writes_per_s: l.ops_per_sec,
        latency_mean_us: l.latency_mean / 1e3,
        latency_p50_us: l.latency_p50 as f64 / 1e3,
        latency_p99_us: l.latency_p99 as f64 / 1e3,
        latency_max_us: l.latency_max as f64 / 1e3,
        txg_wait_fallbacks: l.txg_wait_fallbacks,
        metaslab_loads: l.metaslab_loads,
        metaslab_load_stall_s: l.load_stall as f64 / 1e9,
        preloads: l.preloads,
        preload_waits: l.preload_waits,
        preload_wait_s: l.preload_wait as f64 / 1e9,
        log_blocks: l.blocks,
        mean_log_block_bytes: if l.blocks > 0 {
            l.block_bytes as f64 / l.blocks as f64
        } else {
            0.0
        },
        blocks_from_log_class: l.tier_log,
        blocks_from_embedded_log: l.tier_embedded_log,
        blocks_from_normal: l.tier_normal,
        start_pool_fragmentation_pct: r.start_view.normal_fragmentation,
    }
}

pub fn run_summary(sc: &Scenario, r: &RunResult, is_log: &[bool]) -> RunSummary {
    let n = r.vdev_names.len();
    let secs = r.end_time as f64 / 1e9;
    let last = r.samples.last().expect("at least one sample");
    let rates = vdev_rates(&r.samples, n);
    let mut max_spread = 0.0;
    let mut max_spread_at = 0.0;
    let mut samples = Vec::with_capacity(r.samples.len());
    for (k, s) in r.samples.iter().enumerate() {
        let sp = spread(s, is_log);
        if sp > max_spread {
            max_spread = sp;
            max_spread_at = s.t as f64 / 1e9;
        }
        let (tput, ops_rate) = if k == 0 {
            (0.0, 0.0)
        } else {
            let p = &r.samples[k - 1];
            let dt = (s.t - p.t) as f64 / 1e9;
            if dt > 0.0 {
                (
                    (s.committed - p.committed) as f64 / dt,
                    s.log_ops as f64 / dt,
                )
            } else {
                (0.0, 0.0)
            }
        };
        let mut used = vec![None; n];
        let mut aliquot = vec![None; n];
        let mut queue_target = vec![None; n];
        let mut queue_depth = vec![None; n];
        for (i, v) in s.vdevs.iter().enumerate() {
            used[i] = Some(v.used_fraction());
            aliquot[i] = Some(v.aliquot);
            queue_target[i] = Some(v.queue_target);
            queue_depth[i] = Some(v.queue_depth);
        }
        samples.push(SampleSummary {
            t_s: s.t as f64 / 1e9,
            used_fraction: used,
            write_bytes_per_s: rates[k].clone(),
            aliquot,
            queue_target,
            queue_depth,
            spread: sp,
            throughput_bytes_per_s: tput,
            sync_writes_per_s: ops_rate,
            sync_latency_mean_us: (s.log_ops > 0)
                .then(|| s.log_latency_sum as f64 / s.log_ops as f64 / 1e3),
        });
    }
    let vdevs = (0..n)
        .map(|i| {
            let v = last.vdevs.get(i);
            let bytes = v.map(|v| v.bytes_done).unwrap_or(0);
            VdevSummary {
                name: r.vdev_names[i].clone(),
                capacity: v.map(|v| v.capacity).unwrap_or(0),
                final_used_fraction: v.map(|v| v.used_fraction()).unwrap_or(0.0),
                bytes_written: bytes,
                mean_write_bytes_per_s: if secs > 0.0 { bytes as f64 / secs } else { 0.0 },
                write_ios: r.device_ios.get(i).copied().unwrap_or(0),
                mean_io_bytes: match r.device_ios.get(i) {
                    Some(&n) if n > 0 => bytes as f64 / n as f64,
                    _ => 0.0,
                },
                seeks: r.device_seeks.get(i).copied().unwrap_or(0),
                start_fragmentation_pct: r.start_view.vdevs.get(i).and_then(|v| v.fragmentation),
                final_fragmentation_pct: r.final_view.vdevs.get(i).and_then(|v| v.fragmentation),
                metaslab_count: r.final_view.vdevs.get(i).map_or(0, |v| v.metaslab_count),
                metaslab_shift: r.final_view.vdevs.get(i).map_or(0, |v| v.metaslab_shift),
                embedded_log_metaslab: r
                    .final_view
                    .vdevs
                    .get(i)
                    .and_then(|v| v.embedded_log_metaslab),
                log_blocks: r.log.as_ref().map(|l| {
                    let t = l.tier_by_vdev.get(i).copied().unwrap_or([0; 3]);
                    LogTierCounts {
                        log: t[0],
                        embedded_log: t[1],
                        normal: t[2],
                    }
                }),
            }
        })
        .collect();
    let variant = sc.variants[r.spec.variant].name.clone();
    RunSummary {
        label: r.spec.label.clone(),
        policy: policy_name(r.spec.policy),
        block_size: r.spec.block_size,
        variant,
        stop_reason: r.stop_reason.clone(),
        total_time_s: secs,
        bytes_written: r.bytes_committed,
        bytes_planned: r.bytes_planned,
        mean_throughput_bytes_per_s: if secs > 0.0 {
            r.bytes_committed as f64 / secs
        } else {
            0.0
        },
        allocations: r.allocations,
        data_metaslab_loads: r.data_metaslab_loads,
        data_load_stall_s: r.data_load_stall as f64 / 1e9,
        metadata_blocks: r.metadata_blocks,
        metadata_bytes: r.metadata_bytes,
        cpu_utilisation: r.cpu_utilisation(),
        vdevs,
        max_spread,
        max_spread_at_s: max_spread_at,
        final_spread: spread(last, is_log),
        events: r
            .events
            .iter()
            .map(|(t, w)| EventSummary {
                t_s: *t as f64 / 1e9,
                what: w.clone(),
            })
            .collect(),
        log: r.log.as_ref().map(|l| log_summary(l, r)),
        samples,
    }
}

pub fn write_summary(dir: &Path, s: &Summary) -> anyhow::Result<()> {
    let f = std::fs::File::create(dir.join("summary.json"))?;
    let mut w = std::io::BufWriter::new(f);
    serde_json::to_writer_pretty(&mut w, s)?;
    w.write_all(b"\n")?;
    w.flush()?;
    Ok(())
}

pub fn write_csv(dir: &Path, s: &Summary) -> anyhow::Result<()> {
    let f = std::fs::File::create(dir.join("timeseries.csv"))?;
    let mut w = std::io::BufWriter::new(f);
    writeln!(
        w,
        "run,time_s,vdev,used_fraction,write_bytes_per_s,spread,pool_throughput_bytes_per_s,sync_writes_per_s,sync_latency_mean_us"
    )?;
    for r in &s.runs {
        for smp in &r.samples {
            for (i, v) in r.vdevs.iter().enumerate() {
                let Some(used) = smp.used_fraction[i] else {
                    continue;
                };
                let rate = smp.write_bytes_per_s[i].unwrap_or(0.0);
                let lat = smp
                    .sync_latency_mean_us
                    .map(|l| format!("{l:.3}"))
                    .unwrap_or_default();
                writeln!(
                    w,
                    "{},{:.6},{},{:.6},{:.0},{:.6},{:.0},{:.1},{}",
                    r.label,
                    smp.t_s,
                    v.name,
                    used,
                    rate,
                    smp.spread,
                    smp.throughput_bytes_per_s,
                    smp.sync_writes_per_s,
                    lat
                )?;
            }
        }
    }
    w.flush()?;
    Ok(())
}
