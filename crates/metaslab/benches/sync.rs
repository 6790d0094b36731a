//! `Pool::sync` at 1 PiB: eight 128 TiB vdevs (65 536 metaslabs), each txg
//! committing 64 blocks of 128 KiB (the rotor spreads them over every vdev)
//! and freeing the previous txg's. Only the sync is timed. Prints figures
//! (no harness):
//!
//!   cargo bench -p metaslab --bench sync
//!
//! `ALIQUOT_BENCH_TXGS` txgs are timed (default 400) after 20 of warm-up.
//! A sync should cost its dirty metaslabs, not the pool's metaslab count.

use std::time::{Duration, Instant};

use metaslab::testing::pool_of;
use metaslab::*;

const TIB: u64 = 1 << 40;

fn main() {
    let txgs: usize = std::env::var("ALIQUOT_BENCH_TXGS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let mut pool = pool_of(&[128 * TIB; 8]);
    let metaslabs: usize = pool
        .stats()
        .vdevs
        .iter()
        .map(|v| v.metaslab_count as usize)
        .sum();
    let mut prev: Vec<Extent> = Vec::new();
    let mut times: Vec<Duration> = Vec::with_capacity(txgs);
    for i in 0..txgs + 20 {
        let mut now = Vec::new();
        for _ in 0..64 {
            let req = AllocRequest {
                kind: AllocKind::Data,
                size: 128 << 10,
                copies: 1,
                max_size: None,
                affinity: None,
            };
            let Submitted::Ready(t) = pool.submit(req).unwrap() else {
                unreachable!("one allocation in flight")
            };
            let a = pool.allocate(t, false).unwrap();
            pool.commit(a.id).unwrap();
            now.extend(a.extents);
        }
        pool.free(&prev).unwrap();
        prev = now;
        let t = Instant::now();
        std::hint::black_box(pool.sync());
        if i >= 20 {
            times.push(t.elapsed());
        }
    }
    times.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "Pool::sync, {metaslabs} metaslabs, 64 x 128 KiB committed + 64 freed per txg: median {:.1} us, mean {:.1} us, p99 {:.1} us over {} txgs",
        us(times[times.len() / 2]),
        us(mean),
        us(times[times.len() * 99 / 100]),
        times.len()
    );
}
