//! The ZIL path: sync writers batch records into log blocks, wait for
//! them, and fall back to `txg_wait_synced` when the log cannot allocate.

use super::*;

/// `lr_write_t` and `zil_chain_t` sizes: what a log record and block add.
pub(super) const LOG_RECORD_HEADER: u64 = 192;

pub(super) const LOG_BLOCK_HEADER: u64 = 256;

/// ELOG-era ZIL block buckets (`zil.c:zil_lwb_plan@zfs-2.4.0`).
pub(super) const LOG_BUCKETS: [u64; 5] = [4 << 10, 12 << 10, 36 << 10, 68 << 10, 128 << 10];

/// Log block sizes remembered for the next choice.
pub(super) const LOG_HISTORY: usize = 16;

/// The stream id of data written by sync writers.
pub(super) const LOG_STREAM: u32 = u32::MAX;

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stall {
    None,
    Load,
    Txg(Txg),
}

#[derive(Debug)]
pub(super) struct LogState {
    pub(super) size: u64,
    pub(super) streams: u32,
    pub(super) first_block: u32,
    pub(super) blocks: u32,
    pub(super) end_at: u64,
    pub(super) load_cost: u64,
    pub(super) max_block: u64,
    pub(super) max_inflight: u32,
    pub(super) size_range: bool,
    pub(super) dirty_max: u64,
    pub(super) pending: VecDeque<Op>,
    pub(super) inflight: u32,
    pub(super) stall: Stall,
    pub(super) parked: Option<u32>,
    pub(super) txg_waiters: Vec<Op>,
    pub(super) blocked: Vec<u32>,
    pub(super) history: VecDeque<u64>,
    pub(super) latencies: Vec<u64>,
    pub(super) result: LogResult,
    pub(super) frees: VecDeque<(Txg, Vec<Extent>)>,
    /// Data bytes of sync writes submitted and not yet committed.
    pub(super) outstanding: u64,
}

