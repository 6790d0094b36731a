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
//! The disk behind the queue holds the I/Os it was handed (at most
//! `active`, the vdev queue's limit) in its own command queue and serves
//! them one at a time: `overhead` + on rotational disks a seek when the
//! I/O does not start where the head is (`seek × √(distance / capacity)`:
//! short seeks are cheap, a full stroke costs `seek`) and the wait for its
//! sector to come under the head (below) + `bytes / bandwidth` (slower
//! towards the inner tracks by `fill_slowdown`). An I/O completes
//! `latency` after the disk has served it; that latency overlaps other
//! I/Os, but only `active` of them, so a leaf with few writes in flight
//! idles between them (Little's law: at most `active × size / (service +
//! latency)`).
//!
//! **Where the sector is.** A track holds one revolution of bytes
//! (`bandwidth × rotation`), so the sector of child offset `o` sits at
//! angle `(o / track) mod 1` and the platter is at angle `(t / rotation)
//! mod 1` at time `t`. A write that starts at the head as the last one
//! ends streams (no wait); after the disk idled, the sector that was under
//! the head comes round again; after a seek the disk waits until the
//! target's angle is under the head: half a revolution on average, as
//! before, but now a property of the command that the disk can compare.
//!
//! **Which command a rotational disk serves next (NCQ/TCQ).** A SATA or
//! SAS disk with several commands queued does not serve them in arrival
//! order: its firmware serves the one it can reach first (shortest
//! positioning time first: seek plus rotational wait). The model does the
//! same among the commands the vdev queue has handed it (the oldest on a
//! tie). A command that continues where the head is reaches it at once,
//! so a write front's consecutive writes stream even when the vdev queue
//! handed them interleaved with other fronts' (OpenZFS gives every
//! allocator its own metaslab per group, four with 16+ CPUs; the vdev
//! queue's elevator continues after the last offset it issued and wraps,
//! so with several fronts it alternates between them), and among commands
//! elsewhere the disk takes the nearest in time rather than paying half a
//! turn for each. With one front, or one command queued, nothing changes.
//! This uses only the disk's own figures (seek, rotation, bandwidth).
//! What is not modelled: the firmware's starvation limits, track skew
//! and zones beyond `fill_slowdown`, and the volatile write cache (writes
//! acknowledged into the drive's DRAM and destaged in its own order),
//! whose size and policy vary by drive and would need constants to be
//! chosen. Non-rotational leaves serve in arrival order (nothing to
//! position). Served nearest-offset first (shortest seek, no angle) the
//! disks did worse than in arrival order (README, "Per-leaf device queues, load
//! cost, metadata").

use std::collections::BTreeMap;

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

/// One I/O handed to a leaf's disk: where it is, its bytes and the tags of
/// the queued pieces it carries.
#[derive(Clone, Debug, Default)]
struct Io {
    start: u64,
    bytes: u64,
    sync: bool,
    tags: Vec<u32>,
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
    /// When the wake-up (`LeafEvent` without an I/O) last asked for is due;
    /// an earlier one still in the simulator's queue is stale.
    wake_at: Option<u64>,
    sync_active: u32,
    async_active: u32,
    /// Every I/O issued and not completed, by id (free ids in `spare`; an
    /// entry keeps its tag buffer for reuse).
    ios: Vec<Io>,
    spare: Vec<u32>,
    /// The disk's command queue: ids handed to it and not yet served, in
    /// arrival order.
    disk_queue: Vec<u32>,
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
    /// Serve the queued command the disk reaches first (rotational disks;
    /// otherwise in arrival order).
    reorder: bool,
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
    /// I/Os the disks served away from their head (a seek), over all leaves.
    pub seeks: u64,
}

