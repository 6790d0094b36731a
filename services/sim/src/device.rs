//! One top-level vdev's device queue and transfer model in virtual time.
//!
//! Writes wait in two offset-ordered queues (synchronous first, as OpenZFS's
//! vdev queue serves sync writes before async ones). When the device is free
//! it issues the first queued write at or after the end of the last one (an
//! elevator) and merges offset-contiguous neighbours into it up to the
//! aggregation limit, so a deeper queue of small blocks makes fewer, larger
//! I/Os. An I/O occupies the device for `overhead + bytes / bandwidth` and
//! completes `latency` later; completions therefore stay in issue order.
//!
//! A RAIDZ-like vdev is modelled as one queue over its asize space: every
//! child takes `1 / children` of each write, so the vdev's raw bandwidth is
//! `children ×` a child's (its data bandwidth that of the data children) and
//! its aggregation limit `children ×` the per-child limit.

use std::collections::{BTreeMap, VecDeque};

use crate::scenario::VdevModel;

/// OpenZFS's `zfs_vdev_aggregation_limit` (rotational) default.
pub const AGGREGATION_LIMIT: u64 = 1 << 20;
/// OpenZFS's `zfs_vdev_aggregation_limit_non_rotating` default.
pub const AGGREGATION_LIMIT_NON_ROTATING: u64 = 128 << 10;
/// OpenZFS caps any aggregation at 16 MiB per leaf.
const AGGREGATION_CAP: u64 = 16 << 20;

/// A write issued to the device: when the device is free again and when the
/// write completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Issued {
    pub free_at: u64,
    pub done_at: u64,
}

#[derive(Debug)]
pub struct Device {
    /// Bytes per second over all children (asize bytes).
    raw_bandwidth: f64,
    overhead: u64,
    latency: u64,
    rotational: bool,
    capacity: u64,
    fill_slowdown: f64,
    /// Vdev-level bytes; 0 = never merge.
    aggregation_limit: u64,
    /// (offset, tag) → size.
    sync_queue: BTreeMap<(u64, u32), u64>,
    async_queue: BTreeMap<(u64, u32), u64>,
    busy: bool,
    last_end: u64,
    /// Tags of issued I/Os in completion order, with batch lengths.
    inflight_tags: VecDeque<u32>,
    inflight_batches: VecDeque<(u32, u64)>,
    /// Used fraction, set by the simulator; slows non-rotational devices.
    pub used_fraction: f64,
    /// Cumulative bytes completed.
    pub bytes_done: u64,
    pub ios_done: u64,
    /// Bytes queued or in flight.
    pub queued_bytes: u64,
}

impl Device {
    /// `aggregation_limit` is per child, as the tunable is per leaf.
    pub fn new(model: &VdevModel, aggregation_limit: u64) -> Device {
        let per_child = aggregation_limit.min(AGGREGATION_CAP);
        Device {
            raw_bandwidth: model.raw_bandwidth(),
            overhead: model.overhead,
            latency: model.latency,
            rotational: model.rotational,
            capacity: model.total_capacity().max(1),
            fill_slowdown: model.fill_slowdown,
            aggregation_limit: per_child.saturating_mul(model.children as u64),
            sync_queue: BTreeMap::new(),
            async_queue: BTreeMap::new(),
            busy: false,
            last_end: 0,
            inflight_tags: VecDeque::new(),
            inflight_batches: VecDeque::new(),
            used_fraction: 0.0,
            bytes_done: 0,
            ios_done: 0,
            queued_bytes: 0,
        }
    }

    pub fn enqueue(&mut self, offset: u64, size: u64, tag: u32, sync: bool) {
        let q = if sync {
            &mut self.sync_queue
        } else {
            &mut self.async_queue
        };
        q.insert((offset, tag), size);
        self.queued_bytes += size;
    }

    pub fn is_busy(&self) -> bool {
        self.busy
    }

    pub fn queue_len(&self) -> usize {
        self.sync_queue.len() + self.async_queue.len()
    }

    /// Nanoseconds to transfer `bytes` at `offset`.
    fn transfer_time(&self, offset: u64, bytes: u64) -> u64 {
        let slow = if self.rotational {
            // Outer tracks first: bandwidth falls with the LBA.
            self.fill_slowdown * (offset as f64 / self.capacity as f64).min(1.0)
        } else {
            self.fill_slowdown * self.used_fraction.clamp(0.0, 1.0)
        };
        let bw = self.raw_bandwidth * (1.0 - slow);
        self.overhead + (bytes as f64 * 1e9 / bw).ceil() as u64
    }

