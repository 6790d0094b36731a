//! The Python client leaves nothing allocated behind a handover, with real
//! processes: a block (or a batch) whose Commit took effect and synced,
//! but whose answer was lost with the allocator, is refused by the
//! restarted one (ALLOCATOR_RESTARTED, its claim window closed) and written
//! again; the extents of the first Commit must be given back, not left
//! allocated to no block for ever. After the run, what the pool holds is
//! exactly the blocks acknowledged, and they read back as written.

use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, lazy_channel};
use pb::allocator_client::AllocatorClient;

const WRITER: &str = include_str!("py/handover_writer.py");

fn allocated(p: &FilePool) -> u64 {
    p.alloc_by_name().values().sum()
}

/// Every vdev reported in and healthy again after a restart.
async fn wait_healthy(p: &FilePool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut c = AllocatorClient::new(lazy_channel(&p.url));
        if let Ok(st) = c.get_pool(pb::GetPoolRequest {}).await {
            let st = st.into_inner();
            if !st.vdevs.is_empty()
                && st
                    .vdevs
                    .iter()
                    .all(|v| v.health == pb::VdevHealth::Healthy as i32)
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the restarted allocator has no healthy vdevs"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn commit_lost_with_the_allocator(mode: &str) {
    let py = integration_tests::python();
    let pypath = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let dir = tempfile::tempdir().unwrap();
    // No claim window: the restarted allocator refuses the repeated Commit
    // and no Claim may keep the block.
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("64MiB");
    let (committed, restarted) = (dir.path().join("committed"), dir.path().join("restarted"));
    let w = std::process::Command::new(&py)
        .arg("-c")
        .arg(WRITER)
        .args([mode, p.url.as_str()])
        .arg(&committed)
        .arg(&restarted)
        .env("PYTHONPATH", &pypath)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the python writer");
    let out = tokio::task::spawn_blocking(move || w.wait_with_output().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !committed.exists() {
        assert!(Instant::now() < deadline, "the writer never committed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = allocated(&p);
    assert!(before > 0, "the first Commit is durable");
    p.alloc.kill9();
    p.alloc.restart().expect("restart the allocator");
    wait_healthy(&p).await;
    std::fs::write(&restarted, b"").unwrap();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .expect("the writer finished")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the writer failed:\n{stderr}\n{stdout}"
    );
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    assert_eq!(r["wrong"], 0, "blocks read back wrong");
    let acked: u64 = r["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[2].as_u64().unwrap())
        .sum();
    assert!(acked > 0);
    // Frees show at once; give the pool a few txgs anyway.
    let deadline = Instant::now() + Duration::from_secs(20);
    while allocated(&p) != acked {
        assert!(
            Instant::now() < deadline,
            "{mode}: the pool holds {} bytes, the blocks acknowledged {acked}: the first \
             Commit's extents were left allocated ({before} bytes then)",
            allocated(&p)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_whose_commit_was_lost_with_the_allocator_is_given_back() {
    commit_lost_with_the_allocator("block").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_commit_was_lost_with_the_allocator_is_given_back() {
    commit_lost_with_the_allocator("batch").await;
}
