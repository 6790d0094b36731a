//! What a run returns: samples over time, per-vdev figures, the log path's figures.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct VdevSample {
    pub alloc: u64,
    pub capacity: u64,
    /// Cumulative bytes written to the device (asize).
    pub bytes_done: u64,
    /// Bytes placed and not yet committed (the pool's view).
    pub queue_depth: u64,
    pub fragmentation: Option<u32>,
    /// The normal group's quota and queue target at the sample (psize bytes).
    pub aliquot: u64,
    pub queue_target: u64,
}

impl VdevSample {
    pub fn used_fraction(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.alloc as f64 / self.capacity as f64
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Virtual nanoseconds.
    pub t: u64,
    /// One per vdev present at `t`, in vdev id order.
    pub vdevs: Vec<VdevSample>,
    /// Cumulative data bytes committed (psize).
    pub committed: u64,
    /// Sync writes completed since the previous sample.
    pub log_ops: u64,
    pub log_latency_sum: u64,
    pub log_latency_max: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogResult {
    pub ops: u64,
    /// Nanoseconds.
    pub latency_mean: f64,
    pub latency_p50: u64,
    pub latency_p99: u64,
    pub latency_max: u64,
    pub ops_per_sec: f64,
    pub txg_wait_fallbacks: u64,
    pub metaslab_loads: u64,
    /// Nanoseconds the ZIL stalled on those loads.
    pub load_stall: u64,
    pub blocks: u64,
    pub block_bytes: u64,
    pub tier_log: u64,
    pub tier_embedded_log: u64,
    pub tier_normal: u64,
    /// Per vdev, the log block copies placed there from each tier:
    /// `[log, embedded_log, normal]`.
    pub tier_by_vdev: Vec<[u64; 3]>,
    /// Log blocks placed in a metaslab whose preload (`TxgSync::preloaded`,
    /// loaded on the preload taskq in virtual time) had not yet finished:
    /// the ZIL waited for it (`metaslab_load_wait`).
    pub preload_waits: u64,
    /// Nanoseconds of those waits.
    pub preload_wait: u64,
    /// Metaslabs queued for preload during the run.
    pub preloads: u64,
}

#[derive(Clone, Debug)]
pub struct RunResult {
    pub spec: RunSpec,
    pub vdev_names: Vec<String>,
    pub samples: Vec<Sample>,
    /// Virtual nanoseconds at the end.
    pub end_time: u64,
    pub stop_reason: String,
    /// Data bytes committed (psize).
    pub bytes_committed: u64,
    /// Data bytes the load meant to write over all passes.
    pub bytes_planned: u64,
    pub allocations: u64,
    pub log: Option<LogResult>,
    /// The pool just before and after the load ran.
    pub start_view: PoolView,
    pub final_view: PoolView,
    /// (virtual ns, what happened) for scenario events.
    pub events: Vec<(u64, String)>,
    /// Per vdev, the device I/Os completed (leaf model: over all leaves),
    /// so that the mean I/O size after aggregation can be reported.
    pub device_ios: Vec<u64>,
    /// Per vdev, the I/Os its disks served away from the head (leaf model,
    /// rotational: seeks; 0 otherwise).
    pub device_seeks: Vec<u64>,
    /// Metaslab loads data allocations made (the sync path; log writers'
    /// data included) and the nanoseconds their writes waited for them.
    pub data_metaslab_loads: u64,
    pub data_load_stall: u64,
    /// `[metadata]`: metadata blocks written and their device bytes
    /// (asize, every copy).
    pub metadata_blocks: u64,
    pub metadata_bytes: u64,
    /// `[cpu]`: CPU nanoseconds spent over all CPUs (utilisation is this
    /// over CPUs × `end_time`: near 1, the run was CPU-bound).
    pub cpu_busy: Option<u64>,
    /// `[cpu]`: how many CPUs.
    pub spec_cpus: Option<u32>,
    /// Writes that waited OpenZFS's write-throttle delay (`dmu_tx_delay`,
    /// pipeline only), and the virtual nanoseconds they waited in all.
    pub write_delays: u64,
    pub write_delay_ns: u64,
}

impl RunResult {
    /// `[cpu]`: the CPUs' busy share of the run (near 1: the run was bound
    /// by its CPUs, not its devices).
    pub fn cpu_utilisation(&self) -> Option<f64> {
        let cpus = self.spec_cpus?;
        let busy = self.cpu_busy?;
        (self.end_time > 0).then(|| busy as f64 / (cpus as f64 * self.end_time as f64))
    }
}
