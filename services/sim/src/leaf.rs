//! The per-leaf device model (`device_model = "leaf"`): OpenZFS's vdev
//! queue in front of every leaf disk of a top-level vdev.
//!
//! A top-level write is split over the vdev's leaves (a RAIDZ block's
//! columns: each child gets `1 / children` of its asize at child offset
//! `offset / children`, so top-level-contiguous blocks stay contiguous on
//! every child). Each leaf has its own offset-ordered queues and issues at
//! most `active` async writes at a time, `active` scaled by dirty data as
//! `vdev_queue_max_async_writes` does (OpenZFS vdev_queue.c, zfs-2.3.0):
//! `zfs_vdev_async_write_min_active` below
//! `zfs_vdev_async_write_active_min_dirty_percent` of the dirty limit,
//! `max_active` above `…_max_dirty_percent`, linear between. Sync writes
//! go first, at most `zfs_vdev_sync_write_max_active` of them. When a leaf
//! may issue, it takes the first queued write at or after the end of the
//! last one it issued (the elevator of `vdev_queue_io_to_issue`) and
//! aggregates offset-contiguous neighbours up to the aggregation limit, so
//! the fewer writes a leaf may have in flight, the more its queue merges.
//!
//! The disk behind the queue serves the I/Os it was handed one after
//! another: `overhead` + a seek on rotational disks when the I/O does not
//! start where the head is (`seek × √(distance / capacity)`: short seeks
//! are cheap, a full stroke costs `seek`) + `bytes / bandwidth` (slower
//! towards the inner tracks by `fill_slowdown`). An I/O completes `latency`
//! after the disk has served it; that latency overlaps other I/Os, but only
//! `active` of them, so a leaf with few writes in flight idles between
//! them (Little's law: at most `active × size / (service + latency)`).

use std::collections::{BTreeMap, VecDeque};

use crate::scenario::VdevModel;

/// OpenZFS caps any aggregation at 16 MiB per leaf.
const AGGREGATION_CAP: u64 = 16 << 20;

/// The vdev-queue limits every leaf uses (tunables of the run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    pub async_min_active: u32,
    pub async_max_active: u32,
    pub min_dirty_percent: u64,
    pub max_dirty_percent: u64,
    pub sync_max_active: u32,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            async_min_active: 2,
            async_max_active: 10,
            min_dirty_percent: 30,
            max_dirty_percent: 60,
            sync_max_active: 10,
        }
    }
}

impl QueueLimits {
    /// `vdev_queue_max_async_writes`: async writes a leaf may have in flight
    /// at `dirty` bytes of dirty data against `dirty_max`.
    pub fn async_active(&self, dirty: u64, dirty_max: u64) -> u32 {
        let min_bytes = dirty_max as u128 * self.min_dirty_percent as u128 / 100;
        let max_bytes = dirty_max as u128 * self.max_dirty_percent as u128 / 100;
        let dirty = dirty as u128;
        let (lo, hi) = (self.async_min_active, self.async_max_active.max(1));
        if dirty < min_bytes {
            return lo.max(1);
        }
        if dirty > max_bytes || max_bytes <= min_bytes {
            return hi;
        }
        let span = (hi.saturating_sub(lo)) as u128;
        let w = (dirty - min_bytes) * span / (max_bytes - min_bytes) + lo as u128;
        (w as u32).clamp(1, hi)
    }
}

/// One I/O handed to a leaf's disk: how many queued pieces it carries and
/// its bytes.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    pieces: u32,
    bytes: u64,
    sync: bool,
}

#[derive(Debug, Default)]
struct Leaf {
    /// (child offset, tag) → size.
    sync_queue: BTreeMap<(u64, u32), u64>,
    async_queue: BTreeMap<(u64, u32), u64>,
    /// End of the last issued I/O (where the elevator continues).
    last_end: u64,
    /// End of the last I/O the disk served (the head) and when it is free.
    head: u64,
    disk_free_at: u64,
    sync_active: u32,
    async_active: u32,
    inflight: VecDeque<InFlight>,
    tags: VecDeque<u32>,
}

