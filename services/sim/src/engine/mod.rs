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
    Action, Amount, DeviceModel, LoadMode, Metadata, PreloadTaskq, RedundantMetadata, RunSpec,
    Scenario, Trigger, VdevModel,
};

mod cpu;
mod event_loop;
mod log;
mod metadata;
mod result;
mod sample;
mod setup;
#[cfg(test)]
mod tests;
mod txg;
mod writers;

use cpu::{CpuState, CpuWork};
use log::{LOG_STREAM, LogState, Stall};
use metadata::{MetaKey, MetaReq};
pub use result::{LogResult, RunResult, Sample, VdevSample};
pub use txg::{
    ZFS_DELAY_MAX_NS, ZFS_DELAY_MIN_DIRTY_PERCENT, ZFS_DELAY_SCALE, ZFS_DIRTY_DATA_SYNC_PERCENT,
    write_delay,
};

/// Ticket maps hash with foldhash's fixed-seed hasher, not SipHash: they
/// take an insert and two look-ups per block the throttle queues, and
/// SipHash was a visible share of a run once the throttle held most blocks
/// (t6-A at 16K). Fixed seed: nothing iterates them, and runs stay
/// reproducible either way.
type TicketMap<V> = HashMap<Ticket, V, foldhash::fast::FixedState>;

/// Samples kept before halving the sampling rate.
const MAX_SAMPLES: usize = 2000;
/// First sampling interval: 1 ms of virtual time.
const FIRST_SAMPLE_INTERVAL: u64 = 1_000_000;
/// `metaslab_preload_pct`: the preload taskq's threads as a percentage of
/// the CPUs (`spa.c:spa_activate@zfs-2.4.0`). A
/// machine fact for the simulator's clock, not a policy decision.
const METASLAB_PRELOAD_PCT: u64 = 50;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    DevFree(u32),
    DevDone(u32),
    /// `DevFree` and `DevDone` of one I/O due at the same time (a device
    /// without latency): one event, handled as the two in turn.
    DevFreeDone(u32),
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
    /// A data block's metaslab load is done: queue its writes (whether
    /// the throttle had queued it).
    Loaded(u32, bool),
    /// `[cpu]`: CPU `i` finished its block.
    CpuDone(u32),
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

#[derive(Debug)]
struct Slot {
    id: AllocationId,
    remaining: u32,
    extents: Vec<Extent>,
    kind: SlotKind,
}

impl Slot {
    /// An allocation's slot, every extent still to write.
    fn new(a: Allocation, kind: SlotKind) -> Slot {
        Slot {
            id: a.id,
            remaining: a.extents.len() as u32,
            extents: a.extents,
            kind,
        }
    }
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
    /// `[cpu] writer_bandwidth`: its block is on (or waiting for) a CPU, not
    /// yet dirty; a writer writes one block at a time.
    writing: bool,
}

#[derive(Debug)]
struct DataLoad {
    mode: LoadMode,
    block_size: u64,
    passes: u32,
    /// Rate mode: nanoseconds between one stream's writes.
    interval: u64,
    active: bool,
    streams: Vec<Stream>,
    rr: usize,
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
    /// Per preload taskq (one, or one per vdev: `preload_taskq`), when
    /// each of its threads is next free.
    preload_threads: Vec<Vec<u64>>,
    preloads: u64,
    meta_tickets: TicketMap<MetaReq>,
    meta_live: HashMap<MetaKey, Vec<Extent>>,
    meta_blocks: u64,
    meta_bytes: u64,
    agg_limit: u64,
    agg_limit_non_rot: u64,
    slots: Vec<Option<Slot>>,
    free_slots: Vec<u32>,
    tickets: TicketMap<Req>,
    blocks: Vec<Extent>,
    block_busy: Vec<bool>,
    copies: usize,
    data: Option<DataLoad>,
    log: Option<LogState>,
    rng: SmallRng,
    sync_gen: u64,
    last_sync: u64,
    fill_events: Vec<u32>,
    /// The highest normal-class fill `check_fill` saw.
    fill_reached: f64,
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
    /// Writes that waited `dmu_tx_delay`, and the virtual ns they waited.
    write_delays: u64,
    write_delay_ns: u64,
    dirty_sync_pending: bool,
    /// Pipeline: each vdev's allocated bytes as of the last sync, which is
    /// what OpenZFS reports (`vs_alloc` moves only in
    /// `metaslab.c:metaslab_sync_done@zfs-2.4.0`): the syncing txg's
    /// allocations show once it is synced, when its overwrites' frees have
    /// entered the defer tree, never before.
    synced_alloc: Vec<u64>,
    /// `[cpu]`: the CPUs a syncing txg's blocks pass before allocation.
    cpu: Option<CpuState>,
    /// Pipeline, one allocator, data blocks only (no `[metadata]`, `[cpu]`
    /// or `[log]`): a syncing txg's blocks wait here, in order, while the
    /// throttle holds one of them, instead of all queueing in the pool.
    /// The throttle's FIFO admits them in this order at the same moments
    /// (its test at submit is the one at dispatch), so runs are the same;
    /// a txg of thousands of blocks then costs no queue and ticket map of
    /// that size (the rate seeds ran 1.6x slower through the pool's queue).
    backlog: Option<VecDeque<Req>>,
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

#[cfg(test)]
thread_local! {
    /// Tests compare runs with and without the backlog.
    static NO_BACKLOG: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn tests_without_backlog() -> bool {
    #[cfg(test)]
    return NO_BACKLOG.with(|c| c.get());
    #[cfg(not(test))]
    false
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
            vec![
                0;
                (sc.cpus.unwrap_or(1) * METASLAB_PRELOAD_PCT / 100).max(1)
                    as usize
            ];
            match sc.preload_taskq {
                PreloadTaskq::Pool => 1,
                PreloadTaskq::Vdev => sc.vdevs.len().max(1),
            }
        ],
        preloads: 0,
        meta_tickets: TicketMap::default(),
        meta_live: HashMap::new(),
        meta_blocks: 0,
        meta_bytes: 0,
        agg_limit,
        agg_limit_non_rot,
        slots: Vec::new(),
        free_slots: Vec::new(),
        tickets: TicketMap::default(),
        blocks: Vec::new(),
        block_busy: Vec::new(),
        copies: sc.copies as usize,
        data: None,
        log: None,
        rng: SmallRng::seed_from_u64(sc.seed),
        sync_gen: 0,
        last_sync: 0,
        fill_events: Vec::new(),
        fill_reached: 0.0,
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
        write_delays: 0,
        write_delay_ns: 0,
        dirty_max: sc.load.as_ref().map(|l| l.dirty_max).unwrap_or(4 << 30),
        dirty_sync_bytes: sc.load.as_ref().map(|l| l.dirty_max).unwrap_or(4 << 30)
            * ZFS_DIRTY_DATA_SYNC_PERCENT
            / 100,
        dirty_sync_pending: false,
        cpu: sc.cpu.as_ref().map(CpuState::new),
        synced_alloc: Vec::new(),
        backlog: (sc.load.as_ref().is_some_and(|l| l.allocate_at_sync)
            && sc.cpus.is_none()
            && sc.metadata.is_none()
            && sc.cpu.is_none()
            && sc.log.is_none()
            && !tests_without_backlog())
        .then(VecDeque::new),
    };
    sim.setup()?;
    sim.main_loop(progress)
}