    /// If idle with work queued, issue the next (possibly merged) write.
    pub fn issue(&mut self, now: u64) -> Option<Issued> {
        if self.busy {
            return None;
        }
        let q = if !self.sync_queue.is_empty() {
            &mut self.sync_queue
        } else if !self.async_queue.is_empty() {
            &mut self.async_queue
        } else {
            return None;
        };
        let (&(first_off, first_tag), &first_size) = q
            .range((self.last_end, 0)..)
            .next()
            .or_else(|| q.iter().next())
            .expect("queue is not empty");
        q.remove(&(first_off, first_tag));
        let mut start = first_off;
        let mut end = first_off + first_size;
        let mark = self.inflight_tags.len();
        self.inflight_tags.push_back(first_tag);
        let limit = self.aggregation_limit;
        if limit > 0 {
            // Forward: writes beginning exactly where the span ends.
            while let Some((&(off, tag), &size)) = q.range((end, 0)..).next() {
                if off != end || end + size - start > limit {
                    break;
                }
                q.remove(&(off, tag));
                self.inflight_tags.push_back(tag);
                end += size;
            }
            // Backward: writes ending exactly where the span starts.
            while let Some((&(off, tag), &size)) = q.range(..(start, 0)).next_back() {
                if off + size != start || end - off > limit {
                    break;
                }
                q.remove(&(off, tag));
                self.inflight_tags.push_back(tag);
                start = off;
            }
        }
        let bytes = end - start;
        let count = (self.inflight_tags.len() - mark) as u32;
        self.inflight_batches.push_back((count, bytes));
        self.busy = true;
        self.last_end = end;
        let free_at = now + self.transfer_time(start, bytes);
        Some(Issued {
            free_at,
            done_at: free_at + self.latency,
        })
    }

    /// The device finished transferring; it may issue again.
    pub fn set_free(&mut self) {
        self.busy = false;
    }

    /// The oldest issued I/O completed: its tags are appended to `out`.
    pub fn complete(&mut self, out: &mut Vec<u32>) {
        let (count, bytes) = self
            .inflight_batches
            .pop_front()
            .expect("a completion for an issued I/O");
        out.extend(self.inflight_tags.drain(..count as usize));
        self.bytes_done += bytes;
        self.ios_done += 1;
        self.queued_bytes -= bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(bw: f64, children: u32) -> VdevModel {
        VdevModel {
            name: "d".into(),
            capacity: 1 << 30,
            write_bandwidth: bw,
            latency: 1_000,
            overhead: 10_000,
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
    fn contiguous_writes_merge_up_to_the_limit() {
        let mut d = Device::new(&model(1e9, 1), 128 << 10);
        // Eight contiguous 32K writes, queued out of order.
        for i in [3u64, 0, 1, 2, 7, 5, 6, 4] {
            d.enqueue(i * 32768, 32768, i as u32, false);
        }
        let a = d.issue(0).unwrap();
        assert!(d.issue(0).is_none(), "busy until free");
        // 128K at 1 GB/s = 131072 ns plus 10 µs overhead.
        assert_eq!(a.free_at, 10_000 + 131_072);
        assert_eq!(a.done_at, a.free_at + 1_000);
        d.set_free();
        let b = d.issue(a.free_at).unwrap();
        assert_eq!(b.free_at - a.free_at, 10_000 + 131_072);
        let mut tags = Vec::new();
        d.complete(&mut tags);
        assert_eq!(tags, vec![0, 1, 2, 3]);
        tags.clear();
        d.complete(&mut tags);
        assert_eq!(tags, vec![4, 5, 6, 7]);
        assert_eq!(d.bytes_done, 256 << 10);
        assert_eq!(d.ios_done, 2);
        assert_eq!(d.queued_bytes, 0);
    }

    #[test]
    fn gaps_and_zero_limit_prevent_merging() {
        let mut d = Device::new(&model(1e9, 1), 0);
        d.enqueue(0, 4096, 0, false);
        d.enqueue(4096, 4096, 1, false);
        d.issue(0).unwrap();
        d.set_free();
        d.issue(0).unwrap();
        let mut tags = Vec::new();
        d.complete(&mut tags);
        assert_eq!(tags, vec![0]);

        let mut d = Device::new(&model(1e9, 1), 1 << 20);
        d.enqueue(0, 4096, 0, false);
        d.enqueue(8192, 4096, 1, false);
        d.issue(0).unwrap();
        let mut tags = Vec::new();
        d.complete(&mut tags);
        assert_eq!(tags, vec![0], "a gap is never bridged for writes");
    }

    #[test]
    fn sync_writes_go_first_and_merge_backwards() {
        let mut d = Device::new(&model(1e9, 1), 1 << 20);
        d.enqueue(0, 4096, 9, false);
        d.enqueue(0x10000, 0x1000, 5, true);
        d.issue(0).unwrap();
        d.set_free();
        // The elevator picks 0x11000 (at the last end); 0x10c00 ends there.
        d.enqueue(0x11000, 0x1000, 1, true);
        d.enqueue(0x10c00, 0x400, 2, true);
        d.issue(0).unwrap();
        let mut tags = Vec::new();
        d.complete(&mut tags);
        assert_eq!(tags, vec![5]);
        tags.clear();
        d.complete(&mut tags);
        assert_eq!(tags, vec![1, 2]);
        assert_eq!(d.bytes_done, 0x1000 + 0x1400);
    }

    #[test]
    fn small_ios_cost_overhead_raidz_scales_bandwidth() {
        // 5 children at 100 MB/s: 500 MB/s raw.
        let m = model(1e8, 5);
        let d = Device::new(&m, 1 << 20);
        assert_eq!(d.aggregation_limit, 5 << 20);
        assert_eq!(d.transfer_time(0, 500_000), 10_000 + 1_000_000);
    }

    #[test]
    fn rotational_slowdown_follows_the_lba() {
        let mut m = model(1e9, 1);
        m.rotational = true;
        m.fill_slowdown = 0.5;
        let d = Device::new(&m, 0);
        let outer = d.transfer_time(0, 1_000_000);
        let inner = d.transfer_time(1 << 30, 1_000_000);
        assert_eq!(outer, 10_000 + 1_000_000);
        assert_eq!(inner, 10_000 + 2_000_000);
    }
}