#[derive(Debug)]
pub struct LeafDevice {
    leaves: Vec<Leaf>,
    /// Bytes per second of one leaf.
    bandwidth: f64,
    overhead: u64,
    latency: u64,
    seek: u64,
    rotation: u64,
    rotational: bool,
    /// One leaf's bytes.
    leaf_capacity: u64,
    fill_slowdown: f64,
    /// Per leaf; 0 = never merge.
    aggregation_limit: u64,
    /// Used fraction, set by the simulator; slows non-rotational devices.
    pub used_fraction: f64,
    /// Cumulative bytes completed over all leaves.
    pub bytes_done: u64,
    pub ios_done: u64,
}

/// A write handed to leaf `leaf` that completes at `done_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeafIssued {
    pub leaf: u32,
    pub done_at: u64,
}

impl LeafDevice {
    /// `aggregation_limit` is per leaf, as the tunable is.
    pub fn new(model: &VdevModel, aggregation_limit: u64) -> LeafDevice {
        let n = model.children.max(1) as usize;
        LeafDevice {
            leaves: (0..n).map(|_| Leaf::default()).collect(),
            bandwidth: model.write_bandwidth,
            overhead: model.overhead,
            latency: model.latency,
            seek: model.seek,
            rotation: model.rotation,
            rotational: model.rotational,
            leaf_capacity: model.capacity.max(1),
            fill_slowdown: model.fill_slowdown,
            aggregation_limit: aggregation_limit.min(AGGREGATION_CAP),
            used_fraction: 0.0,
            bytes_done: 0,
            ios_done: 0,
        }
    }

    pub fn leaves(&self) -> usize {
        self.leaves.len()
    }

    /// Queue a top-level write on every leaf; returns the pieces queued
    /// (each completes on its own).
    pub fn enqueue(&mut self, offset: u64, size: u64, tag: u32, sync: bool) -> u32 {
        let n = self.leaves.len() as u64;
        // Floor both ends so that the next block's pieces start exactly
        // where this one's end (RAIDZ asizes are rarely multiples of n).
        let start = offset / n;
        let end = (offset + size) / n;
        let piece = (end - start).max(1);
        for leaf in &mut self.leaves {
            let q = if sync {
                &mut leaf.sync_queue
            } else {
                &mut leaf.async_queue
            };
            q.insert((start, tag), piece);
        }
        n as u32
    }

    /// Nanoseconds the disk spends on `bytes` at `offset` with its head at
    /// `head`, starting at `begin` after it went idle at `free_at`.
    fn service_time(&self, head: u64, offset: u64, bytes: u64, begin: u64, free_at: u64) -> u64 {
        let slow = if self.rotational {
            self.fill_slowdown * (offset as f64 / self.leaf_capacity as f64).min(1.0)
        } else {
            self.fill_slowdown * self.used_fraction.clamp(0.0, 1.0)
        };
        let bw = self.bandwidth * (1.0 - slow);
        let seek = if self.rotational && self.seek > 0 && offset != head {
            let d = offset.abs_diff(head) as f64 / self.leaf_capacity as f64;
            (self.seek as f64 * d.min(1.0).sqrt()) as u64
        } else {
            0
        };
        // Rotational delay: none while streaming (the next sector is under
        // the head as the last write ends); after a seek half a
        // revolution on average; after idling, until the sector that was
        // under the head when the disk went idle comes round again.
        let rot = if !self.rotational || self.rotation == 0 {
            0
        } else if offset != head {
            self.rotation / 2
        } else if begin > free_at {
            let r = (begin - free_at) % self.rotation;
            if r == 0 { 0 } else { self.rotation - r }
        } else {
            0
        };
        self.overhead + seek + rot + (bytes as f64 * 1e9 / bw).ceil() as u64
    }

