//! Sequential write throughput through the file backend over gRPC, beside
//! raw positioned writes (and `dd`, when installed) to the same filesystem.
//! Every run ends with an fsync, so the page cache does not flatter anyone.
//!
//! `cargo bench -p aliquot-agent --bench seq_write`
//! Env: ALIQUOT_BENCH_DIR (default: the temp dir), ALIQUOT_BENCH_MIB (512),
//! ALIQUOT_BENCH_BLOCK_KIB + ALIQUOT_BENCH_INFLIGHT (one run instead of the
//! default two), ALIQUOT_BENCH_PCT (the agent's zio_taskq_batch_pct),
//! ALIQUOT_BENCH_MALLOC=default (skip the binary's malloc tuning),
//! ALIQUOT_BENCH_ROUNDS (3), ALIQUOT_BENCH_CONNS (client connections, 1),
//! ALIQUOT_BENCH_DIRECT=1 (all I/O O_DIRECT, `--direct`), =0 (all
//! buffered, `--buffered`); unset: the default (for a file, large writes
//! into holes direct, everything else buffered).

use aliquot_agent::measure::median;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_agent::{Agent, BackendKind, Config};
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{FlushRequest, GetStatsRequest, WriteRequest};

const MIB: u64 = 1 << 20;

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cpu() -> Duration {
    aliquot_agent::measure::process_cpu("self")
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / MIB as f64 / d.as_secs_f64()
}

fn raw(path: &Path, total: u64, block: usize) -> (f64, Duration) {
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .expect("open raw file");
    let buf = pattern(block, 7);
    let (t, c) = (Instant::now(), cpu());
    let mut off = 0;
    while off < total {
        f.write_all_at(&buf, off).expect("raw write");
        off += block as u64;
    }
    f.sync_all().expect("fsync");
    let r = (mib_s(total, t.elapsed()), cpu() - c);
    let _ = std::fs::remove_file(path);
    r
}

fn dd(path: &Path, total: u64, block: usize) -> Option<f64> {
    let t = Instant::now();
    let st = std::process::Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", path.display()))
        .arg(format!("bs={block}"))
        .arg(format!("count={}", total / block as u64))
        .arg("conv=fsync")
        .stderr(std::process::Stdio::null())
        .status()
        .ok()?;
    let d = t.elapsed();
    let _ = std::fs::remove_file(path);
    st.success().then(|| mib_s(total, d))
}

