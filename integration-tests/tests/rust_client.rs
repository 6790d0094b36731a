//! The Rust client library (`aliquot-client`) against a real pool of
//! processes over loopback: one block written, made durable, read back
//! and freed; a batch of 256 x 64 KiB pipelined with at most 4 blocks
//! between Allocate and Written (the class's RESERVED, sampled while it
//! runs, never holds more than 4 blocks' extents), committed in one txg and
//! read back; and a batch across an allocator restart (SIGKILL mid-batch,
//! a claim window of 5 s): what was written in the old generation is
//! claimed in the new one, the rest is written again, and every block
//! reads back intact, with no two blocks sharing space. And the batch
//! helper as the Python one is held to: 256 x 1 MiB under a class limit
//! below 64 MiB beside a paced `aliquotctl write` (which never waits more
//! than 2 s in the throttle), and a batch failing mid-way leaves nothing
//! reserved or allocated.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aliquot_client::bytes::{BufMut, Bytes};
use aliquot_client::{Block, BlockData, ClientTls, Config, Pool};
use aliquot_proto::v1::GetPoolRequest;
use integration_tests::throttle::{Classes, paced_writer, throttle_wait_us};
use integration_tests::{FilePool, args};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
}

fn config(url: &str, in_flight: usize) -> Config {
    let mut c = Config::new(url, ClientTls::Insecure);
    c.in_flight = in_flight;
    c
}

fn data(i: usize) -> Bytes {
    // Not a multiple of the sector size: the extent's tail is padding.
    let mut v = vec![(i % 251) as u8; (64 << 10) - 100];
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    Bytes::from(v)
}

/// No two blocks share a byte of any vdev.
fn assert_disjoint(blocks: &[Block]) {
    let mut all: Vec<(u32, u64, u64)> = blocks
        .iter()
        .flat_map(|b| b.extents.iter().map(|e| (e.vdev, e.offset, e.size)))
        .collect();
    all.sort();
    for w in all.windows(2) {
        assert!(
            w[0].0 != w[1].0 || w[0].1 + w[0].2 <= w[1].1,
            "extents overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
}

#[test]
fn a_block_and_a_bounded_batch_over_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("128MiB");
    p.add_agent("128MiB");
    runtime().block_on(async {
        let pool = Arc::new(Pool::connect(config(&p.url, 4)).await.unwrap());
        let mut classes = Classes::new(&p.url);

        // One block: put, durable, read, free.
        let one = Bytes::from_static(b"one block through aliquot-client");
        let b = pool.put(&one).await.unwrap();
        assert_eq!(b.len, one.len() as u64);
        assert_eq!(b.extents.len(), 1);
        let txg = pool.sync().await.unwrap();
        assert!(txg >= b.txg, "synced {txg}, committed in {}", b.txg);
        assert_eq!(pool.read(&b).await.unwrap(), one);
        pool.free(std::slice::from_ref(&b)).await.unwrap();

        // A batch, RESERVED sampled while it runs.
        let stop = Arc::new(AtomicBool::new(false));
        let most = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (mut classes, stop, most) = (classes.clone(), stop.clone(), most.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    most.fetch_max(classes.reserved().await, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        let datas: Vec<Bytes> = (0..256).map(data).collect();
        let blocks = pool.put_batch(datas.clone(), Some(7)).await.unwrap();
        stop.store(true, Ordering::Relaxed);
        sampler.await.unwrap();
        assert_eq!(blocks.len(), 256);
        let txgs: std::collections::BTreeSet<u64> = blocks.iter().map(|b| b.txg).collect();
        assert_eq!(txgs.len(), 1, "one Commit, one txg: {txgs:?}");
        let extent = blocks.iter().map(|b| b.extents[0].size).max().unwrap();
        let most = most.load(Ordering::Relaxed);
        assert!(
            most <= 4 * extent,
            "{most} bytes reserved at once: more than 4 blocks of {extent} in flight"
        );
        assert_disjoint(&blocks);
        pool.sync().await.unwrap();
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(pool.read(b).await.unwrap(), datas[i], "block {i}");
        }
        assert_eq!(classes.reserved().await, 0, "nothing stays reserved");
        pool.free(&blocks).await.unwrap();
        eprintln!("batch: 256 x 64 KiB, at most {most} bytes reserved at once");
    });
}

/// A block that, when `gate` is given, holds its first write until the
/// test opens the gate (the allocator is restarted meanwhile).
#[derive(Clone)]
struct Gated {
    data: Bytes,
    gate: Option<Arc<Gate>>,
}

#[derive(Default)]
struct Gate {
    reached: AtomicBool,
    open: AtomicBool,
}

impl BlockData for Gated {
    fn len(&self) -> u64 {
        self.data.len() as u64
    }
    fn put<B: BufMut>(&self, dst: &mut B, len: usize) {
        if let Some(g) = &self.gate {
            g.reached.store(true, Ordering::Relaxed);
            // Inside the encoder, on one of the runtime's threads: the
            // other threads carry on.
            while !g.open.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.data.put(dst, len)
    }
}

#[test]
fn a_batch_across_an_allocator_restart_claims_what_it_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &args!["--claim-window", "5s"]);
    p.add_agent("128MiB");
    p.add_agent("128MiB");
    let rt = runtime();
    let pool = Arc::new(rt.block_on(Pool::connect(config(&p.url, 4))).unwrap());
    let gate = Arc::new(Gate::default());
    let datas: Vec<Gated> = (0..256)
        .map(|i| Gated {
            data: data(i),
            gate: (i == 128).then(|| gate.clone()),
        })
        .collect();
    let batch = {
        let (pool, datas) = (pool.clone(), datas.clone());
        rt.spawn(async move { pool.put_batch(datas, None).await })
    };
    let t0 = Instant::now();
    while !gate.reached.load(Ordering::Relaxed) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "block 128 never written"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = rt.block_on(async {
        pool.allocator()
            .clone()
            .get_pool(GetPoolRequest {})
            .await
            .unwrap()
            .into_inner()
            .generation
    });
    p.alloc.kill9();
    p.alloc.restart().expect("restart the allocator");
    gate.open.store(true, Ordering::Relaxed);
    let blocks = rt
        .block_on(batch)
        .unwrap()
        .expect("the batch completes across the restart");
    assert_eq!(blocks.len(), 256);
    assert!(
        blocks.iter().all(|b| b.generation > before),
        "every block belongs to the new generation"
    );
    let claimed = pool.writer().claims.claimed_extents();
    assert!(
        claimed > 0,
        "the blocks written before the restart are claimed, not written again"
    );
    assert_disjoint(&blocks);
    rt.block_on(async {
        pool.sync().await.unwrap();
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(pool.read(b).await.unwrap(), datas[i].data, "block {i}");
        }
        let mut classes = Classes::new(&p.url);
        assert_eq!(classes.reserved().await, 0, "nothing stays reserved");
    });
    eprintln!("restart mid-batch: {claimed} extents claimed in the new generation");
}