    /// Hand every leaf as many writes as its limits allow now; the writes
    /// issued are appended to `out`.
    pub fn issue(
        &mut self,
        now: u64,
        async_active: u32,
        sync_active: u32,
        out: &mut Vec<LeafIssued>,
    ) {
        for i in 0..self.leaves.len() {
            loop {
                let leaf = &self.leaves[i];
                let sync = if !leaf.sync_queue.is_empty() && leaf.sync_active < sync_active {
                    true
                } else if !leaf.async_queue.is_empty() && leaf.async_active < async_active {
                    false
                } else {
                    break;
                };
                let (start, bytes) = self.aggregate(i, sync);
                let leaf = &self.leaves[i];
                let begin = now.max(leaf.disk_free_at);
                let served =
                    begin + self.service_time(leaf.head, start, bytes, begin, leaf.disk_free_at);
                let leaf = &mut self.leaves[i];
                leaf.disk_free_at = served;
                leaf.head = start + bytes;
                if sync {
                    leaf.sync_active += 1;
                } else {
                    leaf.async_active += 1;
                }
                out.push(LeafIssued {
                    leaf: i as u32,
                    done_at: served + self.latency,
                });
            }
        }
    }

    /// Take the elevator's next write from leaf `i`'s queue and merge its
    /// contiguous neighbours into it; returns the I/O's (offset, bytes).
    fn aggregate(&mut self, i: usize, sync: bool) -> (u64, u64) {
        let limit = self.aggregation_limit;
        let leaf = &mut self.leaves[i];
        let q = if sync {
            &mut leaf.sync_queue
        } else {
            &mut leaf.async_queue
        };
        let (&(first_off, first_tag), &first_size) = q
            .range((leaf.last_end, 0)..)
            .next()
            .or_else(|| q.iter().next())
            .expect("queue is not empty");
        q.remove(&(first_off, first_tag));
        let mut start = first_off;
        let mut end = first_off + first_size;
        let mut pieces = 1;
        leaf.tags.push_back(first_tag);
        if limit > 0 {
            while let Some((&(off, tag), &size)) = q.range((end, 0)..).next() {
                if off != end || end + size - start > limit {
                    break;
                }
                q.remove(&(off, tag));
                leaf.tags.push_back(tag);
                pieces += 1;
                end += size;
            }
            while let Some((&(off, tag), &size)) = q.range(..(start, 0)).next_back() {
                if off + size != start || end - off > limit {
                    break;
                }
                q.remove(&(off, tag));
                leaf.tags.push_back(tag);
                pieces += 1;
                start = off;
            }
        }
        leaf.last_end = end;
        leaf.inflight.push_back(InFlight {
            pieces,
            bytes: end - start,
            sync,
        });
        (start, end - start)
    }

