//! CopyFrom over real mutual TLS: the allocator's certificate asks the agent
//! to copy a block from an agent (here itself, over the network, with its
//! own agent certificate, as it would from another) under a read token for
//! the source and a write token for the destination. The bytes arrive, the
//! answer carries their Fletcher-4; a write token of another range, a bad
//! read token, and callers of other roles are refused.

mod common;

use aliquot_agent::copy::Fletcher4;
use aliquot_auth::{Role, WriteGrant};
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{CopyFromRequest, ReadRequest, WriteRequest};
use common::{EXTENT, GENERATION, POOL, SIZE, TlsAgent, VDEV, grant_of};
use tonic::Code;
use tonic_types::StatusExt;

const TO: u64 = 8 << 20;

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

fn at(offset: u64, allocation_id: u64) -> WriteGrant {
    WriteGrant {
        offset,
        ..grant_of(allocation_id)
    }
}

#[tokio::test]
async fn copy_from_moves_a_block_under_the_allocators_tokens() {
    let t = TlsAgent::start(&[(Role::Allocator, "alloc"), (Role::Client, "c0")]).await;
    let (agent, signer) = (&t.agent, &t.signer);
    agent.set_vdev(VDEV);
    agent.gate().learn_pool(POOL, GENERATION);
    let mut client = VdevAgentClient::new(t.channel(Role::Client, "c0").await);
    let data: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
    client
        .write(WriteRequest {
            offset: EXTENT,
            data: data.clone().into(),
            token: signer.sign(&grant_of(17)),
        })
        .await
        .unwrap();
    let source = format!("https://127.0.0.1:{}", t.port);
    let copy = |token: Vec<u8>, source_token: Vec<u8>| CopyFromRequest {
        source_endpoint: source.clone(),
        source_offset: EXTENT,
        source_token,
        offset: TO,
        size: SIZE,
        token,
    };
    let read_token = signer.sign_read(&at(EXTENT, 100));
    let mut alloc = VdevAgentClient::new(t.channel(Role::Allocator, "alloc").await);

    // A write token of another range: refused before anything is read.
    let e = alloc
        .copy_from(copy(signer.sign(&at(TO + SIZE, 200)), read_token.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A read token of another extent: the source refuses it.
    let e = alloc
        .copy_from(copy(
            signer.sign(&at(TO, 200)),
            signer.sign_read(&at(TO, 100)),
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "COPY_SOURCE", "{e:?}");
    // Neither a client nor an agent certificate may ask for a copy, and
    // a client may not read as a copy does.
    let e = client
        .copy_from(copy(signer.sign(&at(TO, 200)), read_token.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = client
        .read_for_copy(ReadRequest {
            offset: EXTENT,
            size: SIZE,
            token: read_token.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    let r = alloc
        .copy_from(copy(signer.sign(&at(TO, 200)), read_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.bytes, SIZE);
    assert_eq!(r.fletcher4, Fletcher4::of(&data).to_bytes());
    let copied = client
        .read(ReadRequest {
            offset: TO,
            size: SIZE,
            token: signer.sign_read(&at(TO, 300)),
        })
        .await
        .unwrap()
        .into_inner()
        .data;
    assert!(copied == data, "the copy differs from the block");
}
