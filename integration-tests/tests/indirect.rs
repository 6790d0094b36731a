//! Moves that keep the old address, across real processes over mutual TLS
//! with two file agents: alice writes blocks with the Python client and
//! over gRPC; an admin moves every one on one agent to the other with
//! Relocate's keep_address (copying the bytes agent to agent itself);
//! alice then reads every block, byte for byte, through its ORIGINAL
//! address (ReadTokens names the new extent and grants it; the Python
//! client follows it with its unchanged block references); bob
//! can neither read nor Remap them (NOT_OWNER); alice's replayed original
//! write token is refused by the old agent; the mapping survives kill -9 of
//! the allocator; alice's Remap and Free drop the entries.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use aliquot_auth::Role;
use aliquot_proto::v1 as pb;
use integration_tests::data_request as data;
use integration_tests::secure_pool::{SecurePool, SecurePoolSpec, tls_channel};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const MIB: u64 = 1 << 20;

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// Alice's Python blocks: written (`write`, printing each block's JSON)
/// or read back from those references (`read`, JSON on stdin).
const PY: &str = r#"
import sys
from aliquot_client import Pool, Tls, Block

allocator, certs, mode = sys.argv[1], sys.argv[2], sys.argv[3]
pool = Pool(allocator, tls=Tls.in_dir(certs, role="client", name="alice"))
data = lambda i: bytes((i * 13 + j) % 253 for j in range(200_000 + i * 4096))
if mode == "write":
    for i in range(6):
        print(pool.write_block(data(i)).to_json())
else:
    lines = sys.stdin.read().splitlines()
    for i, line in enumerate(lines):
        assert pool.read_block(Block.from_json(line)) == data(i), i
    # The asyncio API follows a moved block the same way.
    import asyncio
    from aliquot_client import AsyncPool

    async def aio():
        async with AsyncPool(allocator, tls=Tls.in_dir(certs, role="client", name="alice")) as ap:
            for i, line in enumerate(lines):
                assert await ap.read_block(Block.from_json(line)) == data(i), i

    asyncio.run(aio())
    print("read back")
"#;