    /// Leaf `leaf`'s oldest I/O completed: the tags of its pieces are
    /// appended to `out`.
    pub fn complete(&mut self, leaf: u32, out: &mut Vec<u32>) {
        let l = &mut self.leaves[leaf as usize];
        let io = l
            .inflight
            .pop_front()
            .expect("a completion for an issued I/O");
        out.extend(l.tags.drain(..io.pieces as usize));
        if io.sync {
            l.sync_active -= 1;
        } else {
            l.async_active -= 1;
        }
        self.bytes_done += io.bytes;
        self.ios_done += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(children: u32, latency: u64) -> VdevModel {
        VdevModel {
            name: "d".into(),
            capacity: 1 << 30,
            write_bandwidth: 1e9,
            latency,
            overhead: 0,
            seek: 0,
            rotation: 0,
            rotational: false,
            children,
            parity: 0,
            ashift: 12,
            fill_slowdown: 0.0,
            log: false,
        }
    }

    #[test]
    fn async_active_scales_with_dirty_data() {
        let l = QueueLimits::default();
        let max = 1000;
        assert_eq!(l.async_active(0, max), 2);
        assert_eq!(l.async_active(299, max), 2);
        // Halfway between 30 % and 60 %: 2 + 8 / 2.
        assert_eq!(l.async_active(450, max), 6);
        assert_eq!(l.async_active(600, max), 10);
        assert_eq!(l.async_active(900, max), 10);
    }

    #[test]
    fn a_leaf_holds_at_most_active_writes_and_aggregates_the_rest() {
        let mut d = LeafDevice::new(&model(1, 1_000_000), 128 << 10);
        // 16 scattered 4K writes (no merging possible) and 2 may be active.
        for i in 0..16u64 {
            d.enqueue(i * 65536, 4096, i as u32, false);
        }
        let mut out = Vec::new();
        d.issue(0, 2, 10, &mut out);
        assert_eq!(out.len(), 2);
        // Served back to back (4096 ns each), each 1 ms later.
        assert_eq!(out[0].done_at, 4096 + 1_000_000);
        assert_eq!(out[1].done_at, 2 * 4096 + 1_000_000);
        let mut tags = Vec::new();
        d.complete(0, &mut tags);
        assert_eq!(tags, vec![0]);
        out.clear();
        d.issue(1_004_096, 2, 10, &mut out);
        assert_eq!(out.len(), 1, "one slot freed");

        // Contiguous writes queued while the slots are full merge.
        let mut d = LeafDevice::new(&model(1, 1_000_000), 128 << 10);
        for i in 0..40u64 {
            d.enqueue(i * 4096, 4096, i as u32, false);
        }
        out.clear();
        d.issue(0, 1, 10, &mut out);
        assert_eq!(out.len(), 1);
        tags.clear();
        d.complete(0, &mut tags);
        assert_eq!(tags.len(), 32, "128K of 4K pieces in one I/O");
        assert_eq!(d.bytes_done, 128 << 10);
    }

    #[test]
    fn raidz_pieces_go_to_every_child_at_offset_over_children() {
        let mut d = LeafDevice::new(&model(5, 0), 1 << 20);
        // Two contiguous 160K blocks: 32K per child each, contiguous per child.
        assert_eq!(d.enqueue(0, 160 << 10, 1, false), 5);
        assert_eq!(d.enqueue(160 << 10, 160 << 10, 2, false), 5);
        let mut out = Vec::new();
        d.issue(0, 10, 10, &mut out);
        assert_eq!(out.len(), 5, "one merged I/O per child");
        // 64K per child at 1 GB/s.
        assert!(out.iter().all(|o| o.done_at == 65536), "{out:?}");
        let mut tags = Vec::new();
        for c in 0..5 {
            d.complete(c, &mut tags);
        }
        assert_eq!(tags.len(), 10);
        assert_eq!(d.bytes_done, 5 * (64 << 10));
    }

    #[test]
    fn rotational_seeks_cost_by_distance_and_sync_goes_first() {
        let mut m = model(1, 0);
        m.rotational = true;
        m.seek = 10_000_000;
        let mut d = LeafDevice::new(&m, 0);
        d.enqueue(0, 4096, 0, false);
        // A quarter of the disk away: √0.25 × 10 ms.
        d.enqueue(1 << 28, 4096, 1, true);
        let mut out = Vec::new();
        d.issue(0, 1, 1, &mut out);
        assert_eq!(out.len(), 2);
        // Sync first, from head 0 to 256 MiB: 5 ms seek.
        assert_eq!(out[0].done_at, 5_000_000 + 4096);
        // Then back to 0: another 5 ms seek (from its end, a hair further).
        assert!(out[1].done_at > 2 * 5_000_000 + 2 * 4096, "{out:?}");
        let mut tags = Vec::new();
        d.complete(0, &mut tags);
        assert_eq!(tags, vec![1]);
    }

    #[test]
    fn an_idle_disk_waits_for_its_sector_a_streaming_one_does_not() {
        let mut m = model(1, 0);
        m.rotational = true;
        m.rotation = 8_000_000;
        let mut d = LeafDevice::new(&m, 0);
        let mut out = Vec::new();
        d.enqueue(0, 4096, 0, false);
        d.enqueue(4096, 4096, 1, false);
        d.issue(0, 2, 1, &mut out);
        // Head at 0 and the disk never idled: both stream.
        assert_eq!(out[0].done_at, 4096);
        assert_eq!(out[1].done_at, 2 * 4096);
        // The next contiguous write arrives 1 ms after the disk went idle:
        // 7 ms until its sector is back.
        d.enqueue(8192, 4096, 2, false);
        out.clear();
        let t = 2 * 4096 + 1_000_000;
        d.issue(t, 3, 1, &mut out);
        assert_eq!(out[0].done_at, t + 7_000_000 + 4096);
    }
}