/// 256 x 1 MiB through `put_batch` on a pool whose class limit is below
/// 64 MiB, beside a paced `aliquotctl write`: the batch never waits on its
/// own reservations and the other writer keeps its pace; a batch that
/// fails mid-way (block 100 is larger than any block may be) leaves
/// nothing reserved and nothing allocated.
#[test]
fn a_batch_over_the_throttle_limit_and_one_abandoned_mid_way() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("512MiB");
    p.add_agent("512MiB");
    let other = paced_writer(&p);
    let rt = runtime();
    let (limit, blocks) = rt.block_on(async {
        let pool = Pool::connect(config(&p.url, 16)).await.unwrap();
        let datas: Vec<Bytes> = (0..256u32)
            .map(|i| Bytes::from(vec![(i % 251) as u8; 1 << 20]))
            .collect();
        let blocks = pool.put_batch(datas.clone(), None).await.unwrap();
        let limit = Classes::new(&p.url).normal().await.alloc_max;
        for i in (0..256).step_by(37) {
            assert_eq!(pool.read(&blocks[i]).await.unwrap(), datas[i], "block {i}");
        }
        pool.free(&blocks).await.unwrap();
        (limit, blocks.len())
    });
    let (waited, w) = throttle_wait_us(&other.wait_with_output().unwrap(), "the batch");
    assert_eq!(blocks, 256);
    assert!(
        limit > 0 && limit < 64 << 20,
        "the class limit must be below 64 MiB: {limit}"
    );
    assert!(
        waited <= 2_000_000,
        "beside the batch the other writer waited {waited} us in the throttle: {w}"
    );

    rt.block_on(async {
        let pool = Pool::connect(config(&p.url, 16)).await.unwrap();
        let mut classes = Classes::new(&p.url);
        // The batch's frees leave the deferred trees after two syncs.
        for _ in 0..3 {
            pool.sync().await.unwrap();
        }
        let before = classes.normal().await.alloc;
        let datas: Vec<Bytes> = (0..256usize)
            .map(|i| Bytes::from(vec![1u8; if i == 100 { 17 << 20 } else { 1 << 20 }]))
            .collect();
        let e = pool.put_batch(datas, None).await.unwrap_err();
        eprintln!("abandoned batch: {e}");
        let c = classes.normal().await;
        assert_eq!(c.reserved, 0, "RESERVED after an abandoned batch: {c:?}");
        assert_eq!(c.waiting, 0, "{c:?}");
        // Aborted space is free again at once; what was committed is
        // freed (deferred: it leaves after two syncs).
        for _ in 0..3 {
            pool.sync().await.unwrap();
        }
        assert_eq!(
            classes.normal().await.alloc,
            before,
            "nothing stays allocated"
        );
    });
    eprintln!(
        "256 x 1 MiB under a {} MiB limit; the other writer's longest throttle wait {waited} us",
        limit >> 20
    );
}
