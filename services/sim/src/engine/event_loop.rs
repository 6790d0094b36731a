//! The event heap and its dispatch, and device scheduling.

use super::*;

impl<P: SimPool> Sim<'_, P> {
    pub(super) fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, ev)));
    }

    /// The next event: the heap's first or a CPU's completion, whichever
    /// comes first by (time, sequence number), as if both were in the heap.
    fn next_event(&mut self) -> Option<(u64, Ev)> {
        let cpu = self.cpu_next();
        let heap_first = self.heap.peek().map(|Reverse((t, seq, _))| (*t, *seq));
        match (cpu, heap_first) {
            (Some((t, seq, i)), h) if h.is_none_or(|h| (t, seq) < h) => {
                // cpu_done clears the CPU's due time.
                Some((t, Ev::CpuDone(i)))
            }
            _ => self.heap.pop().map(|Reverse((t, _, ev))| (t, ev)),
        }
    }

    pub(super) fn main_loop(mut self, progress: &mut dyn FnMut(f64)) -> anyhow::Result<RunResult> {
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
            let Some((t, ev)) = self.next_event() else {
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
        self.check_fill_events_fired(&stop_reason)?;
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
            write_delays: self.write_delays,
            write_delay_ns: self.write_delay_ns,
            cpu_busy: self.cpu.as_ref().map(|c| c.busy),
            spec_cpus: self.cpu.as_ref().map(|c| c.model.count),
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

    pub(super) fn fraction_done(&self, planned: u64) -> f64 {
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

    pub(super) fn finished(&self) -> bool {
        let data_done = self.data.as_ref().is_none_or(|d| {
            d.streams
                .iter()
                .all(|s| s.finished && s.outstanding == 0 && !s.writing)
        });
        let log_done = self.log.as_ref().is_none_or(|l| {
            self.now >= l.end_at
                && l.pending.is_empty()
                && l.inflight == 0
                && l.txg_waiters.is_empty()
                && l.outstanding == 0
        });
        data_done && log_done
    }

    pub(super) fn handle(&mut self, ev: Ev) -> anyhow::Result<()> {
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
            Ev::DevFreeDone(v) => {
                self.handle(Ev::DevFree(v))?;
                self.handle(Ev::DevDone(v))?;
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
            Ev::Loaded(tag, held) => self.slot_placed(tag, held)?,
            Ev::CpuDone(i) => self.cpu_done(i)?,
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

    pub(super) fn start_streams(&mut self) -> anyhow::Result<()> {
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
    pub(super) fn schedule_leaf(&mut self, v: u32, out: &mut Vec<LeafEvent>) {
        for e in out.drain(..) {
            let ev = match e.io {
                Some(io) => Ev::LeafDone(v, e.leaf, io),
                None => Ev::LeafFree(v, e.leaf),
            };
            self.push(e.at, ev);
        }
    }

    pub(super) fn kick(&mut self, v: u32) {
        let dirty = self.dirty();
        let limits = self.queue_limits;
        let dirty_max = self.dirty_max;
        match &mut self.devices[v as usize] {
            Dev::Simple(d) => {
                if let Some(iss) = d.issue(self.now) {
                    if iss.done_at == iss.free_at {
                        // Nothing can come between the two: events
                        // pushed while handling the first come after both.
                        self.push(iss.free_at, Ev::DevFreeDone(v));
                    } else {
                        self.push(iss.free_at, Ev::DevFree(v));
                        self.push(iss.done_at, Ev::DevDone(v));
                    }
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
}
