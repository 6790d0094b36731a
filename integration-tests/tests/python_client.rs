//! The Python client package (`clients/python`) against a real pool: `up`
//! with mutual TLS (the default), a client certificate issued by
//! `aliquotctl certs issue --role client`, the package's `Pool.write_block`
//! (allocate → write each copy with its token → flush → commit, durable)
//! for blocks of several sizes and copies, every copy read back, the
//! allocator's own accounting matching, a free; and `grpcio-reflection`
//! (v1alpha) listing exactly the allocator's services on its port.
//!
//! The package is installed by `.ci/run` (`ALIQUOT_PYTHONPATH`); without it
//! the test installs it into the target dir itself, so `cargo test` alone
//! works on a machine with Python 3 and pip.

use std::path::Path;
use std::process::Command;

use integration_tests::{INSECURE_ENV, Proc, args, bin, ctl, json_u64, ok_stdout};

const PY_TEST: &str = r#"
import json, sys
from aliquot_client import Pool, Tls, AliquotError

allocator, certs = sys.argv[1], sys.argv[2]
pool = Pool(allocator, tls=Tls.in_dir(certs, role="client", name="pytest"))
sizes = [(4096, 1), (100_000, 2), (1 << 20, 1), (3 * 65536 + 17, 3)]
blocks = []
for i, (size, copies) in enumerate(sizes):
    data = bytes((i * 7 + j) % 251 for j in range(size))
    b = pool.write_block(data, copies=copies)
    assert b.synced and len(b.extents) == copies, b
    assert len({e.vdev for e in b.extents}) == copies, "copies on distinct vdevs"
    for c in range(copies):
        assert pool.read_block(b, copy=c) == data, f"block {i} copy {c}"
    blocks.append(b)

# A bad request comes back as an AliquotError with the server's reason.
try:
    pool.write_block(b"x", copies=4)
    raise SystemExit("copies=4 was accepted")
except AliquotError as e:
    assert e.reason == "INVALID_ARGUMENT", e

placed = {}
for b in blocks:
    for e in b.extents:
        placed[e.vdev] = placed.get(e.vdev, 0) + e.size
freed_txg = pool.free(blocks[:1])
pool.sync_txg(freed_txg)

# The asyncio API writes, reads back and frees too (its blocks leave the
# pool's accounting as they came).
import asyncio
from aliquot_client import AsyncPool, Block

async def aio():
    async with AsyncPool(allocator, tls=Tls.in_dir(certs, role="client", name="pytest")) as ap:
        bs = await asyncio.gather(*(ap.write_block(bytes([i]) * 8192) for i in range(4)))
        for i, b in enumerate(bs):
            assert await ap.read_block(Block.from_json(b.to_json())) == bytes([i]) * 8192, i
        t = await ap.free(bs)
        assert t >= max(b.txg for b in bs), (t, [b.txg for b in bs])
        await ap.sync_txg(t)
        # Past the frees' deferral (two more txgs): the pool holds none of it.
        for _ in range(3):
            await ap.sync_txg()
asyncio.run(aio())

from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
services = sorted(ProtoReflectionDescriptorDatabase(pool.allocator_channel).get_services())
print(json.dumps({"placed": placed, "services": services,
                  "freed": [e.size for e in blocks[0].extents],
                  "freed_vdevs": [e.vdev for e in blocks[0].extents]}))
"#;

/// Where the package is importable from (see the shared helper).
fn python_path(py: &str) -> String {
    integration_tests::python_client_path(py, Path::new(env!("CARGO_TARGET_TMPDIR")))
}

