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
    /// A slot throttle (0: none): at most this many data blocks admitted
    /// and not committed, the rest queued FIFO and admitted as commits
    /// free slots.
    slot_limit: usize,
    holding: usize,
    waiting: VecDeque<Ticket>,
    admitted: Vec<Ticket>,
    reserved: std::collections::HashSet<AllocationId>,
    /// Blocks the slot throttle queued.
    queued: u64,
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
    fn submit(&mut self, req: AllocRequest) -> PResult<Submitted> {
        self.ticket += 1;
        let t = self.ticket;
        let throttled = self.slot_limit > 0 && req.kind != AllocKind::Log;
        self.pending.insert(t, req);
        if !throttled {
            return Ok(Submitted::Ready(t));
        }
        if self.waiting.is_empty() && self.holding < self.slot_limit {
            self.holding += 1;
            return Ok(Submitted::Ready(t));
        }
        self.waiting.push_back(t);
        self.queued += 1;
        Ok(Submitted::Queued(t))
    }
    fn take_admitted(&mut self) -> Vec<Ticket> {
        std::mem::take(&mut self.admitted)
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
        if self.slot_limit > 0 && req.kind != AllocKind::Log {
            self.reserved.insert(self.id);
        }
        Ok(Allocation {
            id: self.id,
            extents,
            txg: self.txg,
            tier: (req.kind == AllocKind::Log).then_some(LogTier::Normal),
            psize: req.size,
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
        if self.reserved.remove(&id) {
            self.holding -= 1;
            while self.holding < self.slot_limit {
                let Some(t) = self.waiting.pop_front() else {
                    break;
                };
                self.holding += 1;
                self.admitted.push(t);
            }
        }
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
    let sc =
        scenario("[load]\nmode = \"full\"\nsize = \"1000MB\"\nstreams = 4\ndirty_max = \"64MiB\"");
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
        // Allocation as the writer writes (the pipeline's rate load has its
        // own test below).
        "[load]\nmode = \"rate\"\nrate = \"100MB/s\"\nsize = \"100MB\"\npasses = 3\nstreams = 2\n\
         allocate = \"write\"",
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

/// Rate writers pay `dmu_tx_delay` as full-speed ones do: a rate the
/// devices cannot take (2 GB/s against 1.5 GB/s of devices, of which
/// round-robin gets ~1 GB/s) fills dirty data past 60 % of `dirty_max`,
/// and from there each write waits its delay; a rate they take never
/// waits. Before, rate writers only ever stopped at `dirty_max`.
#[test]
fn rate_writers_pay_the_write_throttle_delay() {
    let load = |rate: &str| {
        scenario(&format!(
            "[load]\nmode = \"rate\"\nrate = \"{rate}\"\nsize = \"400MB\"\nstreams = 2\n\
             dirty_max = \"64MiB\""
        ))
    };
    let fast = go(&load("2000MB/s"), Fake::default());
    assert_eq!(fast.stop_reason, "done");
    assert!(fast.write_delays > 100, "{} delays", fast.write_delays);
    assert!(fast.write_delay_ns > 0);
    let slow = go(&load("100MB/s"), Fake::default());
    assert_eq!(slow.stop_reason, "done");
    assert_eq!(slow.write_delays, 0);
}

#[test]
fn pool_full_stops_the_load_and_events_fire() {
    let sc = scenario(
        "[load]\nmode = \"full\"\nsize = \"4GiB\"\ndirty_max = \"64MiB\"\nallocate = \"write\"\n[[event]]\nat_time = \"100ms\"\naction = \"add_vdev\"\nvdev = { name = \"c\", capacity = \"1GiB\", write_bandwidth = \"1GB/s\" }\n[[event]]\nat_fill = 0.5\naction = \"stop_load\"\n[[event]]\nat_time = \"3s\"\naction = \"start_load\"",
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
    let sc = scenario("[log]\nstreams = 8\nsize = \"8K\"\nduration = \"2s\"\ndataset = \"64MiB\"");
    let r = go(&sc, Fake::default());
    let l = r.log.unwrap();
    assert!(l.ops > 1000, "{l:?}");
    assert_eq!(l.txg_wait_fallbacks, 0);
    // Every log block is counted on the vdev it landed on, under its tier;
    // the fake round-robins them over both vdevs.
    let by_vdev: Vec<u64> = l.tier_by_vdev.iter().map(|t| t.iter().sum()).collect();
    assert_eq!(
        by_vdev.iter().sum::<u64>(),
        l.blocks,
        "{:?}",
        l.tier_by_vdev
    );
    assert!(
        by_vdev.len() == 2 && by_vdev.iter().all(|&n| n > 0),
        "{by_vdev:?}"
    );
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
fn a_preload_taskq_per_vdev_loads_in_parallel() {
    // As above for 10 s, but each of the two vdevs has its own one-thread
    // taskq (`preload_taskq = "vdev"`): vdev b's preloads no longer queue
    // behind vdev a's 64, so log blocks wait less and more complete.
    let log = "[log]\nstreams = 8\nsize = \"8K\"\nduration = \"10s\"\ndataset = \"64MiB\"\nmetaslab_load_cost = \"100ms\"";
    let preload = || Fake {
        preload_at_txg: 2,
        ..Default::default()
    };
    let pool = go(&scenario(log), preload()).log.unwrap();
    let sc = scenario(&format!("preload_taskq = \"vdev\"\n{log}"));
    let vdev = go(&sc, preload()).log.unwrap();
    assert_eq!(vdev.preloads, 128, "{vdev:?}");
    assert!(vdev.preload_waits > 0, "{vdev:?}");
    assert!(
        vdev.preload_wait < pool.preload_wait,
        "{vdev:?} vs {pool:?}"
    );
    assert!(vdev.ops > pool.ops, "{vdev:?} vs {pool:?}");
}

#[test]
fn data_metaslab_loads_delay_their_writes_by_the_load_cost() {
    // One writer with one block in flight, allocated as written: nothing
    // overlaps a load.
    let load = "[load]\nmode = \"full\"\nsize = \"100MB\"\nstreams = 1\ndirty_max = \"128K\"\n\
                allocate = \"write\"";
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
    // Every txg: per stream one L1 (381 blocks per stream fit one
    // 1024-pointer L1, and at most 3 L1s need no L2: the dnode points at
    // them), the dnode block, three MOS blocks.
    let per_txg = 2 + 1 + 3;
    assert!(r.metadata_blocks >= 3 * per_txg, "{}", r.metadata_blocks);
    // The run ends when the data is written: of the last txg's metadata,
    // only objects' indirect blocks (issued between the objects' data, see
    // `push_txg`) can be written by then.
    let (txgs, partial) = (r.metadata_blocks / per_txg, r.metadata_blocks % per_txg);
    assert!(partial <= 2, "{}", r.metadata_blocks);
    // 4K blocks except the L1s (up to 381 pointers × 128 B / 2 = 24K),
    // with two copies (three for the MOS).
    let small = txgs * (2 + 3 * 3) * 4096;
    assert!(r.metadata_bytes > small, "{} vs {small}", r.metadata_bytes);
    assert!(
        r.metadata_bytes <= small + (txgs + 1) * 2 * 2 * (24 << 10),
        "{}",
        r.metadata_bytes
    );
    // Copy-on-write: what stays allocated is one version of each.
    let alloc = |v: &PoolView| v.vdevs.iter().map(|v| v.alloc).sum::<u64>();
    let extra = alloc(&r.final_view) - alloc(&plain.final_view);
    assert!(
        extra <= 2 * ((2 + 3 * 3) * 4096 + 2 * 2 * (24 << 10)),
        "{extra}"
    );
}

/// An object's levels as `dnode_new_blkid` grows them: data pointers in
/// the dnode up to 3 blocks, then one level per outgrown span.
#[test]
fn dnode_levels_grow_as_openzfs_grows_them() {
    use super::metadata::dnode_levels;
    assert_eq!(dnode_levels(1, 1024), 1);
    assert_eq!(dnode_levels(3, 1024), 1);
    assert_eq!(dnode_levels(4, 1024), 2);
    assert_eq!(dnode_levels(3 * 1024, 1024), 2);
    assert_eq!(dnode_levels(3 * 1024 + 1, 1024), 3);
    assert_eq!(dnode_levels(3 * 1024 * 1024 + 1, 1024), 4);
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

#[test]
fn rate_load_through_the_pipeline_allocates_each_txg_at_sync() {
    // 10 MB/s with 1 s txgs: a txg's 10 MB stay dirty (unallocated) until
    // the txg is pushed at `zfs_txg_timeout`, then go out as one burst.
    let sc = scenario(
        "[load]\nmode = \"rate\"\nrate = \"10MB/s\"\nsize = \"30MB\"\nstreams = 2\n\
         dirty_max = \"64MiB\"\nallocate = \"sync\"",
    );
    let r = go(&sc, Fake::default());
    assert_eq!(r.stop_reason, "done");
    let secs = r.end_time as f64 / 1e9;
    assert!((2.95..3.1).contains(&secs), "{secs}");
    let alloc_at = |t: f64| {
        let s = r
            .samples
            .iter()
            .rev()
            .find(|s| (s.t as f64) <= t * 1e9)
            .unwrap();
        s.vdevs.iter().map(|v| v.alloc).sum::<u64>()
    };
    assert_eq!(alloc_at(0.9), 0, "nothing allocated before the first sync");
    let first = alloc_at(1.2);
    assert!((9_000_000..11_000_000).contains(&first), "{first}");
    assert_eq!(alloc_at(1.9), first, "the next txg waits for its sync");
}

#[test]
fn cpu_model_bounds_a_full_load_by_its_cpus() {
    // Devices take 1500 MB/s together; one CPU at 50 MB/s sets the pace.
    let load = "[load]\nmode = \"full\"\nsize = \"100MB\"\nstreams = 4\n\
                dirty_max = \"64MiB\"\nallocate = \"sync\"\n";
    let fast = go(&scenario(load), Fake::default());
    let cpu = go(
        &scenario(&format!(
            "{load}[cpu]\ncount = 1\nblock_cost = \"0\"\nbandwidth = \"50MB/s\""
        )),
        Fake::default(),
    );
    assert_eq!(cpu.bytes_committed, fast.bytes_committed);
    let (t_fast, t_cpu) = (fast.end_time as f64 / 1e9, cpu.end_time as f64 / 1e9);
    assert!(t_fast < 0.5, "{t_fast}");
    assert!((1.9..2.3).contains(&t_cpu), "{t_cpu}");
    let u = cpu.cpu_utilisation().unwrap();
    assert!(u > 0.85, "{u}");
    assert!(fast.cpu_utilisation().is_none());
}

/// `[cpu] writer_bandwidth`: the writers' own work shares the CPUs with the
/// sync's. A CPU-bound load slows by that share (each block's writer work
/// is spent, on top of the sync's), a device-bound one, whose CPUs idle,
/// hardly moves.
#[test]
fn writers_work_shares_the_cpus_with_the_sync() {
    let load = "[load]\nmode = \"full\"\nsize = \"100MB\"\nstreams = 4\n\
                dirty_max = \"64MiB\"\nallocate = \"sync\"\n";
    let run_with = |load: &str, cpu: &str| {
        let r = go(&scenario(&format!("{load}{cpu}")), Fake::default());
        assert_eq!(r.stop_reason, "done", "{cpu}");
        r
    };
    let ratio = |a: &RunResult, b: &RunResult| a.end_time as f64 / b.end_time as f64;
    // One CPU at 50 MB/s: 2.62 ms of sync work a 128K block; its writer's
    // work at 100 MB/s, half of that, makes every block cost 1.5 times as
    // much.
    let slow = "[cpu]\ncount = 1\nblock_cost = \"0\"\nbandwidth = \"50MB/s\"\n";
    let base = run_with(load, slow);
    let shared = run_with(load, &format!("{slow}writer_bandwidth = \"100MB/s\"\n"));
    assert_eq!(shared.bytes_committed, base.bytes_committed);
    let writer_busy = shared.cpu_busy.unwrap() - base.cpu_busy.unwrap();
    assert_eq!(writer_busy, base.allocations * 1_310_720);
    let r = ratio(&shared, &base);
    assert!((1.4..1.6).contains(&r), "{r}");
    // Two CPUs at 2 GB/s behind devices of 1000 MB/s in all: the writers'
    // work fits in the CPUs' idle time (over 1 GB: the first txg, which
    // the writers now take a while to fill, is a small part of the run).
    let fast = "[cpu]\ncount = 2\nblock_cost = \"0\"\nbandwidth = \"2GB/s\"\n";
    let load = load.replace("100MB", "1000MB");
    let base = run_with(&load, fast);
    let shared = run_with(&load, &format!("{fast}writer_bandwidth = \"1300MB/s\"\n"));
    assert_eq!(shared.bytes_committed, base.bytes_committed);
    let r = ratio(&shared, &base);
    assert!((1.0..1.05).contains(&r), "{r}");
}

/// `[cpu] after_throttle`: the work after the throttle is queued behind
/// the CPUs' other work while the block holds its slot, so a slot
/// throttle that never filled when all the work came before it now holds
/// blocks back; each held block costs `dispatch` more CPU when admitted,
/// and nothing else changes the CPU time spent.
#[test]
fn cpu_work_after_the_throttle_holds_slots_and_held_blocks_pay_a_dispatch() {
    let load = "[load]\nmode = \"full\"\nsize = \"20MB\"\nstreams = 4\n\
                dirty_max = \"64MiB\"\nallocate = \"sync\"\n";
    let cpu = "[cpu]\ncount = 1\nblock_cost = \"100us\"\nbandwidth = \"500MB/s\"\n";
    let run_with = |extra: &str| {
        let sc = scenario(&format!("{load}{cpu}{extra}"));
        let fake = Fake {
            slot_limit: 8,
            ..Fake::default()
        };
        let r = go(&sc, fake);
        assert_eq!(r.stop_reason, "done", "{extra}");
        r
    };
    let base = run_with("");
    let busy = base.cpu_busy.unwrap();
    // All of the work before the throttle: a block is in flight only for
    // its device write, the 8 slots never fill and no dispatch is paid.
    let only_dispatch = run_with("dispatch = \"10us\"\n");
    assert_eq!(only_dispatch.cpu_busy.unwrap(), busy);
    // Split in half without a dispatch cost: the same CPU time.
    let split = run_with("after_throttle = 0.5\n");
    assert_eq!(split.cpu_busy.unwrap(), busy);
    assert_eq!(split.bytes_committed, base.bytes_committed);
    // Split, with a dispatch cost: the first blocks' second halves wait
    // behind the txg's first halves, so most blocks are held, and each
    // held one pays 10 us once.
    let held = run_with("after_throttle = 0.5\ndispatch = \"10us\"\n");
    assert_eq!(held.bytes_committed, base.bytes_committed);
    let extra = held.cpu_busy.unwrap() - busy;
    assert_eq!(extra % 10_000, 0, "{extra}");
    let blocks = base.allocations;
    assert!(
        extra / 10_000 > blocks / 2 && extra / 10_000 <= blocks,
        "{} of {blocks} blocks held",
        extra / 10_000
    );
}

#[test]
fn the_dirty_limit_is_the_pools_not_a_writers_share() {
    // The pipeline: every writer waits only while the pool's dirty data is
    // at `dirty_max` (`dmu_tx_wait`); there is no per-writer share of it,
    // so 32 writers fill the pool as fast as 4 (a share of `dirty_max /
    // 32` each held the last writers to one txg at a time).
    let end = |streams: u32| {
        let sc = scenario(&format!(
            "[load]\nmode = \"full\"\nsize = \"600MB\"\nstreams = {streams}\n\
             dirty_max = \"64MiB\""
        ));
        let r = go(&sc, Fake::default());
        assert_eq!(r.stop_reason, "done");
        assert_eq!(r.bytes_committed, (600_000_000 / (128 << 10)) * (128 << 10));
        r.end_time as f64 / 1e9
    };
    let (four, many) = (end(4), end(32));
    assert!(
        (many / four - 1.0).abs() < 0.05,
        "4 writers {four:.3} s, 32 writers {many:.3} s"
    );
    // Both at the devices' pace (1500 MB/s together), not a txg timeout's.
    assert!(four < 1.0, "{four:.3} s");
}

#[test]
fn the_txg_backlog_changes_nothing_but_the_queue_it_saves() {
    // A syncing txg's blocks wait in the simulator's backlog while the
    // throttle holds one of them, rather than all queueing in the pool:
    // the throttle admits them in the same order at the same moments, so a
    // run is the same with or without it (a throttle of 4 slots, rate
    // bursts of ~100 blocks per txg, and full speed).
    for load in [
        "[load]\nmode = \"rate\"\nrate = \"20MB/s\"\nsize = \"60MB\"\nstreams = 3\npasses = 2\n\
         dirty_max = \"64MiB\"",
        "[load]\nmode = \"full\"\nsize = \"200MB\"\nstreams = 5\ndirty_max = \"32MiB\"",
    ] {
        let sc = scenario(load);
        let with = || Fake {
            slot_limit: 4,
            ..Default::default()
        };
        let a = go(&sc, with());
        NO_BACKLOG.with(|c| c.set(true));
        let b = go(&sc, with());
        NO_BACKLOG.with(|c| c.set(false));
        assert_eq!(a.stop_reason, "done");
        assert_eq!(a.end_time, b.end_time, "{load}");
        assert_eq!(a.bytes_committed, b.bytes_committed);
        assert_eq!(a.samples.len(), b.samples.len());
        for (x, y) in a.samples.iter().zip(&b.samples) {
            let bytes = |s: &Sample| s.vdevs.iter().map(|v| v.bytes_done).collect::<Vec<_>>();
            assert_eq!((x.t, bytes(x)), (y.t, bytes(y)), "{load}");
        }
    }
}
