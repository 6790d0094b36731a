//! The indirect mapping's memory and speed at 10^6 and 10^7 live entries
//! (`cargo bench -p aliquot-allocator --bench indirect_map`): bytes per
//! entry as the allocator's heap sees them (a counting global allocator,
//! after the map is built and the build's garbage freed), entries added in
//! random order (moves of a balancer) and loaded sorted (a restart), and
//! lookups of mapped and unmapped extents, by old extent (`get`) and by new
//! extent (`source_of`, what a Free or a removal asks of a moved block's new
//! home). `ALIQUOT_BENCH_ENTRIES=100000` runs one size only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use aliquot_allocator::indirect::{IndirectMap, Mapping};
use metaslab::Extent;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Entry `k`: a 128 KiB block of vdev k % 4 moved to vdev 4 + k % 3.
fn mapping(k: u64) -> Mapping {
    Mapping {
        from: Extent {
            vdev: (k % 4) as u32,
            offset: (k / 4) << 17,
            size: 128 << 10,
        },
        to: Extent {
            vdev: 4 + (k % 3) as u32,
            offset: (k / 3) << 17,
            size: 128 << 10,
        },
        txg: 1,
    }
}

fn main() {
    let sizes: Vec<u64> = match std::env::var("ALIQUOT_BENCH_ENTRIES") {
        Ok(v) => vec![v.parse().expect("ALIQUOT_BENCH_ENTRIES: a number")],
        Err(_) => vec![1_000_000, 10_000_000],
    };
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    for n in sizes {
        let mut order: Vec<u64> = (0..n).collect();
        order.shuffle(&mut rng);
        let base = LIVE.load(Ordering::Relaxed);
        let t = Instant::now();
        let mut map = IndirectMap::default();
        for &k in &order {
            map.insert(mapping(k)).unwrap();
        }
        let insert_s = t.elapsed().as_secs_f64();
        // The order vector is the bench's, not the map's.
        let heap = LIVE.load(Ordering::Relaxed) - base;
        println!(
            "entries {n}: random-order inserts {:.0} ns each ({insert_s:.2} s); heap {:.2} \
             bytes/entry (status says {:.2})",
            insert_s * 1e9 / n as f64,
            heap as f64 / n as f64,
            map.memory_bytes() as f64 / n as f64,
        );
        let t = Instant::now();
        let mut hits = 0u64;
        let probes = 1_000_000u64;
        for _ in 0..probes {
            let k = rng.random_range(0..n);
            hits += map.get(&mapping(k).from).is_some() as u64;
            let miss = Extent {
                offset: mapping(k).from.offset + 4096,
                ..mapping(k).from
            };
            hits += map.get(&miss).is_some() as u64;
        }
        assert_eq!(hits, probes);
        println!(
            "entries {n}: lookups {:.0} ns each (half mapped, half not)",
            t.elapsed().as_secs_f64() * 1e9 / (2 * probes) as f64
        );
        // By new extent: up to 10^6 probes or about a second, whichever
        // comes first (a scan of every entry per probe would take ~n times
        // a lookup).
        let t = Instant::now();
        let (mut probes, mut hits) = (0u64, 0u64);
        while probes < 1_000_000 && (probes % 64 != 0 || t.elapsed().as_secs_f64() < 1.0) {
            let k = rng.random_range(0..n);
            let to = mapping(k).to;
            hits += map.source_of(&to).is_some() as u64;
            let miss = Extent {
                offset: to.offset + 4096,
                ..to
            };
            hits += map.source_of(&miss).is_some() as u64;
            probes += 1;
        }
        assert_eq!(hits, probes);
        println!(
            "entries {n}: source_of {:.0} ns each (half mapped, half not; {probes} probes)",
            t.elapsed().as_secs_f64() * 1e9 / (2 * probes) as f64
        );
        let all: Vec<Mapping> = map.iter().collect();
        drop(map);
        let base = LIVE.load(Ordering::Relaxed);
        let t = Instant::now();
        let map = IndirectMap::from_sorted(all.iter().copied()).unwrap();
        let load_s = t.elapsed().as_secs_f64();
        let heap = LIVE.load(Ordering::Relaxed) - base;
        println!(
            "entries {n}: load from sorted rows {load_s:.2} s; heap {:.2} bytes/entry",
            heap as f64 / n as f64
        );
        drop(map);
        drop(all);
    }
}
