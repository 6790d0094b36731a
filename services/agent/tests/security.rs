//! The agent over real mutual TLS on loopback, with write tokens: writes
//! need a valid token for this pool, vdev, generation and range; reads need a
//! client certificate; the agent's tunables need an admin.

mod common;

use aliquot_auth::{Role, TokenSigner, WriteGrant};
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{AgentTunables, ReadRequest, WriteRequest};
use common::{EXTENT, GENERATION, POOL, SIZE, TlsAgent, VDEV, grant_of, now_ms, token_write};
use tonic::Code;

/// A read capability of the grant's extent, granted after the allocations
/// of these tests wrote (a read token carries the first allocation id not
/// yet given out when it was granted).
fn read_grant() -> WriteGrant {
    WriteGrant {
        allocation_id: 100,
        ..grant()
    }
}

fn grant() -> WriteGrant {
    grant_of(17)
}

#[tokio::test]
async fn tokens_and_roles_over_tls() {
    let t = TlsAgent::start(&[
        (Role::Agent, "a1"),
        (Role::Client, "c0"),
        (Role::Admin, "root"),
    ])
    .await;
    let (agent, signer) = (&t.agent, &t.signer);
    let mut client = VdevAgentClient::new(t.channel(Role::Client, "c0").await);
    let token = signer.sign(&grant());

    // Before registration the agent knows no pool or generation: no writes.
    let e = client
        .write(token_write(EXTENT, 4096, token.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");

    agent.set_vdev(VDEV);
    agent.gate().learn_pool(POOL, GENERATION);

    // A valid token: the whole extent, then read back.
    client
        .write(token_write(EXTENT, SIZE as usize, token.clone()))
        .await
        .unwrap();
    // Reads need a read capability: none, or a write token, is refused.
    let e = client
        .read(ReadRequest {
            offset: EXTENT,
            size: 4096,
            token: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = client
        .read(ReadRequest {
            offset: EXTENT,
            size: 4096,
            token: token.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::PermissionDenied,
        "a write token reads: {e:?}"
    );
    let back = client
        .read(ReadRequest {
            offset: EXTENT,
            size: 4096,
            token: signer.sign_read(&read_grant()),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&back.data[..], &[0x5a; 4096][..]);
    // A read token does not write.
    let e = client
        .write(token_write(EXTENT, 4096, signer.sign_read(&grant())))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::PermissionDenied,
        "a read token writes: {e:?}"
    );

    let refused = |r: Result<tonic::Response<_>, tonic::Status>, code: Code, reason: &str| {
        let e = r.expect_err("write accepted");
        assert_eq!(e.code(), code, "{e:?}");
        let info = tonic_types::StatusExt::get_error_details(&e)
            .error_info()
            .cloned()
            .expect("ErrorInfo");
        assert_eq!(info.reason, reason, "{e:?}");
    };
    // No token.
    refused(
        client.write(token_write(EXTENT, 4096, vec![])).await,
        Code::Unauthenticated,
        "WRITE_TOKEN_MISSING",
    );
    // Outside the token's range: past its end, and before it.
    refused(
        client
            .write(token_write(EXTENT + SIZE, 4096, token.clone()))
            .await,
        Code::PermissionDenied,
        "WRITE_TOKEN_OUT_OF_RANGE",
    );
    refused(
        client
            .write(token_write(EXTENT - 4096, 8192, token.clone()))
            .await,
        Code::PermissionDenied,
        "WRITE_TOKEN_OUT_OF_RANGE",
    );
    // Forged: signed by another key, or a widened extent.
    refused(
        client
            .write(token_write(
                EXTENT,
                4096,
                TokenSigner::generate().sign(&grant()),
            ))
            .await,
        Code::PermissionDenied,
        "WRITE_TOKEN_FORGED",
    );
    let mut widened = token.clone();
    widened[29..37].copy_from_slice(&(1u64 << 30).to_be_bytes());
    refused(
        client.write(token_write(EXTENT, 4096, widened)).await,
        Code::PermissionDenied,
        "WRITE_TOKEN_FORGED",
    );
    // Expired: the lease ended (the late writer).
    let late = signer.sign(&WriteGrant {
        expires_ms: now_ms() - 1,
        ..grant()
    });
    refused(
        client.write(token_write(EXTENT, 4096, late)).await,
        Code::PermissionDenied,
        "WRITE_TOKEN_EXPIRED",
    );
    // Another vdev's token.
    let other = signer.sign(&WriteGrant {
        vdev: VDEV + 1,
        ..grant()
    });
    refused(
        client.write(token_write(EXTENT, 4096, other)).await,
        Code::PermissionDenied,
        "WRITE_TOKEN_OTHER_VDEV",
    );
    // The allocator restarted (ReportAck carries generation 7): tokens of
    // generation 6 are refused, 7's accepted.
    agent.gate().learn_generation(GENERATION + 1);
    agent.gate().learn_generation(GENERATION); // never moves back
    refused(
        client.write(token_write(EXTENT, 4096, token.clone())).await,
        Code::PermissionDenied,
        "WRITE_TOKEN_OLD_GENERATION",
    );
    let fresh = signer.sign(&WriteGrant {
        generation: GENERATION + 1,
        ..grant()
    });
    client
        .write(token_write(EXTENT, 4096, fresh))
        .await
        .unwrap();

    // Roles: another agent cannot read; a client cannot set the tunables; an admin can.
    let mut other_agent = VdevAgentClient::new(t.channel(Role::Agent, "a1").await);
    let e = other_agent
        .read(ReadRequest {
            offset: EXTENT,
            size: 4096,
            token: signer.sign_read(&read_grant()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role client or admin"), "{e:?}");
    let e = client
        .set_tunables(AgentTunables::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role admin"), "{e:?}");
    let mut admin = VdevAgentClient::new(t.channel(Role::Admin, "root").await);
    admin.set_tunables(AgentTunables::default()).await.unwrap();

    // Plaintext to the TLS port gets nothing.
    let plain = async {
        VdevAgentClient::connect(format!("http://127.0.0.1:{}", t.port))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?
            .read(ReadRequest {
                offset: EXTENT,
                size: 4096,
                token: Default::default(),
            })
            .await
    };
    assert!(plain.await.is_err(), "plaintext read served");

    t.stop().await;
}

/// WriteBatch over real TLS: every write checked against its own token, one
/// refused write refuses the batch before anything is written, contiguous
/// writes of a batch merge into one device I/O, and the data reads back.
#[tokio::test]
async fn batch_writes_check_every_token() {
    use aliquot_proto::v1::WriteBatchRequest;
    let t = TlsAgent::start(&[(Role::Agent, "a1"), (Role::Client, "c0")]).await;
    let signer = &t.signer;
    t.agent.set_vdev(VDEV);
    t.agent.gate().learn_pool(POOL, GENERATION);
    let mut client = VdevAgentClient::new(t.channel(Role::Client, "c0").await);

    // Two extents, each with its own token.
    let second = EXTENT + 4 * SIZE;
    let ta = signer.sign(&grant());
    let tb = signer.sign(&WriteGrant {
        offset: second,
        allocation_id: 18,
        ..grant()
    });
    let fill = |offset: u64, len: usize, byte: u8, token: &Vec<u8>| WriteRequest {
        offset,
        data: vec![byte; len].into(),
        token: token.clone(),
    };
    let reader = client.clone();
    let read = |offset: u64, size: u64| {
        let mut c = reader.clone();
        let token = signer.sign_read(&WriteGrant {
            offset,
            size,
            ..read_grant()
        });
        async move {
            c.read(ReadRequest {
                offset,
                size,
                token,
            })
            .await
            .unwrap()
            .into_inner()
            .data
        }
    };

    let reply = client
        .write_batch(WriteBatchRequest {
            writes: vec![
                fill(EXTENT, 4096, 0x11, &ta),
                fill(EXTENT + 4096, 4096, 0x22, &ta),
                fill(second, 8192, 0x33, &tb),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    let bytes: Vec<u64> = reply.results.iter().map(|r| r.bytes).collect();
    assert_eq!(bytes, [4096, 4096, 8192]);
    // Queued together: the two contiguous writes went out as one device I/O.
    assert_eq!(reply.results[0].aggregated_ios, 2, "{reply:?}");
    assert_eq!(reply.results[1].aggregated_ios, 2, "{reply:?}");
    assert_eq!(reply.results[2].aggregated_ios, 1, "{reply:?}");
    assert_eq!(&read(EXTENT, 4096).await[..], &[0x11; 4096][..]);
    assert_eq!(&read(EXTENT + 4096, 4096).await[..], &[0x22; 4096][..]);
    assert_eq!(&read(second, 8192).await[..], &[0x33; 8192][..]);

    let refused = |r: Result<tonic::Response<_>, tonic::Status>, code: Code, reason: &str, at| {
        let e = r.expect_err("batch accepted");
        assert_eq!(e.code(), code, "{e:?}");
        assert!(
            e.message().contains(&format!("write {at} of the batch")),
            "{e:?}"
        );
        let info = tonic_types::StatusExt::get_error_details(&e)
            .error_info()
            .cloned()
            .expect("ErrorInfo");
        assert_eq!(info.reason, reason, "{e:?}");
    };
    // The second write uses the first extent's token on the second extent:
    // the whole batch is refused, and its valid first write is not written.
    refused(
        client
            .write_batch(WriteBatchRequest {
                writes: vec![fill(EXTENT, 4096, 0x44, &ta), fill(second, 4096, 0x44, &ta)],
            })
            .await,
        Code::PermissionDenied,
        "WRITE_TOKEN_OUT_OF_RANGE",
        1,
    );
    // A missing token last, after two valid writes.
    refused(
        client
            .write_batch(WriteBatchRequest {
                writes: vec![
                    fill(EXTENT, 4096, 0x55, &ta),
                    fill(second, 4096, 0x55, &tb),
                    fill(EXTENT + 8192, 4096, 0x55, &vec![]),
                ],
            })
            .await,
        Code::Unauthenticated,
        "WRITE_TOKEN_MISSING",
        2,
    );
    assert_eq!(&read(EXTENT, 4096).await[..], &[0x11; 4096][..]);
    assert_eq!(&read(second, 4096).await[..], &[0x33; 4096][..]);
    assert_eq!(&read(EXTENT + 8192, 4096).await[..], &[0u8; 4096][..]);

    // An unaligned write inside a valid token's range refuses the batch too.
    let e = client
        .write_batch(WriteBatchRequest {
            writes: vec![
                fill(EXTENT, 4096, 0x66, &ta),
                fill(EXTENT + 4096, 100, 0x66, &ta),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("write 1 of the batch"), "{e:?}");
    assert_eq!(&read(EXTENT, 4096).await[..], &[0x11; 4096][..]);
    // An empty batch is an error, not a no-op.
    let e = client
        .write_batch(WriteBatchRequest { writes: vec![] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Another agent may not write, batch or not (the role table).
    let mut other = VdevAgentClient::new(t.channel(Role::Agent, "a1").await);
    let e = other
        .write_batch(WriteBatchRequest {
            writes: vec![fill(EXTENT, 4096, 0x77, &ta)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(&read(EXTENT, 4096).await[..], &[0x11; 4096][..]);

    t.stop().await;
}
