//! OpenZFS's space-allocation policy, pure: no async, no I/O, no clock, no
//! randomness of its own. Time, device facts and "is the pool busy" come in as
//! arguments, so the allocator service and the simulator run the very same
//! code. See `../../../shared/design/allocation-spec.md` (the spec) for the
//! algorithms; module docs cite its sections.
//!
//! The life of a data allocation:
//! `submit` (admission by the throttle; may queue) → `take_admitted` tells the
//! caller which queued tickets got in → `allocate(ticket, busy)` places the
//! copies → the caller writes → `commit` (or `abort`) releases the throttle
//! bytes and queue depth → `sync` closes the txg and returns what changed.
//! `free` is deferred for `TXG_DEFER_SIZE` syncs.
#![forbid(unsafe_code)]

// API CONTRACT (written by the lead before the implementation; the crate's
// implementer keeps these public names and signatures, adding to them freely).

use std::fmt;

pub type VdevId = u32;
pub type Txg = u64;
pub type AllocationId = u64;
/// A data or log request between `submit` and `allocate`.
pub type Ticket = u64;

pub const SPA_MINBLOCKSIZE: u64 = 512;
pub const SPA_MAXBLOCKSIZE: u64 = 16 << 20;
pub const TXG_INITIAL: Txg = 4;
pub const TXG_DEFER_SIZE: u64 = 2;

/// A contiguous range of one vdev; offset and size in bytes, multiples of the
/// vdev's `1 << ashift`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Extent {
    pub vdev: VdevId,
    pub offset: u64,
    pub size: u64,
}

impl fmt::Display for Extent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{:#x}+{:#x}", self.vdev, self.offset, self.size)
    }
}

/// Which class a vdev's main metaslab group joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VdevRole {
    /// Data vdev (normal class); also gets an embedded_log group.
    Normal,
    /// Dedicated log vdev ("slog").
    Log,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Health {
    Healthy,
    Degraded,
    Faulted,
    Unavailable,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClassKind {
    Normal,
    Log,
    EmbeddedLog,
}

/// What a request allocates for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllocKind {
    /// Async data writes: throttled in the normal class.
    Data,
    /// Intent-log blocks: never throttled; log → embedded_log → normal.
    Log,
}

/// Which class served a log allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LogTier {
    Log,
    EmbeddedLog,
    Normal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ThrottlePolicy {
    /// OpenZFS #17020 (spec §3), the default.
    #[default]
    Unified,
    /// The request-based throttle it replaced (spec §4).
    Legacy,
    /// No admission throttle: rotor and aliquot only.
    Off,
}

/// The facts about a device that placement needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VdevSpec {
    /// Allocatable bytes (asize).
    pub capacity: u64,
    pub ashift: u8,
    /// Children of a RAIDZ-like vdev (1 for a plain device).
    pub children: u32,
    pub parity: u32,
    pub rotational: bool,
    pub role: VdevRole,
    /// The metaslab shift chosen when the vdev was first added (persisted by
    /// the store); `None` chooses it as OpenZFS does (spec §1.6).
    pub metaslab_shift: Option<u8>,
}

/// One allocation request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocRequest {
    pub kind: AllocKind,
    /// Bytes (psize), 1 ..= SPA_MAXBLOCKSIZE.
    pub size: u64,
    /// 1 ..= 3, each copy on a different vdev.
    pub copies: u8,
}

/// What `submit` decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Admitted now: call `allocate(ticket, busy)`.
    Ready(Ticket),
    /// Waiting in the class's FIFO; `take_admitted` will return it.
    Queued(Ticket),
}

/// Placed extents, one per copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocationId,
    pub extents: Vec<Extent>,
    /// The open txg when it was placed.
    pub txg: Txg,
    /// For log allocations, the class that served it.
    pub tier: Option<LogTier>,
    /// Metaslabs this allocation had to load (a cost the simulator models).
    pub metaslab_loads: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpaceChangeKind {
    Alloc,
    Free,
}

/// One durable change, in the order it happened within its txg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpaceChange {
    pub kind: SpaceChangeKind,
    pub extent: Extent,
}

