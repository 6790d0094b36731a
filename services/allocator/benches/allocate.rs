//! Allocate+Commit throughput and latency of the allocator, in-process over
//! real gRPC on loopback, with fake vdevs (no agents, no data). Prints, for
//! 1, 8 and 64 concurrent clients, pairs per second and the p50/p99 latency
//! of one pair (allocate sent → commit acknowledged), over AllocateStream
//! (each client pipelines `DEPTH` pairs on one stream) and over unary calls.
//!
//! `cargo bench -p aliquot-allocator --bench allocate` (release build);
//! `ALIQUOT_BENCH_SECS` sets the seconds per case (default 3),
//! `ALIQUOT_BENCH_SIZE` the block size (default 4096).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aliquot_allocator::{Config, MemStore};
use aliquot_proto::v1 as pb;
use hdrhistogram::Histogram;
use pb::allocator_client::AllocatorClient;
use pb::stream_request::Op;
use tokio::sync::mpsc;
use tonic::transport::Channel;

/// Pairs a streaming client keeps in flight.
const DEPTH: usize = 32;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Outcome {
    pairs: u64,
    hist: Histogram<u64>,
}

fn alloc_req(size: u64) -> pb::AllocateRequest {
    pb::AllocateRequest {
        class: pb::AllocationClass::Data as i32,
        size,
        copies: 1,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    }
}

async fn unary_client(
    mut c: AllocatorClient<Channel>,
    size: u64,
    stop: Arc<AtomicBool>,
) -> Outcome {
    let mut hist = Histogram::<u64>::new(3).unwrap();
    let mut pairs = 0;
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let a = c
            .allocate(alloc_req(size))
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
        pairs += 1;
    }
    Outcome { pairs, hist }
}

async fn stream_client(
    mut c: AllocatorClient<Channel>,
    size: u64,
    stop: Arc<AtomicBool>,
) -> Outcome {
    let mut hist = Histogram::<u64>::new(3).unwrap();
    let (tx, rx) = mpsc::channel(DEPTH * 2);
    let mut replies = c
        .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    // request id → start time of its pair; allocate ids are even, commits odd.
    let mut started = std::collections::HashMap::with_capacity(DEPTH * 2);
    let mut next_id = 0u64;
    let mut in_flight = 0usize;
    let mut pairs = 0;
    let send_alloc = |id: u64| pb::StreamRequest {
        request_id: id,
        op: Some(Op::Allocate(alloc_req(size))),
        ..Default::default()
    };
    for _ in 0..DEPTH {
        started.insert(next_id, Instant::now());
        tx.send(send_alloc(next_id)).await.unwrap();
        next_id += 2;
        in_flight += 1;
    }
    while in_flight > 0 {
        let r = replies
            .message()
            .await
            .expect("reply")
            .expect("stream open");
        match r.result {
            Some(pb::stream_reply::Result::Allocate(a)) => {
                let t = started.remove(&r.request_id).unwrap();
                started.insert(r.request_id + 1, t);
                tx.send(pb::StreamRequest {
                    request_id: r.request_id + 1,
                    op: Some(Op::Commit(pb::CommitRequest {
                        allocation_ids: vec![a.allocation_id],
                        wait_synced: false,
                        generation: a.generation,
                    })),
                    ..Default::default()
                })
                .await
                .unwrap();
            }
            Some(pb::stream_reply::Result::Commit(_)) => {
                let t = started.remove(&r.request_id).unwrap();
                hist.record(t.elapsed().as_micros() as u64).unwrap();
                pairs += 1;
                in_flight -= 1;
                if !stop.load(Ordering::Relaxed) {
                    started.insert(next_id, Instant::now());
                    tx.send(send_alloc(next_id)).await.unwrap();
                    next_id += 2;
                    in_flight += 1;
                }
            }
            other => panic!("unexpected reply {other:?}"),
        }
    }
    Outcome { pairs, hist }
}

async fn case(url: &str, streaming: bool, clients: usize, secs: u64, size: u64) {
    // One connection per 8 clients, as a pipelining client library would.
    let mut channels = Vec::new();
    for _ in 0..clients.div_ceil(8) {
        channels.push(
            Channel::from_shared(url.to_string())
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let c = AllocatorClient::new(channels[i / 8].clone());
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            if streaming {
                stream_client(c, size, stop).await
            } else {
                unary_client(c, size, stop).await
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut hist = Histogram::<u64>::new(3).unwrap();
    let mut pairs = 0;
    for t in tasks {
        let o = t.await.unwrap();
        pairs += o.pairs;
        hist.add(&o.hist).unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "{:<7} clients={:<3} {:>9.0} allocate+commit/s   p50 {:>6} us   p99 {:>6} us   ({} pairs in {:.1} s)",
        if streaming { "stream" } else { "unary" },
        clients,
        pairs as f64 / elapsed,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        pairs,
        elapsed
    );
}

fn main() {
    // `cargo bench` passes --bench; a plain run of the binary works too.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let secs = env_u64("ALIQUOT_BENCH_SECS", 3);
        let size = env_u64("ALIQUOT_BENCH_SIZE", 4096);
        let mut c = Config::with_listen("127.0.0.1:0".parse().unwrap());
        c.report_interval = Duration::from_secs(3600);
        let server = aliquot_allocator::start(c, Arc::new(MemStore::new()))
            .await
            .expect("start allocator");
        let url = server.url();
        let ch = Channel::from_shared(url.clone()).unwrap().connect().await.unwrap();
        let mut reg = pb::agent_registry_client::AgentRegistryClient::new(ch);
        for guid in 1..=4u64 {
            reg.register(pb::RegisterRequest {
                endpoint: format!("http://127.0.0.1:1/fake-{guid}"),
                device_guid: guid,
                name: format!("fake{guid}"),
                capacity: 4 << 40,
                ashift: 12,
                rotational: false,
                children: 1,
                parity: 0,
                log: false,
                backend: "sim".into(),
                ..Default::default()
            })
            .await
            .expect("register");
        }
        println!(
            "aliquot-allocator bench: 4 fake vdevs of 4 TiB, {size}-byte blocks, copies 1, {secs} s per case, {} cores, stream depth {DEPTH}",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        for streaming in [true, false] {
            for clients in [1, 8, 64] {
                case(&url, streaming, clients, secs, size).await;
            }
        }
        server.shutdown().await.unwrap();
    });
}
