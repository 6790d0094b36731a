//! The CPU model (`[cpu]`): a syncing txg's blocks wait for one of the
//! CPUs before the pool allocates them, so a pool of fast devices is
//! bounded by its CPUs, and its devices' queues stay short (as real
//! OpenZFS on memory-speed file vdevs: calibration t1a).

use super::*;
use crate::scenario::Cpu;

/// A block waiting for, or on, a CPU.
#[derive(Clone, Copy, Debug)]
pub(super) enum CpuWork {
    Data(Req),
    Meta(MetaReq),
}

impl CpuWork {
    fn size(&self) -> u64 {
        match self {
            CpuWork::Data(r) => r.size,
            CpuWork::Meta(m) => m.size * m.copies as u64,
        }
    }
}

/// The CPUs: a FIFO of work and one slot per CPU.
#[derive(Debug)]
pub(super) struct CpuState {
    pub(super) model: Cpu,
    pub(super) queue: VecDeque<CpuWork>,
    pub(super) running: Vec<Option<CpuWork>>,
    /// Nanoseconds of CPU spent, over all CPUs.
    pub(super) busy: u64,
}

impl CpuState {
    pub(super) fn new(model: &Cpu) -> CpuState {
        CpuState {
            model: model.clone(),
            queue: VecDeque::new(),
            running: vec![None; model.count as usize],
            busy: 0,
        }
    }
}

impl<P: SimPool> Sim<'_, P> {
    /// Queue a syncing txg's block for the CPUs, or hand it to the pool at
    /// once without a CPU model.
    pub(super) fn cpu_issue(&mut self, w: CpuWork) -> anyhow::Result<()> {
        let Some(c) = &mut self.cpu else {
            return match w {
                CpuWork::Data(r) => self.issue_data(r),
                CpuWork::Meta(m) => self.issue_meta(m),
            };
        };
        c.queue.push_back(w);
        self.cpu_start();
        Ok(())
    }

    /// Put queued work on idle CPUs.
    fn cpu_start(&mut self) {
        let now = self.now;
        let mut done_at = Vec::new();
        if let Some(c) = &mut self.cpu {
            for (i, slot) in c.running.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let Some(w) = c.queue.pop_front() else { break };
                let cost = c.model.cost(w.size());
                c.busy += cost;
                *slot = Some(w);
                done_at.push((now + cost, i as u32));
            }
        }
        for (at, i) in done_at {
            self.push(at, Ev::CpuDone(i));
        }
    }

    /// CPU `i` finished its block: the block goes on to the pool.
    pub(super) fn cpu_done(&mut self, i: u32) -> anyhow::Result<()> {
        let w = self
            .cpu
            .as_mut()
            .and_then(|c| c.running[i as usize].take())
            .context("a CPU finished with nothing on it")?;
        self.cpu_start();
        match w {
            CpuWork::Data(r) => self.issue_data(r),
            CpuWork::Meta(m) => self.issue_meta(m),
        }
    }
}
