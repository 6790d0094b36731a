//! The tuning seed's workload: 4 KiB random writes through one file agent
//! (a separate `aliquot-agent` process, so its CPU is its own, from
//! /proc/PID/stat), with Write per block or WriteBatch of N, under the
//! four settings of the seed's comparison: zfs_vdev_aggregation_limit on
//! (128 KiB, the non-rotating default) or off (0) × zio_taskq_batch_pct 80
//! or 5, the percentage taken of `--taskq-cpus` (default 64 here, a big
//! host: 51 or 3 I/O workers; on this 2-core box every percentage is one
//! worker). Every run ends with a Flush (fdatasync). Rounds are
//! interleaved; medians are printed, and the seed's settings against the
//! defaults as ratios. A raw pwrite loop on the same filesystem is the
//! floor (fio is not installed here).
//!
//! `cargo bench -p aliquot-agent --bench rand_write`
//! Env: ALIQUOT_BENCH_WRITES (40000 per run), ALIQUOT_BENCH_BATCH (writes
//! per request: one figure set per value, comma-separated, default "1,32"),
//! ALIQUOT_BENCH_INFLIGHT (requests in flight, 16), ALIQUOT_BENCH_ROUNDS (3),
//! ALIQUOT_BENCH_TASKQ_CPUS (64), ALIQUOT_BENCH_DEVICE_MIB (1024),
//! ALIQUOT_BENCH_DIR (the temp dir). ALIQUOT_BENCH_AGG=bytes plus
//! ALIQUOT_BENCH_PCT=n run that one setting once (for whole-process A/B
//! timing of the bench binary). ALIQUOT_BENCH_AGENT_BIN: the agent binary
//! to run (default: this build's).

use aliquot_agent::measure::median;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{FlushRequest, GetStatsRequest, WriteBatchRequest, WriteRequest};
use tonic::codegen::Bytes;

const BLOCK: u64 = 4096;
const MIB: u64 = 1 << 20;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

fn cpu(pid: &str) -> Duration {
    aliquot_agent::measure::process_cpu(pid)
}

/// Random block offsets over the device (xorshift: the same every run).
fn offsets(n: u64, blocks: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * BLOCK
        })
        .collect()
}

#[derive(Clone, Copy)]
struct Setting {
    agg: u64,
    pct: u32,
}

struct Run {
    agent_us: f64,
    client_us: f64,
    writes_s: f64,
    device_writes: u64,
}

fn spawn_agent(path: &Path, dev_mib: u64, s: Setting, cpus: u64) -> (Child, String) {
    let _ = std::fs::remove_file(path);
    // ALIQUOT_BENCH_AGENT_BIN: another build's agent, to compare builds.
    let bin = std::env::var("ALIQUOT_BENCH_AGENT_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_aliquot-agent").to_string());
    let mut child = Command::new(bin)
        .args(["--path", path.to_str().unwrap()])
        .args(["--capacity", &format!("{}MiB", dev_mib + 1)])
        .args([
            "--allocator",
            "none",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
        ])
        .args(["--zfs-vdev-aggregation-limit", &s.agg.to_string()])
        .args(["--zio-taskq-batch-pct", &s.pct.to_string()])
        .args(["--taskq-cpus", &cpus.to_string()])
        // The deployed default: what the log layer then formats matters.
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start aliquot-agent");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("LISTEN grpc ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

