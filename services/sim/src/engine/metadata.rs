//! Metadata a syncing txg writes (pipeline only): indirect blocks, the
//! dnode block and MOS blocks as ditto copies, each freeing its previous
//! version when the new one commits.

use super::*;

/// Which metadata block a write replaces (copy-on-write: the previous
/// version is freed when the new one commits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum MetaKey {
    /// A stream's (object's) level-1 indirect block number `span`.
    L1(u32, u32),
    /// A stream's level-2 indirect block (it maps 128 GiB at 128K records).
    L2(u32),
    /// The dataset's dnode block.
    Dnode,
    /// The MOS's `i`-th block of the txg (space maps, MOS dnodes, DSL).
    Mos(u32),
}

impl MetaKey {
    /// The object (stream) whose indirect block this is; `None` for the
    /// per-txg blocks (the dnode block, the MOS).
    pub(super) fn object(&self) -> Option<u32> {
        match *self {
            MetaKey::L1(s, _) | MetaKey::L2(s) => Some(s),
            MetaKey::Dnode | MetaKey::Mos(_) => None,
        }
    }
}

impl MetaReq {
    /// Bytes written for it: every copy.
    pub(super) fn bytes(&self) -> u64 {
        self.size * self.copies as u64
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct MetaReq {
    pub(super) key: MetaKey,
    pub(super) size: u64,
    pub(super) copies: u8,
}

/// Bytes of one block pointer (`blkptr_t`).
pub(super) const BLKPTR_SIZE: u64 = 128;

/// Smallest metadata block written (one 4K sector at ashift 12).
pub(super) const META_MIN: u64 = 4096;

/// `spa_max_replication`: the MOS's copies.
pub(super) const MOS_COPIES: u8 = 3;

impl<P: SimPool> Sim<'_, P> {
    /// The metadata a txg holding `reqs` writes (`dbuf_sync` of the dirty
    /// indirect blocks, the dnode block, then the MOS), with the copies
    /// `dmu_write_policy` gives them: one more than the data for
    /// `redundant_metadata = all` (level-1 blocks of file data excepted
    /// with `most`), three for the MOS.
    pub(super) fn txg_metadata(&self, md: &Metadata, reqs: &[Req]) -> Vec<MetaReq> {
        let Some(d) = &self.data else {
            return Vec::new();
        };
        let per_l1 = (md.indirect_block / BLKPTR_SIZE).max(1) as u32;
        let data_copies = self.sc.copies;
        let extra = |level1: bool| match md.redundant {
            RedundantMetadata::All => 1,
            RedundantMetadata::Most if !level1 => 1,
            _ => 0,
        };
        let copies = |level1: bool| (data_copies + extra(level1)).min(3);
        // (stream, span) → the highest block index in the span written.
        let mut spans: Vec<(u32, u32, u32)> = Vec::new();
        for r in reqs {
            let st = &d.streams[r.stream as usize];
            let i = r.block - st.first;
            let span = i / per_l1;
            let last = i % per_l1;
            match spans
                .iter_mut()
                .find(|(s, sp, _)| *s == r.stream && *sp == span)
            {
                Some(e) => e.2 = e.2.max(last),
                None => spans.push((r.stream, span, last)),
            }
        }
        let mut out = Vec::new();
        let mut streams: Vec<u32> = Vec::new();
        for &(s, span, last) in &spans {
            // A level-1 block holds the pointers written so far in its
            // span (sequential writers: up to the last one); the rest are
            // holes that compress away.
            let filled = (last as u64 + 1) * BLKPTR_SIZE;
            let size = ((filled as f64 / md.compression) as u64)
                .div_ceil(META_MIN)
                .max(1)
                * META_MIN;
            out.push(MetaReq {
                key: MetaKey::L1(s, span),
                size: size.min(md.indirect_block),
                copies: copies(true),
            });
            if !streams.contains(&s) {
                streams.push(s);
            }
        }
        for s in streams {
            out.push(MetaReq {
                key: MetaKey::L2(s),
                size: META_MIN,
                copies: copies(false),
            });
        }
        if !out.is_empty() {
            out.push(MetaReq {
                key: MetaKey::Dnode,
                size: META_MIN,
                copies: copies(false),
            });
        }
        for i in 0..md.mos_blocks {
            out.push(MetaReq {
                key: MetaKey::Mos(i),
                size: META_MIN,
                copies: MOS_COPIES,
            });
        }
        out
    }

    pub(super) fn issue_meta(&mut self, m: MetaReq) -> anyhow::Result<()> {
        let r = AllocRequest {
            kind: AllocKind::Data,
            size: m.size,
            copies: m.copies,
            max_size: None,
            affinity: None,
        };
        match self.pool.submit(r).context("metadata submit")? {
            Submitted::Ready(t) => self.allocate_meta(t, m, false),
            Submitted::Queued(t) => {
                self.meta_tickets.insert(t, m);
                Ok(())
            }
        }
    }

    pub(super) fn allocate_meta(
        &mut self,
        t: Ticket,
        m: MetaReq,
        held: bool,
    ) -> anyhow::Result<()> {
        let busy = self.busy();
        match self.pool.allocate(t, busy) {
            Ok(a) => self.place_loaded(a, SlotKind::Meta(m), held),
            Err(PoolError::NoSpace { reason, .. }) => {
                if !self.pool_full {
                    self.pool_full = true;
                    self.events.push((
                        self.now,
                        format!("pool full ({reason:?}) writing metadata: data load stopped"),
                    ));
                }
                if let Some(d) = &mut self.data {
                    for s in &mut d.streams {
                        s.finished = true;
                    }
                }
                self.syncing_block_done()
            }
            Err(e) => Err(e).context("metadata allocate"),
        }
    }
}
