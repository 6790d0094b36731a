//! Across real processes: a write token dies with its
//! block. Alice allocates, writes and commits: her token is revoked at the
//! agent within a report interval. She frees; Bob is given the same space,
//! writes and commits; Alice's old (bearer) token is refused and Bob's
//! block is intact. A restarted agent honours no token of an
//! allocation made before it registered.

use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args, data_request as data};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const MIB: u64 = 1 << 20;

fn lazy(url: &str) -> Channel {
    Channel::from_shared(url.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

fn overlaps(a: &pb::Extent, b: &pb::Extent) -> bool {
    a.vdev == b.vdev && a.offset < b.offset + b.size && b.offset < a.offset + a.size
}

async fn write(
    agent: &mut VdevAgentClient<Channel>,
    a: &pb::AllocateReply,
    byte: u8,
) -> Result<(), tonic::Status> {
    let e = a.extents[0];
    agent
        .write(pb::WriteRequest {
            offset: e.offset,
            data: vec![byte; e.size as usize].into(),
            token: a.tokens[0].clone(),
        })
        .await
        .map(|_| ())
}

async fn sync(c: &mut AllocatorClient<Channel>, generation: u64) {
    let open = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner()
        .open_txg;
    // The free's txg and the two after it (frees are deferred two txgs).
    c.sync_txg(pb::SyncTxgRequest {
        txg: open + 2,
        generation,
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_dies_when_its_space_is_given_to_someone_else() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = FilePool::start_with_write_tokens(
        dir.path(),
        "tokens",
        &args!["--report-interval", "100ms", "--zfs-txg-timeout", "100ms",],
    );
    let url = pool.url.clone();
    pool.add_file_agent("d0", &dir.path().join("d0.img"), "64MiB", &[]);
    let agent = &mut pool.agents[0];
    let mut c = AllocatorClient::new(lazy(&url));
    let mut ag = VdevAgentClient::new(lazy(&agent.url("grpc")));

    // Alice: allocate, write, commit, free, and the free becomes reusable.
    let deadline = Instant::now() + Duration::from_secs(20);
    let alice = loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // The agent may not have its RegisterReply yet (UNAVAILABLE: retry).
    while let Err(e) = write(&mut ag, &alice, 0xa1).await {
        assert_eq!(e.code(), Code::Unavailable, "alice writes: {e}");
        assert!(Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.commit(pb::CommitRequest {
        allocation_ids: vec![alice.allocation_id],
        wait_synced: true,
        generation: alice.generation,
    })
    .await
    .unwrap();
    // Committed: the allocator tells the agent in its next ReportAck, and
    // from then on her token no longer writes, even onto her own block.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match write(&mut ag, &alice, 0xa1).await {
            Ok(()) => {
                assert!(Instant::now() < deadline, "alice's token never revoked");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::PermissionDenied, "{e}");
                assert_eq!(reason(&e), "WRITE_TOKEN_REVOKED", "{e}");
                break;
            }
        }
    }
    c.free(pb::FreeRequest {
        extents: alice.extents.clone(),
    })
    .await
    .unwrap();
    sync(&mut c, alice.generation).await;

    // Bob: allocate until he is given (part of) Alice's old space.
    let mut held = Vec::new();
    let bob = loop {
        let r = c.allocate(data(MIB)).await.unwrap().into_inner();
        if overlaps(&r.extents[0], &alice.extents[0]) {
            break r;
        }
        held.push(r.allocation_id);
        assert!(held.len() < 64, "alice's space never came back");
    };
    write(&mut ag, &bob, 0xb2).await.expect("bob writes");
    c.commit(pb::CommitRequest {
        allocation_ids: vec![bob.allocation_id],
        wait_synced: true,
        generation: bob.generation,
    })
    .await
    .unwrap();

    // Alice (or whoever holds her token) writes again: refused.
    let e = write(&mut ag, &alice, 0xa1)
        .await
        .expect_err("alice's token after her block was freed and given to bob");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    // Revoked at her commit; were that news lost (a broken report stream),
    // Bob's write over the bytes would refuse it as superseded.
    assert!(
        ["WRITE_TOKEN_REVOKED", "WRITE_TOKEN_SUPERSEDED"].contains(&reason(&e).as_str()),
        "{e}"
    );
    assert!(e.message().contains("allocate again"), "{e}");
    let be = bob.extents[0];
    // Reads need a read token, from the allocator.
    let token = c
        .read_tokens(pb::ReadTokensRequest { extents: vec![be] })
        .await
        .unwrap()
        .into_inner()
        .tokens
        .remove(0);
    let back = ag
        .read(pb::ReadRequest {
            offset: be.offset,
            size: be.size,
            token,
        })
        .await
        .unwrap()
        .into_inner()
        .data;
    assert!(
        back.iter().all(|&b| b == 0xb2),
        "bob's committed block intact"
    );

    // The agent restarts: it cannot know what was written before, so no
    // token of an earlier allocation is honoured any more.
    let carol = c.allocate(data(MIB)).await.unwrap().into_inner();
    agent.kill9();
    agent.restart().expect("agent restarts");
    let mut ag = VdevAgentClient::new(lazy(&agent.url("grpc")));
    // Allocations made once the agent registered again are honoured (one
    // placed in the instant before it did is refused like Carol's: the
    // writer allocates again).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dave = match c.allocate(data(MIB)).await {
            Ok(r) => r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match write(&mut ag, &dave, 0xd5).await {
            Ok(()) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "{e}");
                let r = reason(&e);
                assert!(
                    r == "WRITE_TOKEN_BEFORE_AGENT_START" || e.code() == Code::Unavailable,
                    "{e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let e = write(&mut ag, &carol, 0xc4)
        .await
        .expect_err("a token from before the agent restarted");
    assert_eq!(reason(&e), "WRITE_TOKEN_BEFORE_AGENT_START", "{e}");
}

async fn read(
    agent: &mut VdevAgentClient<Channel>,
    e: &pb::Extent,
    token: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    agent
        .read(pb::ReadRequest {
            offset: e.offset,
            size: e.size,
            token,
        })
        .await
        .map(|r| r.into_inner().data.to_vec())
}

async fn read_token(
    c: &mut AllocatorClient<Channel>,
    e: &pb::Extent,
) -> Result<Vec<u8>, tonic::Status> {
    c.read_tokens(pb::ReadTokensRequest { extents: vec![*e] })
        .await
        .map(|r| r.into_inner().tokens.remove(0))
}

/// A refusal of ReadTokens: FAILED_PRECONDITION with `want` as reason.
fn refused_grant(r: Result<Vec<u8>, tonic::Status>, want: &str, what: &str) {
    let e = r.expect_err(what);
    assert_eq!(e.code(), Code::FailedPrecondition, "{what}: {e}");
    assert_eq!(reason(&e), want, "{what}: {e}");
    assert!(e.message().contains("no read token"), "{what}: {e}");
}

/// Read tokens are granted only for exactly committed blocks, and die with
/// their block: Alice's kept read token is refused once her block was freed
/// and Bob wrote his block over the space; free, never-allocated, in-flight
/// and partial extents get no token; a read without a token is told so in
/// words about reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_token_is_only_for_a_committed_block_and_dies_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = FilePool::start_with_write_tokens(
        dir.path(),
        "reads",
        &args!["--report-interval", "100ms", "--zfs-txg-timeout", "100ms",],
    );
    let url = pool.url.clone();
    pool.add_file_agent("d0", &dir.path().join("d0.img"), "64MiB", &[]);
    let agent = &mut pool.agents[0];
    let mut c = AllocatorClient::new(lazy(&url));
    let mut ag = VdevAgentClient::new(lazy(&agent.url("grpc")));

    let deadline = Instant::now() + Duration::from_secs(30);
    let alice = loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let ae = alice.extents[0];
    // In flight, not committed: no read token.
    refused_grant(
        read_token(&mut c, &ae).await,
        "READ_TOKEN_NOT_COMMITTED",
        "a read token of an allocation in flight",
    );
    while let Err(e) = write(&mut ag, &alice, 0xa1).await {
        assert_eq!(e.code(), Code::Unavailable, "alice writes: {e}");
        assert!(Instant::now() < deadline, "{e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.commit(pb::CommitRequest {
        allocation_ids: vec![alice.allocation_id],
        wait_synced: true,
        generation: alice.generation,
    })
    .await
    .unwrap();

    // A read without a token is told about reads.
    let e = read(&mut ag, &ae, Vec::new())
        .await
        .expect_err("a read without a token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    assert_eq!(reason(&e), "READ_TOKEN_MISSING", "{e}");
    assert!(
        e.message().starts_with("read without a token") && !e.message().contains("write"),
        "{e}"
    );
    // Space nobody ever allocated, and part of Alice's block: no token.
    let never = pb::Extent {
        vdev: ae.vdev,
        offset: if ae.offset + 9 * MIB <= 64 * MIB {
            ae.offset + 8 * MIB
        } else {
            ae.offset - 8 * MIB
        },
        size: MIB,
    };
    refused_grant(
        read_token(&mut c, &never).await,
        "READ_TOKEN_NOT_COMMITTED",
        "a read token of never-allocated space",
    );
    let part = pb::Extent {
        size: ae.size / 2,
        ..ae
    };
    refused_grant(
        read_token(&mut c, &part).await,
        "READ_TOKEN_NOT_EXACT",
        "a read token of half a block",
    );

    // Alice's own block: granted, and it reads.
    let alice_token = read_token(&mut c, &ae).await.expect("alice's read token");
    let back = read(&mut ag, &ae, alice_token.clone())
        .await
        .expect("alice reads her block");
    assert!(back.iter().all(|&b| b == 0xa1), "alice's block");

    // Freed (its txg not synced yet, and then synced): no token any more.
    c.free(pb::FreeRequest { extents: vec![ae] }).await.unwrap();
    refused_grant(
        read_token(&mut c, &ae).await,
        "READ_TOKEN_NOT_COMMITTED",
        "a read token of a block just freed",
    );
    sync(&mut c, alice.generation).await;
    refused_grant(
        read_token(&mut c, &ae).await,
        "READ_TOKEN_NOT_COMMITTED",
        "a read token of freed space",
    );

    // Bob is given (part of) Alice's old space, writes and commits.
    let mut held = Vec::new();
    let bob = loop {
        let r = c.allocate(data(MIB)).await.unwrap().into_inner();
        if overlaps(&r.extents[0], &ae) {
            break r;
        }
        held.push(r.allocation_id);
        assert!(held.len() < 64, "alice's space never came back");
    };
    write(&mut ag, &bob, 0xb2).await.expect("bob writes");
    c.commit(pb::CommitRequest {
        allocation_ids: vec![bob.allocation_id],
        wait_synced: true,
        generation: bob.generation,
    })
    .await
    .unwrap();

    // Alice's kept read token no longer reads: her block is gone.
    let e = read(&mut ag, &ae, alice_token)
        .await
        .expect_err("alice's read token after her block was freed and bob wrote there");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert_eq!(reason(&e), "READ_TOKEN_SUPERSEDED", "{e}");
    assert!(e.message().starts_with("read token is superseded"), "{e}");
    // Bob's own token reads his block.
    let be = bob.extents[0];
    let t = read_token(&mut c, &be).await.expect("bob's read token");
    let back = read(&mut ag, &be, t).await.expect("bob reads");
    assert!(back.iter().all(|&b| b == 0xb2), "bob's block intact");
}
