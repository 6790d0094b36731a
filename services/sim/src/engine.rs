//! The discrete-event loop in virtual time (nanoseconds).
//!
//! Writers submit allocation requests to the pool exactly as the allocator
//! service does (`submit`, `take_admitted`, `allocate(ticket, busy(class))`),
//! the placed extents are queued on the simulated devices, and each
//! allocation is committed when every copy's write has completed; an
//! overwrite frees the block's previous extents at that moment, as a
//! copy-on-write pool frees the old block in the txg of the new one. The pool
//! syncs every `zfs_txg_timeout`. Devices are one queue per top-level vdev
//! (`device.rs`) or a vdev queue per leaf (`leaf.rs`); with the pipeline a
//! syncing txg also writes its metadata as ditto blocks, and metaslab loads
//! the pool reports cost time. The simulator only moves time and bytes:
//! where and when data may go is the pool's answer.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use anyhow::{Context, bail};
use metaslab::{
    AllocKind, AllocRequest, Allocation, AllocationId, Error as PoolError, Extent, LogTier,
    Submitted, Ticket, Txg, VdevRole, VdevSpec,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::device::{AGGREGATION_LIMIT, AGGREGATION_LIMIT_NON_ROTATING, Device};
use crate::leaf::{LeafDevice, LeafEvent, QueueLimits};
use crate::pool::{PoolView, SimPool};
use crate::scenario::{
    Action, Amount, DeviceModel, LoadMode, Metadata, RedundantMetadata, RunSpec, Scenario, Trigger,
    VdevModel,
};

/// Samples kept before halving the sampling rate.
const MAX_SAMPLES: usize = 2000;
/// First sampling interval: 1 ms of virtual time.
const FIRST_SAMPLE_INTERVAL: u64 = 1_000_000;
/// `lr_write_t` and `zil_chain_t` sizes: what a log record and block add.
const LOG_RECORD_HEADER: u64 = 192;
const LOG_BLOCK_HEADER: u64 = 256;
/// ELOG-era ZIL block buckets (spec §5.4).
const LOG_BUCKETS: [u64; 5] = [4 << 10, 12 << 10, 36 << 10, 68 << 10, 128 << 10];
/// Log block sizes remembered for the next choice.
const LOG_HISTORY: usize = 16;
/// The stream id of data written by sync writers.
const LOG_STREAM: u32 = u32::MAX;

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
    /// Log blocks placed in a metaslab whose preload (`TxgSync::preloaded`,
    /// loaded on the preload taskq in virtual time) had not yet finished:
    /// the ZIL waited for it (`metaslab_load_wait`).
    pub preload_waits: u64,
    /// Nanoseconds of those waits.
    pub preload_wait: u64,
    /// Metaslabs queued for preload during the run.
    pub preloads: u64,
}

/// `metaslab_preload_pct`: the preload taskq's threads as a percentage of
/// the CPUs (module/zfs/spa.c@be7657e3f2:196, 1915-1917; spec §2.10). A
/// machine fact for the simulator's clock, not a policy decision.
const METASLAB_PRELOAD_PCT: u64 = 50;

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    DevFree(u32),
    DevDone(u32),
    /// Leaf model: (vdev, leaf) completed its I/O (id).
    LeafDone(u32, u32, u32),
    /// Leaf model: (vdev, leaf)'s disk is free to serve its next command.
    LeafFree(u32, u32),
    Sync(u64),
    Tick(u32),
    Scenario(u32),
    LoadStart,
    LogStart,
    ZilResume,
    /// Pipeline: a writer's write-throttle delay has passed.
    ThrottleWake,
    /// A data block's metaslab load is done: queue its writes.
    Loaded(u32),
}

#[derive(Clone, Copy, Debug)]
struct Req {
    block: u32,
    stream: u32,
    size: u64,
}

#[derive(Clone, Copy, Debug)]
struct Op {
    issued: u64,
    stream: u32,
}

#[derive(Debug)]
enum SlotKind {
    Data(Req),
    LogBlock(Vec<Op>),
    Meta(MetaReq),
}

/// Which metadata block a write replaces (copy-on-write: the previous
/// version is freed when the new one commits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum MetaKey {
    /// A stream's (object's) level-1 indirect block number `span`.
    L1(u32, u32),
    /// A stream's level-2 indirect block (it maps 128 GiB at 128K records).
    L2(u32),
    /// The dataset's dnode block.
    Dnode,
    /// The MOS's `i`-th block of the txg (space maps, MOS dnodes, DSL).
    Mos(u32),
}

#[derive(Clone, Copy, Debug)]
struct MetaReq {
    key: MetaKey,
    size: u64,
    copies: u8,
}

/// Bytes of one block pointer (`blkptr_t`).
const BLKPTR_SIZE: u64 = 128;
/// Smallest metadata block written (one 4K sector at ashift 12).
const META_MIN: u64 = 4096;
/// `spa_max_replication`: the MOS's copies.
const MOS_COPIES: u8 = 3;

#[derive(Debug)]
struct Slot {
    id: AllocationId,
    remaining: u32,
    extents: Vec<Extent>,
    kind: SlotKind,
}

#[derive(Debug)]
struct Stream {
    first: u32,
    count: u32,
    cursor: u32,
    pass: u32,
    outstanding: u64,
    finished: bool,
    /// Rate mode: waiting for outstanding bytes to fall before its next write.
    blocked: bool,
}

#[derive(Debug)]
struct DataLoad {
    mode: LoadMode,
    block_size: u64,
    passes: u32,
    dirty_per_stream: u64,
    /// Rate mode: nanoseconds between one stream's writes.
    interval: u64,
    active: bool,
    streams: Vec<Stream>,
    rr: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum Stall {
    None,
    Load,
    Txg(Txg),
}

#[derive(Debug)]
struct LogState {
    size: u64,
    streams: u32,
    first_block: u32,
    blocks: u32,
    end_at: u64,
    load_cost: u64,
    max_block: u64,
    max_inflight: u32,
    dirty_max: u64,
    pending: VecDeque<Op>,
    inflight: u32,
    stall: Stall,
    parked: Option<u32>,
    txg_waiters: Vec<Op>,
    blocked: Vec<u32>,
    history: VecDeque<u64>,
    latencies: Vec<u64>,
    result: LogResult,
    frees: VecDeque<(Txg, Vec<Extent>)>,
    /// Data bytes of sync writes submitted and not yet committed.
    outstanding: u64,
}

struct Sim<'a, P: SimPool> {
    pool: P,
    sc: &'a Scenario,
    spec: &'a RunSpec,
    now: u64,
    seq: u64,
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    devices: Vec<Dev>,
    names: Vec<String>,
    queue_limits: QueueLimits,
    issued: Vec<LeafEvent>,
    data_loads: u64,
    data_load_stall: u64,
    /// Per vdev, its metaslab shift (to name the metaslab of an extent).
    ms_shift: Vec<u8>,
    /// Virtual time at which each queued preload finishes.
    preload_done: HashMap<(metaslab::VdevId, u32), u64>,
    /// When each preload taskq thread is next free.
    preload_threads: Vec<u64>,
    preloads: u64,
    meta_tickets: HashMap<Ticket, MetaReq>,
    meta_live: HashMap<MetaKey, Vec<Extent>>,
    meta_blocks: u64,
    meta_bytes: u64,
    agg_limit: u64,
    agg_limit_non_rot: u64,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<u32>,
    tickets: HashMap<Ticket, Req>,
    blocks: Vec<Extent>,
    block_busy: Vec<bool>,
    copies: usize,
    data: Option<DataLoad>,
    log: Option<LogState>,
    rng: SmallRng,
    sync_gen: u64,
    last_sync: u64,
    fill_events: Vec<u32>,
    commits_since_fill_check: u32,
    samples: Vec<Sample>,
    sample_interval: u64,
    next_sample: u64,
    log_ops_acc: u64,
    log_lat_acc: u64,
    log_max_acc: u64,
    committed: u64,
    allocations: u64,
    pool_full: bool,
    tags: Vec<u32>,
    events: Vec<(u64, String)>,
    pump_wanted: bool,
    /// Data bytes committed into the open txg (OpenZFS's dirty data of
    /// that txg) and the amount that pushes a sync early.
    txg_dirty: u64,
    /// Data bytes submitted and not yet committed (log writers' included).
    inflight: u64,
    /// The load's `dirty_max`, OpenZFS's `zfs_dirty_data_max`.
    dirty_max: u64,
    dirty_sync_bytes: u64,
    /// `allocate = "sync"`: OpenZFS's pipeline. Writes join the open txg as
    /// dirty data (`open_reqs`); a pushed txg becomes the syncing one, whose
    /// blocks are all submitted and allocated at once, and the pool syncs
    /// when the last of them is written. At most one txg syncs at a time.
    alloc_at_sync: bool,
    open_reqs: Vec<Req>,
    open_bytes: u64,
    /// Blocks of the syncing txg not yet written (0: no txg syncing).
    syncing_left: u64,
    push_pending: bool,
    /// Write throttle: when the last delayed write may go (`dp_last_wakeup`),
    /// and whether the next write has served its delay already.
    last_wakeup: u64,
    delay_served: bool,
    delay_waiting: bool,
    dirty_sync_pending: bool,
}

/// OpenZFS's `zfs_dirty_data_sync_percent`: a txg is pushed as soon as its
/// dirty data exceeds this share of `zfs_dirty_data_max` (here the load's
/// `dirty_max`), not only after `zfs_txg_timeout`.
pub const ZFS_DIRTY_DATA_SYNC_PERCENT: u64 = 20;

/// OpenZFS's write throttle (`dmu_tx_delay`): above
/// `zfs_delay_min_dirty_percent` of `zfs_dirty_data_max` each write waits
/// `zfs_delay_scale × (dirty − min) / (max − dirty)` ns, at most
/// `zfs_delay_max_ns`, and the waits of all writers queue one after another.
pub const ZFS_DELAY_MIN_DIRTY_PERCENT: u64 = 60;
pub const ZFS_DELAY_SCALE: u64 = 500_000;
pub const ZFS_DELAY_MAX_NS: u64 = 100_000_000;

