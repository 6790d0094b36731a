//! The agent's refusals over real mutual TLS on loopback, as a client reads
//! them: code, an `ErrorReason` of the proto (domain `aliquot.v1`), the
//! values involved in the ErrorInfo metadata, and a RetryInfo on exactly
//! the ones the same call may get past later. One call per family: the
//! agent's own state, write and read tokens, the write fence, the role
//! layer in front of it.

mod common;

use std::time::Duration;

use aliquot_auth::{Role, WriteGrant};
use aliquot_proto::error::{metadata, reason, retry_after};
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{AgentTunables, ErrorReason, ReadRequest};
use common::{EXTENT, GENERATION, POOL, SIZE, TlsAgent, VDEV, grant_of, now_ms, token_write};
use tonic::Code;

/// The refusal's code, reason and retry hint, and its metadata.
fn refused<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    want: ErrorReason,
    retry: Option<Duration>,
) -> std::collections::HashMap<String, String> {
    let e = r.expect_err("accepted");
    assert_eq!(e.code(), code, "{e:?}");
    assert_eq!(reason(&e), Some(want), "{e:?}");
    assert_eq!(retry_after(&e), retry, "{e:?}");
    metadata(&e)
}

#[tokio::test]
async fn every_refusal_family_carries_reason_values_and_retry() {
    let t = TlsAgent::start(&[(Role::Client, "c0")]).await;
    let (agent, signer) = (&t.agent, &t.signer);
    let mut client = VdevAgentClient::new(t.channel(Role::Client, "c0").await);

    // The agent's state: not registered yet, retry shortly.
    refused(
        client
            .write(token_write(EXTENT, 4096, signer.sign(&grant_of(17))))
            .await,
        Code::Unavailable,
        ErrorReason::AgentNotRegistered,
        Some(Duration::from_secs(1)),
    );
    agent.set_vdev(VDEV);
    agent.gate().learn_pool(POOL, GENERATION);

    // Write tokens: an expired one says when it expired.
    let expires_ms = now_ms() - 1;
    let m = refused(
        client
            .write(token_write(
                EXTENT,
                4096,
                signer.sign(&WriteGrant {
                    expires_ms,
                    ..grant_of(17)
                }),
            ))
            .await,
        Code::PermissionDenied,
        ErrorReason::WriteTokenExpired,
        None,
    );
    assert_eq!(m["expires_ms"], expires_ms.to_string(), "{m:?}");
    assert!(m["now_ms"].parse::<u64>().unwrap() > expires_ms, "{m:?}");
    let m = refused(
        client
            .write(token_write(EXTENT + SIZE, 4096, signer.sign(&grant_of(17))))
            .await,
        Code::PermissionDenied,
        ErrorReason::WriteTokenOutOfRange,
        None,
    );
    assert_eq!(m["offset"], (EXTENT + SIZE).to_string(), "{m:?}");
    assert_eq!(m["len"], "4096", "{m:?}");
    assert_eq!(m["token_offset"], EXTENT.to_string(), "{m:?}");
    assert_eq!(m["token_size"], SIZE.to_string(), "{m:?}");
    let m = refused(
        client.write(token_write(EXTENT, 4096, vec![])).await,
        Code::Unauthenticated,
        ErrorReason::WriteTokenMissing,
        None,
    );
    assert!(m.is_empty(), "{m:?}");

    // The fence: allocation 20 wrote the extent; 17's token is superseded,
    // and the refusal names both allocations and the bytes.
    client
        .write(token_write(EXTENT, 4096, signer.sign(&grant_of(20))))
        .await
        .unwrap();
    let m = refused(
        client
            .write(token_write(EXTENT, 4096, signer.sign(&grant_of(17))))
            .await,
        Code::PermissionDenied,
        ErrorReason::WriteTokenSuperseded,
        None,
    );
    assert_eq!(m["allocation_id"], "17", "{m:?}");
    assert_eq!(m["newer_allocation_id"], "20", "{m:?}");
    assert_eq!(m["offset"], EXTENT.to_string(), "{m:?}");

    // Read tokens: the same values, said of reads.
    let m = refused(
        client
            .read(ReadRequest {
                offset: EXTENT,
                size: 4096,
                token: signer.sign_read(&WriteGrant {
                    allocation_id: 100,
                    expires_ms,
                    ..grant_of(0)
                }),
            })
            .await,
        Code::PermissionDenied,
        ErrorReason::ReadTokenExpired,
        None,
    );
    assert_eq!(m["expires_ms"], expires_ms.to_string(), "{m:?}");

    // The role layer: a client may not set the agent's tunables.
    let m = refused(
        client.set_tunables(AgentTunables::default()).await,
        Code::PermissionDenied,
        ErrorReason::RoleNotAllowed,
        None,
    );
    assert_eq!(m["role"], "client", "{m:?}");
    assert_eq!(m["allowed"], "admin", "{m:?}");
    assert!(m["method"].ends_with("/SetTunables"), "{m:?}");

    t.stop().await;
}
