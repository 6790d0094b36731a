//! The write fence: a token dies once a newer allocation has written over
//! its bytes. Allocation ids only grow (the generation is
//! in their high bits), and space is handed out again only after it was
//! freed or aborted; so a write whose allocation id is older than one that
//! already wrote any of the same bytes comes from an allocation that no
//! longer owns them: alice's bearer token replayed after her block was freed
//! and the space given to bob, or the source extent of a block the balancer
//! moved away. It is refused (PERMISSION_DENIED, reason `TOKEN_SUPERSEDED`),
//! so bob's committed block is never overwritten.
//!
//! What the fence remembers lives in memory: a restarted agent knows no
//! history, so it also refuses every token of an allocation made before it
//! registered (the allocator gives the floor in RegisterReply); those
//! clients allocate again. An entry is kept until no older token can still
//! be valid: every token expires within the allocator's longest lease of
//! its issue, and an older token was issued before this entry's.
//!
//! The allocator also tells the agent, in its next ReportAck, which
//! allocations were committed, aborted or expired: their tokens are refused
//! from then on (`WRITE_TOKEN_REVOKED`), which covers a replay onto the
//! holder's own committed block, after at most one report interval.
//!
//! Read tokens die the same way (`check_read`): a read token carries the
//! first allocation id not yet given out when it was granted, and any write
//! over its bytes by that allocation or a newer one means the block it was
//! granted for was freed and its space given again (`READ_TOKEN_SUPERSEDED`).
//! A restarted agent refuses read tokens granted before it registered
//! (`READ_TOKEN_BEFORE_AGENT_START`): it cannot know what was written then.
//!
//! Not covered: two overlapping writes in flight at the same instant (the
//! older one may land last), a replay within that report interval, and a
//! read in flight while the next owner's write lands.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

/// The allocator's default `--max-lease` (5 min), used until it says.
const DEFAULT_MAX_LEASE_MS: u64 = 5 * 60 * 1000;

/// Bit where an allocation id's generation starts (the allocator numbers
/// each generation's allocations from `generation << 40`).
const ALLOCATION_ID_GENERATION_SHIFT: u32 = 40;

/// At most this many ranges are named to a new allocator generation; past
/// it the agent says it cannot name them all (the vdev then waits for the
/// claim window instead).
pub const OLDER_WRITES_MAX: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
struct Written {
    end: u64,
    allocation_id: u64,
    /// When the writer's token expires (unix ms).
    expires_ms: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Fenced {
    #[error(
        "write token of allocation {mine} is superseded: allocation {newer} has written bytes \
         [{offset}, {end}) since (the space was freed and given again); allocate again"
    )]
    Superseded {
        mine: u64,
        newer: u64,
        offset: u64,
        end: u64,
    },
    #[error(
        "write token of allocation {mine} was issued before this agent (re)started (first \
         allocation it honours: {floor}): allocate again"
    )]
    BeforeStart { mine: u64, floor: u64 },
    #[error(
        "write token of allocation {mine} belongs to an older allocator generation than \
         {generation}, which this agent has joined: allocate again"
    )]
    OlderGeneration { mine: u64, generation: u64 },
    #[error(
        "write token of allocation {mine} is revoked: the allocation was committed, aborted or \
         expired; allocate again to write"
    )]
    Revoked { mine: u64 },
    #[error(
        "read token is superseded: allocation {newer} has written bytes [{offset}, {end}) since \
         it was granted (the block was freed and its space given again): the block it was \
         granted for is gone"
    )]
    ReadSuperseded { newer: u64, offset: u64, end: u64 },
    #[error(
        "read token was granted before this agent (re)started (it honours read tokens granted \
         from allocation {floor} on): it cannot tell what was written over the block since; ask \
         ReadTokens again"
    )]
    ReadBeforeStart { granted_at: u64, floor: u64 },
}

#[derive(Debug, Default)]
pub struct WriteFence {
    /// offset -> what wrote [offset, end) last; ranges never overlap.
    written: Mutex<BTreeMap<u64, Written>>,
    /// Allocation ids below this were made before this process registered.
    floor: AtomicU64,
    max_lease_ms: AtomicU64,
    /// Allocations that ended (from ReportAck) -> expiry of their tokens.
    revoked: Mutex<std::collections::HashMap<u64, u64>>,
    /// Writes of allocations of older generations than this are refused
    /// (set, under the `written` lock, when older writes are named).
    fenced_below: AtomicU64,
    /// See `records_since`.
    records_since: AtomicU64,
}