async fn agent_run(path: &Path, s: Setting, batch: usize, offs: &[u64]) -> Run {
    let dev_mib = env_u64("ALIQUOT_BENCH_DEVICE_MIB").unwrap_or(1024);
    let cpus = env_u64("ALIQUOT_BENCH_TASKQ_CPUS").unwrap_or(64);
    let inflight = env_u64("ALIQUOT_BENCH_INFLIGHT").unwrap_or(16).max(1) as usize;
    let (mut child, addr) = spawn_agent(path, dev_mib, s, cpus);
    let pid = child.id().to_string();
    let client = VdevAgentClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(32 << 20);
    let data = Bytes::from(vec![0xa5u8; BLOCK as usize]);
    let chunks: Vec<Vec<u64>> = offs.chunks(batch).map(<[u64]>::to_vec).collect();
    let chunks = std::sync::Arc::new(chunks);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (a0, c0, t) = (cpu(&pid), cpu("self"), Instant::now());
    let mut tasks = Vec::new();
    for _ in 0..inflight {
        let (mut c, chunks, next, data) =
            (client.clone(), chunks.clone(), next.clone(), data.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chunk) = chunks.get(i) else { return };
                let w = |o: &u64| WriteRequest {
                    offset: *o,
                    data: data.clone(),
                    token: vec![],
                };
                if batch == 1 {
                    c.write(w(&chunk[0])).await.expect("agent write");
                } else {
                    c.write_batch(WriteBatchRequest {
                        writes: chunk.iter().map(w).collect(),
                    })
                    .await
                    .expect("agent write batch");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut c = client.clone();
    c.flush(FlushRequest {}).await.unwrap();
    let (wall, agent, own) = (t.elapsed(), cpu(&pid) - a0, cpu("self") - c0);
    let stats = c.get_stats(GetStatsRequest {}).await.unwrap().into_inner();
    drop((c, client));
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let _ = child.wait();
    let _ = std::fs::remove_file(path);
    let n = offs.len() as f64;
    Run {
        agent_us: agent.as_secs_f64() * 1e6 / n,
        client_us: own.as_secs_f64() * 1e6 / n,
        writes_s: n / wall.as_secs_f64(),
        device_writes: stats.device_writes,
    }
}

/// The floor: the same offsets with pwrite from one thread, then fdatasync.
fn raw(path: &Path, offs: &[u64]) -> (f64, f64) {
    let dev = env_u64("ALIQUOT_BENCH_DEVICE_MIB").unwrap_or(1024) * MIB;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    f.set_len(dev).unwrap();
    let buf = vec![0xa5u8; BLOCK as usize];
    let (c0, t) = (cpu("self"), Instant::now());
    for &o in offs {
        f.write_all_at(&buf, o).unwrap();
    }
    f.sync_data().unwrap();
    let (wall, used) = (t.elapsed(), cpu("self") - c0);
    let _ = std::fs::remove_file(path);
    let n = offs.len() as f64;
    (used.as_secs_f64() * 1e6 / n, n / wall.as_secs_f64())
}

fn main() {
    let dir = std::env::var_os("ALIQUOT_BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(dir).expect("bench dir");
    let path = dir.path().join("rand.img");
    let n = env_u64("ALIQUOT_BENCH_WRITES").unwrap_or(40_000);
    let dev_mib = env_u64("ALIQUOT_BENCH_DEVICE_MIB").unwrap_or(1024);
    let offs = offsets(n, dev_mib * MIB / BLOCK, 0x5eed);
    let batches: Vec<usize> = std::env::var("ALIQUOT_BENCH_BATCH")
        .unwrap_or_else(|_| "1,32".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|&b| b >= 1)
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    if let (Some(agg), Some(pct)) = (env_u64("ALIQUOT_BENCH_AGG"), env_u64("ALIQUOT_BENCH_PCT")) {
        let s = Setting {
            agg,
            pct: pct as u32,
        };
        for &b in &batches {
            let r = rt.block_on(agent_run(&path, s, b, &offs));
            println!(
                "agg {agg} pct {pct} batch {b}: agent {:.1} us/write, client {:.1} us/write, {:.0} writes/s, {} device writes",
                r.agent_us, r.client_us, r.writes_s, r.device_writes
            );
        }
        return;
    }
    let settings = [
        Setting {
            agg: 128 << 10,
            pct: 80,
        },
        Setting { agg: 0, pct: 80 },
        Setting {
            agg: 128 << 10,
            pct: 5,
        },
        Setting { agg: 0, pct: 5 },
    ];
    let rounds = env_u64("ALIQUOT_BENCH_ROUNDS").unwrap_or(3).max(1) as usize;
    let cpus = env_u64("ALIQUOT_BENCH_TASKQ_CPUS").unwrap_or(64);
    println!(
        "4 KiB random writes, {n} per run over {dev_mib} MiB, Flush at the end, taskq cpus {cpus}, in {}",
        dir.path().display()
    );
    let _ = raw(&path, &offs); // warm-up
    for &b in &batches {
        // results[setting] over rounds
        let mut res: Vec<Vec<Run>> = settings.iter().map(|_| Vec::new()).collect();
        let mut raws = Vec::new();
        for _ in 0..rounds {
            raws.push(raw(&path, &offs));
            for (k, s) in settings.iter().enumerate() {
                res[k].push(rt.block_on(agent_run(&path, *s, b, &offs)));
            }
        }
        let raw_cpu = median(raws.iter().map(|r| r.0).collect());
        let raw_rate = median(raws.iter().map(|r| r.1).collect());
        println!("writes per request {b}, median of {rounds}:");
        println!(
            "  raw pwrite, 1 thread                      cpu {raw_cpu:6.1} us/write  {raw_rate:9.0} writes/s"
        );
        let med = |k: usize| {
            (
                median(res[k].iter().map(|r| r.agent_us).collect()),
                median(res[k].iter().map(|r| r.client_us).collect()),
                median(res[k].iter().map(|r| r.writes_s).collect()),
            )
        };
        for (k, s) in settings.iter().enumerate() {
            let (a, c, w) = med(k);
            println!(
                "  agg {:>6} pct {:>2} ({:>2} workers)  agent {a:6.1} us/write ({:.1}x raw)  client {c:6.1}  {w:9.0} writes/s  {} device writes",
                s.agg,
                s.pct,
                (cpus as usize * s.pct as usize / 100).max(1),
                a / raw_cpu,
                res[k].last().map_or(0, |r| r.device_writes)
            );
        }
        // Pair by pair within a round (same machine state), then the median.
        let ratio = |f: fn(&Run) -> f64| {
            median((0..rounds).map(|i| f(&res[3][i]) / f(&res[0][i])).collect())
        };
        println!(
            "  seed settings (agg 0, pct 5) / defaults (agg 128K, pct 80): agent CPU per write {:+.0} %, throughput {:+.0} % (seed: -18 %, +15 %)",
            (ratio(|r| r.agent_us) - 1.0) * 100.0,
            (ratio(|r| r.writes_s) - 1.0) * 100.0
        );
    }
}