#[test]
fn python_client_writes_reads_and_discovers_over_tls() {
    let py = integration_tests::python();
    let pypath = python_path(&py);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let up = Proc::start(
        "up",
        &bin("aliquotctl"),
        &args![
            "up",
            "--ephemeral",
            "--no-metrics",
            "--data-dir",
            data.display(),
            "--agents",
            "128MiB,128MiB,256MiB"
        ],
        // TLS, as `up` is by default (the harness defaults to --insecure).
        &[(INSECURE_ENV.to_string(), "false".to_string())],
        &["grpc"],
        tmp.path(),
    )
    .expect("aliquotctl up");
    let addr = up.addr("grpc").to_string();
    let certs = data.join("certs");
    ok_stdout(
        &ctl(&args![
            "certs",
            "issue",
            "--dir",
            certs.display(),
            "--role",
            "client",
            "pytest"
        ]),
        "certs issue --role client",
    );

    let out = Command::new(&py)
        .args(["-c", PY_TEST, &addr, &certs.display().to_string()])
        .env("PYTHONPATH", &pypath)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(
        out.stdout
            .split(|&b| b == b'\n')
            .rfind(|l| !l.is_empty())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        r["services"],
        serde_json::json!([
            "aliquot.v1.AgentRegistry",
            "aliquot.v1.Allocator",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"
        ]),
        "reflection lists exactly the allocator's services"
    );

    let st: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args![
            "status",
            "--allocator",
            addr,
            "--certs-dir",
            certs.display(),
            "--json"
        ]),
        "status --json",
    ))
    .unwrap();
    let mut want: std::collections::BTreeMap<u64, u64> = r["placed"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap()))
        .collect();
    let total_placed: u64 = want.values().sum();
    for (v, s) in r["freed_vdevs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["freed"].as_array().unwrap())
    {
        *want.get_mut(&v.as_u64().unwrap()).unwrap() -= s.as_u64().unwrap();
    }
    let have: u64 = st["vdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| json_u64(&v["alloc"]).unwrap())
        .sum();
    // The allocator holds what the client placed; the freed block's space
    // counts until its deferral ends (2 more txgs): either figure is right
    // at this instant, nothing else is.
    let after_free: u64 = want.values().sum();
    assert!(
        have == total_placed || have == after_free,
        "allocator holds {have}, the client placed {total_placed} and freed down to {after_free}"
    );
}

/// The client across a takeover: given both allocators of an
/// `up --ha` pool, it writes durable blocks, the leading allocator is
/// killed with -9, and it follows NOT_LEADER to the new leader, waits out
/// the takeover and the claim window, writes on, and reads everything back;
/// so does an `AsyncPool` given both, the killed leader first, which
/// writes first after the kill.
const PY_HA: &str = r#"
import asyncio, os, sys, time
from aliquot_client import AsyncPool, Pool

def listener_pid(port):
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            p = line.split()
            if int(p[1].rsplit(":", 1)[1], 16) == port and p[3] == "0A":
                inodes.add("socket:[%s]" % p[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                if os.readlink("/proc/%s/fd/%s" % (pid, fd)) in inodes:
                    return int(pid)
        except OSError:
            pass
    raise SystemExit("no process listens on %d" % port)

pool = Pool(sys.argv[1], allocator_wait=60)
before = [pool.write_block(bytes([i]) * 65536) for i in range(4)]
st = pool.get_pool()
leader = st.leadership.leader
# The AsyncPool below starts on the first address given: the one killed.
assert sys.argv[1].split(",")[0].split("://")[-1] == leader.split("://")[-1], (sys.argv[1], leader)
os.kill(listener_pid(int(leader.rsplit(":", 1)[1])), 9)

async def aio_after():
    async with AsyncPool(sys.argv[1], allocator_wait=60) as ap:
        t0 = time.time()
        bs = [await ap.write_block(bytes([200 + i]) * 65536) for i in range(4)]
        took = time.time() - t0
        for i, b in enumerate(bs):
            assert await ap.read_block(b) == bytes([200 + i]) * 65536, i
        return bs, took
aio_blocks, aio_took = asyncio.run(aio_after())
t0 = time.time()
after = [pool.write_block(bytes([100 + i]) * 65536) for i in range(4)]
took = time.time() - t0
st2 = pool.get_pool()
# A new generation leads (`up` restarts the killed allocator as a standby,
# and either may win the expired lease).
assert st2.generation > st.generation, (st.generation, st2.generation)
for i, b in enumerate(before):
    assert pool.read_block(b) == bytes([i]) * 65536, i
for i, b in enumerate(after):
    assert pool.read_block(b) == bytes([100 + i]) * 65536, i
for i, b in enumerate(aio_blocks):
    assert pool.read_block(b) == bytes([200 + i]) * 65536, i
print("takeover followed: %d blocks before; after, AsyncPool %d (%.1f s) and Pool %d (%.1f s), all read back"
      % (len(before), len(aio_blocks), aio_took, len(after), took))
"#;

#[test]
fn python_client_follows_a_takeover() {
    let py = integration_tests::python();
    let pypath = python_path(&py);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let up = Proc::start(
        "up",
        &bin("aliquotctl"),
        &args![
            "up",
            "--ha",
            "--insecure",
            "--ephemeral",
            "--no-metrics",
            "--data-dir",
            data.display(),
            "--agents",
            "256MiB,256MiB"
        ],
        &[],
        &["grpc"],
        tmp.path(),
    )
    .expect("aliquotctl up --ha");
    // Both allocators, as the leader lists them once it saw the standby.
    let (leader, standby) = integration_tests::leader_and_standby(&up.url("grpc"));
    let both = format!("{leader},{standby}");
    let out = Command::new(&py)
        .args(["-c", PY_HA, &both])
        .env("PYTHONPATH", &pypath)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}
