//! The allocator's refusals over real gRPC on loopback, as a client reads
//! them: code, an `ErrorReason` (domain `aliquot.v1`), the values in the
//! ErrorInfo metadata, a RetryInfo on exactly the ones the same call may get
//! past later; and the same error inside `AllocateStream` carrying the same
//! google.rpc.Status, details and all, as the unary call.

mod common;

use std::time::Duration;

use aliquot_proto::error::{DOMAIN, from_stream_error, metadata, reason, retry_after};
use aliquot_proto::v1 as pb;
use common::*;
use pb::ErrorReason;
use pb::stream_request::Op;
use tonic::Code;
use tonic_types::StatusExt;

/// Sends one op on a fresh AllocateStream and returns its error reply.
async fn stream_error(h: &mut Harness, op: Op) -> pb::StreamError {
    let (tx, mut replies) = h.stream(1).await;
    tx.send(pb::StreamRequest {
        request_id: 9,
        op: Some(op),
        ..Default::default()
    })
    .await
    .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await
        .expect("a reply")
        .unwrap()
        .unwrap();
    assert_eq!(r.request_id, 9);
    match r.result {
        Some(pb::stream_reply::Result::Error(e)) => e,
        other => panic!("not an error: {other:?}"),
    }
}

/// The unary status and the stream's say the same, to the last detail.
fn same_as_unary(unary: &tonic::Status, stream: pb::StreamError) {
    assert_eq!(stream.code, unary.code() as i32);
    assert_eq!(stream.reason, reason(unary).unwrap().as_str_name());
    let s = from_stream_error(stream);
    assert_eq!(s.code(), unary.code());
    assert_eq!(s.message(), unary.message());
    assert_eq!(reason(&s), reason(unary));
    assert_eq!(metadata(&s), metadata(unary));
    assert_eq!(retry_after(&s), retry_after(unary));
    assert_eq!(s.get_details_error_info().unwrap().domain, DOMAIN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_reason_values_and_retry_unary_and_streamed() {
    let mut h = start(config()).await;

    // No vdev yet: retry once agents are back, in about a report interval.
    let e = h.allocate(MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(reason(&e), Some(ErrorReason::VdevsOffline), "{e:?}");
    assert_eq!(metadata(&e)["vdevs"], "0", "{e:?}");
    assert_eq!(retry_after(&e), Some(Duration::from_secs(1)), "{e:?}");
    same_as_unary(&e, stream_error(&mut h, Op::Allocate(data(MIB))).await);

    let vdev = h.add_vdev(1, GIB).await;

    // An allocation never made: its id named, and no retry.
    let id = 4242;
    let commit = pb::CommitRequest {
        allocation_ids: vec![id],
        wait_synced: false,
        generation: h.pool().await.generation,
    };
    let e = h.alloc.commit(commit.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(reason(&e), Some(ErrorReason::UnknownAllocation), "{e:?}");
    assert_eq!(metadata(&e)["allocation_id"], id.to_string(), "{e:?}");
    assert_eq!(retry_after(&e), None, "{e:?}");
    same_as_unary(&e, stream_error(&mut h, Op::Commit(commit)).await);

    // The policy's own refusal (metaslab::Error): a free of free space.
    let free = pb::FreeRequest {
        extents: vec![pb::Extent {
            vdev,
            offset: 64 * MIB,
            size: 4096,
        }],
    };
    let e = h.alloc.free(free).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), Some(ErrorReason::NotAllocated), "{e:?}");
    assert!(!metadata(&e).is_empty(), "{e:?}");
    assert_eq!(retry_after(&e), None, "{e:?}");

    // A request out of range: INVALID_ARGUMENT, the same in the stream.
    let e = h.allocate(0).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(reason(&e), Some(ErrorReason::InvalidArgument), "{e:?}");
    assert_eq!(retry_after(&e), None, "{e:?}");
    same_as_unary(&e, stream_error(&mut h, Op::Allocate(data(0))).await);
}

/// A Commit repeated after its reply was missed (a client deadline passed
/// while the store was away) answers the first txg even when many txgs
/// synced since, as they do within a second once the store is back: it is
/// not refused as an unknown allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_repeated_after_many_txgs_synced_answers_its_first_txg() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let a = h.allocate(8192).await.unwrap();
    let commit = pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        wait_synced: true,
        generation: a.generation,
    };
    let first = h.alloc.commit(commit.clone()).await.unwrap().into_inner();
    assert!(first.synced);
    for _ in 0..8 {
        h.alloc
            .sync_txg(pb::SyncTxgRequest {
                txg: 0,
                generation: a.generation,
            })
            .await
            .unwrap();
    }
    assert!(h.pool().await.synced_txg >= first.txg + 8);
    let again = h.alloc.commit(commit).await.unwrap().into_inner();
    assert_eq!((again.txg, again.synced), (first.txg, true));
}
