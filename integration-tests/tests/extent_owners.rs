//! Issue 25, item 3, across real processes over mutual TLS: a committed
//! extent belongs to the identity that committed it. Another client cannot
//! free it (PERMISSION_DENIED, reason NOT_OWNER) nor move it (Relocate is
//! an admin call) nor read it (read tokens go to the owner and admins);
//! its owner and admins can. Owners are persisted with the txg: the refusal holds
//! after the allocator is killed and restarted.

use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_auth::{PoolCa, Role, TlsFiles};
use aliquot_proto::v1 as pb;
use integration_tests::{Proc, args, bin, data_request as data, tls_args};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const MIB: u64 = 1 << 20;

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

fn channel(url: &str, certs: &Path, role: Role, name: &str, server: Role) -> Channel {
    let f = TlsFiles::in_dir(certs, role, name);
    Channel::from_shared(url.to_string())
        .unwrap()
        .tls_config(f.client_config(server).unwrap())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_or_an_admin_frees_or_moves_a_block() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let ca = PoolCa::init(&certs, "owners").unwrap();
    for (role, name) in [
        (Role::Allocator, "allocator"),
        (Role::Agent, "d0"),
        (Role::Client, "alice"),
        (Role::Client, "bob"),
        (Role::Admin, "op"),
    ] {
        ca.issue(role, name, &[]).unwrap();
    }
    let mut a = args![
        "--listen",
        "127.0.0.1:0",
        "--pool",
        "owners",
        "--data-dir",
        dir.path().join("allocator").display(),
        "--token-key",
        certs.display(),
        "--report-interval",
        "200ms",
        "--claim-window",
        "0s",
    ];
    a.extend(tls_args(&certs, Role::Allocator, "allocator"));
    let mut alloc = Proc::start(
        "allocator",
        &bin("aliquot-allocator"),
        &a,
        &[],
        &["grpc"],
        dir.path(),
    )
    .expect("allocator");
    let addr = alloc.addr("grpc");
    alloc.set_arg("--listen", &addr.to_string());
    let url = format!("https://127.0.0.1:{}", addr.port());
    let mut g = args![
        "--listen",
        "127.0.0.1:0",
        "--allocator",
        url,
        "--name",
        "d0",
        "--path",
        dir.path().join("d0.img").display(),
        "--capacity",
        "128MiB",
        "--token-key",
        certs.display(),
    ];
    g.extend(tls_args(&certs, Role::Agent, "d0"));
    let agent = Proc::start(
        "agent",
        &bin("aliquot-agent"),
        &g,
        &[],
        &["grpc"],
        dir.path(),
    )
    .expect("agent");
    let agent_url = format!("https://127.0.0.1:{}", agent.addr("grpc").port());

    let client = |name: &str, role: Role| {
        AllocatorClient::new(channel(&url, &certs, role, name, Role::Allocator))
    };
    let mut alice = client("alice", Role::Client);
    let mut bob = client("bob", Role::Client);
    let mut op = client("op", Role::Admin);
    let mut alice_agent = VdevAgentClient::new(channel(
        &agent_url,
        &certs,
        Role::Client,
        "alice",
        Role::Agent,
    ));

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
    let mut bob_agent = VdevAgentClient::new(channel(
        &agent_url,
        &certs,
        Role::Client,
        "bob",
        Role::Agent,
    ));
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
    alloc.kill9();
    alloc.restart().expect("restart");
    let mut bob = client("bob", Role::Client);
    let mut alice = client("alice", Role::Client);
    let mut op = {
        let _ = &mut op;
        client("op", Role::Admin)
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
