//! Who owns each committed extent: the certificate
//! identity that committed it. Free and Relocate of an extent are allowed
//! to its owner and to admins only (PERMISSION_DENIED, reason NOT_OWNER); a
//! relocation keeps the block's owner. Without mutual TLS there are no
//! identities: nothing is recorded and nothing is checked, and extents
//! committed before owners existed (or under `--insecure`) have none.
//!
//! Kept compactly as runs: consecutive extents of one owner on one vdev are
//! one `[start, end)` run (one client's stream of blocks is a few runs, not
//! one entry per block), and identities are numbered once. Each txg persists
//! only the windows it changed, widened to whole owner-map rows
//! (`crate::owner_map`: a row holds the runs whose start lies in its
//! window), so every row a change touches is rewritten whole.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use metaslab::Extent;

use crate::owner_map;

/// An identity's number in the store (1-based; 0 is never used).
pub type OwnerIdx = u32;

/// What one txg changed: the runs of `vdev` in `[start, end)` are now
/// exactly `runs`, and `identities` were numbered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerChanges {
    pub identities: Vec<(OwnerIdx, String)>,
    pub windows: Vec<OwnerWindow>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerWindow {
    pub vdev: u32,
    pub start: u64,
    pub end: u64,
    /// `(start, end, owner)`, in order, inside `[start, end)`.
    pub runs: Vec<(u64, u64, OwnerIdx)>,
}

impl OwnerChanges {
    pub fn is_empty(&self) -> bool {
        self.identities.is_empty() && self.windows.is_empty()
    }
}

#[derive(Debug, Default)]
pub struct ExtentOwners {
    names: Vec<String>,
    by_name: HashMap<String, OwnerIdx>,
    /// (vdev, start) -> (end, owner); runs never overlap.
    runs: BTreeMap<(u32, u64), (u64, OwnerIdx)>,
    /// Windows changed since the last `take_changes`: (vdev, start) ->
    /// end, so a stream of commits growing one run is one entry.
    dirty: BTreeMap<(u32, u64), u64>,
    new_names: Vec<(OwnerIdx, String)>,
}

impl ExtentOwners {
    /// Rebuild from the store.
    pub fn restore(
        identities: Vec<(OwnerIdx, String)>,
        runs: Vec<(u32, u64, u64, OwnerIdx)>,
    ) -> ExtentOwners {
        let mut o = ExtentOwners::default();
        for (idx, name) in identities {
            let i = idx as usize;
            if o.names.len() < i {
                o.names.resize(i, String::new());
            }
            o.names[i - 1] = name.clone();
            o.by_name.insert(name, idx);
        }
        // Sorted input (the stores read in order): built in one pass.
        o.runs = runs
            .into_iter()
            .map(|(vdev, start, end, owner)| ((vdev, start), (end, owner)))
            .collect();
        o
    }

    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Every run, `(vdev, start, end, owner)` in order: what a store that
    /// persisted every change holds.
    pub fn all_runs(&self) -> Vec<(u32, u64, u64, OwnerIdx)> {
        self.runs
            .iter()
            .map(|(&(v, s), &(e, o))| (v, s, e, o))
            .collect()
    }

    fn index(&mut self, name: &str) -> OwnerIdx {
        if let Some(&i) = self.by_name.get(name) {
            return i;
        }
        self.names.push(name.to_string());
        let i = self.names.len() as OwnerIdx;
        self.by_name.insert(name.to_string(), i);
        self.new_names.push((i, name.to_string()));
        i
    }

    /// The run keys of `vdev` overlapping or touching `[a, b)`.
    fn around(&self, vdev: u32, a: u64, b: u64) -> Vec<(u64, u64, OwnerIdx)> {
        let mut v = Vec::new();
        if let Some((&(vv, s), &(e, o))) = self.runs.range(..(vdev, a)).next_back()
            && vv == vdev
            && e >= a
        {
            v.push((s, e, o));
        }
        for (&(_, s), &(e, o)) in self.runs.range((vdev, a)..=(vdev, b)) {
            v.push((s, e, o));
        }
        v
    }

    fn mark_dirty(&mut self, vdev: u32, start: u64, end: u64) {
        let e = self.dirty.entry((vdev, start)).or_insert(end);
        *e = (*e).max(end);
    }

    /// The common commit: `[a, b)` lies inside `owner`'s run, or extends
    /// the run ending at or before `a` with nothing else up to `b`. Done in
    /// place (no run removed and re-inserted); false when it is not that case.
    fn extend_in_place(&mut self, vdev: u32, a: u64, b: u64, owner: OwnerIdx) -> bool {
        let Some((&(v, s), &(e, o))) = self.runs.range(..=(vdev, a)).next_back() else {
            return false;
        };
        if v != vdev || o != owner {
            return false;
        }
        if e >= b {
            // Already this owner's (a retried commit, a claim).
            return true;
        }
        if e > a {
            return false;
        }
        // [e, b) must hold no other run, and the next run must be another
        // owner's (the general path joins this owner's next run to it).
        if let Some((&(nv, ns), &(_, no))) = self.runs.range((vdev, a)..).next()
            && nv == vdev
            && (ns < b || no == owner)
        {
            return false;
        }
        if let Some(run) = self.runs.get_mut(&(vdev, s)) {
            run.0 = b;
        }
        self.mark_dirty(vdev, s, b);
        true
    }

