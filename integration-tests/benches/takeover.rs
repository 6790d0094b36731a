//! Takeovers with the DEFAULT allocator flags (5 s lease, 10 s claim window,
//! 5 s txg timeout), across real processes: a private PostgreSQL, two
//! allocators sharing it, two file agents, write tokens on. Prints figures
//! (no harness, nothing asserted):
//!
//!   cargo bench -p integration-tests --bench takeover
//!
//! Part 1: `ALIQUOT_BENCH_KILLS` (20) rounds of `kill -9` of the leader while
//! `aliquotctl write --verify` (its default flags, a rate so that it spans
//! the takeover) runs: the time from the kill to the first Allocate served
//! by the new leader (p50/max; the target is lease + 2 s = 7 s), and from
//! each run's read-back the blocks lost (the run failed naming them, or a
//! block read back wrong: a double allocation overwrote it).
//! Part 2: `ALIQUOT_BENCH_STEP_DOWNS` (5) `aliquotctl allocator step-down`
//! under the same writer: its longest gap without a block completing (the
//! target is 1 s).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::postgres::Postgres;
use integration_tests::{INSECURE_ENV, Proc, args, bin, data_request, lazy_channel};
use pb::allocator_client::AllocatorClient;

const AGENTS: usize = 2;

struct Pool {
    _pg: Postgres,
    allocators: Vec<Proc>,
    _agents: Vec<Proc>,
}

impl Pool {
    fn start(dir: &Path) -> Pool {
        let pg = Postgres::start();
        let certs = dir.join("certs");
        aliquot_auth::PoolCa::init(&certs, "bench").unwrap();
        let mut allocators = Vec::new();
        for i in 0..2 {
            let mut p = Proc::start(
                &format!("allocator{i}"),
                &bin("aliquot-allocator"),
                &args![
                    "--listen",
                    "127.0.0.1:0",
                    "--store",
                    pg.url(),
                    "--pool",
                    "bench",
                    "--token-key",
                    certs.display(),
                ],
                &[],
                &["grpc"],
                dir,
            )
            .expect("start allocator");
            let addr = p.addr("grpc");
            p.set_arg("--listen", &addr.to_string());
            allocators.push(p);
        }
        let list: Vec<String> = allocators.iter().map(|p| p.url("grpc")).collect();
        let agents = (0..AGENTS)
            .map(|i| {
                Proc::start(
                    &format!("agent{i}"),
                    &bin("aliquot-agent"),
                    &args![
                        "--listen",
                        "127.0.0.1:0",
                        "--allocator",
                        list.join(","),
                        "--name",
                        format!("d{i}"),
                        "--backend",
                        "file",
                        "--path",
                        dir.join(format!("d{i}.img")).display(),
                        "--capacity",
                        "1GiB",
                        "--token-key",
                        certs.display(),
                    ],
                    &[],
                    &["grpc"],
                    dir,
                )
                .expect("start agent")
            })
            .collect();
        Pool {
            _pg: pg,
            allocators,
            _agents: agents,
        }
    }

    fn urls(&self) -> Vec<String> {
        self.allocators.iter().map(|p| p.url("grpc")).collect()
    }

