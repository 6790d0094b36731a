//! The CPU model (`[cpu]`): a syncing txg's blocks wait for one of the
//! CPUs before the pool allocates them, so a pool of fast devices is
//! bounded by its CPUs, and its devices' queues stay short (as real
//! OpenZFS on memory-speed file vdevs: calibration t1a).
//!
//! With `after_throttle` a block's work is split at the allocation
//! throttle, as OpenZFS's zio pipeline is (include/sys/zio_impl.h,
//! zfs-2.3.9 and zfs-2.4.4: `ZIO_STAGE_DVA_THROTTLE` comes after
//! `WRITE_COMPRESS`, `ENCRYPT` and `CHECKSUM_GENERATE`, before
//! `DVA_ALLOCATE` and `VDEV_IO_START`, where `vdev_raidz_io_start_write`
//! generates RAIDZ parity). The first part runs before the pool sees the
//! block; the second (allocation, parity, the leaf writes, which
//! `vdev_file_io_start` hands to the `z_vdev_file` taskq, and their
//! completions on `z_wr_int`) is new work queued behind whatever the CPUs
//! already have, and the block holds its throttle reservation through it:
//! OpenZFS releases it in `zio_dva_throttle_done`, when the top-level
//! vdev's write, children included, is done (zio.c, both tags). A block
//! the throttle queued is handed to the issue taskq once more when it is
//! admitted (`zio_allocate_dispatch`: one per completion in 2.3.9, a
//! `do … while (more)` loop in 2.4.4, both with `TQ_FRONT`): `dispatch`
//! of CPU, at the head of the CPUs' queue, before its allocation.

use super::*;
use crate::scenario::Cpu;

/// A block waiting for, or on, a CPU.
#[derive(Clone, Copy, Debug)]
pub(super) enum CpuWork {
    /// A data block's work before the throttle.
    Data(Req),
    /// A metadata block's work before the throttle.
    Meta(MetaReq),
    /// A placed block's work after the throttle (slot tag, bytes): its
    /// writes are queued when it is done.
    Issue(u32, u64),
    /// A block the throttle queued, now admitted: handed to the issue
    /// taskq again before it is allocated.
    DispatchData(Ticket, Req),
    DispatchMeta(Ticket, MetaReq),
}

impl CpuWork {
    fn size(&self) -> u64 {
        match self {
            CpuWork::Data(r) | CpuWork::DispatchData(_, r) => r.size,
            CpuWork::Meta(m) | CpuWork::DispatchMeta(_, m) => m.size * m.copies as u64,
            CpuWork::Issue(_, size) => *size,
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

    fn cost(&self, w: &CpuWork) -> u64 {
        let m = &self.model;
        match w {
            CpuWork::Data(_) | CpuWork::Meta(_) => m.before_throttle_cost(w.size()),
            CpuWork::Issue(..) => m.after_throttle_cost(w.size()),
            CpuWork::DispatchData(..) | CpuWork::DispatchMeta(..) => m.dispatch,
        }
    }
}

impl<P: SimPool> Sim<'_, P> {
    /// Queue a syncing txg's block for the CPUs, or hand it to the pool at
    /// once without a CPU model.
    pub(super) fn cpu_issue(&mut self, w: CpuWork) -> anyhow::Result<()> {
        let Some(c) = &mut self.cpu else {
            return self.cpu_finish(w);
        };
        c.queue.push_back(w);
        self.cpu_start();
        Ok(())
    }

    /// Whether a placed block (slot `tag`) has CPU work after the
    /// throttle: the syncing txg's data and metadata blocks, with a
    /// `[cpu]` whose `after_throttle` is above 0.
    fn has_issue_work(&self, tag: u32) -> bool {
        if !self
            .cpu
            .as_ref()
            .is_some_and(|c| c.model.after_throttle > 0.0)
        {
            return false;
        }
        match &self.slots[tag as usize].as_ref().expect("live slot").kind {
            SlotKind::Data(r) => r.stream != LOG_STREAM,
            SlotKind::Meta(_) => true,
            SlotKind::LogBlock(_) => false,
        }
    }

    /// A placed data or metadata block is ready for its writes: queue
    /// them, or first its CPU work after the throttle.
    pub(super) fn slot_placed(&mut self, tag: u32) -> anyhow::Result<()> {
        if !self.has_issue_work(tag) {
            self.enqueue_slot(tag, false);
            return Ok(());
        }
        let size = match &self.slots[tag as usize].as_ref().expect("live slot").kind {
            SlotKind::Data(r) => r.size,
            SlotKind::Meta(m) => m.size * m.copies as u64,
            SlotKind::LogBlock(_) => unreachable!("log blocks have no issue work"),
        };
        self.cpu_issue(CpuWork::Issue(tag, size))
    }

    /// A block the throttle queued is admitted: allocate it, after the
    /// taskq hand-off when the model has one.
    pub(super) fn admitted_data(&mut self, t: Ticket, req: Req) -> anyhow::Result<()> {
        if req.stream != LOG_STREAM && self.cpu.as_ref().is_some_and(|c| c.model.dispatch > 0) {
            self.cpu_front(CpuWork::DispatchData(t, req));
            return Ok(());
        }
        self.allocate_data(t, req)
    }

    /// As `admitted_data` for a metadata block.
    pub(super) fn admitted_meta(&mut self, t: Ticket, m: MetaReq) -> anyhow::Result<()> {
        if self.cpu.as_ref().is_some_and(|c| c.model.dispatch > 0) {
            self.cpu_front(CpuWork::DispatchMeta(t, m));
            return Ok(());
        }
        self.allocate_meta(t, m)
    }

    /// Queue work at the head of the CPUs' queue (`TQ_FRONT`).
    fn cpu_front(&mut self, w: CpuWork) {
        let c = self.cpu.as_mut().expect("a CPU model");
        c.queue.push_front(w);
        self.cpu_start();
    }

    /// Put queued work on idle CPUs.
    fn cpu_start(&mut self) {
        let now = self.now;
        let mut done_at = Vec::new();
        if let Some(c) = &mut self.cpu {
            for i in 0..c.running.len() {
                if c.running[i].is_some() {
                    continue;
                }
                let Some(w) = c.queue.pop_front() else { break };
                let cost = c.cost(&w);
                c.busy += cost;
                c.running[i] = Some(w);
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
        self.cpu_finish(w)
    }

    /// What follows a piece of CPU work.
    fn cpu_finish(&mut self, w: CpuWork) -> anyhow::Result<()> {
        match w {
            CpuWork::Data(r) => self.issue_data(r),
            CpuWork::Meta(m) => self.issue_meta(m),
            CpuWork::Issue(tag, _) => {
                self.enqueue_slot(tag, false);
                Ok(())
            }
            CpuWork::DispatchData(t, r) => self.allocate_data(t, r),
            CpuWork::DispatchMeta(t, m) => self.allocate_meta(t, m),
        }
    }
}