impl<P: SimPool> Sim<'_, P> {
    pub(super) fn log_issue(&mut self, stream: u32) -> anyhow::Result<()> {
        let now = self.now;
        let l = self.log.as_mut().unwrap();
        if now >= l.end_at {
            return Ok(());
        }
        if l.outstanding + l.size > l.dirty_max {
            l.blocked.push(stream);
            return Ok(());
        }
        let block = l.first_block + self.rng.random_range(0..l.blocks);
        let size = l.size;
        l.pending.push_back(Op {
            issued: now,
            stream,
        });
        // The record's data also reaches the pool in the txg (random overwrite).
        if !self.block_busy[block as usize] {
            self.submit_data(Req {
                block,
                stream: LOG_STREAM,
                size,
            })?;
        }
        self.zil_try_issue()
    }

    pub(super) fn unblock_log_streams(&mut self) -> anyhow::Result<()> {
        let l = self.log.as_mut().unwrap();
        if l.blocked.is_empty() || l.outstanding + l.size > l.dirty_max {
            return Ok(());
        }
        let blocked = std::mem::take(&mut l.blocked);
        for s in blocked {
            self.log_issue(s)?;
        }
        Ok(())
    }

    /// Write pending sync records into log blocks while the ZIL may.
    pub(super) fn zil_try_issue(&mut self) -> anyhow::Result<()> {
        loop {
            let l = self.log.as_mut().unwrap();
            if l.stall != Stall::None || l.pending.is_empty() || l.inflight >= l.max_inflight {
                return Ok(());
            }
            let rec = l.size + LOG_RECORD_HEADER;
            let want = (l.pending.len() as u64 * rec + LOG_BLOCK_HEADER).min(l.max_block);
            let bucket = LOG_BUCKETS
                .iter()
                .copied()
                .find(|&b| b >= want)
                .unwrap_or(l.max_block);
            if l.history.len() == LOG_HISTORY {
                l.history.pop_front();
            }
            l.history.push_back(bucket);
            let block = l.history.iter().copied().max().unwrap().min(l.max_block);
            let fit = ((block.saturating_sub(LOG_BLOCK_HEADER)) / rec).max(1) as usize;
            let take = fit.min(l.pending.len());
            let ops: Vec<Op> = l.pending.drain(..take).collect();
            // With a range: at least what these records need, in whole
            // ZIL_MIN_BLKSZ (4K) units, at most the planned block.
            let need = (take as u64 * rec + LOG_BLOCK_HEADER).next_multiple_of(4 << 10);
            // One dataset: one allocator for every log block, as
            // `zio_alloc_zil` hashes the dataset.
            let req = AllocRequest {
                kind: AllocKind::Log,
                size: if l.size_range { need.min(block) } else { block },
                copies: 1,
                max_size: (l.size_range && need < block).then_some(block),
                affinity: Some(LOG_STREAM as u64),
            };
            let t = match self.pool.submit(req).context("log submit")? {
                Submitted::Ready(t) => t,
                Submitted::Queued(t) => {
                    bail!("the pool queued log ticket {t}; log requests are never throttled")
                }
            };
            let busy = self.busy();
            match self.pool.allocate(t, busy) {
                Ok(a) => {
                    let loads = a.metaslab_loads;
                    let wait = self.preload_wait(&a.extents);
                    let l = self.log.as_mut().unwrap();
                    l.inflight += 1;
                    l.result.blocks += 1;
                    l.result.block_bytes += a.psize;
                    let k = match a.tier {
                        Some(LogTier::Log) => 0,
                        Some(LogTier::EmbeddedLog) => 1,
                        Some(LogTier::Normal) | None => 2,
                    };
                    match k {
                        0 => l.result.tier_log += 1,
                        1 => l.result.tier_embedded_log += 1,
                        _ => l.result.tier_normal += 1,
                    }
                    for e in &a.extents {
                        let v = e.vdev as usize;
                        if l.result.tier_by_vdev.len() <= v {
                            l.result.tier_by_vdev.resize(v + 1, [0; 3]);
                        }
                        l.result.tier_by_vdev[v][k] += 1;
                    }
                    if wait > 0 {
                        l.result.preload_waits += 1;
                        l.result.preload_wait += wait;
                    }
                    if loads > 0 || wait > 0 {
                        // zil_commit loads the metaslab synchronously (or
                        // waits for its preload): the ZIL stalls before this
                        // block can be written.
                        l.result.metaslab_loads += loads as u64;
                        l.result.load_stall += loads as u64 * l.load_cost;
                        l.stall = Stall::Load;
                        let at = self.now + (loads as u64 * l.load_cost).max(wait);
                        let tag = self.place(a, SlotKind::LogBlock(ops), true);
                        self.log.as_mut().unwrap().parked = Some(tag);
                        self.push(at, Ev::ZilResume);
                        return Ok(());
                    }
                    self.place(a, SlotKind::LogBlock(ops), true);
                }
                Err(PoolError::TxgWaitRequired { until }) => {
                    self.txg_wait(ops, until);
                    return Ok(());
                }
                Err(PoolError::NoSpace { .. }) => {
                    let until = self.pool.open_txg() + metaslab::TXG_DEFER_SIZE;
                    self.txg_wait(ops, until);
                    return Ok(());
                }
                Err(e) => return Err(e).context("log allocate"),
            }
        }
    }

    /// No log space anywhere: every waiting record is made durable by the
    /// txg sync instead (`txg_wait_synced`).
    pub(super) fn txg_wait(&mut self, ops: Vec<Op>, until: Txg) {
        let l = self.log.as_mut().unwrap();
        l.result.txg_wait_fallbacks += 1;
        l.txg_waiters.extend(ops);
        let rest: Vec<Op> = l.pending.drain(..).collect();
        l.txg_waiters.extend(rest);
        l.stall = Stall::Txg(until);
        self.force_sync();
    }

    // --- sampling ------------------------------------------------------------
}