/// The delay `dmu_tx_delay` gives a write at `dirty` bytes of dirty data.
pub fn write_delay(dirty: u64, dirty_max: u64) -> u64 {
    let min = dirty_max * ZFS_DELAY_MIN_DIRTY_PERCENT / 100;
    if dirty <= min {
        return 0;
    }
    if dirty >= dirty_max {
        return ZFS_DELAY_MAX_NS;
    }
    let d = ZFS_DELAY_SCALE as u128 * (dirty - min) as u128 / (dirty_max - dirty) as u128;
    (d as u64).min(ZFS_DELAY_MAX_NS)
}

/// A top-level vdev's device model.
#[derive(Debug)]
enum Dev {
    Simple(Device),
    Leaf(LeafDevice),
}

impl Dev {
    /// Queue a write; returns how many pieces complete separately.
    fn enqueue(&mut self, offset: u64, size: u64, tag: u32, sync: bool) -> u32 {
        match self {
            Dev::Simple(d) => {
                d.enqueue(offset, size, tag, sync);
                1
            }
            Dev::Leaf(d) => d.enqueue(offset, size, tag, sync),
        }
    }
    fn ios_done(&self) -> u64 {
        match self {
            Dev::Simple(d) => d.ios_done,
            Dev::Leaf(d) => d.ios_done,
        }
    }
    fn seeks(&self) -> u64 {
        match self {
            Dev::Simple(_) => 0,
            Dev::Leaf(d) => d.seeks,
        }
    }
    fn bytes_done(&self) -> u64 {
        match self {
            Dev::Simple(d) => d.bytes_done,
            Dev::Leaf(d) => d.bytes_done,
        }
    }
    fn set_used_fraction(&mut self, f: f64) {
        match self {
            Dev::Simple(d) => d.used_fraction = f,
            Dev::Leaf(d) => d.used_fraction = f,
        }
    }
}

/// Read a u64 tunable from the scenario's lists (last one wins).
fn tunable_u64<'a>(
    mut list: impl Iterator<Item = &'a (String, String)>,
    name: &str,
) -> anyhow::Result<Option<u64>> {
    let mut out = None;
    for (k, v) in list.by_ref() {
        if k == name {
            out = Some(
                v.trim()
                    .parse::<u64>()
                    .with_context(|| format!("tunables.{k}: {v:?} is not a whole number"))?,
            );
        }
    }
    Ok(out)
}

fn vdev_spec(m: &VdevModel) -> VdevSpec {
    VdevSpec {
        capacity: m.total_capacity(),
        ashift: m.ashift,
        children: m.children,
        parity: m.parity,
        rotational: m.rotational,
        role: if m.log {
            VdevRole::Log
        } else {
            VdevRole::Normal
        },
        metaslab_shift: None,
    }
}

/// Run one (policy, block size, variant) of a scenario on `pool`, which must
/// be empty and configured with the run's tunables. `progress` gets the
/// fraction done now and then.
pub fn run<P: SimPool>(
    pool: P,
    sc: &Scenario,
    spec: &RunSpec,
    progress: &mut dyn FnMut(f64),
) -> anyhow::Result<RunResult> {
    let variant = &sc.variants[spec.variant];
    let mut agg_limit = AGGREGATION_LIMIT;
    let mut agg_limit_non_rot = AGGREGATION_LIMIT_NON_ROTATING;
    for (k, v) in sc.tunables.iter().chain(variant.tunables.iter()) {
        let parse = || units::parse_size(v).with_context(|| format!("tunables.{k}"));
        match k.as_str() {
            "zfs_vdev_aggregation_limit" => agg_limit = parse()?,
            "zfs_vdev_aggregation_limit_non_rotating" => agg_limit_non_rot = parse()?,
            _ => {}
        }
    }
    // The vdev queue's limits: OpenZFS's defaults, or the run's tunables
    // (the max active and dirty percents are also the policy crate's).
    let mut queue_limits = QueueLimits::default();
    {
        let all = || sc.tunables.iter().chain(variant.tunables.iter());
        let t = metaslab::Tunables::default();
        let u32_of = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        queue_limits.async_min_active =
            u32_of(tunable_u64(all(), "zfs_vdev_async_write_min_active")?.unwrap_or(2));
        queue_limits.sync_max_active =
            u32_of(tunable_u64(all(), "zfs_vdev_sync_write_max_active")?.unwrap_or(10));
        queue_limits.async_max_active = u32_of(
            tunable_u64(all(), "zfs_vdev_async_write_max_active")?
                .unwrap_or(t.zfs_vdev_async_write_max_active),
        );
        queue_limits.min_dirty_percent =
            tunable_u64(all(), "zfs_vdev_async_write_active_min_dirty_percent")?
                .unwrap_or(t.zfs_vdev_async_write_active_min_dirty_percent);
        queue_limits.max_dirty_percent =
            tunable_u64(all(), "zfs_vdev_async_write_active_max_dirty_percent")?
                .unwrap_or(t.zfs_vdev_async_write_active_max_dirty_percent);
    }
    let mut sim = Sim {
        pool,
        sc,
        spec,
        now: 0,
        seq: 0,
        heap: BinaryHeap::new(),
        devices: Vec::new(),
        names: Vec::new(),
        queue_limits,
        issued: Vec::new(),
        data_loads: 0,
        data_load_stall: 0,
        ms_shift: Vec::new(),
        preload_done: HashMap::new(),
        preload_threads: vec![
            0;
            (sc.cpus.unwrap_or(1) * METASLAB_PRELOAD_PCT / 100).max(1) as usize
        ],
        preloads: 0,
        meta_tickets: HashMap::new(),
        meta_live: HashMap::new(),
        meta_blocks: 0,
        meta_bytes: 0,
        agg_limit,
        agg_limit_non_rot,
        slots: Vec::new(),
        free_slots: Vec::new(),
        tickets: HashMap::new(),
        blocks: Vec::new(),
        block_busy: Vec::new(),
        copies: sc.copies as usize,
        data: None,
        log: None,
        rng: SmallRng::seed_from_u64(sc.seed),
        sync_gen: 0,
        last_sync: 0,
        fill_events: Vec::new(),
        commits_since_fill_check: 0,
        samples: Vec::new(),
        sample_interval: FIRST_SAMPLE_INTERVAL,
        next_sample: 0,
        log_ops_acc: 0,
        log_lat_acc: 0,
        log_max_acc: 0,
        committed: 0,
        allocations: 0,
        pool_full: false,
        tags: Vec::new(),
        events: Vec::new(),
        pump_wanted: false,
        txg_dirty: 0,
        inflight: 0,
        alloc_at_sync: sc.load.as_ref().is_some_and(|l| l.allocate_at_sync),
        open_reqs: Vec::new(),
        open_bytes: 0,
        syncing_left: 0,
        push_pending: false,
        last_wakeup: 0,
        delay_served: false,
        delay_waiting: false,
        dirty_max: sc.load.as_ref().map(|l| l.dirty_max).unwrap_or(4 << 30),
        dirty_sync_bytes: sc.load.as_ref().map(|l| l.dirty_max).unwrap_or(4 << 30)
            * ZFS_DIRTY_DATA_SYNC_PERCENT
            / 100,
        dirty_sync_pending: false,
    };
    sim.setup()?;
    sim.main_loop(progress)
}

