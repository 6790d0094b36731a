//! allocate + commit + free of 4K, 128K and 1M blocks on a fresh 4-vdev
//! pool and on one at 80 % fragmentation (targets: ≤ 1 µs per 128K
//! allocation fresh, ≤ 3 µs fragmented). Each iteration is one full
//! submit → allocate → commit → free cycle; a sync every 64 iterations
//! keeps the defer pipeline moving as the service's txg loop would.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metaslab::testing::pool_of;
use metaslab::*;

const GIB: u64 = 1 << 30;

fn pool(vdevs: usize, capacity: u64) -> Pool {
    pool_of(&vec![capacity; vdevs])
}

fn cycle(pool: &mut Pool, size: u64, n: &mut u64) {
    let req = AllocRequest {
        kind: AllocKind::Data,
        size,
        copies: 1,
        max_size: None,
        affinity: None,
    };
    let t = match pool.submit(req).unwrap() {
        Submitted::Ready(t) => t,
        Submitted::Queued(_) => unreachable!("one allocation in flight"),
    };
    let a = pool.allocate(t, false).unwrap();
    pool.commit(a.id).unwrap();
    pool.free(&a.extents).unwrap();
    *n += 1;
    if n.is_multiple_of(64) {
        black_box(pool.sync());
    }
}

/// Fill a pool to 92 % with 4K and 8K blocks, then free every other one:
/// most free space in single-block holes, class fragmentation ≈ 80 %, and
/// a few percent left whole at the metaslab ends for the 1M case.
fn fragmented() -> Pool {
    let mut pool = pool(4, 4 * GIB);
    let space = pool.stats().classes[0].space;
    let mut live = Vec::new();
    let mut i = 0u64;
    let mut bytes = 0;
    loop {
        let size = 4096 << (i % 2);
        i += 1;
        let req = AllocRequest {
            kind: AllocKind::Data,
            size,
            copies: 1,
            max_size: None,
            affinity: None,
        };
        let Ok(Submitted::Ready(t)) = pool.submit(req) else {
            break;
        };
        let Ok(a) = pool.allocate(t, false) else {
            break;
        };
        pool.commit(a.id).unwrap();
        live.push(a.extents[0]);
        bytes += size;
        if i.is_multiple_of(4096) {
            pool.sync();
        }
        if bytes >= space / 100 * 92 {
            break;
        }
    }
    for (j, e) in live.iter().enumerate() {
        if j % 2 == 0 {
            pool.free(&[*e]).unwrap();
        }
        if j % 4096 == 0 {
            pool.sync();
        }
    }
    for _ in 0..3 {
        pool.sync();
    }
    pool
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("fresh_4_vdevs");
    for size in [4u64 << 10, 128 << 10, 1 << 20] {
        g.throughput(Throughput::Elements(1));
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            let mut p = pool(4, 64 * GIB);
            let mut n = 0;
            b.iter(|| cycle(&mut p, size, &mut n));
        });
    }
    g.finish();
    let frag = fragmented();
    let f = frag.stats().classes[0].fragmentation;
    eprintln!("fragmented pool: class fragmentation {f:?}");
    let mut g = c.benchmark_group("fragmented_80pct");
    for size in [4u64 << 10, 128 << 10, 1 << 20] {
        g.throughput(Throughput::Elements(1));
        // Criterion calls this once per sample: clone the pool built once
        // above instead of building it again (3.5 M allocations, seconds).
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            let mut p = frag.clone();
            let mut n = 0;
            b.iter(|| cycle(&mut p, size, &mut n));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
