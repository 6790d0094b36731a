//! Across real processes over mutual TLS: a committed
//! extent belongs to the identity that committed it. Another client cannot
//! free it (PERMISSION_DENIED, reason NOT_OWNER) nor move it (Relocate is
//! an admin call) nor read it (read tokens go to the owner and admins);
//! its owner and admins can. Owners are persisted with the txg: the refusal holds
//! after the allocator is killed and restarted.

use std::time::{Duration, Instant};

use aliquot_auth::Role;
use aliquot_proto::v1 as pb;
use integration_tests::data_request as data;
use integration_tests::secure_pool::{SecurePool, SecurePoolSpec};
use tonic::Code;
use tonic_types::StatusExt;

const MIB: u64 = 1 << 20;

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_or_an_admin_frees_or_moves_a_block() {
    let dir = tempfile::tempdir().unwrap();
    let mut sp = SecurePool::start(
        dir.path(),
        SecurePoolSpec {
            pool: "owners",
            agents: &[("d0", "128MiB")],
            callers: &[
                (Role::Client, "alice"),
                (Role::Client, "bob"),
                (Role::Admin, "op"),
            ],
            allocator_flags: &[],
        },
    )
    .await;
    let agent_url = sp.agent_url(0);
    let mut alice = sp.allocator(Role::Client, "alice");
    let mut bob = sp.allocator(Role::Client, "bob");
    let mut op = sp.allocator(Role::Admin, "op");
    let mut alice_agent = sp.agent(&agent_url, Role::Client, "alice");

    // Alice writes and commits two blocks.
    let mut mine = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while mine.len() < 2 {
        let r = match alice.allocate(data(MIB)).await {
            Ok(r) => r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let e = r.extents[0];
        let mut written = alice_agent
            .write(pb::WriteRequest {
                offset: e.offset,
                data: vec![0xa1; e.size as usize].into(),
                token: r.tokens[0].clone(),
            })
            .await;
        while let Err(s) = &written {
            // The agent may not have its registration reply yet.
            assert!(Instant::now() < deadline, "{s}");
            tokio::time::sleep(Duration::from_millis(50)).await;
            written = alice_agent
                .write(pb::WriteRequest {
                    offset: e.offset,
                    data: vec![0xa1; e.size as usize].into(),
                    token: r.tokens[0].clone(),
                })
                .await;
        }
        alice
            .commit(pb::CommitRequest {
                allocation_ids: vec![r.allocation_id],
                wait_synced: true,
                generation: r.generation,
            })
            .await
            .expect("alice commits");
        mine.push(e);
    }

    // Reads need a read token, issued to the owner (and admins) only.
    let e = bob
        .read_tokens(pb::ReadTokensRequest {
            extents: vec![mine[0]],
        })
        .await
        .expect_err("bob asks to read alice's block");
    assert_eq!(reason(&e), "NOT_OWNER", "{e}");
    let mut bob_agent = sp.agent(&agent_url, Role::Client, "bob");
    let e = bob_agent
        .read(pb::ReadRequest {
            offset: mine[0].offset,
            size: mine[0].size,
            token: Default::default(),
        })
        .await
        .expect_err("a read without a token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");
    let token = alice
        .read_tokens(pb::ReadTokensRequest {
            extents: vec![mine[0]],
        })
        .await
        .expect("alice's read token")
        .into_inner()
        .tokens
        .remove(0);
    let back = alice_agent
        .read(pb::ReadRequest {
            offset: mine[0].offset,
            size: mine[0].size,
            token,
        })
        .await
        .expect("alice reads her block")
        .into_inner()
        .data;
    assert!(back.iter().all(|&b| b == 0xa1));

    let refused = |r: Result<tonic::Response<pb::FreeReply>, tonic::Status>| {
        let e = r.expect_err("bob frees alice's block");
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        assert_eq!(reason(&e), "NOT_OWNER", "{e}");
        assert!(e.message().contains("client/alice"), "{e}");
    };
    refused(
        bob.free(pb::FreeRequest {
            extents: vec![mine[0]],
        })
        .await,
    );
    let e = bob
        .relocate(pb::RelocateRequest {
            extent: Some(mine[0]),
            ..Default::default()
        })
        .await
        .expect_err("bob moves alice's block");
    // Relocate is an admin call already (the mover runs as admin).
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");

    // A claim of exactly alice's block is not a no-op for bob: the bytes
    // are another client's (his own block was lost), so it is refused.
    let e = bob
        .claim(pb::ClaimRequest {
            extents: vec![mine[0]],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect_err("bob claims alice's block");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(reason(&e), "CLAIM_CONFLICT", "{e}");
    // An admin's claim is a claim too, not an override.
    let e = op
        .claim(pb::ClaimRequest {
            extents: vec![mine[1]],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect_err("an admin claims alice's block");
    assert_eq!(reason(&e), "CLAIM_CONFLICT", "{e}");
    // Alice's own claim of her block is refused too while it was committed
    // in this generation: a claim names a block of an older one, and the
    // allocator cannot tell this from a lost block of hers whose extent
    // this generation gave her again (two blocks "durable" on one extent).
    let e = alice
        .claim(pb::ClaimRequest {
            extents: vec![mine[0]],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect_err("alice claims a block committed in this generation");
    assert_eq!(reason(&e), "CLAIM_CONFLICT", "{e}");
    // Free space bob claims is his: alice cannot free it.
    let claimed = pb::Extent {
        vdev: mine[0].vdev,
        offset: 64 * MIB,
        size: MIB,
    };
    bob.claim(pb::ClaimRequest {
        extents: vec![claimed],
        per_extent: false,
        allocation_ids: Vec::new(),
    })
    .await
    .expect("bob claims free space");
    let e = alice
        .free(pb::FreeRequest {
            extents: vec![claimed],
        })
        .await
        .expect_err("alice frees bob's claimed block");
    assert_eq!(reason(&e), "NOT_OWNER", "{e}");

    // Owners are durable: after kill -9 and a restart, still refused.
    sp.alloc.kill9();
    sp.alloc.restart().expect("restart");
    let mut bob = sp.allocator(Role::Client, "bob");
    let mut alice = sp.allocator(Role::Client, "alice");
    let mut op = {
        let _ = &mut op;
        sp.allocator(Role::Admin, "op")
    };
    refused(
        bob.free(pb::FreeRequest {
            extents: vec![mine[0]],
        })
        .await,
    );
    let e = bob
        .claim(pb::ClaimRequest {
            extents: vec![mine[0]],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect_err("bob claims alice's block after the restart");
    assert_eq!(reason(&e), "CLAIM_CONFLICT", "{e}");
    // The owner frees her block; an admin frees any.
    alice
        .free(pb::FreeRequest {
            extents: vec![mine[0]],
        })
        .await
        .expect("alice frees her own block");
    op.free(pb::FreeRequest {
        extents: vec![mine[1]],
    })
    .await
    .expect("an admin frees any block");
}