    /// Set `[a, b)` of `vdev` to `owner` (None: no owner), merging with
    /// neighbours of the same owner, and mark the window dirty.
    fn set(&mut self, vdev: u32, a: u64, b: u64, owner: Option<OwnerIdx>) {
        if a >= b {
            return;
        }
        if let Some(o) = owner
            && self.extend_in_place(vdev, a, b, o)
        {
            return;
        }
        let near = self.around(vdev, a, b);
        let mut lo = a;
        let mut hi = b;
        let mut pieces: Vec<(u64, u64, OwnerIdx)> = Vec::new();
        for (s, e, o) in near {
            self.runs.remove(&(vdev, s));
            lo = lo.min(s);
            hi = hi.max(e);
            // Keep what lies outside [a, b).
            if s < a {
                pieces.push((s, e.min(a), o));
            }
            if e > b {
                pieces.push((s.max(b), e, o));
            }
        }
        if let Some(o) = owner {
            pieces.push((a, b, o));
            // A run may span free space: ownership of free bytes is never
            // asked (Free, ReadTokens take exactly committed extents) and
            // the next commit there sets its own owner. So the nearest runs
            // on either side join this one when they are the same owner's:
            // one client's blocks stay one run however they interleave
            // with free space (the gapped layout of the restart bench).
            let left = self
                .runs
                .range((vdev, 0)..(vdev, lo))
                .next_back()
                .map(|(&(_, s), &(e, oo))| (s, e, oo));
            let right = self
                .runs
                .range((vdev, hi)..(vdev, u64::MAX))
                .next()
                .map(|(&(_, s), &(e, oo))| (s, e, oo));
            for (s, e, oo) in left.into_iter().chain(right) {
                if oo == o {
                    self.runs.remove(&(vdev, s));
                    lo = lo.min(s);
                    hi = hi.max(e);
                    pieces.push((s, e, oo));
                }
            }
        }
        pieces.sort_unstable();
        let mut merged: Vec<(u64, u64, OwnerIdx)> = Vec::new();
        for p in pieces {
            match merged.last_mut() {
                // Touching, or (for a commit) across free space: see above.
                Some(l) if l.2 == p.2 && (l.1 == p.0 || owner == Some(p.2)) => l.1 = l.1.max(p.1),
                _ => merged.push(p),
            }
        }
        for (s, e, o) in merged {
            self.runs.insert((vdev, s), (e, o));
        }
        self.mark_dirty(vdev, lo, hi);
    }

    /// `owner` committed these extents.
    pub fn committed(&mut self, owner: &str, extents: &[Extent]) {
        let i = self.index(owner);
        for e in extents {
            self.set(e.vdev, e.offset, e.offset + e.size, Some(i));
        }
    }

    /// A relocation committed: `to` gets `from`'s owner, `from` none.
    pub fn moved(&mut self, from: &Extent, to: &[Extent]) {
        let owner = self.owners_of(from).into_iter().next();
        self.set(from.vdev, from.offset, from.offset + from.size, None);
        if let Some(o) = owner {
            for e in to {
                self.set(e.vdev, e.offset, e.offset + e.size, Some(o));
            }
        }
    }

    /// A move that keeps its old address: `to` gets `from`'s owner, and
    /// `from` keeps it (its address still answers for the block).
    pub fn copied(&mut self, from: &Extent, to: &[Extent]) {
        if let Some(o) = self.owners_of(from).into_iter().next() {
            for e in to {
                self.set(e.vdev, e.offset, e.offset + e.size, Some(o));
            }
        }
    }

    /// These extents were freed.
    pub fn freed(&mut self, extents: &[Extent]) {
        for e in extents {
            self.set(e.vdev, e.offset, e.offset + e.size, None);
        }
    }

    fn owners_of(&self, e: &Extent) -> BTreeSet<OwnerIdx> {
        let (a, b) = (e.offset, e.offset + e.size);
        self.around(e.vdev, a, b)
            .into_iter()
            .filter(|(s, en, _)| *s < b && *en > a)
            .map(|(_, _, o)| o)
            .collect()
    }

    /// No identity owns any byte of `e`.
    pub fn unowned(&self, e: &Extent) -> bool {
        self.owners_of(e).is_empty()
    }

    /// The first of `extents` that some identity other than `caller` owns,
    /// with that owner's name.
    pub fn foreign(&self, caller: &str, extents: &[Extent]) -> Option<(Extent, String)> {
        let me = self.by_name.get(caller).copied();
        extents.iter().find_map(|e| {
            self.owners_of(e)
                .into_iter()
                .find(|o| Some(*o) != me)
                .map(|o| (*e, self.names[o as usize - 1].clone()))
        })
    }

