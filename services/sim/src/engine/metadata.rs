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
    /// A stream's indirect block at a level of 2 or more (one per level:
    /// a sequential writer dirties one span of each level a txg).
    Upper(u32, u8),
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
            MetaKey::L1(s, _) | MetaKey::Upper(s, _) => Some(s),
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

/// Block pointers in a dnode without a bonus buffer (`dn_nblkptr`: the
/// calibration driver's objects, `dmu_object_alloc` with `bonuslen` 0).
pub(super) const DN_NBLKPTR: u64 = 3;

/// Levels of an object whose highest block is `blocks - 1`, with `per`
/// block pointers per indirect block: the dnode points at its data
/// directly while it has at most `DN_NBLKPTR` blocks, and gains a level
/// each time the top level's span is outgrown (`dnode.c:dnode_new_blkid`,
/// `dnode_increase_indirection`, zfs-2.3.9 and zfs-2.4.4).
pub(super) fn dnode_levels(blocks: u64, per: u64) -> u32 {
    let mut levels = 1;
    let mut span = DN_NBLKPTR;
    while span < blocks {
        span = span.saturating_mul(per);
        levels += 1;
    }
    levels
}

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
        // stream → its object's size in blocks when this txg syncs.
        let mut sizes: Vec<(u32, u64)> = Vec::new();
        for r in reqs {
            let st = &d.streams[r.stream as usize];
            let i = r.block - st.first;
            // Past its first pass an object has its full size.
            let size = if st.pass > 0 { st.count } else { i + 1 } as u64;
            match sizes.iter_mut().find(|(s, _)| *s == r.stream) {
                Some(e) => e.1 = e.1.max(size),
                None => sizes.push((r.stream, size)),
            }
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
        let levels = |s: u32| {
            let size = sizes.iter().find(|(x, _)| *x == s).map_or(1, |e| e.1);
            dnode_levels(size, per_l1 as u64)
        };
        let mut out = Vec::new();
        for &(s, span, last) in &spans {
            // An object of at most `DN_NBLKPTR` blocks has no indirect
            // block: the dnode holds its block pointers.
            if levels(s) < 2 {
                continue;
            }
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
        }
        // The levels above 1, as many as the object has (a level-2 block
        // only once it outgrew `DN_NBLKPTR` level-1 spans: 384 MiB at 128K
        // records and 128K indirect blocks). Each such ditto block can
        // move the legacy rotor, so writing one where OpenZFS writes none
        // added rotor restarts (calibration t1a legacy with many writers).
        for &(s, _) in &sizes {
            for level in 2..levels(s) {
                out.push(MetaReq {
                    key: MetaKey::Upper(s, level as u8),
                    size: META_MIN,
                    copies: copies(false),
                });
            }
        }
        if !reqs.is_empty() {
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
