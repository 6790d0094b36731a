//! A batch larger than the throttle's limit, against a real pool: the
//! Python client's batch helper, blocking (`Pool.write_blocks`) and asyncio
//! (`AsyncPool.write_blocks`), writes 256 x 1 MiB with one Commit on a pool
//! whose class limit is below 64 MiB while `aliquotctl write` writes beside
//! it. Each block is reported written as soon as its copies are on their
//! agents, which ends its throttle reservation then (not at the batch's
//! Commit): the batch never waits on itself, the other writer never waits
//! more than 2 s in the throttle, and a batch abandoned mid-way (its block
//! source raises) leaves nothing reserved.

use std::path::Path;
use std::process::Command;

use integration_tests::FilePool;
use integration_tests::throttle::{Classes, paced_writer, throttle_wait_us};

const PY: &str = r#"
import asyncio, json, sys, time
from aliquot_client import AsyncPool, Pool

url, api, phase = sys.argv[1], sys.argv[2], sys.argv[3]
MIB = 1 << 20
N = 256

def data(i):
    return bytes([i % 251]) * MIB

class Abandoned(Exception):
    pass

def blocks(stop_at=None):
    for i in range(N):
        if i == stop_at:
            raise Abandoned()
        yield data(i)

def batch(source):
    if api == "sync":
        with Pool(url) as p:
            return p.write_blocks(source)
    async def main():
        async with AsyncPool(url) as p:
            return await p.write_blocks(source)
    return asyncio.run(main())

def normal(pool):
    return next(c for c in pool.get_pool().classes if c.name == "normal")

pool = Pool(url)
out = {"limit": normal(pool).alloc_max}
if phase == "batch":
    t = time.monotonic()
    bs = batch(blocks())
    out["secs"] = time.monotonic() - t
    # The limit once 1 MiB blocks raised the class's alloc_io_size.
    out["limit"] = max(out["limit"], normal(pool).alloc_max)
    out["blocks"] = len(bs)
    out["txgs"] = len({b.txg for b in bs})
    out["synced"] = all(b.synced for b in bs)
    out["intact"] = all(pool.read_block(bs[i]) == data(i) for i in range(0, N, 37))
    pool.sync_txg(pool.free(bs))
else:
    # The batch phase's frees leave the deferred trees after two syncs.
    for _ in range(3):
        pool.sync_txg()
    before = normal(pool).alloc
    try:
        batch(blocks(stop_at=100))
        out["abandoned"] = "no error"
    except Abandoned:
        out["abandoned"] = "raised"
    c = normal(pool)
    out["reserved"] = c.reserved
    out["waiting"] = c.waiting
    out["queue_depth"] = sum(g.queue_depth for g in c.groups)
    # Aborted space is free again at once (nothing of it was committed).
    out["alloc_back"] = c.alloc == before
print(json.dumps(out))
"#;

fn python(py: &str, path: &str, url: &str, api: &str, phase: &str) -> serde_json::Value {
    let o = Command::new(py)
        .args(["-c", PY, url, api, phase])
        .env("PYTHONPATH", path)
        .output()
        .expect("python");
    assert!(
        o.status.success(),
        "{api} {phase}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("the script's JSON line")
}

#[test]
fn a_batch_over_the_throttle_limit_never_waits_on_itself() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("512MiB");
    p.add_agent("512MiB");
    let py = integration_tests::python();
    let path = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    for api in ["sync", "aio"] {
        // The other writer: paced, one block per Commit, 2 s of work.
        let other = paced_writer(&p);
        let v = python(&py, &path, &p.url, api, "batch");
        let (waited, w) = throttle_wait_us(
            &other.wait_with_output().unwrap(),
            &format!("the {api} batch"),
        );
        let limit = v["limit"].as_u64().unwrap();
        assert!(
            limit > 0 && limit < 64 << 20,
            "the class limit must be below 64 MiB: {v}"
        );
        assert_eq!(v["blocks"], 256, "{api}: {v}");
        assert_eq!(v["txgs"], 1, "{api}: one Commit, one txg: {v}");
        assert_eq!(v["synced"], true, "{api}: {v}");
        assert_eq!(v["intact"], true, "{api}: {v}");
        assert!(
            waited <= 2_000_000,
            "beside the {api} batch the other writer waited {waited} us in the throttle: {w}"
        );
        eprintln!(
            "{api}: 256 x 1 MiB in {:.2} s under a {} MiB limit; the other writer's longest throttle wait {} us",
            v["secs"].as_f64().unwrap(),
            limit >> 20,
            waited
        );

        let v = python(&py, &path, &p.url, api, "abandon");
        assert_eq!(v["abandoned"], "raised", "{api}: {v}");
        assert_eq!(
            v["reserved"], 0,
            "{api}: RESERVED after an abandoned batch: {v}"
        );
        assert_eq!(v["waiting"], 0, "{api}: {v}");
        assert_eq!(v["queue_depth"], 0, "{api}: {v}");
        assert_eq!(v["alloc_back"], true, "{api}: {v}");
    }
    let normal = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async { Classes::new(&p.url).normal().await });
    assert_eq!(normal.reserved, 0, "{normal:?}");
}