/// What the simulator must schedule for leaf `leaf` at `at`: the
/// completion of its I/O `io`, or (`io == None`) its disk being free to
/// serve the next queued command (`LeafDevice::wake`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeafEvent {
    pub leaf: u32,
    pub at: u64,
    pub io: Option<u32>,
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
            reorder: model.rotational,
            leaf_capacity: model.capacity.max(1),
            fill_slowdown: model.fill_slowdown,
            aggregation_limit: aggregation_limit.min(AGGREGATION_CAP),
            used_fraction: 0.0,
            bytes_done: 0,
            ios_done: 0,
            seeks: 0,
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

    /// Bytes per second at `offset` (slower towards the inner tracks on
    /// rotational disks, as the device fills otherwise).
    fn bandwidth_at(&self, offset: u64) -> f64 {
        let slow = if self.rotational {
            self.fill_slowdown * (offset as f64 / self.leaf_capacity as f64).min(1.0)
        } else {
            self.fill_slowdown * self.used_fraction.clamp(0.0, 1.0)
        };
        self.bandwidth * (1.0 - slow)
    }

    /// Nanoseconds from `begin` until the disk, its head at `head` and idle
    /// since `free_at`, can start writing at `offset`: `overhead`, on
    /// rotational disks the seek and the wait for the sector.
    ///
    /// The rotational wait follows the platter's angle. A track holds one
    /// revolution of bytes (`bandwidth × rotation`), so the sector of
    /// `offset` sits at angle `(offset / track) mod 1`, and the platter is
    /// at angle `(t / rotation) mod 1` at time `t`. Streaming (the write
    /// starts at the head as the last one ends) waits nothing; after idling
    /// the sector that was under the head comes round again; after a seek
    /// the wait is until the target sector's angle comes under the head,
    /// on average half a revolution, but known to the disk in advance,
    /// which is what lets it choose the command it reaches first.
    fn position_time(&self, head: u64, offset: u64, begin: u64, free_at: u64) -> u64 {
        if !self.rotational {
            return self.overhead;
        }
        let seek = if self.seek > 0 && offset != head {
            let d = offset.abs_diff(head) as f64 / self.leaf_capacity as f64;
            (self.seek as f64 * d.min(1.0).sqrt()) as u64
        } else {
            0
        };
        let rot = if self.rotation == 0 {
            0
        } else if offset != head {
            let arrive = begin + self.overhead + seek;
            let track = self.bandwidth_at(offset) * self.rotation as f64 / 1e9;
            let sector = (offset as f64 / track).fract();
            let platter = (arrive % self.rotation) as f64 / self.rotation as f64;
            let turn = (sector - platter).rem_euclid(1.0);
            (turn * self.rotation as f64) as u64
        } else if begin > free_at {
            let r = (begin - free_at) % self.rotation;
            if r == 0 { 0 } else { self.rotation - r }
        } else {
            0
        };
        self.overhead + seek + rot
    }

    /// Nanoseconds the disk spends writing `bytes` at `offset` once there.
    fn transfer_time(&self, offset: u64, bytes: u64) -> u64 {
        (bytes as f64 * 1e9 / self.bandwidth_at(offset)).ceil() as u64
    }

    /// Hand every leaf's disk as many writes as its limits allow now, and
    /// let every idle disk start on one; what to schedule is appended to
    /// `out`.
    pub fn issue(
        &mut self,
        now: u64,
        async_active: u32,
        sync_active: u32,
        out: &mut Vec<LeafEvent>,
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
                let id = self.aggregate(i, sync);
                let leaf = &mut self.leaves[i];
                if sync {
                    leaf.sync_active += 1;
                } else {
                    leaf.async_active += 1;
                }
                leaf.disk_queue.push(id);
            }
            self.serve(i, now, out);
        }
    }

    /// Leaf `leaf`'s disk is free (a `LeafEvent` with `io == None` fell
    /// due): it starts on its next command, if any.
    pub fn wake(&mut self, leaf: u32, now: u64, out: &mut Vec<LeafEvent>) {
        let l = &mut self.leaves[leaf as usize];
        if l.wake_at == Some(now) {
            l.wake_at = None;
            self.serve(leaf as usize, now, out);
        }
    }

    /// If leaf `i`'s disk is free, serve one queued command: the nearest
    /// to the head (rotational) or the oldest.
    fn serve(&mut self, i: usize, now: u64, out: &mut Vec<LeafEvent>) {
        let leaf = &self.leaves[i];
        if leaf.disk_queue.is_empty() {
            return;
        }
        if now < leaf.disk_free_at {
            if leaf.wake_at != Some(leaf.disk_free_at) {
                let at = leaf.disk_free_at;
                out.push(LeafEvent {
                    leaf: i as u32,
                    at,
                    io: None,
                });
                self.leaves[i].wake_at = Some(at);
            }
            return;
        }
        // The command the disk reaches first (positioning time: seek and
        // rotational wait; the oldest on a tie), or the oldest.
        let position = |id: u32| {
            let start = leaf.ios[id as usize].start;
            self.position_time(leaf.head, start, now, leaf.disk_free_at)
        };
        let (pick, pos) = if self.reorder {
            leaf.disk_queue
                .iter()
                .enumerate()
                .map(|(k, &id)| (k, position(id)))
                .min_by_key(|&(_, p)| p)
                .expect("queue is not empty")
        } else {
            (0, position(leaf.disk_queue[0]))
        };
        let id = leaf.disk_queue[pick];
        let (start, bytes) = {
            let io = &leaf.ios[id as usize];
            (io.start, io.bytes)
        };
        let head = leaf.head;
        let served = now + pos + self.transfer_time(start, bytes);
        if self.rotational && start != head {
            self.seeks += 1;
        }
        let leaf = &mut self.leaves[i];
        leaf.disk_queue.remove(pick);
        leaf.disk_free_at = served;
        leaf.head = start + bytes;
        out.push(LeafEvent {
            leaf: i as u32,
            at: served + self.latency,
            io: Some(id),
        });
        if !leaf.disk_queue.is_empty() {
            out.push(LeafEvent {
                leaf: i as u32,
                at: served,
                io: None,
            });
            leaf.wake_at = Some(served);
        }
    }

    /// Take the elevator's next write from leaf `i`'s queue and merge its
    /// contiguous neighbours into it; returns the new I/O's id.
    fn aggregate(&mut self, i: usize, sync: bool) -> u32 {
        let limit = self.aggregation_limit;
        let leaf = &mut self.leaves[i];
        let id = match leaf.spare.pop() {
            Some(id) => id,
            None => {
                leaf.ios.push(Io::default());
                (leaf.ios.len() - 1) as u32
            }
        };
        let io = &mut leaf.ios[id as usize];
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
        io.tags.push(first_tag);
        if limit > 0 {
            while let Some((&(off, tag), &size)) = q.range((end, 0)..).next() {
                if off != end || end + size - start > limit {
                    break;
                }
                q.remove(&(off, tag));
                io.tags.push(tag);
                end += size;
            }
            while let Some((&(off, tag), &size)) = q.range(..(start, 0)).next_back() {
                if off + size != start || end - off > limit {
                    break;
                }
                q.remove(&(off, tag));
                io.tags.push(tag);
                start = off;
            }
        }
        io.start = start;
        io.bytes = end - start;
        io.sync = sync;
        leaf.last_end = end;
        id
    }

    /// Leaf `leaf`'s I/O `io` completed: the tags of its pieces are
    /// appended to `out`.
    pub fn complete(&mut self, leaf: u32, io: u32, out: &mut Vec<u32>) {
        let l = &mut self.leaves[leaf as usize];
        let done = &mut l.ios[io as usize];
        out.append(&mut done.tags);
        if done.sync {
            l.sync_active -= 1;
        } else {
            l.async_active -= 1;
        }
        self.bytes_done += done.bytes;
        self.ios_done += 1;
        l.spare.push(io);
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

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

    /// A 7200 rpm disk of 1 GiB, 100 MB/s, 10 ms full-stroke seek.
    fn hdd(latency: u64) -> VdevModel {
        let mut m = model(1, latency);
        m.rotational = true;
        m.write_bandwidth = 1e8;
        m.seek = 10_000_000;
        m.rotation = 8_333_000;
        m
    }

    /// Drive `d` as the engine does: `arrivals` (time, offset, size, tag)
    /// are queued as async writes at their time, every arrival and
    /// completion issues what the limit of `active` allows, and the disk
    /// is woken when it asked to be. Returns (completion time, tag) in
    /// completion order.
    fn drive(
        d: &mut LeafDevice,
        arrivals: &[(u64, u64, u64, u32)],
        active: u32,
    ) -> Vec<(u64, u32)> {
        // (time, seq, kind): kind 0 = arrival index, 1 = event.
        let mut heap = BinaryHeap::new();
        let mut seq = 0u64;
        for (k, a) in arrivals.iter().enumerate() {
            heap.push(Reverse((a.0, seq, k as u64, None)));
            seq += 1;
        }
        let mut done = Vec::new();
        let mut out = Vec::new();
        let mut tags = Vec::new();
        while let Some(Reverse((t, _, k, ev))) = heap.pop() {
            match ev {
                None => {
                    let (_, off, size, tag) = arrivals[k as usize];
                    d.enqueue(off, size, tag, false);
                    d.issue(t, active, 10, &mut out);
                }
                Some(LeafEvent { leaf, io: None, .. }) => d.wake(leaf, t, &mut out),
                Some(LeafEvent {
                    leaf, io: Some(io), ..
                }) => {
                    d.complete(leaf, io, &mut tags);
                    done.extend(tags.drain(..).map(|tag| (t, tag)));
                    d.issue(t, active, 10, &mut out);
                }
            }
            for e in out.drain(..) {
                heap.push(Reverse((e.at, seq, 0, Some(e))));
                seq += 1;
            }
        }
        done
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
        // The idle disk starts on the first at once and asks to be woken
        // when it is free for the second (4096 ns each at 1 GB/s).
        assert_eq!(
            out,
            vec![
                LeafEvent {
                    leaf: 0,
                    at: 4096 + 1_000_000,
                    io: Some(0)
                },
                LeafEvent {
                    leaf: 0,
                    at: 4096,
                    io: None
                },
            ]
        );
        out.clear();
        d.wake(0, 4096, &mut out);
        assert_eq!(
            out,
            vec![LeafEvent {
                leaf: 0,
                at: 2 * 4096 + 1_000_000,
                io: Some(1)
            }]
        );
        let mut tags = Vec::new();
        d.complete(0, 0, &mut tags);
        assert_eq!(tags, vec![0]);
        out.clear();
        d.issue(1_004_096, 2, 10, &mut out);
        assert_eq!(out.len(), 1, "one slot freed: {out:?}");

        // Contiguous writes queued while the slots are full merge.
        let mut d = LeafDevice::new(&model(1, 1_000_000), 128 << 10);
        for i in 0..40u64 {
            d.enqueue(i * 4096, 4096, i as u32, false);
        }
        out.clear();
        d.issue(0, 1, 10, &mut out);
        assert_eq!(out.len(), 1);
        tags.clear();
        d.complete(0, out[0].io.unwrap(), &mut tags);
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
        assert!(out.iter().all(|o| o.at == 65536), "{out:?}");
        let mut tags = Vec::new();
        for o in &out {
            d.complete(o.leaf, o.io.unwrap(), &mut tags);
        }
        assert_eq!(tags.len(), 10);
        assert_eq!(d.bytes_done, 5 * (64 << 10));
    }

    #[test]
    fn rotational_seeks_cost_by_distance_and_sync_goes_first() {
        let mut m = model(1, 0);
        m.rotational = true;
        m.seek = 10_000_000;
        // Arrival order, to see the vdev queue's order alone.
        let mut d = LeafDevice::new(&m, 0);
        d.reorder = false;
        d.enqueue(0, 4096, 0, false);
        // A quarter of the disk away: √0.25 × 10 ms.
        d.enqueue(1 << 28, 4096, 1, true);
        let mut out = Vec::new();
        d.issue(0, 1, 1, &mut out);
        // Sync first, from head 0 to 256 MiB: 5 ms seek.
        assert_eq!(out[0].at, 5_000_000 + 4096);
        assert_eq!(out[1].io, None);
        let wake = out[1].at;
        out.clear();
        d.wake(0, wake, &mut out);
        // Then back to 0: another 5 ms seek (from its end, a hair further).
        assert!(out[0].at > 2 * 5_000_000 + 2 * 4096, "{out:?}");
        let mut tags = Vec::new();
        d.complete(0, 0, &mut tags);
        assert_eq!(tags, vec![1]);
        assert_eq!(d.seeks, 2);
    }

    #[test]
    fn an_idle_disk_waits_for_its_sector_a_streaming_one_does_not() {
        let mut m = model(1, 0);
        m.rotational = true;
        m.rotation = 8_000_000;
        let mut d = LeafDevice::new(&m, 0);
        d.enqueue(0, 4096, 0, false);
        d.enqueue(4096, 4096, 1, false);
        // Head at 0 and the disk never idled: both stream.
        let done = drive(&mut d, &[(0, 8192, 4096, 2)], 2);
        assert_eq!(done[..2], [(4096, 0), (2 * 4096, 1)]);
        // (The arrival at 8192 came at time 0 and streamed too.)
        assert_eq!(done[2], (3 * 4096, 2));
        // The next contiguous write arrives 1 ms after the disk went idle:
        // 7 ms until its sector is back.
        let t = 3 * 4096 + 1_000_000;
        let done = drive(&mut d, &[(t, 12288, 4096, 3)], 2);
        assert_eq!(done, [(t + 7_000_000 + 4096, 3)]);
    }

    /// NCQ: a disk holding a far command and one that continues where its
    /// head is serves the continuation first. In arrival order (the model
    /// before) it would seek away and back.
    #[test]
    fn the_disk_serves_the_command_nearest_its_head_first() {
        let mut d = LeafDevice::new(&hdd(0), 0);
        let far = 1 << 28;
        // Front A's first write and front B's, then (while the disk is on
        // A's) A's next: the elevator, past B, wraps round to it, so the
        // disk holds [B, A1] in arrival order.
        let done = drive(
            &mut d,
            &[(0, 0, 4096, 0), (0, far, 4096, 1), (1000, 4096, 4096, 2)],
            4,
        );
        let order: Vec<u32> = done.iter().map(|&(_, tag)| tag).collect();
        assert_eq!(order, [0, 2, 1], "{done:?}");
        assert_eq!(d.seeks, 1, "only B is a seek");

        let mut fifo = LeafDevice::new(&hdd(0), 0);
        fifo.reorder = false;
        let done = drive(
            &mut fifo,
            &[(0, 0, 4096, 0), (0, far, 4096, 1), (1000, 4096, 4096, 2)],
            4,
        );
        let order: Vec<u32> = done.iter().map(|&(_, tag)| tag).collect();
        assert_eq!(order, [0, 1, 2]);
        assert_eq!(fifo.seeks, 2, "to B and back");
    }

    /// Two commands off the head: the disk serves first the one whose
    /// sector comes under the head sooner, not the older one.
    #[test]
    fn the_disk_serves_first_the_sector_that_comes_round_first() {
        let mut m = hdd(0);
        // No seek cost: only the angle differs. 100 MB/s × 8 ms: a track
        // holds 800 000 bytes.
        m.seek = 0;
        m.rotation = 8_000_000;
        let track = 800_000;
        // A first write at the head (angle 0, time 0) keeps the disk busy
        // for 40 960 ns while two more arrive: the older one's sector at
        // 3/4 of a turn, the younger one's at 1/4.
        let arrivals = [
            (0, 0, 4096, 0),
            (1, 3 * track / 4, 4096, 1),
            (1, track / 4, 4096, 2),
        ];
        let near = |a: u64, b: u64| a.abs_diff(b) <= 1;
        let mut d = LeafDevice::new(&m, 0);
        let done = drive(&mut d, &arrivals, 4);
        // The younger first: its sector comes round 2 ms after time 0,
        // then 4096 bytes (40 960 ns); the older half a turn later.
        assert_eq!((done[1].1, done[2].1), (2, 1), "{done:?}");
        assert!(near(done[1].0, 2_040_960), "{done:?}");
        assert!(near(done[2].0, 6_040_960), "{done:?}");

        let mut fifo = LeafDevice::new(&m, 0);
        fifo.reorder = false;
        let done = drive(&mut fifo, &arrivals, 4);
        // In arrival order: the older at 6 ms, then almost a whole turn.
        assert_eq!((done[1].1, done[2].1), (1, 2), "{done:?}");
        assert!(near(done[1].0, 6_040_960), "{done:?}");
        assert!(near(done[2].0, 10_040_960), "{done:?}");
    }

    /// Four write fronts on one disk (four allocators' metaslabs), each
    /// writing 16K pieces in order, their writes arriving in turn: the
    /// disk that serves the command it reaches first writes them all
    /// sooner than one serving them in arrival order.
    #[test]
    fn interleaved_fronts_are_written_sooner() {
        let quarter = 1u64 << 28;
        let piece = 16 << 10;
        let arrivals: Vec<_> = (0..400u64)
            .map(|k| {
                let off = (k % 4) * quarter + (k / 4) * piece;
                (k * 500_000, off, piece, k as u32)
            })
            .collect();
        let run = |reorder: bool| {
            let mut d = LeafDevice::new(&hdd(500_000), 1 << 20);
            d.reorder = reorder;
            let done = drive(&mut d, &arrivals, 10);
            assert_eq!(done.len(), arrivals.len());
            (done.last().unwrap().0, d.seeks, d.ios_done)
        };
        let (ncq_end, ncq_seeks, ncq_ios) = run(true);
        let (fifo_end, fifo_seeks, fifo_ios) = run(false);
        eprintln!(
            "reordered: {ncq_seeks} seeks in {ncq_ios} I/Os, done at {ncq_end} ns; \
             arrival order: {fifo_seeks} seeks in {fifo_ios} I/Os, done at {fifo_end} ns"
        );
        assert!(
            ncq_end * 10 < fifo_end * 9,
            "{ncq_end} vs {fifo_end}: not 10 % sooner"
        );
    }
}
