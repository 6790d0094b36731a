//! Faults with a whole local pool (`aliquotctl up`) as child processes:
//! one hung agent (SIGSTOP) does not stall writes to the others; a full pool
//! restarts; a second `up` on a running pool starts nothing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{Proc, args, bin, children_of, ctl, ok_stdout};

fn up(dir: &Path, agents: &str, name: &str) -> Proc {
    Proc::start(
        name,
        &bin("aliquotctl"),
        &args![
            "up",
            "--data-dir",
            dir.display(),
            "--ephemeral",
            "--no-metrics",
            "--agents",
            agents,
            "--zfs-txg-timeout",
            "1s"
        ],
        &[],
        &["grpc"],
        dir,
    )
    .expect("aliquotctl up")
}

/// The agents among `up`'s children (by their command line).
fn agent_pids(up_pid: u32) -> Vec<u32> {
    children_of(up_pid)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains("agent"))
                .unwrap_or(false)
        })
        .collect()
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[test]
fn a_hung_agent_does_not_stall_writes_to_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = up(tmp.path(), "512MiB,512MiB,512MiB", "up");
    let url = pool.url("grpc");
    let agents = agent_pids(pool.pid().unwrap());
    assert_eq!(agents.len(), 3, "{agents:?}");
    let victim = agents[1];
    signal(victim, "-STOP");
    let stopped = Instant::now();
    // 32 in flight, a 2 s deadline per agent write; no final flush (the
    // stopped agent would hold it): the run ends when every block is
    // committed somewhere.
    let child = Command::new(bin("aliquotctl"))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "write",
            "--allocator",
            url,
            "--total",
            "96MiB",
            "--block-size",
            "256KiB",
            "--concurrency",
            "32",
            "--timeout",
            "2s",
            "--no-sync",
            "--json"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let took = stopped.elapsed();
    signal(victim, "-CONT");
    let report: serde_json::Value =
        serde_json::from_str(&ok_stdout(&out, "write with a hung agent")).unwrap();
    let max_ms = report["write"]["max_us"].as_u64().unwrap() / 1000;
    let p99_ms = report["write"]["p99_us"].as_u64().unwrap() / 1000;
    println!(
        "hung agent: write finished in {took:?}, {} retries, write p99 {p99_ms} ms, max stall {max_ms} ms",
        report["retries"]
    );
    assert_eq!(report["blocks"], 384);
    // Finished while the agent was still stopped (it stays so for 10 s in
    // the test): the other vdevs kept writing.
    assert!(
        took < Duration::from_secs(10),
        "writes stalled behind the hung agent: {took:?}"
    );
    // No committed write waited on the hung agent: those went elsewhere.
    assert!(max_ms < 2000, "a write took {max_ms} ms");
    let vdevs = report["vdev_bytes"].as_object().unwrap();
    assert!(vdevs.len() >= 2, "{vdevs:?}");
}

#[test]
fn a_full_pool_restarts_and_a_second_up_starts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pool = up(tmp.path(), "128MiB,128MiB", "up");
    let url = pool.url("grpc");
    // A second `up` on the same data dir exits at once, naming the first.
    let started = Instant::now();
    let second = ctl(&args![
        "up",
        "--data-dir",
        tmp.path().display(),
        "--ephemeral",
        "--no-metrics",
        "--agents",
        "128MiB"
    ]);
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("in use by another aliquotctl up"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));

    // Fill it with intent-log blocks (no slop kept back) until no space.
    let out = ctl(&args![
        "write",
        "--allocator",
        url,
        "--class",
        "log",
        "--total",
        "512MiB",
        "--block-size",
        "1MiB",
        "--concurrency",
        "4"
    ]);
    assert!(!out.status.success(), "a 512 MiB write cannot fit 256 MiB");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ResourceExhausted") || err.contains("no space"),
        "{err}"
    );
    pool.kill();
    // Restart: it comes up although no vdev is allocatable.
    let t = Instant::now();
    let pool = up(tmp.path(), "128MiB,128MiB", "up-again");
    let took = t.elapsed();
    println!("full pool back in {took:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    let st: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args!["status", "--allocator", pool.url("grpc"), "--json"]),
        "status",
    ))
    .unwrap();
    assert_eq!(st["vdevs"].as_array().unwrap().len(), 2, "{st}");
}
