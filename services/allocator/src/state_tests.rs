//! `Inner`'s memory of committed ids, so a repeated Commit gets the first
//! answer: kept `COMMIT_MEMORY_TXGS` txgs after its txg synced and at least
//! `COMMIT_MEMORY`, then forgotten (the clock is the caller's `now`).

use std::time::{Duration, Instant};

use metaslab::testing::{data, pool_of};

use super::*;

pub(crate) fn inner() -> Inner {
    Inner::new(pool_of(&[1 << 30]))
}

/// One block allocated and committed in the open txg, which then closes.
fn commit_one(g: &mut Inner) -> (AllocationId, Txg) {
    let Submitted::Ready(t) = g.pool.submit(data(4096, 1)).unwrap() else {
        panic!("queued")
    };
    let (a, _) = g.place(t, Duration::from_secs(600)).unwrap();
    let txg = g.commit(&[a.id]).unwrap();
    g.pool.sync();
    (a.id, txg)
}

/// Whether a repeated Commit of `id` still answers its first `txg`.
fn remembered(g: &mut Inner, id: AllocationId, txg: Txg) -> bool {
    match g.commit(&[id]) {
        Ok(t) => {
            assert_eq!(t, txg, "a repeated commit of {id} answers its first txg");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn committed_ids_are_forgotten_four_txgs_and_a_minute_after_their_sync() {
    let mut g = inner();
    let t0 = Instant::now();
    let blocks: Vec<(AllocationId, Txg)> = (0..10).map(|_| commit_one(&mut g)).collect();
    let last = blocks.last().unwrap().1;
    // Every txg synced within the minute: all remembered, however many.
    for &(_, t) in &blocks {
        g.synced(t, t0);
    }
    for &(id, t) in &blocks {
        assert!(
            remembered(&mut g, id, t),
            "{id} in txg {t}, all within a minute"
        );
    }
    // A minute on: txgs more than four behind the last sync are forgotten.
    g.synced(last, t0 + Duration::from_secs(61));
    for &(id, t) in &blocks {
        assert_eq!(
            remembered(&mut g, id, t),
            t + COMMIT_MEMORY_TXGS > last,
            "{id} in txg {t}, last synced {last}"
        );
    }
    assert_eq!(
        g.committed.len(),
        g.committed_by_txg.values().map(Vec::len).sum::<usize>(),
        "the by-txg index names exactly the remembered ids"
    );
    // Younger than a minute stays, however many txgs synced since.
    let (young, yt) = commit_one(&mut g);
    let mut now = t0 + Duration::from_secs(62);
    for _ in 0..20 {
        let (_, t) = commit_one(&mut g);
        now += Duration::from_millis(100);
        g.synced(t, now);
    }
    assert!(remembered(&mut g, young, yt));
    // And goes once it is both.
    let (_, t) = commit_one(&mut g);
    g.synced(t, now + Duration::from_secs(61));
    g.synced(t, now + Duration::from_secs(62));
    assert!(!remembered(&mut g, young, yt));
}