/// Put `x` at `[offset, x.end)` in `w`, replacing what it covers of the
/// `overlapping` ranges and keeping their uncovered ends; then forget what
/// no older token can reach any more (bounded work: a full sweep only when
/// the map has doubled since the last one).
fn remember(
    w: &mut BTreeMap<u64, Written>,
    overlapping: Vec<(u64, Written)>,
    offset: u64,
    x: Written,
    keep_for: u64,
    now_ms: u64,
) {
    let end = x.end;
    for (o, old) in overlapping {
        w.remove(&o);
        if o < offset {
            w.insert(o, Written { end: offset, ..old });
        }
        if old.end > end {
            w.insert(end, old);
        }
    }
    w.insert(offset, x);
    if w.len() > 1024 && w.len().is_power_of_two() {
        w.retain(|_, x| x.expires_ms.saturating_add(keep_for) > now_ms);
    }
}

impl WriteFence {
    /// The first registration of this process sets the floor; later ones
    /// (the same process reconnecting) keep the history and the floor.
    /// `label_generation`: the generation the device's label named when
    /// this process first registered. If it is older than the floor's, no
    /// earlier process of this device wrote in the floor's generation, so
    /// the records cover that whole generation.
    pub fn learn_floor(&self, first_allocation_id: u64, max_lease_ms: u64, label_generation: u64) {
        if self
            .floor
            .compare_exchange(0, first_allocation_id, Relaxed, Relaxed)
            .is_ok()
        {
            let generation = first_allocation_id >> ALLOCATION_ID_GENERATION_SHIFT;
            let since = if generation > label_generation {
                (generation << ALLOCATION_ID_GENERATION_SHIFT) | 1
            } else {
                first_allocation_id
            };
            self.records_since.store(since, Relaxed);
        }
        if max_lease_ms > 0 {
            self.max_lease_ms.store(max_lease_ms, Relaxed);
        }
    }

    /// The allocator says these allocations ended; their tokens die now
    /// (each is remembered until its token would have expired anyway).
    pub fn revoke(&self, ids: &[u64], expires_ms: &[u64], now_ms: u64) {
        let mut r = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
        for (id, exp) in ids.iter().zip(expires_ms) {
            if *exp > now_ms {
                r.insert(*id, *exp);
            }
        }
        if r.len() > 4096 && r.len().is_power_of_two() {
            r.retain(|_, exp| *exp > now_ms);
        }
    }

    fn max_lease_ms(&self) -> u64 {
        match self.max_lease_ms.load(Relaxed) {
            0 => DEFAULT_MAX_LEASE_MS,
            ms => ms,
        }
    }