    /// The allocator that serves Allocate, polled every 20 ms; its index.
    async fn leader(&self, within: Duration) -> Option<usize> {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            for (i, url) in self.urls().iter().enumerate() {
                if self.allocators[i].pid().is_none() {
                    continue;
                }
                let mut c = AllocatorClient::new(lazy_channel(url));
                if let Ok(Ok(r)) =
                    tokio::time::timeout(Duration::from_millis(300), c.allocate(data_request(4096)))
                        .await
                {
                    let _ = c
                        .abort(pb::AbortRequest {
                            allocation_ids: vec![r.into_inner().allocation_id],
                        })
                        .await;
                    return Some(i);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

/// `aliquotctl write` with its default flags but a size and rate that make
/// it outlast a takeover, reading everything back at the end.
fn writer(pool: &Pool, total: &str, rate: &str) -> Child {
    Command::new(bin("aliquotctl"))
        .args(args![
            "write",
            "--allocator",
            pool.urls().join(","),
            "--total",
            total,
            "--rate",
            rate,
            "--verify",
            "--json",
            "--no-progress",
            "--no-manifest",
        ])
        .env(INSECURE_ENV, "1")
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn aliquotctl write")
}

/// What a writer's run says: (verified blocks, longest stall ms), or the
/// reason it failed.
fn outcome(w: Child) -> Result<(u64, u64), String> {
    let out = w.wait_with_output().expect("writer output");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let n = |k: &str| integration_tests::json_u64(&v[k]).unwrap_or(0);
    Ok((n("verified_blocks"), n("max_stall_us") / 1000))
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let kills = env("ALIQUOT_BENCH_KILLS", 20);
    let step_downs = env("ALIQUOT_BENCH_STEP_DOWNS", 5);
    let dir = tempfile::tempdir().unwrap();
    let mut pool = Pool::start(dir.path());
    let mut leader = pool
        .leader(Duration::from_secs(120))
        .await
        .expect("a leader");

    println!("part 1: {kills} kill -9 of the leader under aliquotctl write (default flags)");
    let (mut took, mut failed, mut blocks) = (Vec::new(), Vec::new(), 0u64);
    for round in 0..kills {
        let w = writer(&pool, "64MiB", "4MiB/s");
        tokio::time::sleep(Duration::from_secs(3)).await;
        pool.allocators[leader].kill9();
        let killed = Instant::now();
        let Some(next) = pool.leader(Duration::from_secs(60)).await else {
            println!("round {round}: no leader within 60 s");
            break;
        };
        let t = killed.elapsed();
        took.push(t);
        let r = tokio::task::spawn_blocking(move || outcome(w))
            .await
            .unwrap();
        match &r {
            Ok((n, stall)) => {
                blocks += n;
                println!(
                    "round {round}: first Allocate {:.2} s after the kill; {n} blocks read back intact, longest stall {stall} ms",
                    t.as_secs_f64()
                );
            }
            Err(e) => {
                println!(
                    "round {round}: first Allocate {:.2} s after the kill; the run FAILED: {e}",
                    t.as_secs_f64()
                );
                failed.push(e.clone());
            }
        }
        pool.allocators[leader]
            .restart()
            .expect("restart as a standby");
        leader = next;
    }
    took.sort();
    if !took.is_empty() {
        println!(
            "kill -9: {} takeovers, first Allocate served p50 {:.2} s, max {:.2} s (target 7 s); \
             runs failed {} (lost or read back wrong), blocks read back intact {blocks}",
            took.len(),
            pct(&took, 0.5).as_secs_f64(),
            took.last().unwrap().as_secs_f64(),
            failed.len()
        );
    }

    println!("part 2: {step_downs} step-downs under aliquotctl write");
    let mut stalls = Vec::new();
    for round in 0..step_downs {
        let w = writer(&pool, "48MiB", "8MiB/s");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let o = Command::new(bin("aliquotctl"))
            .args(args![
                "allocator",
                "--allocator",
                pool.urls().join(","),
                "step-down"
            ])
            .env(INSECURE_ENV, "1")
            .env_remove("ALIQUOT_ALLOCATOR")
            .output()
            .expect("step-down");
        let said = String::from_utf8_lossy(&o.stdout).trim().to_string();
        match tokio::task::spawn_blocking(move || outcome(w))
            .await
            .unwrap()
        {
            Ok((n, stall)) => {
                stalls.push(stall);
                println!(
                    "step-down {round}: {said}; {n} blocks intact, writer's longest gap {stall} ms"
                );
            }
            Err(e) => println!("step-down {round}: {said}; the run FAILED: {e}"),
        }
    }
    stalls.sort();
    if let Some(max) = stalls.last() {
        println!(
            "step-down: writer's longest gap p50 {} ms, max {max} ms (target 1000 ms)",
            stalls[(stalls.len() - 1) / 2]
        );
    }
}
