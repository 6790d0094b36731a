//! OpenZFS's space-allocation policy, pure: no async, no I/O, no clock, no
//! randomness of its own. Time, device facts and "is the pool busy" come in as
//! arguments, so the allocator service and the simulator run the very same
//! code. `DESIGN.md` beside this crate describes the policy as implemented,
//! the OpenZFS function each rule comes from, and where Aliquot differs.
//! Comments cite OpenZFS as `file.c:function@tag`.
//!
//! The life of a data allocation:
//! `submit` (admission by the throttle; may queue) → `take_admitted` tells the
//! caller which queued tickets got in → `allocate(ticket, busy)` places the
//! copies → the caller writes → `commit` (or `abort`) releases the throttle
//! bytes and queue depth → `sync` closes the txg and returns what changed.
//! `free` is deferred for `TXG_DEFER_SIZE` syncs.
#![forbid(unsafe_code)]

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
    /// OpenZFS #17020 (zfs-2.4.0), the default.
    #[default]
    Unified,
    /// The request-based throttle it replaced (zfs-2.3.0).
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
    /// the store); `None` chooses it as OpenZFS does
    /// (`vdev.c:vdev_metaslab_set_size@zfs-2.4.0`).
    pub metaslab_shift: Option<u8>,
}

/// One allocation request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocRequest {
    pub kind: AllocKind,
    /// Bytes (psize), 1 ..= SPA_MAXBLOCKSIZE.
    pub size: u64,
    /// 1 ..= 3: copies go to distinct vdevs while the ring has enough;
    /// otherwise a vdev takes a second copy in another of its metaslabs.
    pub copies: u8,
    /// Intent-log blocks only: the largest size the caller can use. The
    /// allocation is then any size in `[size, max_size]` that one free
    /// segment holds, so a log block that fits smaller stays in its class
    /// (`zio_alloc_zil` → `metaslab_alloc_range@zfs-2.4.0`); the extents
    /// say what was given. `None`: exactly `size`.
    pub max_size: Option<u64>,
    /// Which allocator places it (`spa_alloc_count` of them): the one this
    /// key hashes to, so a stream of blocks that gives one key keeps one
    /// allocator, its rotor and its active metaslabs (OpenZFS hashes the
    /// objset, object, level and 2^20-block region of a data block,
    /// `spa.c:spa_select_allocator@zfs-2.4.0`, and the dataset of a log
    /// block, `zio_alloc_zil`). `None`: the allocators in turn.
    pub affinity: Option<u64>,
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
    /// Bytes of the block every copy holds: the request's size, or for a
    /// ranged log block what was given (an extent's size is its vdev's
    /// asize, parity included on RAIDZ).
    pub psize: u64,
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
    /// Metaslabs `(vdev, metaslab id)` this sync queued for preload
    /// (`metaslab.c:metaslab_group_preload@zfs-2.4.0`), in queue order. The
    /// crate treats them as loaded at once; a caller with a clock may charge
    /// their load time (OpenZFS loads them on the preload taskq, and an
    /// allocation that picks one still loading waits for it).
    pub preloaded: Vec<(VdevId, u32)>,
    /// The pool checked `changes` against its in-memory space maps as it
    /// closed the txg ([`Pool::txg_changes_fit`]): every freed extent is in
    /// this txg's freeing tree, no allocation overlaps allocatable or
    /// deferred space or another allocation of the txg. A store may then
    /// skip checking them against its own durable extents; false (a record
    /// made by hand, or a check that failed) asks it to check.
    pub checked: bool,
}

/// Description of one tunable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunableInfo {
    /// OpenZFS's name.
    pub name: &'static str,
    pub default: String,
    pub description: &'static str,
}

mod admission;
pub mod balance_score;
mod class;
mod class_balance;
mod error;
mod group;
mod hold;
mod metaslab;
pub mod move_plan;
mod placement;
pub mod pool;
mod range_tree;
mod relocation;
mod removal;
mod space;
mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod throttle;
mod tunables;
mod txg;
mod txg_sync;
pub mod vdev;

pub use error::{Error, NoSpaceReason, Result};
pub use pool::Pool;
pub use stats::{ClassStats, GroupStats, PoolStats, VdevStats};
pub use tunables::Tunables;
pub use vdev::{Asize, Psize};
