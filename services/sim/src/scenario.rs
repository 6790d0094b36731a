//! Scenario files: the TOML a user writes, parsed strictly (unknown keys are
//! errors naming the key) and validated into plain numbers (bytes, bytes per
//! second, nanoseconds) before anything runs.
//!
//! Sizes, rates and durations accept the `units` crate's forms (`128GiB`,
//! `500MiB/s`, `100us`) or bare integers (bytes, bytes/s, seconds).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use metaslab::ThrottlePolicy;
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};

/// Why a scenario was refused; every message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Parse(String),
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------
// Unit-bearing values.

/// Bytes: `"128GiB"`, `"4K"` or an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);
/// Bytes per second: `"500MiB/s"` or a number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate(pub f64);
/// Nanoseconds: `"100us"`, `"5s"` or a number of seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dur(pub u64);

struct UnitVisitor<T> {
    what: &'static str,
    parse: fn(&str) -> Result<T, String>,
    from_f64: fn(f64) -> Option<T>,
}

impl<'de, T> Visitor<'de> for UnitVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.parse)(v).map_err(E::custom)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        self.visit_f64(v as f64)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        self.visit_f64(v as f64)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        (self.from_f64)(v).ok_or_else(|| E::custom(format!("{v} is not {}", self.what)))
    }
}

fn nonneg(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0).then_some(v)
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UnitVisitor {
            what: "a size such as \"128GiB\", \"4K\" or a number of bytes",
            parse: |s| units::parse_size(s).map(Size).map_err(|e| e.to_string()),
            from_f64: |v| nonneg(v).map(|v| Size(v as u64)),
        })
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UnitVisitor {
            what: "a rate such as \"500MiB/s\" or a number of bytes per second",
            parse: |s| units::parse_rate(s).map(Rate).map_err(|e| e.to_string()),
            from_f64: |v| nonneg(v).map(Rate),
        })
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UnitVisitor {
            what: "a duration such as \"100us\", \"5s\" or a number of seconds",
            parse: |s| {
                units::parse_duration(s)
                    .map(|d| Dur(d.as_nanos() as u64))
                    .map_err(|e| e.to_string())
            },
            from_f64: |v| nonneg(v).map(|v| Dur((v * 1e9).round() as u64)),
        })
    }
}

/// One size or a list of sizes (`block_size = "128K"` or `["16K", "1M"]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeList(pub Vec<u64>);