async fn agent(
    path: &Path,
    total: u64,
    block: usize,
    inflight: usize,
) -> (f64, Duration, u64, u64) {
    let _ = std::fs::remove_file(path);
    let mut cfg = Config::new(BackendKind::File);
    if let Some(p) = env_u64("ALIQUOT_BENCH_PCT") {
        cfg.zio_taskq_batch_pct = p as u32;
    }
    cfg.path = Some(path.to_path_buf());
    // ALIQUOT_BENCH_DIRECT=1: all direct (`--direct`); 0: all buffered.
    match std::env::var("ALIQUOT_BENCH_DIRECT").as_deref() {
        Ok("1") => cfg.direct = true,
        Ok("0") => cfg.buffered = true,
        _ => {}
    }
    cfg.capacity = Some(total + 2 * MIB);
    let agent = Agent::open(&cfg).expect("open agent");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        aliquot_agent::serve(agent, &cfg, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    let conns = env_u64("ALIQUOT_BENCH_CONNS").unwrap_or(1).max(1) as usize;
    let mut clients = Vec::new();
    for _ in 0..conns {
        clients.push(
            VdevAgentClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
                .max_encoding_message_size(32 << 20)
                .max_decoding_message_size(32 << 20),
        );
    }
    let client = clients[0].clone();
    // Shared, not copied per request (as `aliquotctl write` shares a block's copies).
    let buf = tonic::codegen::Bytes::from(pattern(block, 11));
    let blocks = total / block as u64;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (t, c0) = (Instant::now(), cpu());
    let mut tasks = Vec::new();
    for i in 0..inflight {
        let (mut c, next, buf) = (clients[i % conns].clone(), next.clone(), buf.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= blocks {
                    return;
                }
                c.write(WriteRequest {
                    offset: i * block as u64,
                    data: buf.clone(),
                    ..Default::default()
                })
                .await
                .expect("agent write");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut c = client.clone();
    c.flush(FlushRequest {}).await.unwrap();
    let (d, used) = (t.elapsed(), cpu() - c0);
    let s = c.get_stats(GetStatsRequest {}).await.unwrap().into_inner();
    drop((c, client, clients));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let _ = std::fs::remove_file(path);
    (mib_s(total, d), used, s.writes, s.device_writes)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

fn main() {
    // As the aliquot-agent binary does (set ALIQUOT_BENCH_MALLOC=default to compare).
    if std::env::var("ALIQUOT_BENCH_MALLOC").as_deref() != Ok("default") {
        aliquot_agent::tune_allocator();
    }
    // `cargo bench` passes --bench; nothing to parse.
    let dir = std::env::var_os("ALIQUOT_BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let mib: u64 = std::env::var("ALIQUOT_BENCH_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    let total = mib * MIB;
    let dir = tempfile::tempdir_in(dir).expect("bench dir");
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!(
        "sequential write, {mib} MiB per run, fsync at the end, in {}",
        dir.path().display()
    );
    let runs = match (
        env_u64("ALIQUOT_BENCH_BLOCK_KIB"),
        env_u64("ALIQUOT_BENCH_INFLIGHT"),
    ) {
        (Some(b), Some(n)) => vec![((b as usize) << 10, n as usize)],
        _ => vec![(1 << 20, 4usize), (128 << 10, 16)],
    };
    // Warm up the filesystem and page cache so the first figure is not an outlier.
    let _ = raw(
        &dir.path().join("warmup.img"),
        total.min(128 * MIB),
        1 << 20,
    );
    let rounds = env_u64("ALIQUOT_BENCH_ROUNDS").unwrap_or(3).max(1) as usize;
    let per_mib = |c: Duration| c.as_secs_f64() * 1e3 / mib as f64;
    for (block, inflight) in runs {
        // Interleaved rounds, so page-cache and writeback state (and other
        // load on a shared machine) hit every method alike; report medians.
        let (mut r, mut rc, mut d, mut a, mut ac) = (vec![], vec![], vec![], vec![], vec![]);
        let mut counts = (0, 0);
        for _ in 0..rounds {
            let (x, c) = raw(&dir.path().join("raw.img"), total, block);
            r.push(x);
            rc.push(per_mib(c));
            if let Some(x) = dd(&dir.path().join("dd.img"), total, block) {
                d.push(x);
            }
            let (x, c, w, dw) =
                rt.block_on(agent(&dir.path().join("agent.img"), total, block, inflight));
            a.push(x);
            ac.push(per_mib(c));
            counts = (w, dw);
        }
        let (r, rc, a, ac) = (median(r), median(rc), median(a), median(ac));
        println!("block {:>4} KiB, median of {rounds}:", block >> 10);
        println!("  raw pwrite + fsync            {r:8.1} MiB/s  cpu {rc:.2} ms/MiB");
        let dd_rate = (!d.is_empty()).then(|| median(d));
        match dd_rate {
            Some(x) => println!("  dd bs={block:<7} conv=fsync     {x:8.1} MiB/s"),
            None => println!("  dd                            (not available)"),
        }
        println!(
            "  agent gRPC, {inflight:>2} in flight      {a:8.1} MiB/s  cpu {ac:.2} ms/MiB (client + agent)  = {:.0} % of raw{}  ({} writes, {} device writes)",
            100.0 * a / r,
            dd_rate.map_or(String::new(), |x| format!(", {:.0} % of dd", 100.0 * a / x)),
            counts.0,
            counts.1
        );
    }
}