    /// Admit a write of `[offset, offset+len)` by `allocation_id` (whose
    /// token was verified and expires at `expires_ms`), and remember it.
    pub fn admit(
        &self,
        allocation_id: u64,
        offset: u64,
        len: u64,
        expires_ms: u64,
        now_ms: u64,
    ) -> Result<(), Fenced> {
        let floor = self.floor.load(Relaxed);
        if allocation_id < floor {
            return Err(Fenced::BeforeStart {
                mine: allocation_id,
                floor,
            });
        }
        if self
            .revoked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&allocation_id)
        {
            return Err(Fenced::Revoked {
                mine: allocation_id,
            });
        }
        let end = offset.saturating_add(len);
        let keep_for = self.max_lease_ms();
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let fenced_below = self.fenced_below.load(Relaxed);
        if allocation_id >> ALLOCATION_ID_GENERATION_SHIFT < fenced_below {
            return Err(Fenced::OlderGeneration {
                mine: allocation_id,
                generation: fenced_below,
            });
        }
        // Overlapping ranges: the one starting before `offset` and those
        // starting inside [offset, end).
        let first = w
            .range(..offset)
            .next_back()
            .filter(|(_, x)| x.end > offset)
            .map(|(o, _)| *o)
            .unwrap_or(offset);
        let overlapping: Vec<(u64, Written)> = w.range(first..end).map(|(o, x)| (*o, *x)).collect();
        if let Some((o, x)) = overlapping
            .iter()
            .find(|(_, x)| x.allocation_id > allocation_id)
        {
            return Err(Fenced::Superseded {
                mine: allocation_id,
                newer: x.allocation_id,
                offset: (*o).max(offset),
                end: x.end.min(end),
            });
        }
        remember(
            &mut w,
            overlapping,
            offset,
            Written {
                end,
                allocation_id,
                expires_ms,
            },
            keep_for,
            now_ms,
        );
        Ok(())
    }

    /// A write admitted without a token (the agent checks none): nothing is
    /// refused, but its range is remembered under the first allocation id
    /// of `generation`, the allocator generation this agent had joined when
    /// the write arrived, so that the next generation is told what older
    /// ones wrote (`older_writes`), as for checked writes. What a writer of
    /// an older generation sends after the agent joined a newer one cannot
    /// be told apart without a token: it is remembered under the newer one.
    pub fn record_unchecked(&self, generation: u64, offset: u64, len: u64, now_ms: u64) {
        let end = offset.saturating_add(len);
        if end == offset {
            return;
        }
        let keep_for = self.max_lease_ms();
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let first = w
            .range(..offset)
            .next_back()
            .filter(|(_, x)| x.end > offset)
            .map(|(o, _)| *o)
            .unwrap_or(offset);
        let overlapping: Vec<(u64, Written)> = w.range(first..end).map(|(o, x)| (*o, *x)).collect();
        let written = Written {
            end,
            allocation_id: generation << ALLOCATION_ID_GENERATION_SHIFT,
            // Kept as long as a token issued now could be used.
            expires_ms: now_ms.saturating_add(keep_for),
        };
        remember(&mut w, overlapping, offset, written, keep_for, now_ms);
    }

    /// Admit a read of `[offset, offset+len)` with a read token granted
    /// when `granted_at` was the first allocation id not yet given out:
    /// any allocation that wrote here since has an id at or above it, and
    /// the block the token was granted for is gone. Nothing is remembered.
    /// The written ranges outlive every such token: a read token expires
    /// within the longest lease of its grant, a range is kept for that long
    /// past its own (later) writer's token.
    pub fn check_read(&self, granted_at: u64, offset: u64, len: u64) -> Result<(), Fenced> {
        // What was written before this process started is not known: a
        // token from before then cannot be checked, so it is refused.
        let floor = self.floor.load(Relaxed);
        if granted_at < floor {
            return Err(Fenced::ReadBeforeStart { granted_at, floor });
        }
        let end = offset.saturating_add(len);
        let w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let first = w
            .range(..offset)
            .next_back()
            .filter(|(_, x)| x.end > offset)
            .map(|(o, _)| *o)
            .unwrap_or(offset);
        match w
            .range(first..end)
            .find(|(_, x)| x.allocation_id >= granted_at)
        {
            Some((o, x)) => Err(Fenced::ReadSuperseded {
                newer: x.allocation_id,
                offset: (*o).max(offset),
                end: x.end.min(end),
            }),
            None => Ok(()),
        }
    }

    /// The oldest allocation id from which this device's writes are all
    /// recorded here.
    pub fn records_since(&self) -> u64 {
        self.records_since.load(Relaxed)
    }

    /// Fence every generation older than `generation` (no write of theirs
    /// is admitted any more) and name the ranges they wrote, in offset
    /// order, each with the allocation id that wrote it last (adjacent
    /// ranges are merged only when one allocation wrote both: the
    /// allocator refuses a claim by any other); None when there are more
    /// than `OLDER_WRITES_MAX`. Both under one lock: a write admitted
    /// before is named, one after is refused.
    pub fn older_writes(&self, generation: u64) -> Option<Vec<(u64, u64, u64)>> {
        let w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        self.fenced_below.fetch_max(generation, Relaxed);
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        for (&offset, x) in w.iter() {
            if x.allocation_id >> ALLOCATION_ID_GENERATION_SHIFT >= generation {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.1 >= offset && last.2 == x.allocation_id => {
                    last.1 = last.1.max(x.end)
                }
                _ => {
                    if out.len() == OLDER_WRITES_MAX {
                        return None;
                    }
                    out.push((offset, x.end, x.allocation_id));
                }
            }
        }
        Some(out)
    }

    /// Ranges remembered (tests, stats).
    pub fn len(&self) -> usize {
        self.written.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without tokens, writes are remembered under the generation the
    /// agent had joined: a new generation is told of those before it, and
    /// nothing is refused.
    #[test]
    fn unchecked_writes_are_named_by_the_generation_they_arrived_in() {
        let f = WriteFence::default();
        f.record_unchecked(1, 0, 4096, 1000);
        f.record_unchecked(1, 4096, 4096, 1000);
        f.record_unchecked(2, 65536, 4096, 1000);
        let g = |n: u64| n << ALLOCATION_ID_GENERATION_SHIFT;
        assert_eq!(f.older_writes(2), Some(vec![(0, 8192, g(1))]));
        // Still recorded after the fence moved on.
        f.record_unchecked(2, 131072, 4096, 1000);
        assert_eq!(
            f.older_writes(3),
            Some(vec![
                (0, 8192, g(1)),
                (65536, 69632, g(2)),
                (131072, 135168, g(2))
            ])
        );
    }

    /// A new generation learns what older ones wrote, coalesced, and from
    /// then on no older write is admitted.
    #[test]
    fn older_writes_are_named_once_and_fenced() {
        let f = WriteFence::default();
        let g1 = |n: u64| (1 << ALLOCATION_ID_GENERATION_SHIFT) | n;
        let g2 = |n: u64| (2 << ALLOCATION_ID_GENERATION_SHIFT) | n;
        f.learn_floor(g1(5), 60_000, 0);
        f.admit(g1(5), 0, 4096, u64::MAX, 0).unwrap();
        f.admit(g1(6), 4096, 4096, u64::MAX, 0).unwrap();
        f.admit(g1(7), 65536, 4096, u64::MAX, 0).unwrap();
        f.admit(g2(1), 8192, 4096, u64::MAX, 0).unwrap();
        // Adjacent ranges of different allocations stay apart: each names
        // its own last writer.
        assert_eq!(
            f.older_writes(2),
            Some(vec![
                (0, 4096, g1(5)),
                (4096, 8192, g1(6)),
                (65536, 69632, g1(7))
            ])
        );
        assert_eq!(
            f.admit(g1(8), 131072, 4096, u64::MAX, 0),
            Err(Fenced::OlderGeneration {
                mine: g1(8),
                generation: 2
            })
        );
        f.admit(g2(2), 131072, 4096, u64::MAX, 0).unwrap();
        // The label named no older generation: generation 1 is covered
        // from its first allocation, not only from this process's floor.
        assert_eq!(f.records_since(), g1(1));
        let restarted = WriteFence::default();
        restarted.learn_floor(g1(5), 60_000, 1);
        assert_eq!(restarted.records_since(), g1(5));
    }

    #[test]
    fn a_newer_allocation_fences_older_tokens_over_its_bytes_only() {
        let f = WriteFence::default();
        f.admit(5, 0, 8192, 1000, 0).unwrap();
        // Bob (9) is given [4096, 12288) and writes it.
        f.admit(9, 4096, 8192, 1000, 0).unwrap();
        // Alice again: refused wherever she overlaps bob.
        let e = f.admit(5, 0, 8192, 1000, 0).unwrap_err();
        assert!(
            matches!(
                e,
                Fenced::Superseded {
                    newer: 9,
                    offset: 4096,
                    end: 8192,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(f.admit(5, 4096, 4096, 1000, 0).is_err());
        // The part nobody newer wrote is still hers.
        f.admit(5, 0, 4096, 1000, 0).unwrap();
        // Bob rewrites his own block; a newer one writes next to it.
        f.admit(9, 4096, 8192, 1000, 0).unwrap();
        f.admit(12, 12288, 4096, 1000, 0).unwrap();
        assert!(f.admit(9, 12288, 4096, 1000, 0).is_err());
    }

    #[test]
    fn a_read_token_dies_where_a_newer_allocation_wrote() {
        let f = WriteFence::default();
        f.learn_floor(10, 0, 0);
        // Alice's block (allocation 12) is written; her read token is
        // granted when 20 is the next allocation id.
        f.admit(12, 0, 8192, 1000, 0).unwrap();
        f.check_read(20, 0, 8192).unwrap();
        // Freed, and bob (25) writes its second half.
        f.admit(25, 4096, 4096, 1000, 0).unwrap();
        assert_eq!(
            f.check_read(20, 0, 8192),
            Err(Fenced::ReadSuperseded {
                newer: 25,
                offset: 4096,
                end: 8192
            })
        );
        // The half nobody newer wrote still reads; bob's own token reads.
        f.check_read(20, 0, 4096).unwrap();
        f.check_read(26, 0, 8192).unwrap();
        // Granted before this agent started: it cannot know.
        assert_eq!(
            f.check_read(9, 0, 4096),
            Err(Fenced::ReadBeforeStart {
                granted_at: 9,
                floor: 10
            })
        );
    }

    #[test]
    fn a_revoked_allocation_writes_no_more_until_its_token_expired() {
        let f = WriteFence::default();
        f.admit(7, 0, 4096, 1000, 0).unwrap();
        f.revoke(&[7, 8], &[1000, 10], 100);
        assert_eq!(
            f.admit(7, 0, 4096, 1000, 200),
            Err(Fenced::Revoked { mine: 7 })
        );
        // Already expired when revoked: nothing to remember.
        f.admit(8, 8192, 4096, 10, 200).unwrap();
    }

    #[test]
    fn a_restarted_agent_honours_nothing_older_than_its_registration() {
        let f = WriteFence::default();
        f.learn_floor(100, 0, 0);
        f.learn_floor(200, 0, 0); // a reconnect of the same process
        assert_eq!(
            f.admit(99, 0, 4096, 1, 0),
            Err(Fenced::BeforeStart {
                mine: 99,
                floor: 100
            })
        );
        f.admit(100, 0, 4096, 1, 0).unwrap();
        f.admit(150, 0, 4096, 1, 0).unwrap();
    }
}
