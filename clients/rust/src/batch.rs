//! Many blocks at once: [`Pool::put_batch`]. Blocks are pipelined under
//! the allocator's throttle, at most `in_flight` between their Allocate and
//! the end of their writes, never all reserved before the first write.
//! Each block reports itself written (`Written`) as soon as its copies are
//! on their agents, which ends its throttle reservation then (as OpenZFS
//! gives a block's back when its write is done), so the batch never waits
//! on its own reservations, however large. Blocks written early are kept
//! alive ([`crate::Leases`]) until the batch's one Commit per allocator
//! generation. An allocator restart mid-batch: blocks of the old
//! generation are claimed back inside the new one's claim window (their
//! data is written), else written again. A batch that fails aborts every
//! allocation it holds and frees what it committed: nothing stays
//! reserved, nothing of it stays allocated.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use aliquot_proto::error::{metadata, reason};
use aliquot_proto::v1::{AllocateReply, ErrorReason, Extent};
use futures_util::StreamExt;
use tracing::Instrument;

use crate::block::{Block, Then};
use crate::claims::{Committed, claim_each};
use crate::data::BlockData;
use crate::error::{Error, Result};
use crate::retry::{Retry, retry_transient_seen};
use crate::{Pool, flush_agents};

/// A block of the batch, written and not yet committed.
struct Written {
    index: usize,
    reply: AllocateReply,
}

impl Written {
    /// The block it is once committed (or claimed) in `generation`'s `txg`.
    fn block<D: BlockData>(self, blocks: &[D], generation: u64, txg: u64) -> Block {
        Block {
            len: blocks[self.index].len(),
            extents: self.reply.extents,
            endpoints: self.reply.endpoints,
            txg,
            generation,
            allocation_id: self.reply.allocation_id,
        }
    }
}

impl Pool {
    /// Write `blocks` and commit them together: the blocks, in order. See
    /// the module comment for how; on failure nothing of the batch stays
    /// reserved or allocated. `affinity_key`: the batch is one object (its
    /// blocks keep one allocator).
    pub async fn put_batch<D: BlockData>(
        &self,
        blocks: Vec<D>,
        affinity_key: Option<u64>,
    ) -> Result<Vec<Block>> {
        let span = tracing::info_span!("aliquot.batch", blocks = blocks.len());
        let mut committed: Vec<Option<Block>> = vec![None; blocks.len()];
        let r = self
            .batch_inner(&blocks, affinity_key, &mut committed)
            .instrument(span)
            .await;
        match r {
            Ok(()) => Ok(committed.into_iter().flatten().collect()),
            Err(e) => {
                // Committed parts of a failed batch are freed: the caller
                // retries the batch whole.
                let done: Vec<Block> = committed.into_iter().flatten().collect();
                if !done.is_empty() {
                    let _ = self.free(&done).await;
                }
                Err(e)
            }
        }
    }

    async fn batch_inner<D: BlockData>(
        &self,
        blocks: &[D],
        key: Option<u64>,
        committed: &mut [Option<Block>],
    ) -> Result<()> {
        let mut todo: Vec<usize> = (0..blocks.len()).collect();
        let attempts = self.writer.opts.attempts.max(1);
        for round in 1..=attempts {
            let written = self.write_all(blocks, &todo, key).await?;
            let again = match self.commit_all(blocks, written, committed).await {
                Ok(again) => again,
                Err(e) => return Err(e),
            };
            if again.is_empty() {
                return Ok(());
            }
            tracing::info!(
                round,
                blocks = again.len(),
                "batch: blocks written again after an allocator restart"
            );
            todo = again;
        }
        Err(Error::Connect(format!(
            "batch: {} blocks could not be committed in {attempts} rounds (the allocator kept \
             restarting)",
            todo.len()
        )))
    }

