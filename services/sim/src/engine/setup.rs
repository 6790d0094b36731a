//! Building the simulated pool: devices, streams, the log, prefill.

use super::*;

impl<P: SimPool> Sim<'_, P> {
    pub(super) fn add_device(&mut self, m: &VdevModel) -> anyhow::Result<()> {
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

    pub(super) fn setup(&mut self) -> anyhow::Result<()> {
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
                    writing: false,
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
                size_range: l.size_range,
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
    pub(super) fn prefill(
        &mut self,
        fill: f64,
        holes: &[u64],
        weights: &[u32],
    ) -> anyhow::Result<()> {
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

    pub(super) fn model_of(&self, i: usize) -> VdevModel {
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
}