/// What `sync` returns: exactly what the store must persist for `txg`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxgSync {
    pub txg: Txg,
    /// Committed allocations, claims and frees of this txg, in order.
    pub changes: Vec<SpaceChange>,
    /// Bytes whose deferral ended at this sync (allocatable again).
    pub undeferred_bytes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GroupStats {
    pub vdev: VdevId,
    /// Bytes (vs_space of the top-level vdev).
    pub capacity: u64,
    /// Bytes, deferred frees included (as OpenZFS counts them).
    pub alloc: u64,
    pub children: u32,
    pub parity: u32,
    pub aliquot: u64,
    pub queue_target: u64,
    /// Bytes placed and not yet committed.
    pub queue_depth: u64,
    /// Percent; `None` when not known.
    pub fragmentation: Option<u32>,
    pub health: Health,
    pub online: bool,
    pub free_fraction: f64,
    pub allocatable: bool,
    pub embedded_log_metaslab: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClassStats {
    pub kind: ClassKind,
    pub space: u64,
    pub alloc: u64,
    pub deferred: u64,
    pub reserved: u64,
    pub alloc_max: u64,
    pub alloc_io_size: u64,
    pub busy: bool,
    pub waiting: u32,
    pub waiting_bytes: u64,
    pub throttle_enabled: bool,
    pub fragmentation: Option<u32>,
    pub groups: Vec<GroupStats>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VdevStats {
    pub id: VdevId,
    pub spec: VdevSpec,
    pub metaslab_shift: u8,
    pub metaslab_count: u32,
    pub health: Health,
    pub online: bool,
    pub alloc: u64,
    pub embedded_log_metaslab: Option<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    pub open_txg: Txg,
    pub policy: ThrottlePolicy,
    /// Bytes kept back from data (spec §5.6).
    pub slop: u64,
    pub classes: Vec<ClassStats>,
    pub vdevs: Vec<VdevStats>,
}

/// Every error leaves the pool exactly as it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("size must be at least 1 byte")]
    ZeroSize,
    #[error("size {0} is above the 16 MiB maximum block size")]
    TooLarge(u64),
    #[error("copies must be 1, 2 or 3, not {0}")]
    BadCopies(u8),
    #[error("extent {0} is not aligned to its vdev's ashift")]
    Misaligned(Extent),
    #[error("extent {0} lies outside its vdev")]
    OutOfRange(Extent),
    #[error("no vdev {0}")]
    UnknownVdev(VdevId),
    #[error("no allocation {0} in flight")]
    UnknownAllocation(AllocationId),
    #[error("no ticket {0}")]
    UnknownTicket(Ticket),
    #[error("ticket {0} has not been admitted by the throttle")]
    NotAdmitted(Ticket),
    #[error("no space for {size} bytes x{copies}")]
    NoSpace { size: u64, copies: u8 },
    /// Log allocation failed in every class: wait until `until` has synced
    /// (OpenZFS's txg_wait_synced fallback, open txg + TXG_DEFER_SIZE).
    #[error("no log space: wait for txg {until} to sync")]
    TxgWaitRequired { until: Txg },
    #[error("extent {0} is not allocated (double free?)")]
    NotAllocated(Extent),
    #[error("extent {0} is only partly allocated")]
    PartlyAllocated(Extent),
    #[error("claim of {requested} conflicts with allocated {conflicting}")]
    ClaimConflict { requested: Extent, conflicting: Extent },
    #[error("unknown tunable {0}")]
    UnknownTunable(String),
    #[error("bad value {value:?} for {name}: {reason}")]
    BadTunableValue { name: String, value: String, reason: String },
    #[error("bad vdev: {0}")]
    BadVdev(String),
    #[error("inconsistent state: {0}")]
    Inconsistent(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Description of one tunable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunableInfo {
    /// OpenZFS's name.
    pub name: &'static str,
    pub default: String,
    pub description: &'static str,
}

/// OpenZFS's tunables with their names and defaults; validated on set.
#[derive(Clone, Debug, PartialEq)]
pub struct Tunables {
    pub throttle_policy: ThrottlePolicy,
    pub metaslab_aliquot: u64,
    pub metaslab_bias_enabled: bool,
    pub metaslab_perf_bias: u8,
    pub zio_dva_throttle_enabled: bool,
    pub zfs_embedded_slog_min_ms: u64,
    pub zfs_vdev_async_write_active_min_dirty_percent: u64,
    pub zfs_vdev_async_write_active_max_dirty_percent: u64,
    // ... the implementer adds the rest (fragmentation thresholds, df
    // allocator, slop shift, legacy queue depths, metaslab sizing).
}

impl Tunables {
    /// Set by OpenZFS name from a string ("1", "true", "2097152", "2MiB" ...).
    pub fn set(&mut self, _name: &str, _value: &str) -> Result<()> {
        unimplemented!("contract")
    }
    pub fn get(&self, _name: &str) -> Result<String> {
        unimplemented!("contract")
    }
    /// Every tunable with its current value.
    pub fn list(&self) -> Vec<(TunableInfo, String)> {
        unimplemented!("contract")
    }
}

impl Default for Tunables {
    fn default() -> Self {
        unimplemented!("contract")
    }
}

/// The pool: vdevs, their metaslab groups, the classes and the throttle.
pub struct Pool {
    _private: (),
}

impl Pool {
    pub fn new(_tunables: Tunables) -> Pool {
        unimplemented!("contract")
    }
    /// Rebuild a pool from the store: vdevs with their persisted ids and
    /// metaslab shifts, the durable allocated extents, the last synced txg.
    /// Re-selects the embedded log metaslabs. Overlaps or extents outside
    /// their vdev give `Error::Inconsistent` naming the first one.
    pub fn restore(
        _tunables: Tunables,
        _vdevs: Vec<(VdevId, VdevSpec)>,
        _allocated: &[Extent],
        _synced_txg: Txg,
    ) -> Result<Pool> {
        unimplemented!("contract")
    }
    /// Online vdev add; ids are assigned in order from 0. Its metaslabs are
    /// usable after the next sync (OpenZFS's ms_new).
    pub fn add_vdev(&mut self, _spec: VdevSpec) -> Result<VdevId> {
        unimplemented!("contract")
    }
    /// Capacity growth: appends metaslabs of the same size.
    pub fn grow_vdev(&mut self, _vdev: VdevId, _capacity: u64) -> Result<()> {
        unimplemented!("contract")
    }
    pub fn set_health(&mut self, _vdev: VdevId, _health: Health) -> Result<()> {
        unimplemented!("contract")
    }
    /// Administrative online/offline; offline vdevs are not allocatable.
    pub fn set_online(&mut self, _vdev: VdevId, _online: bool) -> Result<()> {
        unimplemented!("contract")
    }
    pub fn tunables(&self) -> &Tunables {
        unimplemented!("contract")
    }
    /// Validated; rebalances the classes.
    pub fn set_tunable(&mut self, _name: &str, _value: &str) -> Result<()> {
        unimplemented!("contract")
    }
    pub fn open_txg(&self) -> Txg {
        unimplemented!("contract")
    }
    /// Validate a request and pass it through the throttle. Log requests are
    /// always `Ready`.
    pub fn submit(&mut self, _req: AllocRequest) -> Result<Submitted> {
        unimplemented!("contract")
    }
    /// Tickets admitted from the FIFO since the last call, in order.
    pub fn take_admitted(&mut self) -> Vec<Ticket> {
        unimplemented!("contract")
    }
    /// Drop a queued or admitted-but-not-placed ticket (the client went away).
    pub fn cancel(&mut self, _ticket: Ticket) -> Result<()> {
        unimplemented!("contract")
    }
    /// The spec's "busy" for a class (preface): reserved + waiting bytes over
    /// alloc_max × (min% + max%) / 200, or any request waiting.
    pub fn busy(&self, _class: ClassKind) -> bool {
        unimplemented!("contract")
    }
    /// Place an admitted ticket. On failure the ticket is consumed and its
    /// reservation released.
    pub fn allocate(&mut self, _ticket: Ticket, _busy: bool) -> Result<Allocation> {
        unimplemented!("contract")
    }
    /// The writes finished: release throttle bytes and queue depth; the
    /// allocation becomes part of the open txg, which is returned.
    pub fn commit(&mut self, _id: AllocationId) -> Result<Txg> {
        unimplemented!("contract")
    }
    /// Never written: release and free the space at once.
    pub fn abort(&mut self, _id: AllocationId) -> Result<()> {
        unimplemented!("contract")
    }
    /// Free committed space; reusable after TXG_DEFER_SIZE more syncs.
    /// All-or-nothing over the slice.
    pub fn free(&mut self, _extents: &[Extent]) -> Result<Txg> {
        unimplemented!("contract")
    }
    /// Re-assert extents after a restart: succeeds when free (allocates them
    /// as committed) or already allocated exactly so. All-or-nothing.
    pub fn claim(&mut self, _extents: &[Extent]) -> Result<Txg> {
        unimplemented!("contract")
    }
    /// Close the open txg: deferred frees move on, balance is recomputed, and
    /// exactly what changed is returned.
    pub fn sync(&mut self) -> TxgSync {
        unimplemented!("contract")
    }
    pub fn stats(&self) -> PoolStats {
        unimplemented!("contract")
    }
    /// Check invariants (no overlaps, per-vdev sums match); the first broken
    /// one is named.
    pub fn verify(&self) -> Result<()> {
        unimplemented!("contract")
    }
}