    /// What changed since the last call, for the txg being synced.
    pub fn take_changes(&mut self) -> OwnerChanges {
        let dirty = std::mem::take(&mut self.dirty);
        // Widened to whole owner-map rows; overlapping or touching windows
        // of one vdev become one.
        let mut windows: Vec<(u32, u64, u64)> = Vec::new();
        for ((v, s), e) in dirty {
            let s = owner_map::window_of(s);
            let e = owner_map::window_of(e - 1).saturating_add(owner_map::WINDOW);
            match windows.last_mut() {
                Some(l) if l.0 == v && s <= l.2 => l.2 = l.2.max(e),
                _ => windows.push((v, s, e)),
            }
        }
        OwnerChanges {
            identities: std::mem::take(&mut self.new_names),
            windows: windows
                .into_iter()
                .map(|(vdev, start, end)| OwnerWindow {
                    vdev,
                    start,
                    end,
                    runs: self
                        .runs
                        .range((vdev, start)..(vdev, end))
                        .map(|(&(_, s), &(e, o))| (s, e, o))
                        .collect(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use metaslab::testing::ext;

    use super::*;

    /// The in-place path and the general one agree with a naive owner per
    /// byte, over random commits and frees of several owners.
    #[test]
    fn owners_match_a_per_block_model() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..50 {
            let mut o = ExtentOwners::default();
            // (vdev, block) -> owner, blocks of 10 bytes.
            let mut held: BTreeMap<(u32, u64), &str> = BTreeMap::new();
            let names = ["client/a", "client/b", "client/c"];
            for _ in 0..300 {
                let vdev = rnd(2) as u32;
                let blk = rnd(40);
                let e = ext(vdev, blk * 10, 10);
                match held.get(&(vdev, blk)) {
                    Some(_) if rnd(3) == 0 => {
                        o.freed(&[e]);
                        held.remove(&(vdev, blk));
                    }
                    Some(_) => {}
                    None => {
                        // Sequential streams most of the time, as clients write.
                        let spread = if rnd(4) == 0 { 3 } else { 1 };
                        let who = names[rnd(spread) as usize];
                        o.committed(who, &[e]);
                        held.insert((vdev, blk), who);
                    }
                }
                for (&(v, b), &who) in &held {
                    let e = ext(v, b * 10, 10);
                    assert_eq!(o.foreign(who, &[e]), None, "{who} owns {e:?}");
                    for other in names.iter().filter(|n| **n != who) {
                        assert_eq!(
                            o.foreign(other, &[e]).map(|x| x.1),
                            Some(who.to_string()),
                            "{e:?} is {who}'s, not {other}'s"
                        );
                    }
                }
            }
            // What a txg persists covers every run it changed.
            let c = o.take_changes();
            let persisted: usize = c.windows.iter().map(|w| w.runs.len()).sum();
            assert_eq!(persisted, o.runs(), "one take_changes after all: every run");
        }
    }

    #[test]
    fn runs_merge_split_and_persist_whole_windows() {
        let mut o = ExtentOwners::default();
        o.committed(
            "client/alice",
            &[ext(0, 0, 10), ext(0, 10, 10), ext(0, 20, 10)],
        );
        assert_eq!(o.runs(), 1, "one owner's consecutive blocks are one run");
        o.committed("client/bob", &[ext(0, 30, 10)]);
        assert_eq!(o.runs(), 2);
        // Across free space, one owner's blocks stay one run.
        o.committed("client/bob", &[ext(0, 100, 10)]);
        assert_eq!(o.runs(), 2);
        o.freed(&[ext(0, 100, 10)]);
        assert_eq!(o.foreign("client/alice", &[ext(0, 10, 10)]), None);
        assert_eq!(
            o.foreign("client/bob", &[ext(0, 10, 10)]).map(|x| x.1),
            Some("client/alice".into())
        );
        let c = o.take_changes();
        assert_eq!(c.identities.len(), 2);
        assert_eq!(c.windows.len(), 1);
        assert_eq!(c.windows[0].runs, vec![(0, 30, 1), (30, 100, 2)]);
        // Free the middle block: the run splits.
        o.freed(&[ext(0, 10, 10)]);
        assert_eq!(o.runs(), 3);
        let c = o.take_changes();
        // The whole owner-map row is rewritten, bob's run in it too.
        assert_eq!(
            (c.windows[0].start, c.windows[0].end),
            (0, owner_map::WINDOW)
        );
        assert_eq!(
            c.windows[0].runs,
            vec![(0, 10, 1), (20, 30, 1), (30, 100, 2)]
        );
        // A relocation keeps the owner.
        o.moved(&ext(0, 20, 10), &[ext(1, 0, 10)]);
        assert_eq!(
            o.foreign("client/bob", &[ext(1, 0, 10)]).map(|x| x.1),
            Some("client/alice".into())
        );
        assert_eq!(o.foreign("client/bob", &[ext(0, 20, 10)]), None);
        // Restored from what was persisted, the same answers.
        let r = ExtentOwners::restore(
            vec![(1, "client/alice".into()), (2, "client/bob".into())],
            vec![(0, 0, 10, 1), (0, 30, 40, 2), (1, 0, 10, 1)],
        );
        assert_eq!(
            r.foreign("client/bob", &[ext(0, 0, 10)]).map(|x| x.1),
            Some("client/alice".into())
        );
    }
}
