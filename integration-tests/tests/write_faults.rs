//! Across real processes: `aliquotctl write` survives a
//! kill -9 of the allocator and of an agent in the middle of a run. Blocks
//! whose agent write fails on the transport (or whose agent restarted and
//! no longer honours the token) are written again elsewhere; the writer
//! waits for the restarted allocator and reconnects its stream; the run
//! finishes with every block verified and listed in the manifest. A run
//! that fails still records the blocks it made durable. The allocator's
//! store on a file system full for a moment: nothing acknowledged that the
//! store lacks, the writer goes on once space returns, nothing lost.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aliquot_allocator::sqlite_store;
use aliquot_proto::v1 as pb;
use aliquotctl::manifest::Manifest;
use integration_tests::{FilePool, INSECURE_ENV, TermOnDrop, Tmpfs, args, bin, lazy_channel};

/// The pool of most of these tests: three 512 MiB file agents, and a claim
/// window for the blocks a killed writer leaves.
fn pool(dir: &Path) -> FilePool {
    let mut p = FilePool::start(dir, &args!["--pool", "faults", "--claim-window", "1s"]);
    for _ in 0..3 {
        p.add_agent("512MiB");
    }
    p
}

/// `aliquotctl write` of `total` in 1 MiB blocks, verified, at 48 MiB/s
/// unless `extra` gives another `--rate`.
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
        "--timeout",
        "2s",
        "--manifest",
        manifest.display(),
        "--verify",
        "--no-progress",
    ];
    if !extra.iter().any(|e| e == "--rate") {
        a.extend(args!["--rate", "48MiB/s"]);
    }
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

/// The store's synced txg as a fresh open of the file reads it (None
/// while the full file system refuses even that).
async fn stored_txg(db: &Path) -> Option<u64> {
    match sqlite_store::read_only(db).await {
        Ok(Some((id, _))) => Some(id.synced_txg),
        _ => None,
    }
}

/// The allocator's data dir on a 3 MiB tmpfs that fills up for a moment
/// under `aliquotctl write`: the synced txg the allocator reports never
/// passes the store's, the failure is shown (status, health), the run goes
/// on once space returns and finishes verified, and after a kill -9 every
/// block of its manifest is in the store.
#[test]
fn a_store_file_system_full_for_a_moment_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&dir.path().join("store"), "3m");
    let mut p = FilePool::start(
        dir.path(),
        &args!["--pool", "fullstore", "--data-dir", fs.0.display()],
    );
    p.add_agent("256MiB");
    p.add_agent("256MiB");
    let db = fs.0.join(sqlite_store::DB_FILE);
    let manifest = dir.path().join("run.manifest");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _in_rt = rt.enter();
    let mut c = pb::allocator_client::AllocatorClient::new(lazy_channel(&p.url));
    let pool = |c: &mut pb::allocator_client::AllocatorClient<tonic::transport::Channel>| {
        rt.block_on(c.get_pool(pb::GetPoolRequest {}))
            .expect("GetPool")
            .into_inner()
    };
    let base = pool(&mut c).synced_txg;
    let w = writer(&p.url, &manifest, "96MiB", &args!["--rate", "6MiB/s"]);
    let mut w = TermOnDrop(w);

    // The run is under way (txgs syncing), then the file system fills.
    let deadline = Instant::now() + Duration::from_secs(60);
    while pool(&mut c).synced_txg < base + 3 {
        assert!(Instant::now() < deadline, "no txg synced under the writer");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ballast = Tmpfs::fill(&fs, "ballast");
    let mut shown = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while shown < 10 {
        let st = pool(&mut c);
        if let Some(stored) = rt.block_on(stored_txg(&db)) {
            assert!(
                st.synced_txg <= stored,
                "the allocator says txg {} is synced; the store holds txg {stored}",
                st.synced_txg
            );
        }
        if st.persist_failure.is_some() {
            shown += 1;
        }
        assert!(
            Instant::now() < deadline,
            "no persist failure shown while the store's file system is full"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // An operator sees it: status (table and JSON) and health.
    let text = p.ok(&args!["status"]);
    assert!(text.contains("STORE FAILING: txg "), "{text}");
    let json = p.status();
    assert!(json["persist_failure"]["txg"].is_string(), "{json}");
    let h = integration_tests::ctl(&args!["health", p.url.clone()]);
    assert!(!h.status.success(), "health while the store refuses txgs");
    assert!(
        String::from_utf8_lossy(&h.stderr).contains("NOT_SERVING"),
        "{}",
        String::from_utf8_lossy(&h.stderr)
    );

    // Space returns; the run goes on and finishes, nothing acknowledged
    // past the store meanwhile.
    std::fs::remove_file(&ballast).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let out = loop {
        let st = pool(&mut c);
        if let Some(stored) = rt.block_on(stored_txg(&db)) {
            assert!(st.synced_txg <= stored, "{} > {stored}", st.synced_txg);
        }
        if let Some(status) = w.0.try_wait().unwrap() {
            use std::io::Read;
            let (mut so, mut se) = (String::new(), String::new());
            let _ = w.0.stdout.take().unwrap().read_to_string(&mut so);
            let _ = w.0.stderr.take().unwrap().read_to_string(&mut se);
            // Exited and reaped: nothing left to stop.
            std::mem::forget(w);
            break (status, so, se);
        }
        assert!(Instant::now() < deadline, "aliquotctl write still running");
        std::thread::sleep(Duration::from_millis(100));
    };
    let (status, stdout, stderr) = out;
    assert!(status.success(), "the run failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("verified"), "{stdout}");
    assert!(pool(&mut c).persist_failure.is_none());

    // Killed and read back: every block of the manifest is in the store.
    p.alloc.kill9();
    let m = Manifest::load(&manifest).expect("manifest");
    assert_eq!(m.blocks.len(), 96, "every block is in the manifest");
    let (_, stored) = rt
        .block_on(sqlite_store::read_only(&db))
        .expect("store")
        .expect("pool");
    let stored: std::collections::HashSet<(u32, u64, u64)> = stored
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    let missing: Vec<_> = m
        .blocks
        .values()
        .flatten()
        .filter(|c| !stored.contains(&(c.at.vdev, c.at.offset, c.at.size)))
        .collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged blocks missing: {missing:?}",
        missing.len()
    );
    p.alloc
        .restart()
        .expect("the allocator restarts on its store");
}
