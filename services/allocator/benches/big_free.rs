//! What a client freeing many blocks costs everyone else:
//! 100 000 committed 4 KiB extents are freed in requests of the largest
//! size the proto allows (4096 extents), while another client runs
//! Allocate+Commit pairs. Prints each Free's time and the pairs' latency
//! before and during the frees. In-process allocator on the default store
//! (SQLite, in a temporary directory), real gRPC on loopback, fake vdevs
//! (no agents, no data).
//!
//! `cargo bench -p aliquot-allocator --bench big_free`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aliquot_allocator::{Config, SqliteStore};
use aliquot_proto::v1 as pb;
use hdrhistogram::Histogram;
use pb::allocator_client::AllocatorClient;
use tonic::transport::Channel;

const EXTENTS: u64 = 100_000;
const PER_REQUEST: u64 = 4096;
const BLOCK: u64 = 4096;

/// Allocate+Commit pairs until `stop`; their latencies in µs.
async fn pairs(mut c: AllocatorClient<Channel>, stop: Arc<AtomicBool>) -> Histogram<u64> {
    let mut hist = Histogram::<u64>::new(3).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let a = c
            .allocate(pb::AllocateRequest {
                class: pb::AllocationClass::Data as i32,
                size: BLOCK,
                copies: 1,
                lease_ms: 0,
                max_size: 0,
                affinity_key: None,
            })
            .await
            .expect("allocate")
            .into_inner();
        c.commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: a.generation,
        })
        .await
        .expect("commit");
        hist.record(t.elapsed().as_micros() as u64).unwrap();
    }
    hist
}

fn line(what: &str, h: &Histogram<u64>) {
    println!(
        "{what:<28} {:>6} pairs   p50 {:>7} us   p99 {:>7} us   max {:>8} us",
        h.len(),
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.max()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
        c.report_interval = Duration::from_secs(3600);
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("pool.db"), "bench", None)
            .await
            .unwrap();
        let server = aliquot_allocator::start(c, Arc::new(store))
            .await
            .expect("start allocator");
        let url = server.url();
        let ch = Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut reg = pb::agent_registry_client::AgentRegistryClient::new(ch.clone());
        let mut vdevs = Vec::new();
        for guid in 1..=2u64 {
            let r = reg
                .register(pb::RegisterRequest {
                    endpoint: format!("http://127.0.0.1:1/fake-{guid}"),
                    device_guid: guid,
                    name: format!("fake{guid}"),
                    capacity: 64 << 30,
                    ashift: 12,
                    rotational: false,
                    children: 1,
                    parity: 0,
                    log: false,
                    backend: "sim".into(),
                    ..Default::default()
                })
                .await
                .expect("register")
                .into_inner();
            vdevs.push(r.vdev);
        }
        // 100 000 blocks, every other 4 KiB of the upper half of vdev 1
        // (apart, so that none merges with its neighbour), claimed as a
        // client whose blocks survived a restart would.
        let mut admin = AllocatorClient::new(ch.clone());
        let base = 32u64 << 30;
        let extents: Vec<pb::Extent> = (0..EXTENTS)
            .map(|i| pb::Extent {
                vdev: vdevs[0],
                offset: base + i * 2 * BLOCK,
                size: BLOCK,
            })
            .collect();
        let mut last = pb::ClaimReply::default();
        for chunk in extents.chunks(PER_REQUEST as usize) {
            last = admin
                .claim(pb::ClaimRequest {
                    extents: chunk.to_vec(),
                    per_extent: false,
                    allocation_ids: Vec::new(),
                })
                .await
                .expect("claim")
                .into_inner();
        }
        // Durable, so that Free's checks read them from the store.
        admin
            .sync_txg(pb::SyncTxgRequest {
                txg: last.txg,
                generation: last.generation,
            })
            .await
            .expect("sync");
        let stop = Arc::new(AtomicBool::new(false));
        let quiet = tokio::spawn(pairs(AllocatorClient::new(ch.clone()), stop.clone()));
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, Ordering::Relaxed);
        let quiet = quiet.await.unwrap();

        let stop = Arc::new(AtomicBool::new(false));
        let busy = tokio::spawn(pairs(AllocatorClient::new(ch.clone()), stop.clone()));
        let mut frees = Histogram::<u64>::new(3).unwrap();
        let started = Instant::now();
        for chunk in extents.chunks(PER_REQUEST as usize) {
            let t = Instant::now();
            admin
                .free(pb::FreeRequest {
                    extents: chunk.to_vec(),
                })
                .await
                .expect("free");
            frees.record(t.elapsed().as_micros() as u64).unwrap();
        }
        let all = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let busy = busy.await.unwrap();
        println!(
            "aliquot-allocator big_free: {EXTENTS} extents of {BLOCK} B freed in {} requests of \
             at most {PER_REQUEST}: {:.2} s in all, per request p50 {} us max {} us",
            frees.len(),
            all.as_secs_f64(),
            frees.value_at_quantile(0.5),
            frees.max()
        );
        line("allocate+commit, quiet", &quiet);
        line("allocate+commit, during", &busy);
        server.shutdown().await.unwrap();
    });
}
