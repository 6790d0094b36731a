//! Issue 25, item 6, across real processes: `aliquotctl write` survives a
//! kill -9 of the allocator and of an agent in the middle of a run. Blocks
//! whose agent write fails on the transport (or whose agent restarted and
//! no longer honours the token) are written again elsewhere; the writer
//! waits for the restarted allocator and reconnects its stream; the run
//! finishes with every block verified and listed in the manifest. A run
//! that fails still records the blocks it made durable.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aliquotctl::manifest::Manifest;
use integration_tests::{FilePool, INSECURE_ENV, args, bin};

/// The pool of these tests: three 512 MiB file agents, and a claim window
/// for the blocks a killed writer leaves.
fn pool(dir: &Path) -> FilePool {
    let mut p = FilePool::start(dir, &args!["--pool", "faults", "--claim-window", "1s"]);
    for _ in 0..3 {
        p.add_agent("512MiB");
    }
    p
}

fn writer(url: &str, manifest: &Path, total: &str, extra: &[String]) -> std::process::Child {
    let mut a = args![
        "write",
        "--allocator",
        url,
        "--total",
        total,
        "--block-size",
        "1MiB",
        "--concurrency",
        "8",
        "--rate",
        "48MiB/s",
        "--timeout",
        "2s",
        "--manifest",
        manifest.display(),
        "--verify",
        "--no-progress",
    ];
    a.extend_from_slice(extra);
    Command::new(bin("aliquotctl"))
        .args(&a)
        .env(INSECURE_ENV, "1")
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn aliquotctl write")
}

fn wait(child: std::process::Child, limit: Duration) -> std::process::Output {
    let start = Instant::now();
    let mut child = child;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "aliquotctl write still running after {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_write_survives_kill9_of_the_allocator_and_of_an_agent() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = pool(dir.path());
    let url = p.url.clone();
    let manifest = dir.path().join("run.manifest");
    let w = writer(&url, &manifest, "192MiB", &[]);

    std::thread::sleep(Duration::from_millis(1200));
    p.alloc.kill9();
    std::thread::sleep(Duration::from_millis(700));
    p.alloc.restart().expect("allocator back");
    std::thread::sleep(Duration::from_millis(1000));
    p.agents[1].kill9();
    std::thread::sleep(Duration::from_millis(500));
    p.agents[1].restart().expect("agent back");

    let out = wait(w, Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the run failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("verified"), "{stdout}");
    let m = Manifest::load(&manifest).expect("manifest");
    assert_eq!(m.blocks.len(), 192, "every block is in the manifest");
    // And every block of it is allocated in the store, exactly: a block
    // committed in the killed generation's unsynced txg was claimed in the
    // new one's claim window (before this check existed, the writer only
    // claimed when its final sync saw the old generation, and lost them).
    p.alloc.kill();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = dir
        .path()
        .join("allocator")
        .join(aliquot_allocator::sqlite_store::DB_FILE);
    let (_, p) = rt
        .block_on(aliquot_allocator::sqlite_store::read_only(&db))
        .expect("store")
        .expect("pool");
    let stored: std::collections::HashSet<(u32, u64, u64)> = p
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    for (block, copies) in &m.blocks {
        for c in copies {
            assert!(
                stored.contains(&(c.at.vdev, c.at.offset, c.at.size)),
                "block {block} ({:?}) is in the manifest but not allocated in the store",
                c.at
            );
        }
    }
}

#[test]
fn a_failed_run_records_what_it_made_durable() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = pool(dir.path());
    let url = p.url.clone();
    let manifest = dir.path().join("failed.manifest");
    // The allocator goes away for good: the writer waits --allocator-wait,
    // then stops, flushing and recording what it placed before.
    let w = writer(&url, &manifest, "512MiB", &args!["--allocator-wait", "2s"]);
    std::thread::sleep(Duration::from_millis(1500));
    p.alloc.kill9();
    let out = wait(w, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the run cannot finish: {stderr}");
    assert!(stderr.contains("the run stopped after"), "{stderr}");
    assert!(stderr.contains("listed in the manifest"), "{stderr}");
    let m = Manifest::load(&manifest).expect("a manifest of the failed run");
    assert!(!m.blocks.is_empty(), "the blocks placed before the failure");
}

#[test]
fn an_interrupted_run_records_what_it_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool(dir.path());
    let manifest = dir.path().join("stopped.manifest");
    let w = writer(&p.url, &manifest, "512MiB", &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let ok = Command::new("kill")
        .args(["-TERM", &w.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let out = wait(w, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(stderr.contains("which are durable"), "{stderr}");
    let m = Manifest::load(&manifest).expect("a manifest of the interrupted run");
    assert!(!m.blocks.is_empty());
}
