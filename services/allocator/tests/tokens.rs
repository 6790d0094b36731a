//! Write tokens in Allocate replies (unary and stream), over real gRPC: one
//! per extent, signed with the pool's token key, binding the extent, the
//! allocation, the generation and the lease deadline.

mod common;

use aliquot_auth::token::WriteCheck;
use aliquot_auth::{PoolCa, TokenError, TokenVerifier};
use aliquot_proto::v1 as pb;
use common::*;

#[tokio::test]
async fn allocate_replies_carry_verifiable_tokens() {
    let dir = tempfile::tempdir().unwrap();
    PoolCa::init(dir.path(), "tank").unwrap();
    let verifier = TokenVerifier::load(dir.path()).unwrap();
    let mut c = config();
    c.token_key = Some(dir.path().to_path_buf());
    let mut h = start(c).await;
    h.add_vdev(1, 4 * GIB).await;
    h.add_vdev(2, 4 * GIB).await;
    let pool_guid = h.server.shared.pool_guid;

    let mut req = data(256 << 10);
    req.copies = 2;
    let unary = h.alloc.allocate(req).await.unwrap().into_inner();
    let (tx, mut replies) = h.stream(1).await;
    tx.send(pb::StreamRequest {
        request_id: 1,
        op: Some(pb::stream_request::Op::Allocate(req)),
        ..Default::default()
    })
    .await
    .unwrap();
    let streamed = match replies.message().await.unwrap().unwrap().result {
        Some(pb::stream_reply::Result::Allocate(a)) => a,
        other => panic!("stream reply {other:?}"),
    };

    for reply in [unary, streamed] {
        assert_eq!(reply.tokens.len(), reply.extents.len());
        assert_eq!(reply.extents.len(), 2);
        for (e, t) in reply.extents.iter().zip(&reply.tokens) {
            let check = WriteCheck {
                pool_guid,
                vdev: e.vdev,
                known_generation: reply.generation,
                now_ms: reply.lease_deadline_ms - 1,
                offset: e.offset,
                len: e.size,
            };
            let g = verifier.verify(t, &check).unwrap();
            assert_eq!(g.allocation_id, reply.allocation_id);
            assert_eq!(g.expires_ms, reply.lease_deadline_ms);
            // Not a byte past the extent, not after the lease, not another vdev.
            let past = WriteCheck {
                len: e.size + 4096,
                ..check
            };
            assert!(matches!(
                verifier.verify(t, &past),
                Err(TokenError::OutOfRange { .. })
            ));
            let late = WriteCheck {
                now_ms: reply.lease_deadline_ms,
                ..check
            };
            assert!(matches!(
                verifier.verify(t, &late),
                Err(TokenError::Expired { .. })
            ));
        }
        // Each copy's token is for its own extent only.
        let other = &reply.extents[1];
        let cross = WriteCheck {
            pool_guid,
            vdev: other.vdev,
            known_generation: reply.generation,
            now_ms: reply.lease_deadline_ms - 1,
            offset: other.offset,
            len: 4096,
        };
        assert!(verifier.verify(&reply.tokens[0], &cross).is_err());
    }
}