    /// Allocate and write blocks `todo`, at most `in_flight` at a time,
    /// each reported written. On failure every allocation made is aborted.
    async fn write_all<D: BlockData>(
        &self,
        blocks: &[D],
        todo: &[usize],
        key: Option<u64>,
    ) -> Result<Vec<Written>> {
        let stop = AtomicBool::new(false);
        let mut results = futures_util::stream::iter(todo.iter().copied())
            .map(|i| {
                let stop = &stop;
                async move {
                    if stop.load(Ordering::Relaxed) {
                        return None;
                    }
                    let r = self
                        .writer
                        .put_then(&blocks[i], key, &mut (), Then::Written)
                        .await;
                    match r {
                        Ok((reply, _)) => {
                            self.leases
                                .hold(reply.allocation_id, reply.lease_deadline_ms);
                            self.writer.claims.hold_written(
                                reply.allocation_id,
                                reply.generation,
                                reply.extents.clone(),
                            );
                            Some(Ok(Written { index: i, reply }))
                        }
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            Some(Err(e))
                        }
                    }
                }
            })
            .buffer_unordered(self.in_flight);
        let mut written = Vec::with_capacity(todo.len());
        let mut failed = None;
        // Every block started is waited for, so none is left reserved.
        while let Some(r) = results.next().await {
            match r {
                Some(Ok(w)) => written.push(w),
                Some(Err(e)) => {
                    failed.get_or_insert(e);
                }
                None => {}
            }
        }
        if let Some(e) = failed {
            self.give_back(&written).await;
            return Err(e);
        }
        Ok(written)
    }

    async fn give_back(&self, written: &[Written]) {
        let ids: Vec<u64> = written.iter().map(|w| w.reply.allocation_id).collect();
        self.leases.release(&ids);
        self.writer.claims.forget_written(&ids);
        // Only the current generation's: an ended generation's ids may
        // name another client's allocations in the new one (its own
        // allocations ended with it).
        let now = self.writer.claims.generation();
        let ids: Vec<u64> = written
            .iter()
            .filter(|w| w.reply.generation == now)
            .map(|w| w.reply.allocation_id)
            .collect();
        if !ids.is_empty() {
            self.writer.ops.abort(ids).await;
        }
    }

    /// Flush the agents written, then one Commit per allocator generation.
    /// Blocks whose generation ended (ALLOCATOR_RESTARTED) are claimed in
    /// the new one while its claim window is open; the indexes of those
    /// that must be written again are returned.
    async fn commit_all<D: BlockData>(
        &self,
        blocks: &[D],
        written: Vec<Written>,
        committed: &mut [Option<Block>],
    ) -> Result<Vec<usize>> {
        let eps = written
            .iter()
            .flat_map(|w| w.reply.endpoints.iter().cloned());
        if let Err(e) = flush_agents(self.agents(), eps, self.writer.opts.timeout).await {
            self.give_back(&written).await;
            return Err(e);
        }
        let claims = &self.writer.claims;
        // An allocator restart while the batch was written: what the
        // restart watcher claimed in the new generation's window is
        // committed there already.
        claims.claim_if_restarted().await;
        let ids: Vec<u64> = written.iter().map(|w| w.reply.allocation_id).collect();
        claims.forget_written(&ids);
        let mut by_gen: BTreeMap<u64, Vec<Written>> = BTreeMap::new();
        for w in written {
            if let Some((generation, txg)) = claims.take_claimed(w.reply.allocation_id) {
                self.leases.release(&[w.reply.allocation_id]);
                let i = w.index;
                committed[i] = Some(w.block(blocks, generation, txg));
                continue;
            }
            by_gen.entry(w.reply.generation).or_default().push(w);
        }
        let policy = Retry::within(self.writer.opts.allocator_wait);
        let mut again = Vec::new();
        let mut groups = by_gen.into_values();
        while let Some(group) = groups.next() {
            let ids: Vec<u64> = group.iter().map(|w| w.reply.allocation_id).collect();
            let generation = group[0].reply.generation;
            let r = retry_transient_seen(
                &policy,
                |_| claims.away(),
                || self.writer.ops.commit(ids.clone(), generation, false),
            )
            .await;
            self.leases.release(&ids);
            let (txg, generation, claimed) = match r {
                Ok(c) => (c.txg, generation, group),
                Err(s) if reason(&s) == Some(ErrorReason::AllocatorRestarted) => {
                    claims.away();
                    let open = metadata(&s)
                        .get("claim_window_remaining_ms")
                        .and_then(|v| v.parse::<u64>().ok())
                        .is_some_and(|ms| ms > 0);
                    match self.claim_group(group, open).await {
                        Ok((txg, generation, claimed, rewrite)) => {
                            again.extend(rewrite);
                            (txg, generation, claimed)
                        }
                        Err(e) => {
                            for g in groups {
                                self.give_back(&g).await;
                            }
                            return Err(e);
                        }
                    }
                }
                Err(s) if reason(&s) == Some(ErrorReason::LeaseExpired) => {
                    // A lease ended (this client stalled): the Commit took
                    // none of them; give the others back, write all again.
                    self.give_back(&group).await;
                    again.extend(group.iter().map(|w| w.index));
                    continue;
                }
                Err(s) => {
                    self.give_back(&group).await;
                    for g in groups {
                        self.give_back(&g).await;
                    }
                    return Err(Error::status("commit the batch", s));
                }
            };
            for w in claimed {
                claims.committed(Committed {
                    generation,
                    txg,
                    extents: w.reply.extents.clone(),
                    allocation_id: w.reply.allocation_id,
                });
                let i = w.index;
                committed[i] = Some(w.block(blocks, generation, txg));
            }
        }
        Ok(again)
    }

    /// Blocks of a generation that ended: claim their extents in the new
    /// one (their data is on the agents) while its claim window is open.
    /// Returns the claim's txg and generation, the blocks claimed whole,
    /// and the indexes of those to write again (any extent refused: what
    /// was claimed of them is freed).
    async fn claim_group(
        &self,
        group: Vec<Written>,
        open: bool,
    ) -> Result<(u64, u64, Vec<Written>, Vec<usize>)> {
        if !open {
            return Ok((0, 0, Vec::new(), group.iter().map(|w| w.index).collect()));
        }
        let extents: Vec<Extent> = group
            .iter()
            .flat_map(|w| w.reply.extents.iter().copied())
            .collect();
        let ids: Vec<u64> = group
            .iter()
            .flat_map(|w| std::iter::repeat_n(w.reply.allocation_id, w.reply.extents.len()))
            .collect();
        let mut c = self.alloc.clone();
        let claimed = claim_each(&mut c, extents, ids)
            .await
            .map_err(|s| Error::status("claim the batch after an allocator restart", s))?;
        self.writer.claims.saw_generation(claimed.generation);
        let refused: std::collections::HashSet<(u32, u64)> = claimed
            .refused
            .iter()
            .map(|(e, _)| (e.vdev, e.offset))
            .collect();
        let (whole, partial): (Vec<Written>, Vec<Written>) = group.into_iter().partition(|w| {
            w.reply
                .extents
                .iter()
                .all(|e| !refused.contains(&(e.vdev, e.offset)))
        });
        let n: usize = whole.iter().map(|w| w.reply.extents.len()).sum();
        self.writer.claims.add_claimed(n as u64);
        let mut rewrite = Vec::new();
        let mut give: Vec<Extent> = Vec::new();
        for w in partial {
            rewrite.push(w.index);
            give.extend(
                w.reply
                    .extents
                    .iter()
                    .filter(|e| !refused.contains(&(e.vdev, e.offset)))
                    .copied(),
            );
        }
        if !give.is_empty() {
            let _ = c
                .free(aliquot_proto::v1::FreeRequest { extents: give })
                .await;
        }
        Ok((claimed.txg, claimed.generation, whole, rewrite))
    }
}