impl<'de> Deserialize<'de> for SizeList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SizeList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as \"128K\" or a list of sizes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SizeList, E> {
                units::parse_size(v)
                    .map(|s| SizeList(vec![s]))
                    .map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SizeList, E> {
                u64::try_from(v)
                    .map(|v| SizeList(vec![v]))
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SizeList, E> {
                Ok(SizeList(vec![v]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SizeList, A::Error> {
                let mut out = Vec::new();
                while let Some(Size(s)) = seq.next_element::<Size>()? {
                    out.push(s);
                }
                Ok(SizeList(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A tunable value as written: string, integer, float or boolean, passed on
/// as the string `Tunables::set` parses.
#[derive(Clone, Debug, PartialEq)]
pub struct TunableValue(pub String);

impl<'de> Deserialize<'de> for TunableValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TunableValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TunableValue, E> {
                Ok(TunableValue(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TunableValue, E> {
                Ok(TunableValue(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TunableValue, E> {
                Ok(TunableValue(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<TunableValue, E> {
                Ok(TunableValue(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<TunableValue, E> {
                Ok(TunableValue(if v { "1" } else { "0" }.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------
// The file as written.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    policies: Option<Vec<String>>,
    #[serde(default)]
    block_size: Option<SizeList>,
    #[serde(default)]
    copies: Option<u8>,
    #[serde(default)]
    seed: Option<u64>,
    /// zfs_txg_timeout.
    #[serde(default)]
    txg_timeout: Option<Dur>,
    /// Shortest virtual time a forced txg sync takes (a txg-wait).
    #[serde(default)]
    txg_sync_time: Option<Dur>,
    #[serde(default)]
    max_time: Option<Dur>,
    #[serde(default)]
    load: Option<RawLoad>,
    /// `simple` (one queue per top-level vdev) or `leaf`.
    #[serde(default)]
    device_model: Option<String>,
    /// What a metaslab load costs a data allocation (default 0: free).
    #[serde(default)]
    metaslab_load_cost: Option<Dur>,
    /// The machine's CPUs: `spa_alloc_count` (default: one allocator).
    #[serde(default)]
    cpus: Option<u64>,
    /// `pool` (one preload taskq, 2.2 on) or `vdev` (one per vdev, 2.0–2.1).
    #[serde(default)]
    preload_taskq: Option<String>,
    #[serde(default)]
    vdev: Vec<RawVdev>,
    #[serde(default)]
    event: Vec<RawEvent>,
    #[serde(default)]
    tunables: BTreeMap<String, TunableValue>,
    #[serde(default)]
    log: Option<RawLog>,
    #[serde(default)]
    prefill: Option<RawPrefill>,
    #[serde(default)]
    metadata: Option<RawMetadata>,
    #[serde(default)]
    cpu: Option<RawCpu>,
    #[serde(default)]
    variant: Vec<RawVariant>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoad {
    mode: String,
    #[serde(default)]
    rate: Option<Rate>,
    #[serde(default)]
    streams: Option<u32>,
    #[serde(default)]
    passes: Option<u32>,
    #[serde(default)]
    size: Option<Size>,
    #[serde(default)]
    fill: Option<f64>,
    #[serde(default)]
    dirty_max: Option<Size>,
    #[serde(default)]
    start: Option<Dur>,
    #[serde(default)]
    allocate: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVdev {
    name: String,
    capacity: Size,
    write_bandwidth: Rate,
    #[serde(default)]
    latency: Option<Dur>,
    #[serde(default)]
    overhead: Option<Dur>,
    #[serde(default)]
    seek: Option<Dur>,
    #[serde(default)]
    rotation: Option<Dur>,
    #[serde(default)]
    rotational: Option<bool>,
    #[serde(default)]
    children: Option<u32>,
    #[serde(default)]
    parity: Option<u32>,
    #[serde(default)]
    ashift: Option<u8>,
    #[serde(default)]
    fill_slowdown: Option<f64>,
    #[serde(default)]
    log: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    #[serde(default)]
    at_time: Option<Dur>,
    #[serde(default)]
    at_fill: Option<f64>,
    action: String,
    #[serde(default)]
    vdev: Option<RawVdev>,
    #[serde(default)]
    tunable: Option<String>,
    #[serde(default)]
    value: Option<TunableValue>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    #[serde(default)]
    streams: Option<u32>,
    #[serde(default)]
    size: Option<Size>,
    #[serde(default)]
    dataset: Option<Size>,
    #[serde(default)]
    duration: Option<Dur>,
    #[serde(default)]
    start: Option<Dur>,
    #[serde(default)]
    metaslab_load_cost: Option<Dur>,
    #[serde(default)]
    max_block: Option<Size>,
    #[serde(default)]
    max_inflight: Option<u32>,
    #[serde(default)]
    size_range: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetadata {
    #[serde(default)]
    redundant_metadata: Option<String>,
    #[serde(default)]
    indirect_block: Option<Size>,
    #[serde(default)]
    compression: Option<f64>,
    #[serde(default)]
    mos_blocks: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCpu {
    count: u32,
    block_cost: Dur,
    #[serde(default)]
    bandwidth: Option<Rate>,
    #[serde(default)]
    after_throttle: Option<f64>,
    #[serde(default)]
    dispatch: Option<Dur>,
    #[serde(default)]
    writer_bandwidth: Option<Rate>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrefill {
    fill: f64,
    #[serde(default)]
    holes: Option<Vec<Size>>,
    #[serde(default)]
    weights: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVariant {
    name: String,
    #[serde(default)]
    tunables: BTreeMap<String, TunableValue>,
}

// ---------------------------------------------------------------------------
// The validated scenario.

/// A validated scenario: everything in bytes, bytes/s and nanoseconds.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub policies: Vec<ThrottlePolicy>,
    pub block_sizes: Vec<u64>,
    pub copies: u8,
    pub seed: u64,
    pub txg_timeout: u64,
    pub txg_sync_time: u64,
    pub max_time: u64,
    pub load: Option<Load>,
    pub device_model: DeviceModel,
    /// Nanoseconds a data allocation waits per metaslab it loaded (OpenZFS
    /// loads it in the allocating thread, in the txg sync); 0 = free.
    pub metaslab_load_cost: u64,
    /// CPUs of the modelled machine, from which the pool derives
    /// `spa_alloc_count` (`Pool::set_cpus`); None = one allocator.
    pub cpus: Option<u64>,
    /// Who loads the metaslabs a sync preloads.
    pub preload_taskq: PreloadTaskq,
    pub vdevs: Vec<VdevModel>,
    pub events: Vec<Event>,
    /// In file order; sim-level names (see [`SIM_TUNABLES`]) included.
    pub tunables: Vec<(String, String)>,
    pub log: Option<LogLoad>,
    pub prefill: Option<Prefill>,
    pub metadata: Option<Metadata>,
    /// `[cpu]` (pipeline only): the CPU work each block of a syncing txg
    /// needs before it is allocated; None = free, as before.
    pub cpu: Option<Cpu>,
    pub variants: Vec<Variant>,
}

/// How devices are modelled (`device_model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceModel {
    /// One bandwidth queue per top-level vdev, latency overlapping freely
    /// (`device.rs`).
    #[default]
    Simple,
    /// OpenZFS's vdev queue per leaf: dirty-scaled active writes, seeks,
    /// RAIDZ children on their own (`leaf.rs`).
    Leaf,
}

/// The preload taskqs (`preload_taskq`), each with `metaslab_preload_pct`
/// (50) % of `cpus` threads, at least 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PreloadTaskq {
    /// One for the pool (`spa.c:spa_activate@zfs-2.4.0`, `spa_metaslab_taskq`).
    #[default]
    Pool,
    /// One per top-level vdev, as each metaslab group had its own
    /// (`metaslab.c:metaslab_group_create@zfs-2.1.0`, `mg_taskq` with
    /// `metaslab_load_pct` 50 %): the OpenZFS the ZIL-metaslab seed measured.
    Vdev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// As fast as the throttle admits (bounded by `dirty_max` in flight).
    Full,
    /// A fixed total rate, split evenly over the streams.
    Rate,
}

#[derive(Clone, Debug)]
pub struct Load {
    pub mode: LoadMode,
    /// Bytes per second, total (rate mode).
    pub rate: f64,
    pub streams: u32,
    pub passes: u32,
    /// Bytes written per pass, or a fraction of the pool's space at start.
    pub amount: Amount,
    /// Most bytes submitted and not yet committed (OpenZFS's dirty data limit).
    pub dirty_max: u64,
    pub start: u64,
    /// `allocate = "sync"` (the default): writes become dirty data and
    /// their blocks are allocated when their txg syncs (OpenZFS's
    /// pipeline); `"write"` allocates each block as it is written.
    pub allocate_at_sync: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Amount {
    Bytes(u64),
    Fill(f64),
}

/// A device as the simulator models it.
#[derive(Clone, Debug, PartialEq)]
pub struct VdevModel {
    pub name: String,
    /// Per child for RAIDZ-like vdevs; the vdev's capacity is `children ×` this.
    pub capacity: u64,
    /// Per child, bytes per second.
    pub write_bandwidth: f64,
    /// Nanoseconds from issue to completion beyond the transfer, overlapped
    /// between I/Os (the device's internal parallelism).
    pub latency: u64,
    /// Nanoseconds each I/O occupies the device besides its transfer.
    pub overhead: u64,
    /// Leaf model, rotational: a full-stroke seek (ns); a seek over a
    /// fraction `d` of the disk costs `seek × √d`.
    pub seek: u64,
    /// Leaf model, rotational: one revolution (ns). A write that finds the
    /// disk idle waits for its sector to come round again; one after a
    /// seek waits half a revolution.
    pub rotation: u64,
    pub rotational: bool,
    pub children: u32,
    pub parity: u32,
    pub ashift: u8,
    /// Bandwidth lost at the end of the device (rotational: by LBA) or when
    /// full (non-rotational: by used fraction), 0 ..< 1.
    pub fill_slowdown: f64,
    /// A dedicated log device (slog).
    pub log: bool,
}

impl VdevModel {
    /// The top-level vdev's allocatable bytes.
    pub fn total_capacity(&self) -> u64 {
        self.capacity.saturating_mul(self.children as u64)
    }
    /// Bytes per second over all children, parity included (asize bytes).
    pub fn raw_bandwidth(&self) -> f64 {
        self.write_bandwidth * self.children as f64
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// Virtual nanoseconds.
    Time(u64),
    /// Normal-class used fraction (alloc / space) at or above this.
    Fill(f64),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    AddVdev(VdevModel),
    StartLoad,
    StopLoad,
    SetTunable(String, String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub trigger: Trigger,
    pub action: Action,
}

/// Synchronous writers (intent-log traffic), one ZIL.
#[derive(Clone, Debug)]
pub struct LogLoad {
    pub streams: u32,
    /// Bytes per sync write (record size).
    pub size: u64,
    /// Bytes of the file the sync writes overwrite at random.
    pub dataset: u64,
    pub start: u64,
    pub duration: u64,
    /// Virtual time a metaslab load stalls the ZIL.
    pub metaslab_load_cost: u64,
    /// Largest log block (zil_maxblocksize).
    pub max_block: u64,
    /// Log block writes in flight at once.
    pub max_inflight: u32,
    /// Ask for each log block as a size range (OpenZFS 2.4's
    /// `zio_alloc_zil` → `metaslab_alloc_range`): at least what its records
    /// need, at most the planned block. Off: exactly the planned block, the
    /// ZIL the seed measured.
    pub size_range: bool,
}

/// OpenZFS's `redundant_metadata` property.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedundantMetadata {
    /// Every metadata block one copy more than the data.
    All,
    /// As `all` but level-1 indirect blocks of file data.
    Most,
    /// No extra copies (the MOS keeps its three).
    None,
}

/// `[metadata]` (pipeline only): the metadata each syncing txg writes
/// besides its data, as ditto blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Metadata {
    pub redundant: RedundantMetadata,
    /// Indirect block size (`indblkshift` 17: 128K): one level-1 block maps
    /// `indirect_block / 128` data blocks.
    pub indirect_block: u64,
    /// How much compression shrinks a level-1 block's pointers.
    pub compression: f64,
    /// MOS blocks per txg (space maps, MOS dnodes, DSL objects), 4K each.
    pub mos_blocks: u32,
}

/// `[cpu]`: the zio pipeline's CPU work. Each data and metadata block of a
/// syncing txg passes `count` CPUs (the write issue taskq, sized by
/// `zio_taskq_batch_pct` = 80 % of the CPUs but sharing them with the
/// writers' copies, the sync thread and, for file vdevs, the `pwrite`
/// into the page cache). A block costs `block_cost + size / bandwidth` of
/// one CPU; so "full speed" is the slower of the CPUs and the devices.
///
/// By default all of it comes before the pool sees the block, as its
/// checksum and compression stages come before `ZIO_STAGE_DVA_THROTTLE`
/// (zio_impl.h:zio_stage@zfs-2.4.0). `after_throttle` moves that share of
/// the cost past the throttle: the pool admits the block after the first
/// part, and the rest (allocation, RAIDZ parity in `vdev_raidz_io_start`,
/// the leaf writes' `z_vdev_file` tasks and their completions) is a new
/// task queued behind the CPUs' other work while the block holds its
/// throttle reservation; its writes are queued once it is done. A block the
/// throttle queued costs `dispatch` more in that work, once admitted:
/// `zio_allocate_dispatch` hands it to the issue taskq again (`TQ_FRONT`,
/// zio.c@zfs-2.3.9 and zfs-2.4.4).
///
/// `writer_bandwidth` is the writers' own work on the same CPUs: each block
/// a writer writes (`dmu_tx_assign`, the copy into the ARC) costs
/// `size / writer_bandwidth` of a CPU before it is dirty (per byte: the
/// real writers' CPU a MiB is nearly the same at 16K, 128K and 1M blocks), so a pool whose writers keep up with its syncs
/// shares the CPUs between both, while one whose writers wait at the
/// dirty limit (a slow device holding the syncs) leaves the sync its CPUs.
#[derive(Clone, Debug, PartialEq)]
pub struct Cpu {
    pub count: u32,
    /// Nanoseconds of CPU per block whatever its size.
    pub block_cost: u64,
    /// Bytes per second one CPU processes (0: no per-byte cost).
    pub bandwidth: f64,
    /// Share of a block's cost after the throttle (0: all before it).
    pub after_throttle: f64,
    /// Nanoseconds of CPU to hand a throttled block to a taskq again.
    pub dispatch: u64,
    /// Bytes per second one CPU's writer work takes into the open txg
    /// (0: writers are free).
    pub writer_bandwidth: f64,
}

impl Cpu {
    /// One CPU's nanoseconds for a block of `size` bytes.
    pub fn cost(&self, size: u64) -> u64 {
        let per_byte = if self.bandwidth > 0.0 {
            (size as f64 * 1e9 / self.bandwidth) as u64
        } else {
            0
        };
        self.block_cost + per_byte
    }

    /// The part of `cost(size)` before the throttle.
    pub fn before_throttle_cost(&self, size: u64) -> u64 {
        self.cost(size) - self.after_throttle_cost(size)
    }

    /// One CPU's nanoseconds for a writer to write a block of `size` bytes.
    pub fn writer_cost(&self, size: u64) -> u64 {
        if self.writer_bandwidth > 0.0 {
            (size as f64 * 1e9 / self.writer_bandwidth) as u64
        } else {
            0
        }
    }

    /// The part of `cost(size)` after the throttle.
    pub fn after_throttle_cost(&self, size: u64) -> u64 {
        (self.cost(size) as f64 * self.after_throttle).round() as u64
    }
}

#[derive(Clone, Debug)]
pub struct Prefill {
    pub fill: f64,
    pub holes: Vec<u64>,
    /// Relative frequency of each hole size (all 1 when not given).
    pub weights: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Variant {
    pub name: String,
    pub tunables: Vec<(String, String)>,
}

/// Tunables the simulator itself consumes (device and txg facts, not
/// allocation policy); every other `[tunables]` name goes to
/// `metaslab::Tunables::set`.
pub const SIM_TUNABLES: &[(&str, &str)] = &[
    (
        "zfs_txg_timeout",
        "seconds between txg syncs (same as txg_timeout)",
    ),
    (
        "zfs_vdev_aggregation_limit",
        "largest merged write on rotational vdevs, per child (default 1MiB; 0 = off)",
    ),
    (
        "zfs_vdev_aggregation_limit_non_rotating",
        "largest merged write on non-rotational vdevs, per child (default 128KiB)",
    ),
    (
        "zfs_vdev_async_write_min_active",
        "device_model = \"leaf\": async writes per leaf in flight below the min dirty percent (default 2)",
    ),
    (
        "zfs_vdev_sync_write_max_active",
        "device_model = \"leaf\": sync writes per leaf in flight (default 10)",
    ),
];

pub fn policy_name(p: ThrottlePolicy) -> &'static str {
    match p {
        ThrottlePolicy::Unified => "unified",
        ThrottlePolicy::Legacy => "legacy",
        ThrottlePolicy::Off => "off",
    }
}

fn parse_policy(s: &str) -> Option<ThrottlePolicy> {
    match s {
        "unified" => Some(ThrottlePolicy::Unified),
        "legacy" => Some(ThrottlePolicy::Legacy),
        "off" => Some(ThrottlePolicy::Off),
        _ => None,
    }
}

fn tunable_list(map: BTreeMap<String, TunableValue>) -> Vec<(String, String)> {
    map.into_iter().map(|(k, v)| (k, v.0)).collect()
}

impl Scenario {
    pub fn from_file(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Scenario::from_toml(&text)
    }

    pub fn from_toml(text: &str) -> Result<Scenario, ScenarioError> {
        let raw: RawScenario =
            toml::from_str(text).map_err(|e| ScenarioError::Parse(e.to_string()))?;
        Scenario::validate(raw)
    }

    fn validate(raw: RawScenario) -> Result<Scenario, ScenarioError> {
        if raw.name.trim().is_empty() {
            return Err(invalid("name", "must not be empty"));
        }
        let policies = match raw.policies {
            None => vec![ThrottlePolicy::Unified],
            Some(list) => {
                if list.is_empty() {
                    return Err(invalid("policies", "name at least one policy"));
                }
                let mut out = Vec::new();
                for (i, p) in list.iter().enumerate() {
                    let p = parse_policy(p).ok_or_else(|| {
                        invalid(
                            format!("policies[{i}]"),
                            format!("unknown policy {p:?} (expected unified, legacy or off)"),
                        )
                    })?;
                    out.push(p);
                }
                out
            }
        };
        let block_sizes = raw
            .block_size
            .map(|b| b.0)
            .unwrap_or_else(|| vec![128 << 10]);
        if block_sizes.is_empty() {
            return Err(invalid("block_size", "name at least one block size"));
        }
        for (i, &b) in block_sizes.iter().enumerate() {
            if b == 0 || b > metaslab::SPA_MAXBLOCKSIZE {
                return Err(invalid(
                    format!("block_size[{i}]"),
                    format!("{b} is outside 1 ..= 16MiB"),
                ));
            }
        }
        let copies = raw.copies.unwrap_or(1);
        if !(1..=3).contains(&copies) {
            return Err(invalid("copies", "must be 1, 2 or 3"));
        }
        let mut tunables = tunable_list(raw.tunables);
        let mut txg_timeout = raw.txg_timeout.map(|d| d.0).unwrap_or(5_000_000_000);
        if let Some((_, v)) = tunables.iter().find(|(k, _)| k == "zfs_txg_timeout") {
            let d = units::parse_duration(v)
                .map_err(|e| invalid("tunables.zfs_txg_timeout", e.to_string()))?;
            txg_timeout = d.as_nanos() as u64;
        }
        tunables.retain(|(k, _)| k != "zfs_txg_timeout");
        if txg_timeout == 0 {
            return Err(invalid("txg_timeout", "must be above zero"));
        }
        for (k, v) in &tunables {
            if k.starts_with("zfs_vdev_aggregation_limit") {
                units::parse_size(v)
                    .map_err(|e| invalid(format!("tunables.{k}"), e.to_string()))?;
            }
        }

        let vdevs = raw
            .vdev
            .iter()
            .enumerate()
            .map(|(i, v)| vdev_model(&format!("vdev[{i}]"), v))
            .collect::<Result<Vec<_>, _>>()?;
        if vdevs.iter().all(|v| v.log) {
            return Err(invalid(
                "vdev",
                "no data vdevs: add at least one [[vdev]] with name, capacity and write_bandwidth",
            ));
        }
        let mut names: Vec<String> = vdevs.iter().map(|v| v.name.clone()).collect();

        let mut events = Vec::new();
        for (i, e) in raw.event.iter().enumerate() {
            let key = format!("event[{i}]");
            let trigger = match (e.at_time, e.at_fill) {
                (Some(t), None) => Trigger::Time(t.0),
                (None, Some(f)) if (0.0..=1.0).contains(&f) => Trigger::Fill(f),
                (None, Some(_)) => {
                    return Err(invalid(format!("{key}.at_fill"), "must be within 0 ..= 1"));
                }
                _ => return Err(invalid(key, "give exactly one of at_time or at_fill")),
            };
            let action = match e.action.as_str() {
                "add_vdev" => {
                    let v = e.vdev.as_ref().ok_or_else(|| {
                        invalid(
                            format!("{key}.vdev"),
                            "add_vdev needs vdev = { name, capacity, write_bandwidth, ... }",
                        )
                    })?;
                    let m = vdev_model(&format!("{key}.vdev"), v)?;
                    Action::AddVdev(m)
                }
                "start_load" => Action::StartLoad,
                "stop_load" => Action::StopLoad,
                "set_tunable" => {
                    let name = e.tunable.clone().ok_or_else(|| {
                        invalid(
                            format!("{key}.tunable"),
                            "set_tunable needs tunable and value",
                        )
                    })?;
                    let value = e.value.clone().ok_or_else(|| {
                        invalid(
                            format!("{key}.value"),
                            "set_tunable needs tunable and value",
                        )
                    })?;
                    Action::SetTunable(name, value.0)
                }
                other => {
                    return Err(invalid(
                        format!("{key}.action"),
                        format!(
                            "unknown action {other:?} (expected add_vdev, start_load, stop_load, set_tunable)"
                        ),
                    ));
                }
            };
            if let Action::AddVdev(m) = &action {
                names.push(m.name.clone());
            }
            events.push(Event { trigger, action });
        }
        let mut sorted = names.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid("vdev.name", format!("{:?} is used twice", w[0])));
        }

        let load = match raw.load {
            None => None,
            Some(l) => Some(load_model(l)?),
        };
        let log = match raw.log {
            None => None,
            Some(l) => Some(log_model(l)?),
        };
        if load.is_none() && log.is_none() {
            return Err(invalid(
                "load",
                "give a [load] section, a [log] section or both",
            ));
        }
        let prefill = match raw.prefill {
            None => None,
            Some(p) => {
                if !(0.0..0.97).contains(&p.fill) {
                    return Err(invalid("prefill.fill", "must be within 0 ..< 0.97"));
                }
                let holes: Vec<u64> = p
                    .holes
                    .unwrap_or_else(|| vec![Size(8 << 10), Size(16 << 10)])
                    .into_iter()
                    .map(|s| s.0)
                    .collect();
                if holes.is_empty() || holes.contains(&0) {
                    return Err(invalid("prefill.holes", "give one or more non-zero sizes"));
                }
                let weights = p.weights.unwrap_or_else(|| vec![1; holes.len()]);
                if weights.len() != holes.len() || weights.iter().all(|&w| w == 0) {
                    return Err(invalid(
                        "prefill.weights",
                        "give one weight per hole size, not all zero",
                    ));
                }
                Some(Prefill {
                    fill: p.fill,
                    holes,
                    weights,
                })
            }
        };
        let mut variants: Vec<Variant> = raw
            .variant
            .into_iter()
            .map(|v| Variant {
                name: v.name,
                tunables: tunable_list(v.tunables),
            })
            .collect();
        if variants.is_empty() {
            variants.push(Variant {
                name: String::new(),
                tunables: Vec::new(),
            });
        }
        let device_model = match raw.device_model.as_deref() {
            None | Some("simple") => DeviceModel::Simple,
            Some("leaf") => DeviceModel::Leaf,
            Some(other) => {
                return Err(invalid(
                    "device_model",
                    format!("unknown model {other:?} (expected \"simple\" or \"leaf\")"),
                ));
            }
        };
        let preload_taskq = match raw.preload_taskq.as_deref() {
            None | Some("pool") => PreloadTaskq::Pool,
            Some("vdev") => PreloadTaskq::Vdev,
            Some(other) => {
                return Err(invalid(
                    "preload_taskq",
                    format!("unknown taskq {other:?} (expected \"pool\" or \"vdev\")"),
                ));
            }
        };
        let metadata = match raw.metadata {
            None => None,
            Some(m) => {
                if !load.as_ref().is_some_and(|l| l.allocate_at_sync) {
                    return Err(invalid(
                        "metadata",
                        "metadata is written by syncing txgs: needs the txg pipeline, not [load] allocate = \"write\"",
                    ));
                }
                let redundant = match m.redundant_metadata.as_deref() {
                    None | Some("all") => RedundantMetadata::All,
                    Some("most") => RedundantMetadata::Most,
                    Some("none") => RedundantMetadata::None,
                    Some(other) => {
                        return Err(invalid(
                            "metadata.redundant_metadata",
                            format!("unknown value {other:?} (expected all, most or none)"),
                        ));
                    }
                };
                let indirect_block = m.indirect_block.map(|s| s.0).unwrap_or(128 << 10);
                if !(1024..=(128 << 10)).contains(&indirect_block)
                    || !indirect_block.is_power_of_two()
                {
                    return Err(invalid(
                        "metadata.indirect_block",
                        "must be a power of two within 1K ..= 128K",
                    ));
                }
                let compression = m.compression.unwrap_or(2.0);
                if !(compression.is_finite() && compression >= 1.0) {
                    return Err(invalid("metadata.compression", "must be at least 1"));
                }
                Some(Metadata {
                    redundant,
                    indirect_block,
                    compression,
                    mos_blocks: m.mos_blocks.unwrap_or(8),
                })
            }
        };
        let max_time = raw
            .max_time
            .map(|d| d.0)
            .unwrap_or(24 * 3600 * 1_000_000_000);
        let cpu = match raw.cpu {
            None => None,
            Some(c) => {
                if !load.as_ref().is_some_and(|l| l.allocate_at_sync) {
                    return Err(invalid(
                        "cpu",
                        "the CPU model costs a syncing txg's blocks: needs the txg pipeline, not [load] allocate = \"write\"",
                    ));
                }
                if c.count == 0 {
                    return Err(invalid("cpu.count", "must be at least 1"));
                }
                let bandwidth = c.bandwidth.map(|r| r.0).unwrap_or(0.0);
                if !(bandwidth.is_finite() && bandwidth >= 0.0) {
                    return Err(invalid("cpu.bandwidth", "must be a rate of 0 or more"));
                }
                if c.block_cost.0 == 0 && bandwidth == 0.0 {
                    return Err(invalid(
                        "cpu",
                        "block_cost and bandwidth are both zero: leave [cpu] out instead",
                    ));
                }
                let writer_bandwidth = c.writer_bandwidth.map(|r| r.0).unwrap_or(0.0);
                if !(writer_bandwidth.is_finite() && writer_bandwidth >= 0.0) {
                    return Err(invalid(
                        "cpu.writer_bandwidth",
                        "must be a rate of 0 or more",
                    ));
                }
                let after_throttle = c.after_throttle.unwrap_or(0.0);
                if !(0.0..=1.0).contains(&after_throttle) {
                    return Err(invalid("cpu.after_throttle", "must be a share from 0 to 1"));
                }
                Some(Cpu {
                    count: c.count,
                    block_cost: c.block_cost.0,
                    bandwidth,
                    after_throttle,
                    dispatch: c.dispatch.map(|d| d.0).unwrap_or(0),
                    writer_bandwidth,
                })
            }
        };
        Ok(Scenario {
            name: raw.name,
            description: raw.description,
            policies,
            block_sizes,
            copies,
            seed: raw.seed.unwrap_or(1),
            txg_timeout,
            txg_sync_time: raw.txg_sync_time.map(|d| d.0).unwrap_or(100_000_000),
            max_time,
            load,
            device_model,
            metaslab_load_cost: raw.metaslab_load_cost.map(|d| d.0).unwrap_or(0),
            cpus: match raw.cpus {
                Some(0) => return Err(invalid("cpus", "must be at least 1")),
                c => c,
            },
            preload_taskq,
            vdevs,
            events,
            tunables,
            log,
            prefill,
            metadata,
            cpu,
            variants,
        })
    }

    /// The same experiment `f` times smaller and faster: capacities, byte
    /// amounts and every time (txg timeout, event times,
    /// log duration) divided by `f`, bandwidths and latencies kept, so a txg
    /// covers the same fraction of a device as at full scale. Used by the
    /// tests to run the shipped scenarios in seconds.
    pub fn scaled_down(&self, f: u64) -> Scenario {
        let f = f.max(1);
        let mut s = self.clone();
        let shrink_vdev = |v: &mut VdevModel| v.capacity = (v.capacity / f).max(64 << 20);
        s.vdevs.iter_mut().for_each(shrink_vdev);
        for e in &mut s.events {
            if let Trigger::Time(t) = &mut e.trigger {
                *t /= f;
            }
            if let Action::AddVdev(v) = &mut e.action {
                shrink_vdev(v);
            }
        }
        s.txg_timeout = (s.txg_timeout / f).max(1);
        s.txg_sync_time = (s.txg_sync_time / f).max(1);
        s.max_time /= f;
        if let Some(l) = &mut s.load {
            if let Amount::Bytes(b) = &mut l.amount {
                *b /= f;
            }
            l.start /= f;
        }
        if let Some(l) = &mut s.log {
            l.dataset = (l.dataset / f).max(l.size);
            l.duration = (l.duration / f).max(1);
            l.start /= f;
        }
        s
    }

    /// Every (policy, block size, variant) combination, in file order.
    pub fn runs(&self) -> Vec<RunSpec> {
        let mut out = Vec::new();
        for &policy in &self.policies {
            for &block_size in &self.block_sizes {
                for (vi, variant) in self.variants.iter().enumerate() {
                    let mut label = policy_name(policy).to_string();
                    if self.block_sizes.len() > 1 {
                        label.push('-');
                        label.push_str(&size_label(block_size));
                    }
                    if !variant.name.is_empty() {
                        label.push('-');
                        label.push_str(&variant.name);
                    }
                    out.push(RunSpec {
                        label,
                        policy,
                        block_size,
                        variant: vi,
                    });
                }
            }
        }
        out
    }
}

/// One simulation run of a scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    /// `unified`, `legacy-16K`, `unified-elog-off`, ...
    pub label: String,
    pub policy: ThrottlePolicy,
    pub block_size: u64,
    pub variant: usize,
}

/// `16K`, `128K`, `1M`, `16M`: exact sizes in the largest unit that divides them.
pub fn size_label(b: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{unit}", b >> shift);
        }
    }
    units::format_bytes_short(b)
}

fn vdev_model(key: &str, v: &RawVdev) -> Result<VdevModel, ScenarioError> {
    if v.name.trim().is_empty() {
        return Err(invalid(format!("{key}.name"), "must not be empty"));
    }
    let children = v.children.unwrap_or(1);
    let parity = v.parity.unwrap_or(0);
    if children == 0 {
        return Err(invalid(format!("{key}.children"), "must be at least 1"));
    }
    if parity >= children || parity > 3 {
        return Err(invalid(
            format!("{key}.parity"),
            format!("{parity} parity needs more than {parity} children and at most 3"),
        ));
    }
    let ashift = v.ashift.unwrap_or(12);
    if !(9..=16).contains(&ashift) {
        return Err(invalid(format!("{key}.ashift"), "must be within 9 ..= 16"));
    }
    if v.capacity.0 < (64 << 20) {
        return Err(invalid(format!("{key}.capacity"), "must be at least 64MiB"));
    }
    if v.write_bandwidth.0 <= 0.0 {
        return Err(invalid(
            format!("{key}.write_bandwidth"),
            "must be above zero",
        ));
    }
    let fill_slowdown = v.fill_slowdown.unwrap_or(0.0);
    if !(0.0..1.0).contains(&fill_slowdown) {
        return Err(invalid(
            format!("{key}.fill_slowdown"),
            "must be within 0 ..< 1",
        ));
    }
    let rotational = v.rotational.unwrap_or(false);
    Ok(VdevModel {
        name: v.name.clone(),
        capacity: v.capacity.0,
        write_bandwidth: v.write_bandwidth.0,
        latency: v.latency.map(|d| d.0).unwrap_or(0),
        overhead: v.overhead.map(|d| d.0).unwrap_or(0),
        seek: v.seek.map(|d| d.0).unwrap_or(0),
        rotation: v.rotation.map(|d| d.0).unwrap_or(0),
        rotational,
        children,
        parity,
        ashift,
        fill_slowdown,
        log: v.log.unwrap_or(false),
    })
}

fn load_model(l: RawLoad) -> Result<Load, ScenarioError> {
    let mode = match l.mode.as_str() {
        "full" => LoadMode::Full,
        "rate" => LoadMode::Rate,
        other => {
            return Err(invalid(
                "load.mode",
                format!("unknown mode {other:?} (expected \"full\" or \"rate\")"),
            ));
        }
    };
    let rate = match (mode, l.rate) {
        (LoadMode::Rate, None) => return Err(invalid("load.rate", "mode = \"rate\" needs a rate")),
        (LoadMode::Rate, Some(r)) if r.0 <= 0.0 => {
            return Err(invalid("load.rate", "must be above zero"));
        }
        (_, r) => r.map(|r| r.0).unwrap_or(0.0),
    };
    let streams = l.streams.unwrap_or(1);
    if streams == 0 {
        return Err(invalid("load.streams", "must be at least 1"));
    }
    let passes = l.passes.unwrap_or(1);
    if passes == 0 {
        return Err(invalid("load.passes", "must be at least 1"));
    }
    let amount = match (l.size, l.fill) {
        (Some(_), Some(_)) => return Err(invalid("load", "give size or fill, not both")),
        (Some(s), None) if s.0 == 0 => return Err(invalid("load.size", "must be above zero")),
        (Some(s), None) => Amount::Bytes(s.0),
        (None, Some(f)) if f > 0.0 && f <= 1.0 => Amount::Fill(f),
        (None, Some(_)) => return Err(invalid("load.fill", "must be within 0 <.. 1")),
        (None, None) => Amount::Fill(0.95),
    };
    let allocate_at_sync = match l.allocate.as_deref() {
        Some("write") => false,
        None | Some("sync") => true,
        Some(other) => {
            return Err(invalid(
                "load.allocate",
                format!("{other:?}: expected \"write\" or \"sync\""),
            ));
        }
    };
    let dirty_max = l.dirty_max.map(|s| s.0).unwrap_or(4 << 30);
    if dirty_max == 0 {
        return Err(invalid("load.dirty_max", "must be above zero"));
    }
    Ok(Load {
        mode,
        rate,
        streams,
        passes,
        amount,
        dirty_max,
        start: l.start.map(|d| d.0).unwrap_or(0),
        allocate_at_sync,
    })
}

fn log_model(l: RawLog) -> Result<LogLoad, ScenarioError> {
    let streams = l.streams.unwrap_or(16);
    if streams == 0 {
        return Err(invalid("log.streams", "must be at least 1"));
    }
    let size = l.size.map(|s| s.0).unwrap_or(8 << 10);
    if size == 0 || size > (1 << 20) {
        return Err(invalid("log.size", "must be within 1 ..= 1MiB"));
    }
    let max_block = l.max_block.map(|s| s.0).unwrap_or(128 << 10);
    if !((4 << 10)..=metaslab::SPA_MAXBLOCKSIZE).contains(&max_block) {
        return Err(invalid("log.max_block", "must be within 4K ..= 16MiB"));
    }
    let dataset = l.dataset.map(|s| s.0).unwrap_or(1 << 30);
    if dataset < size {
        return Err(invalid("log.dataset", "must hold at least one record"));
    }
    let max_inflight = l.max_inflight.unwrap_or(1);
    if max_inflight == 0 {
        return Err(invalid("log.max_inflight", "must be at least 1"));
    }
    let duration = l.duration.map(|d| d.0).unwrap_or(60_000_000_000);
    if duration == 0 {
        return Err(invalid("log.duration", "must be above zero"));
    }
    Ok(LogLoad {
        streams,
        size,
        dataset,
        start: l.start.map(|d| d.0).unwrap_or(0),
        duration,
        metaslab_load_cost: l.metaslab_load_cost.map(|d| d.0).unwrap_or(100_000_000),
        max_block,
        max_inflight,
        size_range: l.size_range.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
name = "t"
[load]
mode = "full"
[[vdev]]
name = "a"
capacity = "1GiB"
write_bandwidth = "500MiB/s"
"#;

    fn err(text: &str) -> String {
        Scenario::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn allocate_mode_parses_and_is_checked() {
        // The pipeline is the default.
        assert!(
            Scenario::from_toml(MIN)
                .unwrap()
                .load
                .unwrap()
                .allocate_at_sync
        );
        let write = MIN.replace("mode = \"full\"", "mode = \"full\"\nallocate = \"write\"");
        assert!(
            !Scenario::from_toml(&write)
                .unwrap()
                .load
                .unwrap()
                .allocate_at_sync
        );
        let bad = MIN.replace("mode = \"full\"", "mode = \"full\"\nallocate = \"later\"");
        assert!(err(&bad).contains("load.allocate"), "{}", err(&bad));
        let rate = MIN.replace(
            "mode = \"full\"",
            "mode = \"rate\"\nrate = \"1MiB/s\"\nallocate = \"sync\"",
        );
        // Rate loads go through the txg pipeline too.
        assert!(
            Scenario::from_toml(&rate)
                .unwrap()
                .load
                .unwrap()
                .allocate_at_sync
        );
    }

    #[test]
    fn cpu_split_at_the_throttle_parses_and_is_checked() {
        let sync = MIN.replace("mode = \"full\"", "mode = \"full\"\nallocate = \"sync\"");
        let cpu = |extra: &str| format!("{sync}[cpu]\ncount = 2\nblock_cost = \"100us\"\n{extra}");
        let c = Scenario::from_toml(&cpu("")).unwrap().cpu.unwrap();
        // Defaults: all of the work before the throttle, no dispatch, free
        // writers.
        assert_eq!((c.after_throttle, c.dispatch), (0.0, 0));
        assert_eq!(c.writer_cost(1 << 20), 0);
        assert_eq!(c.before_throttle_cost(4096), 100_000);
        assert_eq!(c.after_throttle_cost(4096), 0);
        let c = Scenario::from_toml(&cpu(
            "bandwidth = \"1GB/s\"\nafter_throttle = 0.25\ndispatch = \"3us\"\nwriter_bandwidth = \"2GB/s\"",
        ))
        .unwrap()
        .cpu
        .unwrap();
        assert_eq!(c.dispatch, 3_000);
        // 128K at 2 GB/s.
        assert_eq!(c.writer_cost(131_072), 65_536);
        // 100 us + 1 ms: a quarter after the throttle, the rest before.
        assert_eq!(c.after_throttle_cost(1_000_000), 275_000);
        assert_eq!(c.before_throttle_cost(1_000_000), 825_000);
        for bad in [
            "after_throttle = 1.5",
            "after_throttle = -0.1",
            "after_throttle = nan",
        ] {
            let e = err(&cpu(bad));
            assert!(e.starts_with("cpu.after_throttle:"), "{bad}: {e}");
        }
    }

    #[test]
    fn device_model_load_cost_and_metadata_parse_and_are_checked() {
        let s = Scenario::from_toml(MIN).unwrap();
        assert_eq!(s.device_model, DeviceModel::Simple);
        assert_eq!(s.metaslab_load_cost, 0);
        assert!(s.metadata.is_none());
        let top = |extra: &str| MIN.replace("name = \"t\"", &format!("name = \"t\"\n{extra}"));
        let s = Scenario::from_toml(&top("device_model = \"leaf\"\nmetaslab_load_cost = \"1s\""))
            .unwrap();
        assert_eq!(s.device_model, DeviceModel::Leaf);
        assert_eq!(s.metaslab_load_cost, 1_000_000_000);
        let e = err(&top("device_model = \"quantum\""));
        assert!(e.starts_with("device_model:"), "{e}");
        assert_eq!(s.preload_taskq, PreloadTaskq::Pool);
        let t = Scenario::from_toml(&top("preload_taskq = \"vdev\"")).unwrap();
        assert_eq!(t.preload_taskq, PreloadTaskq::Vdev);
        let e = err(&top("preload_taskq = \"cpu\""));
        assert!(e.starts_with("preload_taskq:"), "{e}");
        assert_eq!(
            Scenario::from_toml(&top("cpus = 16")).unwrap().cpus,
            Some(16)
        );
        assert!(err(&top("cpus = 0")).starts_with("cpus:"));
        let disk = format!("{MIN}rotational = true\nseek = \"12ms\"\nrotation = \"8333us\"\n");
        let v = &Scenario::from_toml(&disk).unwrap().vdevs[0];
        assert_eq!((v.seek, v.rotation), (12_000_000, 8_333_000));

        let write = MIN.replace("mode = \"full\"", "mode = \"full\"\nallocate = \"write\"");
        let e = err(&format!("{write}[metadata]\n"));
        assert!(e.starts_with("metadata:"), "needs the pipeline: {e}");
        let sync = MIN.replace("mode = \"full\"", "mode = \"full\"\nallocate = \"sync\"");
        let m = Scenario::from_toml(&format!("{sync}[metadata]\n"))
            .unwrap()
            .metadata
            .unwrap();
        assert_eq!(m.redundant, RedundantMetadata::All);
        assert_eq!(m.indirect_block, 128 << 10);
        assert_eq!(m.mos_blocks, 8);
        let m = Scenario::from_toml(&format!(
            "{sync}[metadata]\nredundant_metadata = \"most\"\nindirect_block = \"16K\"\n"
        ))
        .unwrap()
        .metadata
        .unwrap();
        assert_eq!(
            (m.redundant, m.indirect_block),
            (RedundantMetadata::Most, 16 << 10)
        );
        let e = err(&format!(
            "{sync}[metadata]\nredundant_metadata = \"lots\"\n"
        ));
        assert!(e.starts_with("metadata.redundant_metadata:"), "{e}");
        let e = err(&format!("{sync}[metadata]\nindirect_block = \"100K\"\n"));
        assert!(e.starts_with("metadata.indirect_block:"), "{e}");
    }

    #[test]
    fn minimal_scenario_gets_defaults() {
        let s = Scenario::from_toml(MIN).unwrap();
        assert_eq!(s.policies, vec![ThrottlePolicy::Unified]);
        assert_eq!(s.block_sizes, vec![128 << 10]);
        assert_eq!(s.txg_timeout, 5_000_000_000);
        assert_eq!(s.vdevs[0].capacity, 1 << 30);
        assert_eq!(s.vdevs[0].write_bandwidth, 500.0 * 1024.0 * 1024.0);
        assert_eq!(s.load.as_ref().unwrap().amount, Amount::Fill(0.95));
        assert_eq!(s.runs().len(), 1);
    }

    #[test]
    fn units_and_lists_parse() {
        let s = Scenario::from_toml(
            r#"
name = "t"
policies = ["unified", "legacy", "off"]
block_size = ["16K", "128K", 1048576]
txg_timeout = 1
[tunables]
metaslab_aliquot = "1MiB"
zfs_vdev_aggregation_limit = 0
metaslab_bias_enabled = true
[load]
mode = "rate"
rate = "100MiB/s"
size = "512MiB"
[[vdev]]
name = "a"
capacity = "1GiB"
write_bandwidth = 1000000
latency = "100us"
rotational = true
children = 5
parity = 1
[[event]]
at_fill = 0.5
action = "add_vdev"
vdev = { name = "b", capacity = "2GiB", write_bandwidth = "1GB/s" }
"#,
        )
        .unwrap();
        assert_eq!(s.block_sizes, vec![16 << 10, 128 << 10, 1 << 20]);
        assert_eq!(s.txg_timeout, 1_000_000_000);
        assert_eq!(s.vdevs[0].latency, 100_000);
        assert_eq!(s.vdevs[0].total_capacity(), 5 << 30);
        assert_eq!(
            s.tunables,
            vec![
                ("metaslab_aliquot".to_string(), "1MiB".to_string()),
                ("metaslab_bias_enabled".to_string(), "1".to_string()),
                ("zfs_vdev_aggregation_limit".to_string(), "0".to_string()),
            ]
        );
        assert_eq!(s.runs().len(), 9);
        assert_eq!(s.runs()[1].label, "unified-128K");
        match &s.events[0].action {
            Action::AddVdev(v) => assert_eq!(v.write_bandwidth, 1e9),
            a => panic!("{a:?}"),
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err(&MIN.replace("mode = \"full\"", "mode = \"full\"\nspeed = 3"));
        assert!(e.contains("unknown field `speed`"), "{e}");
        let e = err(&format!("{MIN}bandwith = \"1GiB/s\"\n"));
        assert!(e.contains("bandwith"), "{e}");
    }

    #[test]
    fn bad_unit_is_named() {
        let e = err(&MIN.replace("\"1GiB\"", "\"1 parsec\""));
        assert!(e.contains("capacity") || e.contains("1 parsec"), "{e}");
        assert!(e.contains("not a size"), "{e}");
        let e = err(&MIN.replace("\"500MiB/s\"", "\"fast\""));
        assert!(e.contains("not a rate"), "{e}");
    }

    #[test]
    fn no_vdevs_is_refused() {
        let e = err("name = \"t\"\n[load]\nmode = \"full\"\n");
        assert!(e.starts_with("vdev: no data vdevs"), "{e}");
    }

    #[test]
    fn semantic_errors_name_the_key() {
        let e = err(&MIN.replace("mode = \"full\"", "mode = \"rate\""));
        assert!(e.starts_with("load.rate:"), "{e}");
        let e = err(&MIN.replace("name = \"t\"", "name = \"t\"\npolicies = [\"fast\"]"));
        assert!(e.starts_with("policies[0]:"), "{e}");
        let e = err(&format!("{MIN}parity = 1\n"));
        assert!(e.starts_with("vdev[0].parity:"), "{e}");
        let e = err(&format!(
            "{MIN}[[event]]\nat_time = 1\naction = \"explode\"\n"
        ));
        assert!(e.starts_with("event[0].action:"), "{e}");
        let e = err(&format!("{MIN}[[event]]\naction = \"stop_load\"\n"));
        assert!(e.starts_with("event[0]:"), "{e}");
        let e = err(&format!(
            "{MIN}[[event]]\nat_time = 1\naction = \"add_vdev\"\nvdev = {{ name = \"a\", capacity = \"1G\", write_bandwidth = 1 }}\n"
        ));
        assert!(e.contains("used twice"), "{e}");
    }
}
