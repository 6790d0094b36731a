//! The Python client's batch write, lease renewal and JSON block references,
//! against a real pool: `write_blocks` commits many
//! blocks in one txg with one sync and each reads back; a `Block` survives
//! `to_json`/`from_json` and still reads; `renew_lease` extends an
//! allocation in flight; `AsyncPool` (grpc.aio) writes 8 blocks at once,
//! each read back. It also measures durable `write_block` (one sync a
//! block), `write_blocks` and `aliquotctl write` on the same pool (printed;
//! the README quotes the figures).

use std::path::Path;
use std::process::Command;

use integration_tests::{FilePool, args};

const PY: &str = r#"
import json, sys, time
from aliquot_client import Pool, Block
from aliquot.v1 import allocator_pb2
pool = Pool(sys.argv[1])
out = {}
datas = [bytes([i % 251]) * (64 << 10) for i in range(64)]
blocks = pool.write_blocks(datas)
out["batch_txgs"] = sorted({b.txg for b in blocks})
out["batch_synced"] = all(b.synced for b in blocks)
out["batch_intact"] = all(pool.read_block(b) == d for b, d in zip(blocks, datas))
again = Block.from_json(blocks[5].to_json())
out["json_equal"] = again == blocks[5]
out["json_reads"] = pool.read_block(again) == datas[5]
r = pool.allocator.Allocate(allocator_pb2.AllocateRequest(size=4096, copies=1, **{"class": allocator_pb2.ALLOCATION_CLASS_DATA}))
renewed = pool.renew_lease([r.allocation_id], lease_ms=20000)
out["renewed_ahead_ms"] = renewed.lease_deadline_ms - int(time.time() * 1000)
pool.allocator.Abort(allocator_pb2.AbortRequest(allocation_ids=[r.allocation_id]))
mib = b"\x5a" * (1 << 20)
n = 16
t = time.monotonic()
for _ in range(n):
    pool.write_block(mib)
out["write_block_per_s"] = n / (time.monotonic() - t)
t = time.monotonic()
pool.write_blocks([mib] * n)
out["write_blocks_mib_per_s"] = n / (time.monotonic() - t)
import asyncio
from aliquot_client import AsyncPool
async def main():
    async with AsyncPool(sys.argv[1]) as ap:
        datas = [bytes([7 + i]) * 100_000 for i in range(8)]
        bs = await asyncio.gather(*(ap.write_block(d) for d in datas))
        back = await asyncio.gather(*(ap.read_block(b) for b in bs))
        out["aio_intact"] = back == datas and all(b.synced for b in bs)
        # The sync client reads what the async one wrote.
        out["aio_sync_reads"] = pool.read_block(bs[3]) == datas[3]
asyncio.run(main())
print(json.dumps(out))
"#;

#[test]
fn python_batch_json_and_renew() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("512MiB");
    p.add_agent("512MiB");
    let py = integration_tests::python();
    let path = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let o = Command::new(&py)
        .args(["-c", PY, &p.url])
        .env("PYTHONPATH", &path)
        .output()
        .expect("python");
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("the script's JSON line");
    assert_eq!(
        v["batch_txgs"].as_array().map(|a| a.len()),
        Some(1),
        "one txg: {v}"
    );
    assert_eq!(v["batch_synced"], true, "{v}");
    assert_eq!(v["batch_intact"], true, "{v}");
    assert_eq!(v["json_equal"], true, "{v}");
    assert_eq!(v["json_reads"], true, "{v}");
    assert_eq!(v["aio_intact"], true, "{v}");
    assert_eq!(v["aio_sync_reads"], true, "{v}");
    let ahead = v["renewed_ahead_ms"].as_i64().unwrap();
    assert!((15_000..=21_000).contains(&ahead), "{v}");

    let w = p.ok(&args![
        "write",
        "--total",
        "64MiB",
        "--no-manifest",
        "--no-progress",
        "--json"
    ]);
    let r: serde_json::Value = serde_json::from_str(&w).unwrap();
    let ctl_mib_s = r["bytes_per_sec"].as_f64().unwrap() / (1u64 << 20) as f64;
    eprintln!(
        "measured (debug build): Python write_block durable {:.1} blocks/s (1 MiB), \
         write_blocks {:.1} MiB/s (16 x 1 MiB, one commit), aliquotctl write {:.1} MiB/s",
        v["write_block_per_s"].as_f64().unwrap(),
        v["write_blocks_mib_per_s"].as_f64().unwrap(),
        ctl_mib_s
    );
}

/// `AsyncPool` across an allocator restart: a block
/// whose data is on the agents when the allocator is killed with -9 and
/// restarted is claimed in the new generation (its Commit answers
/// ALLOCATOR_RESTARTED), made durable, and reads back.
const PY_AIO_RESTART: &str = r#"
import asyncio, sys
from aliquot_client import AsyncPool
from aliquot.v1 import agent_pb2, allocator_pb2

async def main():
    async with AsyncPool(sys.argv[1], allocator_wait=60) as ap:
        data = b"\x42" * 65536
        r = await ap.allocator.Allocate(allocator_pb2.AllocateRequest(
            size=len(data), copies=1, **{"class": allocator_pb2.ALLOCATION_CLASS_DATA}))
        for ext, ep, tok in zip(r.extents, r.endpoints, r.tokens or [b""] * len(r.extents)):
            await ap.agent(ep).Write(agent_pb2.WriteRequest(
                offset=ext.offset, data=data + bytes(ext.size - len(data)), token=tok))
            await ap.agent(ep).Flush(agent_pb2.FlushRequest())
        print("written", flush=True)
        sys.stdin.readline()
        b, why = await ap._commit_or_claim(r, len(data), True)
        assert b is not None, why
        assert b.synced and b.generation > r.generation, (b, r.generation)
        assert await ap.read_block(b) == data
        st = await ap.get_pool()
        print("claimed in generation %d of %d" % (b.generation, st.generation), flush=True)

asyncio.run(main())
"#;

#[test]
fn async_pool_claims_its_block_after_an_allocator_restart() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().unwrap();
    // A claim window longer than the test: the client claims only inside
    // one (after it, it would write the block again).
    let mut p = FilePool::start(dir.path(), &args!["--claim-window", "120s"]);
    p.add_agent("256MiB");
    let py = integration_tests::python();
    let path = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let mut child = Command::new(&py)
        .args(["-c", PY_AIO_RESTART, &p.url])
        .env("PYTHONPATH", &path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "written", "the script did not write its block");
    // The allocator dies before the Commit and comes back in a new
    // generation that never heard of the allocation.
    p.alloc
        .restart()
        .expect("kill -9 and restart the allocator");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "{line}{rest}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(rest.contains("claimed in generation"), "{rest}");
}
