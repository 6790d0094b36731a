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
//! of CPU more in its work after the throttle. (That hand-off goes to the
//! head of the issue taskq, but the leaf writes and completions after it
//! queue behind the CPUs' work as a ready block's do; one item at the
//! back for both spends the same CPU with one event fewer per held
//! block.)

use super::*;
use crate::scenario::Cpu;

/// A block waiting for, or on, a CPU.
#[derive(Clone, Copy, Debug)]
pub(super) enum CpuWork {
    /// A data block's work before the throttle.
    Data(Req),
    /// A metadata block's work before the throttle.
    Meta(MetaReq),
    /// A placed block's work after the throttle (slot tag, bytes, whether
    /// the throttle queued it): its writes are queued when it is done.
    Issue(u32, u64, bool),
    /// A writer's work writing a block into the open txg.
    Write(Req),
}

impl CpuWork {
    fn size(&self) -> u64 {
        match self {
            CpuWork::Data(r) | CpuWork::Write(r) => r.size,
            CpuWork::Meta(m) => m.bytes(),
            CpuWork::Issue(_, size, _) => *size,
        }
    }
}

/// The CPUs: a FIFO of work and one slot per CPU. Writers' work has a
/// FIFO of its own, served first: a writer thread woken by the write
/// throttle runs beside the sync's taskq threads rather than behind a
/// whole txg of their queued blocks, as the kernel's scheduler shares
/// the CPUs among threads (at most one block per writer waits here).
#[derive(Debug)]
pub(super) struct CpuState {
    pub(super) model: Cpu,
    pub(super) queue: VecDeque<CpuWork>,
    pub(super) writes: VecDeque<CpuWork>,
    pub(super) running: Vec<Option<CpuWork>>,
    /// Nanoseconds of CPU spent, over all CPUs.
    pub(super) busy: u64,
    /// Per CPU, when its work is done and the event sequence number it
    /// was given: the CPUs' completions are kept here rather than in the
    /// event heap (two of a block's five events with the split), and the
    /// main loop takes the earliest of both in the heap's order.
    pub(super) due: Vec<Option<(u64, u64)>>,
    /// The last block size costed and its costs before and after the
    /// throttle (a run's blocks mostly share one size).
    last: (u64, u64, u64),
}

impl CpuState {
    pub(super) fn new(model: &Cpu) -> CpuState {
        CpuState {
            model: model.clone(),
            queue: VecDeque::new(),
            writes: VecDeque::new(),
            running: vec![None; model.count as usize],
            busy: 0,
            due: vec![None; model.count as usize],
            last: (
                0,
                model.before_throttle_cost(0),
                model.after_throttle_cost(0),
            ),
        }
    }

    fn cost(&mut self, w: &CpuWork) -> u64 {
        let size = w.size();
        if size != self.last.0 {
            let m = &self.model;
            self.last = (
                size,
                m.before_throttle_cost(size),
                m.after_throttle_cost(size),
            );
        }
        match w {
            CpuWork::Data(_) | CpuWork::Meta(_) => self.last.1,
            CpuWork::Issue(_, _, held) => self.last.2 + if *held { self.model.dispatch } else { 0 },
            CpuWork::Write(r) => self.model.writer_cost(r.size),
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
        match w {
            CpuWork::Write(_) => c.writes.push_back(w),
            _ => c.queue.push_back(w),
        }
        self.cpu_start();
        Ok(())
    }

    /// The bytes of a placed block's CPU work after the throttle, if it
    /// has any: the syncing txg's data and metadata blocks, with a `[cpu]`
    /// whose `after_throttle` is above 0, or that the throttle queued
    /// (`held`) with a `dispatch` cost.
    fn issue_bytes(&self, tag: u32, held: bool) -> Option<u64> {
        let c = self.cpu.as_ref()?;
        if c.model.after_throttle <= 0.0 && !(held && c.model.dispatch > 0) {
            return None;
        }
        match &self.slots[tag as usize].as_ref().expect("live slot").kind {
            SlotKind::Data(r) => (r.stream != LOG_STREAM).then_some(r.size),
            SlotKind::Meta(m) => Some(m.bytes()),
            SlotKind::LogBlock(_) => None,
        }
    }

    /// A placed data or metadata block is ready for its writes: queue
    /// them, or first its CPU work after the throttle (`held`: the
    /// throttle queued it before admitting it).
    pub(super) fn slot_placed(&mut self, tag: u32, held: bool) -> anyhow::Result<()> {
        match self.issue_bytes(tag, held) {
            Some(size) => self.cpu_issue(CpuWork::Issue(tag, size, held)),
            None => {
                self.enqueue_slot(tag, false);
                Ok(())
            }
        }
    }

    /// Put queued work on idle CPUs.
    fn cpu_start(&mut self) {
        let Some(c) = &mut self.cpu else { return };
        for i in 0..c.running.len() {
            if c.running[i].is_some() {
                continue;
            }
            let Some(w) = c.writes.pop_front().or_else(|| c.queue.pop_front()) else {
                break;
            };
            let cost = c.cost(&w);
            c.busy += cost;
            c.running[i] = Some(w);
            self.seq += 1;
            c.due[i] = Some((self.now + cost, self.seq));
        }
    }

    /// The CPU whose work is done first, in the event heap's order (time,
    /// then sequence number), with its time and number.
    pub(super) fn cpu_next(&self) -> Option<(u64, u64, u32)> {
        let c = self.cpu.as_ref()?;
        let mut best: Option<(u64, u64, u32)> = None;
        for (i, d) in c.due.iter().enumerate() {
            if let Some((at, seq)) = *d
                && best.is_none_or(|(t, s, _)| (at, seq) < (t, s))
            {
                best = Some((at, seq, i as u32));
            }
        }
        best
    }

    /// CPU `i` finished its block: the block goes on to the pool.
    pub(super) fn cpu_done(&mut self, i: u32) -> anyhow::Result<()> {
        let w = self
            .cpu
            .as_mut()
            .and_then(|c| {
                c.due[i as usize] = None;
                c.running[i as usize].take()
            })
            .context("a CPU finished with nothing on it")?;
        self.cpu_start();
        self.cpu_finish(w)
    }

    /// What follows a piece of CPU work.
    fn cpu_finish(&mut self, w: CpuWork) -> anyhow::Result<()> {
        match w {
            CpuWork::Data(r) => self.issue_data(r),
            CpuWork::Meta(m) => self.issue_meta(m),
            CpuWork::Issue(tag, ..) => {
                self.enqueue_slot(tag, false);
                Ok(())
            }
            CpuWork::Write(r) => self.written(r),
        }
    }
}