fn python(url: &str, certs: &Path, mode: &str, stdin: &str) -> String {
    use std::io::Write;
    let py = integration_tests::python();
    let pypath = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let mut child = Command::new(&py)
        .args(["-c", PY, url, &certs.display().to_string(), mode])
        .env("PYTHONPATH", &pypath)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python {mode} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn pattern(k: usize, size: u64) -> Vec<u8> {
    (0..size)
        .map(|i| (i as usize * 31 + k * 7 + 1) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moved_blocks_read_back_through_their_original_address() {
    let dir = tempfile::tempdir().unwrap();
    let mut sp = SecurePool::start(
        dir.path(),
        SecurePoolSpec {
            pool: "indirect",
            agents: &[("d0", "64MiB"), ("d1", "64MiB")],
            callers: &[
                (Role::Client, "alice"),
                (Role::Client, "bob"),
                (Role::Admin, "op"),
            ],
            allocator_flags: &[],
        },
    )
    .await;
    let (url, certs) = (sp.url.clone(), sp.certs.clone());
    let mut alice = sp.allocator(Role::Client, "alice");
    let mut bob = sp.allocator(Role::Client, "bob");
    let mut op = sp.allocator(Role::Admin, "op");
    let agent_as = |endpoint: &str, name: &str, role: Role| {
        VdevAgentClient::new(tls_channel(endpoint, &certs, role, name, Role::Agent))
    };
    let pool = sp.wait_reported(2).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let endpoint = |vdev: u32| {
        pool.vdevs
            .iter()
            .find(|v| v.vdev == vdev)
            .unwrap()
            .endpoint
            .clone()
    };

    // Alice writes 9 blocks of distinct bytes (some on each vdev).
    let mut blocks: Vec<(pb::Extent, Vec<u8>, Vec<u8>)> = Vec::new();
    for k in 0..9 {
        let size = MIB / 4 * (1 + k as u64 % 3);
        let r = loop {
            match alice.allocate(data(size)).await {
                Ok(r) => break r.into_inner(),
                Err(e) => {
                    assert!(Instant::now() < deadline, "{e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let e = r.extents[0];
        let bytes = pattern(k, e.size);
        let mut ag = agent_as(&r.endpoints[0], "alice", Role::Client);
        loop {
            let w = ag
                .write(pb::WriteRequest {
                    offset: e.offset,
                    data: bytes.clone().into(),
                    token: r.tokens[0].clone(),
                })
                .await;
            match w {
                Ok(_) => break,
                Err(s) => {
                    assert!(Instant::now() < deadline, "{s}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        alice
            .commit(pb::CommitRequest {
                allocation_ids: vec![r.allocation_id],
                wait_synced: true,
                generation: r.generation,
            })
            .await
            .expect("alice commits");
        blocks.push((e, bytes, r.tokens[0].clone()));
    }
    let source = blocks[0].0.vdev;
    let target = 1 - source;
    let moving: Vec<usize> = (0..blocks.len())
        .filter(|&k| blocks[k].0.vdev == source)
        .collect();
    assert!(!moving.is_empty());
    // Alice's Python blocks, and those of them on the source vdev.
    let py_refs = python(&url, &certs, "write", "");
    let py_extents: Vec<pb::Extent> = py_refs
        .lines()
        .map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).unwrap();
            let e = &j["extents"][0];
            let n = |v: &serde_json::Value| v.as_str().unwrap().parse::<u64>().unwrap();
            pb::Extent {
                vdev: e["vdev"].as_u64().unwrap() as u32,
                offset: n(&e["offset"]),
                size: n(&e["size"]),
            }
        })
        .collect();
    let py_moving: Vec<pb::Extent> = py_extents
        .iter()
        .filter(|e| e.vdev == source)
        .copied()
        .collect();
    assert!(
        !py_moving.is_empty(),
        "no Python block on vdev {source}: {py_extents:?}"
    );

    // The operator moves every block of `source`, keeping its address:
    // read it from the old agent, write it to the new one, commit.
    async fn move_keeping_address(
        op: &mut AllocatorClient<Channel>,
        from: pb::Extent,
        agent: impl Fn(&str) -> VdevAgentClient<Channel>,
        endpoint: impl Fn(u32) -> String,
    ) -> pb::Extent {
        let tok = op
            .read_tokens(pb::ReadTokensRequest {
                extents: vec![from],
            })
            .await
            .expect("admin read token")
            .into_inner();
        let data = agent(&endpoint(from.vdev))
            .read(pb::ReadRequest {
                offset: from.offset,
                size: from.size,
                token: tok.tokens[0].clone(),
            })
            .await
            .expect("read the old copy")
            .into_inner()
            .data;
        let r = op
            .relocate(pb::RelocateRequest {
                extent: Some(from),
                keep_address: true,
                ..Default::default()
            })
            .await
            .expect("relocate keeping the address")
            .into_inner();
        let to = r.extents[0];
        agent(&r.endpoints[0])
            .write(pb::WriteRequest {
                offset: to.offset,
                data,
                token: r.tokens[0].clone(),
            })
            .await
            .expect("write the new copy");
        op.commit(pb::CommitRequest {
            allocation_ids: vec![r.allocation_id],
            wait_synced: true,
            generation: r.generation,
        })
        .await
        .expect("commit the move");
        to
    }
    let as_op = |ep: &str| agent_as(ep, "op", Role::Admin);
    let mut new_home = std::collections::BTreeMap::new();
    for &k in &moving {
        let from = blocks[k].0;
        let to = move_keeping_address(&mut op, from, as_op, endpoint).await;
        assert_eq!((to.vdev, to.size), (target, from.size));
        new_home.insert(k, to);
    }
    for &from in &py_moving {
        move_keeping_address(&mut op, from, as_op, endpoint).await;
    }
    let moved = (moving.len() + py_moving.len()) as u64;

    // Every block reads back byte for byte through its original address.
    async fn read_original(
        who: &mut AllocatorClient<Channel>,
        e: pb::Extent,
        agent: impl Fn(&str) -> VdevAgentClient<Channel>,
        endpoint: impl Fn(u32) -> String,
    ) -> Result<(pb::Extent, Vec<u8>), tonic::Status> {
        let r = who
            .read_tokens(pb::ReadTokensRequest { extents: vec![e] })
            .await?
            .into_inner();
        let at = r.locations[0];
        let data = agent(&endpoint(at.vdev))
            .read(pb::ReadRequest {
                offset: at.offset,
                size: at.size,
                token: r.tokens[0].clone(),
            })
            .await?
            .into_inner()
            .data;
        Ok((at, data.to_vec()))
    }
    let check_all = |who: AllocatorClient<Channel>, blocks: Vec<(pb::Extent, Vec<u8>, Vec<u8>)>| {
        let new_home = new_home.clone();
        let certs = certs.clone();
        async move {
            let mut who = who;
            for (k, (e, bytes, _)) in blocks.iter().enumerate() {
                let (at, data) = read_original(
                    &mut who,
                    *e,
                    |ep| {
                        VdevAgentClient::new(tls_channel(
                            ep,
                            &certs,
                            Role::Client,
                            "alice",
                            Role::Agent,
                        ))
                    },
                    endpoint,
                )
                .await
                .unwrap_or_else(|s| panic!("block {k} at {e:?}: {s}"));
                assert_eq!(at, *new_home.get(&k).unwrap_or(e), "block {k}");
                assert!(data == *bytes, "block {k}: other bytes");
            }
        }
    };
    check_all(alice.clone(), blocks.clone()).await;
    assert_eq!(python(&url, &certs, "read", &py_refs).trim(), "read back");
    let p = op
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.mapping_entries, moved);

    // Bob: no read token, no Remap of alice's moved block.
    let first = blocks[moving[0]].0;
    let e = bob
        .read_tokens(pb::ReadTokensRequest {
            extents: vec![first],
        })
        .await
        .expect_err("bob reads alice's moved block");
    assert_eq!(reason(&e), "NOT_OWNER", "{e}");
    let e = bob
        .remap(pb::RemapRequest {
            extents: vec![first],
        })
        .await
        .expect_err("bob remaps alice's moved block");
    assert_eq!(reason(&e), "NOT_OWNER", "{e}");

    // Alice's original write token of a moved block writes nothing on the
    // old agent (its allocation's tokens died with its commit).
    let (e0, _, tok0) = &blocks[moving[0]];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let w = agent_as(&endpoint(e0.vdev), "alice", Role::Client)
            .write(pb::WriteRequest {
                offset: e0.offset,
                data: vec![0xee; e0.size as usize].into(),
                token: tok0.clone(),
            })
            .await;
        if w.is_err() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a replayed write token was still honoured"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // kill -9 of the allocator: the mapping is the store's.
    sp.alloc.kill9();
    sp.alloc.restart().expect("restart");
    let mut alice = sp.allocator(Role::Client, "alice");
    let mut op = sp.allocator(Role::Admin, "op");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p = op.get_pool(pb::GetPoolRequest {}).await;
        if let Ok(p) = p {
            let p = p.into_inner();
            if p.vdevs.iter().all(|v| v.last_report.is_some()) {
                assert_eq!(p.mapping_entries, moved);
                break;
            }
        }
        assert!(Instant::now() < deadline, "the allocator never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check_all(alice.clone(), blocks.clone()).await;
    assert_eq!(python(&url, &certs, "read", &py_refs).trim(), "read back");

    // Alice acknowledges one new address and frees another block by its
    // old one: both entries go.
    let r = alice
        .remap(pb::RemapRequest {
            extents: vec![first],
        })
        .await
        .expect("alice remaps")
        .into_inner();
    assert_eq!(r.locations, vec![new_home[&moving[0]]]);
    if let Some(&k) = moving.get(1) {
        alice
            .free(pb::FreeRequest {
                extents: vec![blocks[k].0],
            })
            .await
            .expect("free by the old address");
    }
    let p = op
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    // The Remap of the first, the Free of the second (if there is one).
    let dropped = moving.len().min(2) as u64;
    assert_eq!(p.mapping_entries, moved - dropped, "{p:?}");
    drop(std::mem::take(&mut sp.agents));
}