impl<P: SimPool> Sim<'_, P> {
    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, ev)));
    }

    fn add_device(&mut self, m: &VdevModel) -> anyhow::Result<()> {
        let id = self
            .pool
            .add_vdev(vdev_spec(m))
            .with_context(|| format!("adding vdev {:?}", m.name))?;
        if id as usize != self.devices.len() {
            bail!(
                "the pool gave vdev {:?} id {id}, expected {}",
                m.name,
                self.devices.len()
            );
        }
        let limit = if m.rotational {
            self.agg_limit
        } else {
            self.agg_limit_non_rot
        };
        self.devices.push(match self.sc.device_model {
            DeviceModel::Simple => Dev::Simple(Device::new(m, limit)),
            DeviceModel::Leaf => Dev::Leaf(LeafDevice::new(m, limit)),
        });
        self.names.push(m.name.clone());
        Ok(())
    }

    fn setup(&mut self) -> anyhow::Result<()> {
        let sc = self.sc;
        for m in &sc.vdevs {
            self.add_device(m)?;
        }
        // Pool creation: the vdevs' metaslabs become usable once this syncs.
        self.pool.sync(self.now / 1_000_000);
        if let Some(p) = &sc.prefill {
            self.prefill(p.fill, &p.holes.clone(), &p.weights.clone())?;
        }
        let view = self.pool.view();
        self.ms_shift = view.vdevs.iter().map(|v| v.metaslab_shift).collect();
        // Data capacity in psize terms: parity is not data.
        let data_capacity: f64 = sc
            .vdevs
            .iter()
            .filter(|m| !m.log)
            .map(|m| m.total_capacity() as f64 * (m.children - m.parity) as f64 / m.children as f64)
            .sum();
        let copies = self.copies;
        let mut total_blocks: u64 = 0;
        if let Some(l) = &sc.load {
            let bs = self.spec.block_size;
            let per_pass = match l.amount {
                Amount::Bytes(b) => b,
                Amount::Fill(f) => {
                    let used = view.normal_alloc as f64 / view.normal_space.max(1) as f64;
                    ((f - used).max(0.0) * data_capacity / copies as f64) as u64
                }
            };
            let n = (per_pass / bs).max(1);
            if n > u32::MAX as u64 / 2 {
                bail!("load: {n} blocks per pass is more than the simulator indexes");
            }
            let streams = l.streams as u64;
            let mut out = Vec::new();
            let mut first = 0u64;
            for s in 0..streams {
                let count = n / streams + u64::from(s < n % streams);
                out.push(Stream {
                    first: first as u32,
                    count: count as u32,
                    cursor: first as u32,
                    pass: 0,
                    outstanding: 0,
                    finished: count == 0,
                    blocked: false,
                });
                first += count;
            }
            total_blocks = n;
            let interval = if l.mode == LoadMode::Rate {
                ((bs as f64 * streams as f64 / l.rate) * 1e9).max(1.0) as u64
            } else {
                0
            };
            self.data = Some(DataLoad {
                mode: l.mode,
                block_size: bs,
                passes: l.passes,
                dirty_per_stream: (l.dirty_max / streams).max(bs),
                interval,
                active: false,
                streams: out,
                rr: 0,
            });
            self.push(l.start, Ev::LoadStart);
        }
        if let Some(l) = &sc.log {
            let blocks = (l.dataset / l.size).max(1);
            if total_blocks + blocks > u32::MAX as u64 / 2 {
                bail!("log.dataset: too many records for the simulator to index");
            }
            self.log = Some(LogState {
                size: l.size,
                streams: l.streams,
                first_block: total_blocks as u32,
                blocks: blocks as u32,
                end_at: l.start + l.duration,
                load_cost: l.metaslab_load_cost,
                max_block: l.max_block,
                max_inflight: l.max_inflight,
                dirty_max: sc.load.as_ref().map(|l| l.dirty_max).unwrap_or(4 << 30),
                pending: VecDeque::new(),
                inflight: 0,
                stall: Stall::None,
                parked: None,
                txg_waiters: Vec::new(),
                blocked: Vec::new(),
                history: VecDeque::new(),
                latencies: Vec::new(),
                result: LogResult::default(),
                frees: VecDeque::new(),
                outstanding: 0,
            });
            total_blocks += blocks;
            self.push(l.start, Ev::LogStart);
        }
        let empty = Extent {
            vdev: 0,
            offset: 0,
            size: 0,
        };
        self.blocks = vec![empty; total_blocks as usize * copies];
        self.block_busy = vec![false; total_blocks as usize];
        for (i, e) in sc.events.iter().enumerate() {
            match e.trigger {
                Trigger::Time(t) => self.push(t, Ev::Scenario(i as u32)),
                Trigger::Fill(_) => self.fill_events.push(i as u32),
            }
        }
        self.sync_gen += 1;
        let g = self.sync_gen;
        self.push(sc.txg_timeout, Ev::Sync(g));
        Ok(())
    }

    /// Lay out a fragmented pool: in every metaslab the data path may use,
    /// allocated runs alternate with free holes of the given sizes so that
    /// `fill` of the space is used. The embedded log metaslab, which data
    /// never uses, is left as the pool reports it.
    fn prefill(&mut self, fill: f64, holes: &[u64], weights: &[u32]) -> anyhow::Result<()> {
        let view = self.pool.view();
        let total_w: u64 = weights.iter().map(|&w| w as u64).sum();
        let mean_hole = holes
            .iter()
            .zip(weights)
            .map(|(&h, &w)| h as f64 * w as f64)
            .sum::<f64>()
            / total_w as f64;
        let mean_run = mean_hole * fill / (1.0 - fill);
        let mut batch = Vec::with_capacity(4096);
        for (i, v) in view.vdevs.iter().enumerate() {
            let m = self.model_of(i);
            if m.log {
                continue;
            }
            let align = 1u64 << m.ashift;
            let ms_size = 1u64 << v.metaslab_shift;
            for ms in 0..v.metaslab_count {
                if Some(ms) == v.embedded_log_metaslab {
                    continue;
                }
                let mut off = ms as u64 * ms_size;
                let end = off + ms_size;
                loop {
                    let r = self.rng.random_range(0.5..1.5) * mean_run;
                    let run = ((r as u64).div_ceil(align) * align).max(align);
                    if off + run > end {
                        break;
                    }
                    batch.push(Extent {
                        vdev: v.id,
                        offset: off,
                        size: run,
                    });
                    let mut pick = self.rng.random_range(0..total_w);
                    let mut k = 0;
                    while pick >= weights[k] as u64 {
                        pick -= weights[k] as u64;
                        k += 1;
                    }
                    let hole = holes[k];
                    off += run + hole.div_ceil(align) * align;
                    if batch.len() == batch.capacity() {
                        self.pool.claim(&batch).context("prefill claim")?;
                        batch.clear();
                    }
                }
            }
        }
        if !batch.is_empty() {
            self.pool.claim(&batch).context("prefill claim")?;
        }
        for _ in 0..=metaslab::TXG_DEFER_SIZE {
            self.pool.sync(self.now / 1_000_000);
        }
        Ok(())
    }

    fn model_of(&self, i: usize) -> VdevModel {
        let sc = self.sc;
        if i < sc.vdevs.len() {
            return sc.vdevs[i].clone();
        }
        let mut k = sc.vdevs.len();
        for e in &sc.events {
            if let Action::AddVdev(m) = &e.action {
                if k == i {
                    return m.clone();
                }
                k += 1;
            }
        }
        panic!("no model for vdev {i}")
    }

    fn main_loop(mut self, progress: &mut dyn FnMut(f64)) -> anyhow::Result<RunResult> {
        let start_view = self.pool.view();
        let planned = self
            .data
            .as_ref()
            .map(|d| {
                let blocks: u64 = d.streams.iter().map(|s| s.count as u64).sum();
                blocks * d.block_size * d.passes as u64
            })
            .unwrap_or(0);
        self.take_sample(0);
        self.next_sample = self.sample_interval;
        let mut steps: u64 = 0;
        let stop_reason;
        loop {
            let Some(Reverse((t, _, ev))) = self.heap.pop() else {
                stop_reason = "stalled: nothing left to happen".to_string();
                break;
            };
            if t > self.sc.max_time {
                self.sample_until(self.sc.max_time);
                self.now = self.sc.max_time;
                stop_reason = "max_time reached".to_string();
                break;
            }
            self.sample_until(t);
            self.now = t;
            self.handle(ev)?;
            if self.pump_wanted {
                self.pump_wanted = false;
                self.pump()?;
            }
            if self.finished() {
                stop_reason = if self.pool_full {
                    "pool full".to_string()
                } else {
                    "done".to_string()
                };
                break;
            }
            steps += 1;
            if steps.is_multiple_of(8192) {
                progress(self.fraction_done(planned));
            }
        }
        progress(1.0);
        let end = self.now;
        self.take_sample(end);
        let final_view = self.pool.view();
        let log = self.log.take().map(|mut l| {
            let r = &mut l.result;
            r.preloads = self.preloads;
            l.latencies.sort_unstable();
            let n = l.latencies.len();
            r.ops = n as u64;
            if n > 0 {
                r.latency_mean = l.latencies.iter().sum::<u64>() as f64 / n as f64;
                r.latency_p50 = l.latencies[n / 2];
                r.latency_p99 = l.latencies[(n * 99 / 100).min(n - 1)];
                r.latency_max = l.latencies[n - 1];
            }
            let span = l
                .end_at
                .min(end)
                .saturating_sub(self.sc.log.as_ref().unwrap().start);
            r.ops_per_sec = if span > 0 {
                n as f64 / (span as f64 / 1e9)
            } else {
                0.0
            };
            l.result
        });
        let device_ios = self.devices.iter().map(Dev::ios_done).collect();
        let device_seeks = self.devices.iter().map(Dev::seeks).collect();
        Ok(RunResult {
            device_ios,
            device_seeks,
            data_metaslab_loads: self.data_loads,
            data_load_stall: self.data_load_stall,
            metadata_blocks: self.meta_blocks,
            metadata_bytes: self.meta_bytes,
            spec: self.spec.clone(),
            vdev_names: self.names,
            samples: self.samples,
            end_time: end,
            stop_reason,
            bytes_committed: self.committed,
            bytes_planned: planned,
            allocations: self.allocations,
            log,
            start_view,
            final_view,
            events: self.events,
        })
    }

    fn fraction_done(&self, planned: u64) -> f64 {
        let mut f: f64 = 0.0;
        if planned > 0 {
            f = self.committed as f64 / planned as f64;
        }
        if let (Some(_), Some(cfg)) = (&self.log, &self.sc.log) {
            let lf = self.now.saturating_sub(cfg.start) as f64 / cfg.duration as f64;
            f = if planned > 0 { f.min(lf) } else { lf };
        }
        f.clamp(0.0, 1.0)
    }

    fn finished(&self) -> bool {
        let data_done = self
            .data
            .as_ref()
            .is_none_or(|d| d.streams.iter().all(|s| s.finished && s.outstanding == 0));
        let log_done = self.log.as_ref().is_none_or(|l| {
            self.now >= l.end_at
                && l.pending.is_empty()
                && l.inflight == 0
                && l.txg_waiters.is_empty()
                && l.outstanding == 0
        });
        data_done && log_done
    }

    fn handle(&mut self, ev: Ev) -> anyhow::Result<()> {
        match ev {
            Ev::LeafFree(v, leaf) => {
                let mut out = std::mem::take(&mut self.issued);
                if let Dev::Leaf(d) = &mut self.devices[v as usize] {
                    d.wake(leaf, self.now, &mut out);
                }
                self.schedule_leaf(v, &mut out);
                self.issued = out;
            }
            Ev::DevFree(v) => {
                if let Dev::Simple(d) = &mut self.devices[v as usize] {
                    d.set_free();
                }
                self.kick(v);
            }
            Ev::DevDone(_) | Ev::LeafDone(..) => {
                let mut tags = std::mem::take(&mut self.tags);
                match (ev, &mut self.devices) {
                    (Ev::DevDone(v), devs) => {
                        if let Dev::Simple(d) = &mut devs[v as usize] {
                            d.complete(&mut tags);
                        }
                    }
                    (Ev::LeafDone(v, leaf, io), devs) => {
                        if let Dev::Leaf(d) = &mut devs[v as usize] {
                            d.complete(leaf, io, &mut tags);
                        }
                    }
                    _ => unreachable!(),
                }
                if let Ev::LeafDone(v, ..) = ev {
                    // A slot of the leaf's queue is free: issue more.
                    self.kick(v);
                }
                for &tag in &tags {
                    let slot = self.slots[tag as usize].as_mut().expect("live slot");
                    slot.remaining -= 1;
                    if slot.remaining == 0 {
                        self.finish_slot(tag)?;
                    }
                }
                tags.clear();
                self.tags = tags;
                self.drain_admitted()?;
            }
            Ev::Sync(generation) => {
                if generation == self.sync_gen {
                    if self.alloc_at_sync {
                        // zfs_txg_timeout: push whatever the open txg holds.
                        self.push_txg()?;
                    } else {
                        self.sync()?;
                    }
                }
            }
            Ev::Tick(s) => self.tick(s)?,
            Ev::Scenario(i) => self.fire(i)?,
            Ev::LoadStart => {
                if let Some(d) = &mut self.data {
                    d.active = true;
                }
                self.start_streams()?;
            }
            Ev::LogStart => {
                let n = self.log.as_ref().map(|l| l.streams).unwrap_or(0);
                for s in 0..n {
                    self.log_issue(s)?;
                }
            }
            Ev::Loaded(tag) => self.enqueue_slot(tag, false),
            Ev::ThrottleWake => {
                self.delay_waiting = false;
                self.delay_served = true;
                self.pump_wanted = true;
            }
            Ev::ZilResume => {
                let l = self.log.as_mut().expect("log load");
                l.stall = Stall::None;
                if let Some(tag) = l.parked.take() {
                    self.enqueue_slot(tag, true);
                }
                self.zil_try_issue()?;
            }
        }
        Ok(())
    }

    fn start_streams(&mut self) -> anyhow::Result<()> {
        let Some(d) = &mut self.data else {
            return Ok(());
        };
        if d.mode == LoadMode::Rate {
            let n = d.streams.len();
            let interval = d.interval;
            for s in 0..n {
                // Stagger the streams evenly over one interval.
                let at = self.now + interval * s as u64 / n as u64;
                self.push(at, Ev::Tick(s as u32));
            }
            Ok(())
        } else {
            self.pump()
        }
    }

    /// Push the events a leaf device asked for (`out` is left empty).
    fn schedule_leaf(&mut self, v: u32, out: &mut Vec<LeafEvent>) {
        for e in out.drain(..) {
            let ev = match e.io {
                Some(io) => Ev::LeafDone(v, e.leaf, io),
                None => Ev::LeafFree(v, e.leaf),
            };
            self.push(e.at, ev);
        }
    }

    fn kick(&mut self, v: u32) {
        let dirty = self.inflight + self.txg_dirty;
        let limits = self.queue_limits;
        let dirty_max = self.dirty_max;
        match &mut self.devices[v as usize] {
            Dev::Simple(d) => {
                if let Some(iss) = d.issue(self.now) {
                    self.push(iss.free_at, Ev::DevFree(v));
                    self.push(iss.done_at, Ev::DevDone(v));
                }
            }
            Dev::Leaf(d) => {
                let mut out = std::mem::take(&mut self.issued);
                let async_active = limits.async_active(dirty, dirty_max);
                d.issue(self.now, async_active, limits.sync_max_active, &mut out);
                self.schedule_leaf(v, &mut out);
                self.issued = out;
            }
        }
    }

    fn new_slot(&mut self, slot: Slot) -> u32 {
        if let Some(i) = self.free_slots.pop() {
            self.slots[i as usize] = Some(slot);
            i
        } else {
            self.slots.push(Some(slot));
            (self.slots.len() - 1) as u32
        }
    }

    fn enqueue_slot(&mut self, tag: u32, sync: bool) {
        let slot = self.slots[tag as usize].as_ref().expect("live slot");
        let n = slot.extents.len();
        // Count every piece before any can complete (a kick may finish
        // nothing synchronously, but keep the count whole regardless).
        let mut pieces = 0;
        for i in 0..n {
            let e = self.slots[tag as usize].as_ref().unwrap().extents[i];
            pieces += self.devices[e.vdev as usize].enqueue(e.offset, e.size, tag, sync);
        }
        self.slots[tag as usize].as_mut().unwrap().remaining = pieces;
        for i in 0..n {
            let e = self.slots[tag as usize].as_ref().unwrap().extents[i];
            self.kick(e.vdev);
        }
    }

    /// A data block whose allocation loaded `loads` metaslabs: its writes
    /// wait for the loads (`metaslab_load_cost` each) before they queue.
    fn place_data(&mut self, a: Allocation, req: Req) {
        let loads = a.metaslab_loads as u64;
        self.data_loads += loads;
        let stall = loads * self.sc.metaslab_load_cost;
        if stall == 0 {
            self.place(a, SlotKind::Data(req), false);
            return;
        }
        self.data_load_stall += stall;
        let tag = self.new_slot(Slot {
            id: a.id,
            remaining: a.extents.len() as u32,
            extents: a.extents,
            kind: SlotKind::Data(req),
        });
        let at = self.now + stall;
        self.push(at, Ev::Loaded(tag));
    }

    fn place(&mut self, a: Allocation, kind: SlotKind, sync: bool) -> u32 {
        let tag = self.new_slot(Slot {
            id: a.id,
            remaining: a.extents.len() as u32,
            extents: a.extents,
            kind,
        });
        if !sync || self.log.as_ref().is_none_or(|l| l.stall != Stall::Load) {
            self.enqueue_slot(tag, sync);
        }
        tag
    }

    fn submit_data(&mut self, req: Req) -> anyhow::Result<()> {
        self.block_busy[req.block as usize] = true;
        self.inflight += req.size;
        if req.stream == LOG_STREAM {
            self.log.as_mut().unwrap().outstanding += req.size;
        } else {
            let d = self.data.as_mut().unwrap();
            d.streams[req.stream as usize].outstanding += req.size;
            if self.alloc_at_sync {
                // Dirty data of the open txg; allocated when the txg syncs.
                self.open_bytes += req.size;
                self.open_reqs.push(req);
                if self.open_bytes >= self.dirty_sync_bytes {
                    self.push_txg()?;
                }
                return Ok(());
            }
        }
        self.issue_data(req)
    }

    /// Hand a written block to the pool: submit, and allocate once admitted.
    fn issue_data(&mut self, req: Req) -> anyhow::Result<()> {
        self.pool.prefer_allocator(req.stream as usize);
        let r = AllocRequest {
            kind: AllocKind::Data,
            size: req.size,
            copies: self.sc.copies,
        };
        match self.pool.submit(r).context("submit")? {
            Submitted::Ready(t) => self.allocate_data(t, req),
            Submitted::Queued(t) => {
                self.tickets.insert(t, req);
                Ok(())
            }
        }
    }

    fn release_req(&mut self, req: Req) {
        self.block_busy[req.block as usize] = false;
        self.inflight -= req.size;
        if req.stream == LOG_STREAM {
            self.log.as_mut().unwrap().outstanding -= req.size;
        } else {
            let d = self.data.as_mut().unwrap();
            d.streams[req.stream as usize].outstanding -= req.size;
        }
        self.pump_wanted = true;
    }

    /// Busy as the allocator service decides it: the throttle's own proxy,
    /// or OpenZFS's dirty-data rule on the bytes written and not yet
    /// synced (in flight plus committed into the open txg).
    fn busy(&self) -> bool {
        let dirty = self.inflight + self.txg_dirty;
        self.pool.busy_with_dirty(dirty, self.dirty_max)
    }

    fn allocate_data(&mut self, t: Ticket, req: Req) -> anyhow::Result<()> {
        let busy = self.busy();
        match self.pool.allocate(t, busy) {
            Ok(a) => {
                self.place_data(a, req);
                Ok(())
            }
            Err(PoolError::NoSpace { reason, .. }) => {
                self.release_req(req);
                if !self.pool_full {
                    self.pool_full = true;
                    self.events.push((
                        self.now,
                        format!("pool full ({reason:?}): data load stopped"),
                    ));
                }
                if self.alloc_at_sync && req.stream != LOG_STREAM {
                    self.syncing_block_done()?;
                }
                if let Some(d) = &mut self.data {
                    for s in &mut d.streams {
                        s.finished = true;
                    }
                }
                Ok(())
            }
            Err(e) => Err(e).context("allocate"),
        }
    }

    fn drain_admitted(&mut self) -> anyhow::Result<()> {
        loop {
            let admitted = self.pool.take_admitted();
            if admitted.is_empty() {
                return Ok(());
            }
            for t in admitted {
                if let Some(m) = self.meta_tickets.remove(&t) {
                    self.allocate_meta(t, m)?;
                    continue;
                }
                let req = self
                    .tickets
                    .remove(&t)
                    .with_context(|| format!("the pool admitted unknown ticket {t}"))?;
                self.allocate_data(t, req)?;
            }
        }
    }

    fn finish_slot(&mut self, tag: u32) -> anyhow::Result<()> {
        let slot = self.slots[tag as usize].take().expect("live slot");
        self.free_slots.push(tag);
        let txg = self.pool.commit(slot.id).context("commit")?;
        match slot.kind {
            SlotKind::Data(req) => {
                let c = self.copies;
                let b = req.block as usize * c;
                if self.blocks[b].size > 0 {
                    let old: Vec<Extent> = self.blocks[b..b + c].to_vec();
                    self.pool
                        .free(&old)
                        .context("free of an overwritten block")?;
                }
                for (i, e) in slot.extents.iter().enumerate().take(c) {
                    self.blocks[b + i] = *e;
                }
                self.committed += req.size;
                self.allocations += 1;
                self.txg_dirty += req.size;
                if self.alloc_at_sync && req.stream != LOG_STREAM {
                    self.release_req(req);
                    self.syncing_block_done()?;
                } else if self.txg_dirty >= self.dirty_sync_bytes && !self.dirty_sync_pending {
                    // The open txg holds enough dirty data: push it now.
                    self.dirty_sync_pending = true;
                    self.force_sync();
                    self.release_req(req);
                } else {
                    self.release_req(req);
                }
                if req.stream == LOG_STREAM {
                    self.unblock_log_streams()?;
                }
                if !self.fill_events.is_empty() {
                    self.commits_since_fill_check += 1;
                    if self.commits_since_fill_check >= 256 {
                        self.commits_since_fill_check = 0;
                        self.check_fill()?;
                    }
                }
            }
            SlotKind::Meta(m) => {
                if let Some(old) = self.meta_live.remove(&m.key) {
                    self.pool
                        .free(&old)
                        .context("free of a rewritten metadata block")?;
                }
                self.meta_blocks += 1;
                self.meta_bytes += slot.extents.iter().map(|e| e.size).sum::<u64>();
                self.meta_live.insert(m.key, slot.extents);
                self.syncing_block_done()?;
            }
            SlotKind::LogBlock(ops) => {
                let now = self.now;
                let l = self.log.as_mut().unwrap();
                l.inflight -= 1;
                l.frees.push_back((txg, slot.extents));
                let mut streams = Vec::with_capacity(ops.len());
                for op in ops {
                    let lat = now - op.issued;
                    l.latencies.push(lat);
                    self.log_ops_acc += 1;
                    self.log_lat_acc += lat;
                    self.log_max_acc = self.log_max_acc.max(lat);
                    streams.push(op.stream);
                }
                for s in streams {
                    self.log_issue(s)?;
                }
                self.zil_try_issue()?;
            }
        }
        Ok(())
    }

    // --- data writers -------------------------------------------------------

    /// The next block of stream `s`, or None when it must wait or is done.
    fn next_block(&mut self, s: usize) -> Option<Req> {
        let d = self.data.as_mut()?;
        let bs = d.block_size;
        let st = &mut d.streams[s];
        if !d.active || st.finished {
            return None;
        }
        if st.outstanding > 0 && st.outstanding + bs > d.dirty_per_stream {
            return None;
        }
        if self.block_busy[st.cursor as usize] {
            return None;
        }
        let block = st.cursor;
        st.cursor += 1;
        if st.cursor == st.first + st.count {
            st.cursor = st.first;
            st.pass += 1;
            if st.pass == d.passes {
                st.finished = true;
            }
        }
        Some(Req {
            block,
            stream: s as u32,
            size: bs,
        })
    }

    fn pump(&mut self) -> anyhow::Result<()> {
        let Some(d) = &self.data else {
            return Ok(());
        };
        let n = d.streams.len();
        match d.mode {
            LoadMode::Full => {
                // Round-robin so streams interleave as concurrent writers do.
                let mut idle = 0;
                let mut s = d.rr;
                while idle < n {
                    if self.alloc_at_sync && !self.throttle_admits() {
                        break;
                    }
                    match self.next_block(s) {
                        Some(req) => {
                            self.delay_served = false;
                            self.submit_data(req)?;
                            idle = 0;
                        }
                        None => idle += 1,
                    }
                    s = (s + 1) % n;
                }
                self.data.as_mut().unwrap().rr = s;
                if self.alloc_at_sync {
                    self.final_push()?;
                }
            }
            LoadMode::Rate => {
                for s in 0..n {
                    let d = self.data.as_ref().unwrap();
                    if !d.streams[s].blocked {
                        continue;
                    }
                    if let Some(req) = self.next_block(s) {
                        let d = self.data.as_mut().unwrap();
                        d.streams[s].blocked = false;
                        let at = self.now + d.interval;
                        self.push(at, Ev::Tick(s as u32));
                        self.submit_data(req)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Pipeline write throttle: may the next write go now? If dirty data
    /// calls for a delay not yet served, schedule the wake-up and say no.
    fn throttle_admits(&mut self) -> bool {
        if self.delay_waiting {
            return false;
        }
        if self.delay_served {
            return true;
        }
        let delay = write_delay(self.inflight, self.dirty_max);
        if delay == 0 {
            return true;
        }
        let wake = self.now.max(self.last_wakeup) + delay;
        self.last_wakeup = wake;
        self.delay_waiting = true;
        self.push(wake, Ev::ThrottleWake);
        false
    }

    fn tick(&mut self, s: u32) -> anyhow::Result<()> {
        match self.next_block(s as usize) {
            Some(req) => {
                let at = self.now + self.data.as_ref().unwrap().interval;
                self.push(at, Ev::Tick(s));
                self.submit_data(req)
            }
            None => {
                let d = self.data.as_mut().unwrap();
                let st = &mut d.streams[s as usize];
                if !st.finished {
                    st.blocked = true;
                }
                Ok(())
            }
        }
    }

    // --- txg sync and events -------------------------------------------------

    /// The crate treats preloaded metaslabs as loaded at once; OpenZFS loads
    /// them on the preload taskq (`metaslab_load_cost` each, as many at a
    /// time as the taskq has threads), in the order queued.
    fn queue_preloads(&mut self, preloaded: &[(metaslab::VdevId, u32)]) {
        let cost = self.log.as_ref().map(|l| l.load_cost).unwrap_or(0);
        if cost == 0 {
            return;
        }
        for &key in preloaded {
            let (i, &free) = self
                .preload_threads
                .iter()
                .enumerate()
                .min_by_key(|&(_, &t)| t)
                .expect("at least one preload thread");
            let done = free.max(self.now) + cost;
            self.preload_threads[i] = done;
            self.preload_done.insert(key, done);
            self.preloads += 1;
        }
    }

    /// How long an allocation in `extents` must wait for preloads still
    /// running in its metaslabs (`metaslab_load_wait`); 0 if none.
    fn preload_wait(&self, extents: &[Extent]) -> u64 {
        extents
            .iter()
            .filter_map(|e| {
                let shift = *self.ms_shift.get(e.vdev as usize)?;
                let done = *self
                    .preload_done
                    .get(&(e.vdev, (e.offset >> shift) as u32))?;
                Some(done.saturating_sub(self.now))
            })
            .max()
            .unwrap_or(0)
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        let ts = self.pool.sync(self.now / 1_000_000);
        let synced = ts.txg;
        self.queue_preloads(&ts.preloaded);
        self.last_sync = self.now;
        self.txg_dirty = 0;
        self.dirty_sync_pending = false;
        let view = self.pool.view();
        for v in &view.vdevs {
            if let Some(d) = self.devices.get_mut(v.id as usize) {
                d.set_used_fraction(v.alloc as f64 / v.capacity.max(1) as f64);
            }
        }
        if let Some(l) = &mut self.log {
            while l.frees.front().is_some_and(|(t, _)| *t <= synced) {
                let (_, ext) = l.frees.pop_front().unwrap();
                self.pool.free(&ext).context("free of a log block")?;
            }
            if matches!(l.stall, Stall::Txg(until) if synced >= until) {
                l.stall = Stall::None;
                let now = self.now;
                let waiters = std::mem::take(&mut l.txg_waiters);
                for op in &waiters {
                    let lat = now - op.issued;
                    l.latencies.push(lat);
                    self.log_ops_acc += 1;
                    self.log_lat_acc += lat;
                    self.log_max_acc = self.log_max_acc.max(lat);
                }
                for op in waiters {
                    self.log_issue(op.stream)?;
                }
                self.zil_try_issue()?;
            }
        }
        // Still waiting for a txg (perhaps anew after the waiters retried):
        // keep syncing back to back.
        let forced = self
            .log
            .as_ref()
            .is_some_and(|l| matches!(l.stall, Stall::Txg(until) if until > synced));
        self.sync_gen += 1;
        let g = self.sync_gen;
        let next = if forced {
            self.now + self.sc.txg_sync_time
        } else {
            self.now + self.sc.txg_timeout
        };
        self.push(next, Ev::Sync(g));
        self.check_fill()?;
        self.drain_admitted()?;
        self.pump_wanted = true;
        Ok(())
    }

    /// Pipeline: quiesce the open txg and start syncing it, or remember the
    /// push while a txg is still syncing (one syncing txg at a time).
    fn push_txg(&mut self) -> anyhow::Result<()> {
        if self.syncing_left > 0 {
            self.push_pending = true;
            return Ok(());
        }
        self.push_pending = false;
        if self.open_reqs.is_empty() {
            // Nothing dirty: an empty txg syncs at once.
            return self.sync();
        }
        let reqs = std::mem::take(&mut self.open_reqs);
        self.open_bytes = 0;
        let metas = match &self.sc.metadata {
            Some(md) => self.txg_metadata(md, &reqs),
            None => Vec::new(),
        };
        self.syncing_left = (reqs.len() + metas.len()) as u64;
        for req in reqs {
            self.issue_data(req)?;
        }
        // Parents after their children: the throttle admits them behind
        // the txg's data, as a dbuf's write follows its children's.
        for m in metas {
            self.issue_meta(m)?;
        }
        Ok(())
    }

    /// The metadata a txg holding `reqs` writes (`dbuf_sync` of the dirty
    /// indirect blocks, the dnode block, then the MOS), with the copies
    /// `dmu_write_policy` gives them: one more than the data for
    /// `redundant_metadata = all` (level-1 blocks of file data excepted
    /// with `most`), three for the MOS.
    fn txg_metadata(&self, md: &Metadata, reqs: &[Req]) -> Vec<MetaReq> {
        let Some(d) = &self.data else {
            return Vec::new();
        };
        let per_l1 = (md.indirect_block / BLKPTR_SIZE).max(1) as u32;
        let data_copies = self.sc.copies;
        let extra = |level1: bool| match md.redundant {
            RedundantMetadata::All => 1,
            RedundantMetadata::Most if !level1 => 1,
            _ => 0,
        };
        let copies = |level1: bool| (data_copies + extra(level1)).min(3);
        // (stream, span) → the highest block index in the span written.
        let mut spans: Vec<(u32, u32, u32)> = Vec::new();
        for r in reqs {
            let st = &d.streams[r.stream as usize];
            let i = r.block - st.first;
            let span = i / per_l1;
            let last = i % per_l1;
            match spans
                .iter_mut()
                .find(|(s, sp, _)| *s == r.stream && *sp == span)
            {
                Some(e) => e.2 = e.2.max(last),
                None => spans.push((r.stream, span, last)),
            }
        }
        let mut out = Vec::new();
        let mut streams: Vec<u32> = Vec::new();
        for &(s, span, last) in &spans {
            // A level-1 block holds the pointers written so far in its
            // span (sequential writers: up to the last one); the rest are
            // holes that compress away.
            let filled = (last as u64 + 1) * BLKPTR_SIZE;
            let size = ((filled as f64 / md.compression) as u64)
                .div_ceil(META_MIN)
                .max(1)
                * META_MIN;
            out.push(MetaReq {
                key: MetaKey::L1(s, span),
                size: size.min(md.indirect_block),
                copies: copies(true),
            });
            if !streams.contains(&s) {
                streams.push(s);
            }
        }
        for s in streams {
            out.push(MetaReq {
                key: MetaKey::L2(s),
                size: META_MIN,
                copies: copies(false),
            });
        }
        if !out.is_empty() {
            out.push(MetaReq {
                key: MetaKey::Dnode,
                size: META_MIN,
                copies: copies(false),
            });
        }
        for i in 0..md.mos_blocks {
            out.push(MetaReq {
                key: MetaKey::Mos(i),
                size: META_MIN,
                copies: MOS_COPIES,
            });
        }
        out
    }

    fn issue_meta(&mut self, m: MetaReq) -> anyhow::Result<()> {
        let r = AllocRequest {
            kind: AllocKind::Data,
            size: m.size,
            copies: m.copies,
        };
        match self.pool.submit(r).context("metadata submit")? {
            Submitted::Ready(t) => self.allocate_meta(t, m),
            Submitted::Queued(t) => {
                self.meta_tickets.insert(t, m);
                Ok(())
            }
        }
    }

    fn allocate_meta(&mut self, t: Ticket, m: MetaReq) -> anyhow::Result<()> {
        let busy = self.busy();
        match self.pool.allocate(t, busy) {
            Ok(a) => {
                let loads = a.metaslab_loads as u64;
                self.data_loads += loads;
                let stall = loads * self.sc.metaslab_load_cost;
                self.data_load_stall += stall;
                let tag = self.new_slot(Slot {
                    id: a.id,
                    remaining: a.extents.len() as u32,
                    extents: a.extents,
                    kind: SlotKind::Meta(m),
                });
                if stall == 0 {
                    self.enqueue_slot(tag, false);
                } else {
                    let at = self.now + stall;
                    self.push(at, Ev::Loaded(tag));
                }
                Ok(())
            }
            Err(PoolError::NoSpace { reason, .. }) => {
                if !self.pool_full {
                    self.pool_full = true;
                    self.events.push((
                        self.now,
                        format!("pool full ({reason:?}) writing metadata: data load stopped"),
                    ));
                }
                if let Some(d) = &mut self.data {
                    for s in &mut d.streams {
                        s.finished = true;
                    }
                }
                self.syncing_block_done()
            }
            Err(e) => Err(e).context("metadata allocate"),
        }
    }

    /// Pipeline: once every writer has written its last block, the open
    /// txg is pushed at once rather than at `zfs_txg_timeout` (the
    /// writers end with a sync, as the calibration driver's run does), so
    /// a run's time is not a partial txg's wait.
    fn final_push(&mut self) -> anyhow::Result<()> {
        let done = self
            .data
            .as_ref()
            .is_some_and(|d| d.streams.iter().all(|s| s.finished));
        if done && !self.open_reqs.is_empty() {
            self.push_txg()?;
        }
        Ok(())
    }

    /// Pipeline: one block of the syncing txg is written (or failed); the
    /// last one completes the sync, and a push that waited starts the next.
    fn syncing_block_done(&mut self) -> anyhow::Result<()> {
        self.syncing_left -= 1;
        if self.syncing_left > 0 {
            return Ok(());
        }
        self.sync()?;
        if self.push_pending || self.open_bytes >= self.dirty_sync_bytes {
            self.push_txg()?;
        }
        Ok(())
    }

    /// Someone waits for a txg: sync as soon as a sync can run, as
    /// `txg_wait_synced` kicks the sync thread.
    fn force_sync(&mut self) {
        self.sync_gen += 1;
        let g = self.sync_gen;
        let at = self.now.max(self.last_sync + self.sc.txg_sync_time);
        self.push(at, Ev::Sync(g));
    }

    fn check_fill(&mut self) -> anyhow::Result<()> {
        if self.fill_events.is_empty() {
            return Ok(());
        }
        let v = self.pool.view();
        let fill = v.normal_alloc as f64 / v.normal_space.max(1) as f64;
        let sc = self.sc;
        let due: Vec<u32> = self
            .fill_events
            .iter()
            .copied()
            .filter(|&i| matches!(sc.events[i as usize].trigger, Trigger::Fill(f) if fill >= f))
            .collect();
        self.fill_events.retain(|i| !due.contains(i));
        for i in due {
            self.fire(i)?;
        }
        Ok(())
    }

    fn fire(&mut self, i: u32) -> anyhow::Result<()> {
        let sc = self.sc;
        let e = &sc.events[i as usize];
        let what = match &e.action {
            Action::AddVdev(m) => {
                self.add_device(m)?;
                format!("add_vdev {}", m.name)
            }
            Action::StartLoad => {
                if let Some(d) = &mut self.data {
                    d.active = true;
                    for s in &mut d.streams {
                        s.blocked = false;
                    }
                }
                self.start_streams()?;
                "start_load".to_string()
            }
            Action::StopLoad => {
                if let Some(d) = &mut self.data {
                    d.active = false;
                }
                "stop_load".to_string()
            }
            Action::SetTunable(k, v) => {
                match k.as_str() {
                    "zfs_vdev_aggregation_limit" => {
                        self.agg_limit = units::parse_size(v).context("set_tunable value")?
                    }
                    "zfs_vdev_aggregation_limit_non_rotating" => {
                        self.agg_limit_non_rot =
                            units::parse_size(v).context("set_tunable value")?
                    }
                    "zfs_vdev_async_write_min_active" | "zfs_vdev_sync_write_max_active" => {
                        let n =
                            tunable_u64(std::iter::once(&(k.clone(), v.clone())), k)?.unwrap_or(0);
                        let n = u32::try_from(n).unwrap_or(u32::MAX);
                        if k == "zfs_vdev_async_write_min_active" {
                            self.queue_limits.async_min_active = n;
                        } else {
                            self.queue_limits.sync_max_active = n;
                        }
                    }
                    _ => {
                        self.pool
                            .set_tunable(k, v)
                            .with_context(|| format!("event[{i}]: set_tunable {k}"))?;
                        // The vdev queue reads these policy tunables too.
                        let parsed = || tunable_u64(std::iter::once(&(k.clone(), v.clone())), k);
                        match k.as_str() {
                            "zfs_vdev_async_write_max_active" => {
                                self.queue_limits.async_max_active =
                                    u32::try_from(parsed()?.unwrap_or(10)).unwrap_or(u32::MAX)
                            }
                            "zfs_vdev_async_write_active_min_dirty_percent" => {
                                self.queue_limits.min_dirty_percent = parsed()?.unwrap_or(30)
                            }
                            "zfs_vdev_async_write_active_max_dirty_percent" => {
                                self.queue_limits.max_dirty_percent = parsed()?.unwrap_or(60)
                            }
                            _ => {}
                        }
                    }
                }
                format!("set_tunable {k}={v}")
            }
        };
        self.events.push((self.now, what));
        Ok(())
    }

    // --- intent log ----------------------------------------------------------

    fn log_issue(&mut self, stream: u32) -> anyhow::Result<()> {
        let now = self.now;
        let l = self.log.as_mut().unwrap();
        if now >= l.end_at {
            return Ok(());
        }
        if l.outstanding + l.size > l.dirty_max {
            l.blocked.push(stream);
            return Ok(());
        }
        let block = l.first_block + self.rng.random_range(0..l.blocks);
        let size = l.size;
        l.pending.push_back(Op {
            issued: now,
            stream,
        });
        // The record's data also reaches the pool in the txg (random overwrite).
        if !self.block_busy[block as usize] {
            self.submit_data(Req {
                block,
                stream: LOG_STREAM,
                size,
            })?;
        }
        self.zil_try_issue()
    }

    fn unblock_log_streams(&mut self) -> anyhow::Result<()> {
        let l = self.log.as_mut().unwrap();
        if l.blocked.is_empty() || l.outstanding + l.size > l.dirty_max {
            return Ok(());
        }
        let blocked = std::mem::take(&mut l.blocked);
        for s in blocked {
            self.log_issue(s)?;
        }
        Ok(())
    }

    /// Write pending sync records into log blocks while the ZIL may.
    fn zil_try_issue(&mut self) -> anyhow::Result<()> {
        loop {
            let l = self.log.as_mut().unwrap();
            if l.stall != Stall::None || l.pending.is_empty() || l.inflight >= l.max_inflight {
                return Ok(());
            }
            let rec = l.size + LOG_RECORD_HEADER;
            let want = (l.pending.len() as u64 * rec + LOG_BLOCK_HEADER).min(l.max_block);
            let bucket = LOG_BUCKETS
                .iter()
                .copied()
                .find(|&b| b >= want)
                .unwrap_or(l.max_block);
            if l.history.len() == LOG_HISTORY {
                l.history.pop_front();
            }
            l.history.push_back(bucket);
            let block = l.history.iter().copied().max().unwrap().min(l.max_block);
            let fit = ((block.saturating_sub(LOG_BLOCK_HEADER)) / rec).max(1) as usize;
            let take = fit.min(l.pending.len());
            let ops: Vec<Op> = l.pending.drain(..take).collect();
            let req = AllocRequest {
                kind: AllocKind::Log,
                size: block,
                copies: 1,
            };
            let t = match self.pool.submit(req).context("log submit")? {
                Submitted::Ready(t) => t,
                Submitted::Queued(t) => {
                    bail!("the pool queued log ticket {t}; log requests are never throttled")
                }
            };
            let busy = self.busy();
            match self.pool.allocate(t, busy) {
                Ok(a) => {
                    let loads = a.metaslab_loads;
                    let wait = self.preload_wait(&a.extents);
                    let l = self.log.as_mut().unwrap();
                    l.inflight += 1;
                    l.result.blocks += 1;
                    l.result.block_bytes += block;
                    match a.tier {
                        Some(LogTier::Log) => l.result.tier_log += 1,
                        Some(LogTier::EmbeddedLog) => l.result.tier_embedded_log += 1,
                        Some(LogTier::Normal) | None => l.result.tier_normal += 1,
                    }
                    if wait > 0 {
                        l.result.preload_waits += 1;
                        l.result.preload_wait += wait;
                    }
                    if loads > 0 || wait > 0 {
                        // zil_commit loads the metaslab synchronously (or
                        // waits for its preload): the ZIL stalls before this
                        // block can be written.
                        l.result.metaslab_loads += loads as u64;
                        l.result.load_stall += loads as u64 * l.load_cost;
                        l.stall = Stall::Load;
                        let at = self.now + (loads as u64 * l.load_cost).max(wait);
                        let tag = self.place(a, SlotKind::LogBlock(ops), true);
                        self.log.as_mut().unwrap().parked = Some(tag);
                        self.push(at, Ev::ZilResume);
                        return Ok(());
                    }
                    self.place(a, SlotKind::LogBlock(ops), true);
                }
                Err(PoolError::TxgWaitRequired { until }) => {
                    self.txg_wait(ops, until);
                    return Ok(());
                }
                Err(PoolError::NoSpace { .. }) => {
                    let until = self.pool.open_txg() + metaslab::TXG_DEFER_SIZE;
                    self.txg_wait(ops, until);
                    return Ok(());
                }
                Err(e) => return Err(e).context("log allocate"),
            }
        }
    }

    /// No log space anywhere: every waiting record is made durable by the
    /// txg sync instead (`txg_wait_synced`).
    fn txg_wait(&mut self, ops: Vec<Op>, until: Txg) {
        let l = self.log.as_mut().unwrap();
        l.result.txg_wait_fallbacks += 1;
        l.txg_waiters.extend(ops);
        let rest: Vec<Op> = l.pending.drain(..).collect();
        l.txg_waiters.extend(rest);
        l.stall = Stall::Txg(until);
        self.force_sync();
    }

    // --- sampling ------------------------------------------------------------

    fn sample_until(&mut self, t: u64) {
        while self.next_sample <= t {
            let at = self.next_sample;
            self.take_sample(at);
            self.next_sample = at + self.sample_interval;
        }
    }

    fn take_sample(&mut self, t: u64) {
        let view = self.pool.view();
        let vdevs = view
            .vdevs
            .iter()
            .map(|v| VdevSample {
                alloc: v.alloc,
                capacity: v.capacity,
                bytes_done: self
                    .devices
                    .get(v.id as usize)
                    .map(|d| d.bytes_done())
                    .unwrap_or(0),
                queue_depth: v.queue_depth,
                fragmentation: v.fragmentation,
                aliquot: v.aliquot,
                queue_target: v.queue_target,
            })
            .collect();
        if self.samples.last().is_some_and(|s| s.t == t) {
            self.samples.pop();
        }
        self.samples.push(Sample {
            t,
            vdevs,
            committed: self.committed,
            log_ops: std::mem::take(&mut self.log_ops_acc),
            log_latency_sum: std::mem::take(&mut self.log_lat_acc),
            log_latency_max: std::mem::take(&mut self.log_max_acc),
        });
        if self.samples.len() >= MAX_SAMPLES {
            decimate(&mut self.samples);
            self.sample_interval *= 2;
        }
    }
}

/// Halve the samples, keeping the first and merging each pair into its later
/// member (cumulative counters stay exact; interval counters add up).
fn decimate(samples: &mut Vec<Sample>) {
    let old = std::mem::take(samples);
    let mut it = old.into_iter();
    if let Some(first) = it.next() {
        samples.push(first);
    }
    while let Some(a) = it.next() {
        match it.next() {
            Some(mut b) => {
                b.log_ops += a.log_ops;
                b.log_latency_sum += a.log_latency_sum;
                b.log_latency_max = b.log_latency_max.max(a.log_latency_max);
                samples.push(b);
            }
            None => samples.push(a),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The event loop against a trivial allocator (round-robin bump pointer,
    //! no throttle), so the plumbing is tested on its own; the seed's claims
    //! are tested on the real pool in `tests/`.
    use super::*;
    use crate::pool::VdevView;
    use metaslab::{Result as PResult, TxgSync};

    #[derive(Default)]
    struct Fake {
        caps: Vec<u64>,
        next: Vec<u64>,
        alloc: Vec<u64>,
        reuse: Vec<Vec<Extent>>,
        freed_this_txg: Vec<Extent>,
        pending: HashMap<Ticket, AllocRequest>,
        placed: HashMap<AllocationId, Vec<Extent>>,
        ticket: u64,
        id: u64,
        rr: usize,
        txg: Txg,
        usable: usize,
        log_fails: bool,
        log_loads: u32,
        /// Every this many data allocations, one loads a metaslab.
        data_load_every: u64,
        data_allocs: u64,
        claims: u64,
        /// The first sync from this txg on reports every metaslab
        /// preloaded; 0 = never.
        preload_at_txg: Txg,
    }

    impl SimPool for Fake {
        fn add_vdev(&mut self, spec: VdevSpec) -> PResult<metaslab::VdevId> {
            self.caps.push(spec.capacity);
            self.next.push(0);
            self.alloc.push(0);
            self.reuse.push(Vec::new());
            Ok(self.caps.len() as u32 - 1)
        }
        fn set_tunable(&mut self, _: &str, _: &str) -> PResult<()> {
            Ok(())
        }
        fn open_txg(&self) -> Txg {
            self.txg
        }
        fn prefer_allocator(&mut self, _: usize) {}
        fn submit(&mut self, req: AllocRequest) -> PResult<Submitted> {
            self.ticket += 1;
            self.pending.insert(self.ticket, req);
            Ok(Submitted::Ready(self.ticket))
        }
        fn take_admitted(&mut self) -> Vec<Ticket> {
            Vec::new()
        }
        fn busy(&self, _: metaslab::ClassKind) -> bool {
            false
        }
        fn busy_with_dirty(&self, _: u64, _: u64) -> bool {
            false
        }
        fn allocate(&mut self, t: Ticket, _busy: bool) -> PResult<Allocation> {
            let req = self.pending.remove(&t).ok_or(PoolError::UnknownTicket(t))?;
            if req.kind == AllocKind::Log && self.log_fails {
                return Err(PoolError::TxgWaitRequired {
                    until: self.txg + 2,
                });
            }
            let size = req.size.div_ceil(4096) * 4096;
            let mut extents = Vec::new();
            for _ in 0..req.copies {
                let n = self.usable;
                let mut found = None;
                for k in 0..n {
                    let v = (self.rr + k) % n;
                    if let Some(i) = self.reuse[v].iter().position(|e| e.size == size) {
                        found = Some(self.reuse[v].swap_remove(i));
                    } else if self.next[v] + size <= self.caps[v] {
                        found = Some(Extent {
                            vdev: v as u32,
                            offset: self.next[v],
                            size,
                        });
                        self.next[v] += size;
                    }
                    if found.is_some() {
                        self.rr = (v + 1) % n;
                        break;
                    }
                }
                let e = found.ok_or(PoolError::NoSpace {
                    size,
                    copies: req.copies,
                    reason: metaslab::NoSpaceReason::Full,
                })?;
                self.alloc[e.vdev as usize] += size;
                extents.push(e);
            }
            self.id += 1;
            self.placed.insert(self.id, extents.clone());
            Ok(Allocation {
                id: self.id,
                extents,
                txg: self.txg,
                tier: (req.kind == AllocKind::Log).then_some(LogTier::Normal),
                metaslab_loads: if req.kind == AllocKind::Log {
                    self.log_loads
                } else {
                    self.data_allocs += 1;
                    u32::from(
                        self.data_load_every > 0
                            && self.data_allocs.is_multiple_of(self.data_load_every),
                    )
                },
            })
        }
        fn commit(&mut self, id: AllocationId) -> PResult<Txg> {
            self.placed
                .remove(&id)
                .ok_or(PoolError::UnknownAllocation(id))?;
            Ok(self.txg)
        }
        fn free(&mut self, extents: &[Extent]) -> PResult<Txg> {
            self.freed_this_txg.extend_from_slice(extents);
            Ok(self.txg)
        }
        fn claim(&mut self, extents: &[Extent]) -> PResult<Txg> {
            for e in extents {
                self.alloc[e.vdev as usize] += e.size;
                self.claims += 1;
            }
            Ok(self.txg)
        }
        fn sync(&mut self, _now_ms: u64) -> TxgSync {
            for e in self.freed_this_txg.drain(..) {
                self.alloc[e.vdev as usize] -= e.size;
                self.reuse[e.vdev as usize].push(e);
            }
            self.usable = self.caps.len();
            self.txg += 1;
            let preloaded = if self.preload_at_txg != 0 && self.txg >= self.preload_at_txg {
                self.preload_at_txg = 0;
                (0..self.caps.len())
                    .flat_map(|v| (0..(self.caps[v] >> 24) as u32).map(move |m| (v as u32, m)))
                    .collect()
            } else {
                Vec::new()
            };
            TxgSync {
                txg: self.txg - 1,
                preloaded,
                ..Default::default()
            }
        }
        fn view(&self) -> PoolView {
            PoolView {
                vdevs: (0..self.caps.len())
                    .map(|i| VdevView {
                        id: i as u32,
                        capacity: self.caps[i],
                        alloc: self.alloc[i],
                        metaslab_shift: 24,
                        metaslab_count: (self.caps[i] >> 24) as u32,
                        ..Default::default()
                    })
                    .collect(),
                normal_space: self.caps.iter().sum(),
                normal_alloc: self.alloc.iter().sum(),
                normal_fragmentation: None,
            }
        }
    }

    fn scenario(extra: &str) -> Scenario {
        Scenario::from_toml(&format!(
            r#"
name = "fake"
txg_timeout = "1s"
{extra}
[[vdev]]
name = "a"
capacity = "1GiB"
write_bandwidth = "1000MB/s"
latency = "100us"
[[vdev]]
name = "b"
capacity = "1GiB"
write_bandwidth = "500MB/s"
latency = "100us"
"#
        ))
        .unwrap()
    }

    fn go(sc: &Scenario, fake: Fake) -> RunResult {
        let spec = sc.runs().remove(0);
        run(fake, sc, &spec, &mut |_| {}).unwrap()
    }

    #[test]
    fn full_load_writes_everything_at_device_speed() {
        let sc = scenario(
            "[load]\nmode = \"full\"\nsize = \"1000MB\"\nstreams = 4\ndirty_max = \"64MiB\"",
        );
        let r = go(&sc, Fake::default());
        assert_eq!(r.stop_reason, "done");
        let blocks = 1_000_000_000 / (128 << 10);
        assert_eq!(r.bytes_committed, blocks * (128 << 10));
        assert_eq!(r.allocations, blocks);
        let last = r.samples.last().unwrap();
        // Round-robin puts half on each; the slower device decides the time.
        assert_eq!(
            last.vdevs[0].bytes_done + last.vdevs[1].bytes_done,
            r.bytes_committed
        );
        let secs = r.end_time as f64 / 1e9;
        assert!((0.99..1.02).contains(&secs), "{secs}");
        assert!(r.samples.len() >= 200, "{}", r.samples.len());
        assert!(r.samples.windows(2).all(|w| w[0].t < w[1].t));
    }

    #[test]
    fn rate_load_keeps_its_rate_and_passes_overwrite() {
        let sc = scenario(
            "[load]\nmode = \"rate\"\nrate = \"100MB/s\"\nsize = \"100MB\"\npasses = 3\nstreams = 2",
        );
        let r = go(&sc, Fake::default());
        assert_eq!(r.stop_reason, "done");
        let secs = r.end_time as f64 / 1e9;
        assert!((2.95..3.05).contains(&secs), "{secs}");
        let last = r.samples.last().unwrap();
        let alloc: u64 = last.vdevs.iter().map(|v| v.alloc).sum();
        // Overwrites freed the earlier passes (all but the last txg's frees synced).
        let per_pass = (100_000_000 / (128 << 10)) * (128 << 10);
        assert!(alloc <= 2 * per_pass, "{alloc}");
        assert_eq!(r.bytes_committed, 3 * per_pass);
    }

    #[test]
    fn pool_full_stops_the_load_and_events_fire() {
        let sc = scenario(
            "[load]\nmode = \"full\"\nsize = \"4GiB\"\ndirty_max = \"64MiB\"\n[[event]]\nat_time = \"100ms\"\naction = \"add_vdev\"\nvdev = { name = \"c\", capacity = \"1GiB\", write_bandwidth = \"1GB/s\" }\n[[event]]\nat_fill = 0.5\naction = \"stop_load\"\n[[event]]\nat_time = \"3s\"\naction = \"start_load\"",
        );
        let r = go(&sc, Fake::default());
        assert_eq!(r.stop_reason, "pool full");
        let what: Vec<&str> = r.events.iter().map(|e| e.1.as_str()).collect();
        assert_eq!(
            what[..3],
            ["add_vdev c", "stop_load", "start_load"],
            "{what:?}"
        );
        assert_eq!(r.vdev_names, ["a", "b", "c"]);
        assert_eq!(r.bytes_committed, 3 << 30);
        // Nothing was written while stopped.
        let stop = r.events[1].0;
        let start = r.events[2].0;
        let at = |t: u64| r.samples.iter().rev().find(|s| s.t <= t).unwrap().committed;
        assert_eq!(at(stop + 200_000_000), at(start));
    }

    #[test]
    fn sync_writes_batch_into_log_blocks_and_fall_back_to_txg_wait() {
        let sc =
            scenario("[log]\nstreams = 8\nsize = \"8K\"\nduration = \"2s\"\ndataset = \"64MiB\"");
        let r = go(&sc, Fake::default());
        let l = r.log.unwrap();
        assert!(l.ops > 1000, "{l:?}");
        assert_eq!(l.txg_wait_fallbacks, 0);
        assert!(
            l.block_bytes / l.blocks > 12 << 10,
            "records were batched: {l:?}"
        );
        // A write's latency is at least the device latency.
        assert!(l.latency_p50 >= 100_000, "{l:?}");

        let r = go(
            &sc,
            Fake {
                log_fails: true,
                ..Default::default()
            },
        );
        let slow = r.log.unwrap();
        assert!(slow.txg_wait_fallbacks > 0);
        assert!(
            slow.latency_mean > 100.0 * l.latency_mean,
            "{slow:?} vs {l:?}"
        );

        let r = go(
            &sc,
            Fake {
                log_loads: 1,
                ..Default::default()
            },
        );
        let loaded = r.log.unwrap();
        assert_eq!(loaded.metaslab_loads, loaded.blocks);
        assert!(loaded.latency_p50 >= 100_000_000, "{loaded:?}");
    }

    #[test]
    fn log_blocks_in_a_metaslab_still_preloading_wait_for_it() {
        // A sync early in the run preloads every metaslab (2 × 64) on one
        // preload thread (no `cpus`), 100 ms each: log blocks meet loads
        // still queued and wait for them.
        let sc = scenario(
            "[log]\nstreams = 8\nsize = \"8K\"\nduration = \"2s\"\ndataset = \"64MiB\"\nmetaslab_load_cost = \"100ms\"",
        );
        let free = go(&sc, Fake::default()).log.unwrap();
        assert_eq!((free.preloads, free.preload_waits), (0, 0));
        let r = go(
            &sc,
            Fake {
                preload_at_txg: 2,
                ..Default::default()
            },
        );
        let l = r.log.unwrap();
        assert_eq!(l.preloads, 128, "{l:?}");
        assert!(l.preload_waits > 0, "{l:?}");
        assert!(l.preload_wait <= 12_800_000_000 * l.preload_waits, "{l:?}");
        assert_eq!(l.metaslab_loads, 0, "a preload wait is not a load");
        assert!(l.ops < free.ops, "{l:?} vs {free:?}");
    }

    #[test]
    fn data_metaslab_loads_delay_their_writes_by_the_load_cost() {
        // One writer with one block in flight: nothing overlaps a load.
        let load = "[load]\nmode = \"full\"\nsize = \"100MB\"\nstreams = 1\ndirty_max = \"128K\"";
        let free = go(
            &scenario(load),
            Fake {
                data_load_every: 100,
                ..Default::default()
            },
        );
        // Loads are counted even when free (the default cost is 0).
        assert_eq!(free.data_metaslab_loads, free.allocations / 100);
        assert_eq!(free.data_load_stall, 0);
        let sc = scenario(&format!("metaslab_load_cost = \"50ms\"\n{load}"));
        let paid = go(
            &sc,
            Fake {
                data_load_every: 100,
                ..Default::default()
            },
        );
        assert_eq!(paid.bytes_committed, free.bytes_committed);
        assert_eq!(paid.data_metaslab_loads, paid.allocations / 100);
        assert_eq!(paid.data_load_stall, paid.data_metaslab_loads * 50_000_000);
        // Each load adds its 50 ms to the run.
        assert!(paid.data_metaslab_loads >= 7);
        assert!(
            paid.end_time >= free.end_time + paid.data_load_stall,
            "{} vs {}",
            paid.end_time,
            free.end_time
        );
    }

    #[test]
    fn syncing_txgs_write_ditto_metadata_and_free_its_old_copies() {
        let load = "[load]\nmode = \"full\"\nsize = \"100MB\"\nstreams = 2\ndirty_max = \"16MiB\"\nallocate = \"sync\"";
        let plain = go(&scenario(load), Fake::default());
        assert_eq!(plain.metadata_blocks, 0);
        let sc = scenario(&format!("{load}\n[metadata]\nmos_blocks = 3\n"));
        let r = go(&sc, Fake::default());
        assert_eq!(r.stop_reason, "done");
        assert_eq!(r.bytes_committed, plain.bytes_committed);
        // Every txg: per stream one L1 (762 blocks per stream fit one
        // 1024-pointer L1) and one L2, the dnode block, three MOS blocks.
        let per_txg = 2 + 2 + 1 + 3;
        assert!(r.metadata_blocks >= 3 * per_txg, "{}", r.metadata_blocks);
        assert_eq!(r.metadata_blocks % per_txg, 0, "{}", r.metadata_blocks);
        let txgs = r.metadata_blocks / per_txg;
        // 4K blocks except the L1s (up to 381 pointers × 128 B / 2 = 24K),
        // with two copies (three for the MOS).
        let small = txgs * ((2 + 1) * 2 + 3 * 3) * 4096;
        assert!(r.metadata_bytes > small, "{} vs {small}", r.metadata_bytes);
        assert!(r.metadata_bytes <= small + txgs * 2 * 2 * (24 << 10));
        // Copy-on-write: what stays allocated is one version of each.
        let alloc = |v: &PoolView| v.vdevs.iter().map(|v| v.alloc).sum::<u64>();
        let extra = alloc(&r.final_view) - alloc(&plain.final_view);
        assert!(
            extra <= 2 * (((2 + 1) * 2 + 3 * 3) * 4096 + 2 * 2 * (24 << 10)),
            "{extra}"
        );
    }

    #[test]
    fn leaf_model_limits_writes_in_flight_per_leaf() {
        // 1000 unmergeable 4K writes, one in flight per leaf, each 10 ms
        // to complete: Little's law makes it ~5 s on two vdevs, where the
        // simple model overlaps the latency of every queued write.
        let body = "block_size = \"4K\"\n[load]\nmode = \"full\"\nsize = \"4096000\"\nstreams = 4\n[tunables]\nzfs_vdev_aggregation_limit_non_rotating = 0\nzfs_vdev_async_write_min_active = 1\nzfs_vdev_async_write_max_active = 1";
        let slow = |extra: &str| {
            let mut sc = scenario(&format!("{extra}\n{body}"));
            for v in &mut sc.vdevs {
                v.latency = 10_000_000;
            }
            go(&sc, Fake::default())
        };
        let simple = slow("");
        let leaf = slow("device_model = \"leaf\"");
        assert_eq!(simple.allocations, 1000);
        assert_eq!(leaf.allocations, 1000);
        let (s, l) = (simple.end_time as f64 / 1e9, leaf.end_time as f64 / 1e9);
        assert!(s < 0.1, "simple {s}");
        assert!((4.9..5.2).contains(&l), "leaf {l}");
        assert_eq!(leaf.device_ios.iter().sum::<u64>(), 1000);
    }

    #[test]
    fn write_delay_follows_dmu_tx_delay() {
        let max = 100 << 20;
        assert_eq!(write_delay(max * 60 / 100, max), 0);
        // Halfway between the 60 % threshold and the limit: one delay scale.
        assert_eq!(write_delay(max * 80 / 100, max), ZFS_DELAY_SCALE);
        assert!(write_delay(max * 90 / 100, max) > write_delay(max * 80 / 100, max));
        assert_eq!(write_delay(max - 1, max), ZFS_DELAY_MAX_NS);
        assert_eq!(write_delay(max, max), ZFS_DELAY_MAX_NS);
    }

    #[test]
    fn prefill_claims_the_fill_fraction() {
        let sc = scenario(
            "[log]\nduration = \"10ms\"\n[prefill]\nfill = 0.6\nholes = [\"8K\", \"64K\"]\nweights = [7, 1]",
        );
        let r = go(&sc, Fake::default());
        let v = &r.start_view;
        let f = v.normal_alloc as f64 / v.normal_space as f64;
        assert!((0.55..0.65).contains(&f), "{f}");
    }
}
