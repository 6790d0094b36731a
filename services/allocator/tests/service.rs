//! The allocator in-process over real gRPC on port 0, with fake vdevs
//! registered through AgentRegistry.

mod common;

use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::MemStore;
use aliquot_proto::v1 as pb;
use common::*;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_requests_wait_fifo_without_blocking_others() {
    let mut h = start(config()).await;
    h.add_vdev(1, 4 * GIB).await;
    h.add_vdev(2, 4 * GIB).await;
    let held = h.fill_throttle(MIB).await;
    assert!(!held.is_empty());

    // Three waiters, queued in a known order.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..3u32 {
        let mut c = h.alloc.clone();
        let done = done_tx.clone();
        tokio::spawn(async move {
            let r = c.allocate(data(MIB)).await.unwrap().into_inner();
            done.send((i, r)).unwrap();
        });
        let want = i + 1;
        wait_waiting(&h.alloc, want).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        done_rx.try_recv().is_err(),
        "nobody may pass a full throttle"
    );

    // Not blocked meanwhile: a log allocation (never throttled), its commit,
    // and GetPool all answer at once.
    let log = tokio::time::timeout(
        Duration::from_secs(2),
        h.alloc.allocate(pb::AllocateRequest {
            class: pb::AllocationClass::Log as i32,
            size: 4096,
            copies: 1,
            lease_ms: 0,
            max_size: 0,
            affinity_key: None,
        }),
    )
    .await
    .expect("log allocation must not wait")
    .unwrap()
    .into_inner();
    assert_ne!(log.tier, pb::LogTier::Unspecified as i32);
    h.commit(vec![log.allocation_id]).await.unwrap();

    // Commit the held allocations one at a time: the waiters come out in
    // the order they arrived.
    let mut order = Vec::new();
    for id in held {
        h.commit(vec![id]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        while let Ok((i, r)) = done_rx.try_recv() {
            assert!(
                r.throttle_wait_us >= 200_000,
                "waited {} us",
                r.throttle_wait_us
            );
            order.push(i);
        }
        if order.len() == 3 {
            break;
        }
    }
    while order.len() < 3 {
        let (i, _) = tokio::time::timeout(Duration::from_secs(5), done_rx.recv())
            .await
            .expect("all waiters admitted")
            .unwrap();
        order.push(i);
    }
    assert_eq!(order, vec![0, 1, 2], "FIFO wake-up");
    assert_eq!(h.normal().await.waiting, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_goes_away_is_cancelled() {
    let mut h = start(config()).await;
    h.add_vdev(1, 4 * GIB).await;
    let held = h.fill_throttle(MIB).await;
    let mut c = h.alloc.clone();
    let waiter = tokio::spawn(async move { c.allocate(data(MIB)).await });
    let mut p = h.alloc.clone();
    eventually("queued", Duration::from_secs(5), || {
        let mut p = p.clone();
        async move {
            let s = p
                .get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner();
            s.classes[0].waiting == 1
                || s.classes
                    .iter()
                    .any(|c| c.name == "normal" && c.waiting == 1)
        }
    })
    .await;
    waiter.abort();
    eventually("cancelled", Duration::from_secs(5), || {
        let mut p = p.clone();
        async move {
            let s = p
                .get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner();
            s.classes
                .iter()
                .any(|c| c.name == "normal" && c.waiting == 0 && c.waiting_bytes == 0)
        }
    })
    .await;
    let _ = &mut p;
    // Its bytes were never reserved: committing the held ones empties it.
    h.commit(held).await.unwrap();
    let n = h.normal().await;
    assert_eq!(n.reserved, 0);
    assert_eq!(n.waiting, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncommitted_allocation_expires_at_its_lease() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let before = h.normal().await;
    let a = h
        .alloc
        .allocate(pb::AllocateRequest {
            lease_ms: 300,
            ..data(MIB)
        })
        .await
        .unwrap()
        .into_inner();
    let during = h.normal().await;
    assert!(
        during.alloc > before.alloc,
        "placed space counts as allocated"
    );
    assert_eq!(during.reserved, MIB);
    assert_eq!(during.groups[0].queue_depth, MIB);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        h.normal().await.reserved > 0,
        "not expired before its lease"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = h.normal().await;
    // The throttle bytes come back at once; the space is deferred like a
    // free, so a late writer cannot land on a block placed there meanwhile.
    assert_eq!(after.reserved, 0);
    assert_eq!(after.groups[0].queue_depth, 0);
    assert!(after.alloc > before.alloc, "expired space is deferred");
    let e = h.commit(vec![a.allocation_id]).await.unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert_eq!(reason(&e), "LEASE_EXPIRED", "{e:?}");
    assert!(
        e.message().contains(&a.allocation_id.to_string()),
        "{}",
        e.message()
    );
    // Never seen is another answer.
    let e = h.commit(vec![a.allocation_id + 1000]).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(reason(&e), "UNKNOWN_ALLOCATION", "{e:?}");
    for _ in 0..3 {
        h.sync().await;
    }
    assert_eq!(
        h.normal().await.alloc,
        before.alloc,
        "free after the deferral"
    );
}

fn reason(s: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_txg_and_commit_wait_synced() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let s0 = h.pool().await;
    assert!(s0.synced_txg < s0.open_txg);
    let open = s0.open_txg;
    // SyncTxg(0) closes the open txg and returns once it is persisted.
    let synced = h.sync().await;
    assert!(synced >= open);
    let s1 = h.pool().await;
    assert_eq!(s1.synced_txg, synced);
    assert!(s1.open_txg > open);
    // An old txg answers at once; one too far ahead is refused.
    // A txg names the generation it was seen in.
    let e = h
        .alloc
        .sync_txg(pb::SyncTxgRequest {
            txg: open,
            generation: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("generation is required"),
        "{}",
        e.message()
    );
    let again = h
        .alloc
        .sync_txg(pb::SyncTxgRequest {
            txg: open,
            generation: s1.generation,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.synced_txg, synced);
    let e = h
        .alloc
        .sync_txg(pb::SyncTxgRequest {
            txg: s1.open_txg + 100,
            generation: s1.generation,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("open txg"), "{}", e.message());
    // A future txg within the deferral window: synced up to it.
    let ahead = s1.open_txg + 1;
    let r = h
        .alloc
        .sync_txg(pb::SyncTxgRequest {
            txg: ahead,
            generation: s1.generation,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.synced_txg >= ahead);

    // Commit without waiting: not synced yet; with wait_synced: synced.
    let a = h.allocate(8192).await.unwrap();
    let c = h.commit(vec![a.allocation_id]).await.unwrap();
    assert!(!c.synced);
    assert_eq!(c.txg, h.pool().await.open_txg);
    let b = h.allocate(8192).await.unwrap();
    let c2 = h
        .alloc
        .commit(pb::CommitRequest {
            allocation_ids: vec![b.allocation_id],
            wait_synced: true,
            generation: b.generation,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(c2.synced);
    assert!(h.pool().await.synced_txg >= c2.txg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txgs_close_on_the_timer_and_the_timeout_is_a_tunable() {
    let mut c = config();
    c.zfs_txg_timeout = Duration::from_millis(100);
    let mut h = start(c).await;
    let t0 = h.pool().await.synced_txg;
    tokio::time::sleep(Duration::from_millis(450)).await;
    let t1 = h.pool().await.synced_txg;
    assert!(t1 >= t0 + 2, "{t0} -> {t1}");
    let r = h
        .alloc
        .set_tunable(pb::SetTunableRequest {
            name: "zfs_txg_timeout".into(),
            value: "600".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.value, "600");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let t2 = h.pool().await.synced_txg;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        h.pool().await.synced_txg,
        t2,
        "no txg closes on a 600 s timer"
    );
    let list = h
        .alloc
        .get_tunables(pb::GetTunablesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        list.tunables
            .iter()
            .any(|t| t.name == "zfs_txg_timeout" && t.value == "600")
    );
    assert!(list.tunables.iter().any(|t| t.name == "metaslab_aliquot"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_vdev_becomes_unavailable_and_comes_back() {
    let mut c = config();
    c.report_interval = Duration::from_millis(100);
    let mut h = start(c).await;
    let v0 = h.add_vdev(1, GIB).await;
    let v1 = h.add_vdev(2, GIB).await;
    let r0 = reporter(&h.registry, v0, GIB, Duration::from_millis(50));
    let r1 = reporter(&h.registry, v1, GIB, Duration::from_millis(50));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let health = |s: &pb::PoolStatus, v: u32| s.vdevs.iter().find(|x| x.vdev == v).unwrap().health;
    let s = h.pool().await;
    assert_eq!(health(&s, v0), pb::VdevHealth::Healthy as i32);
    assert_eq!(health(&s, v1), pb::VdevHealth::Healthy as i32);
    assert!(s.vdevs.iter().all(|v| v.last_report.is_some()));

    r1.abort();
    let mut p = h.alloc.clone();
    eventually("vdev 1 unavailable", Duration::from_secs(3), || {
        let mut p = p.clone();
        async move {
            let s = p
                .get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner();
            health(&s, v1) == pb::VdevHealth::Unavailable as i32
        }
    })
    .await;
    let _ = &mut p;
    // Allocation goes on, elsewhere only.
    // (Each is committed at once: held ones would fill the throttle.)
    for _ in 0..40 {
        let a = h.allocate(256 << 10).await.unwrap();
        assert!(a.extents.iter().all(|e| e.vdev == v0), "{:?}", a.extents);
        h.commit(vec![a.allocation_id]).await.unwrap();
    }

    let r1 = reporter(&h.registry, v1, GIB, Duration::from_millis(50));
    eventually("vdev 1 back", Duration::from_secs(3), || {
        let mut p = h.alloc.clone();
        async move {
            let s = p
                .get_pool(pb::GetPoolRequest {})
                .await
                .unwrap()
                .into_inner();
            health(&s, v1) == pb::VdevHealth::Healthy as i32
        }
    })
    .await;
    let mut on_v1 = 0;
    for _ in 0..80 {
        let a = h.allocate(256 << 10).await.unwrap();
        on_v1 += a.extents.iter().filter(|e| e.vdev == v1).count();
        h.commit(vec![a.allocation_id]).await.unwrap();
    }
    assert!(on_v1 > 0, "allocation uses vdev {v1} again");
    r0.abort();
    r1.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_replies_come_back_out_of_order_by_id() {
    let mut h = start(config()).await;
    h.add_vdev(1, 4 * GIB).await;
    let held = h.fill_throttle(MIB).await;
    let (tx, mut replies) = h.stream(16).await;
    use pb::stream_request::Op;
    tx.send(pb::StreamRequest {
        request_id: 1,
        op: Some(Op::Allocate(data(MIB))),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(pb::StreamRequest {
        request_id: 2,
        op: Some(Op::Allocate(pb::AllocateRequest {
            class: pb::AllocationClass::Log as i32,
            size: 4096,
            copies: 1,
            lease_ms: 0,
            max_size: 0,
            affinity_key: None,
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let r2 = replies.message().await.unwrap().unwrap();
    assert_eq!(
        r2.request_id, 2,
        "the throttled request 1 must not hold back 2"
    );
    let Some(pb::stream_reply::Result::Allocate(log)) = r2.result else {
        panic!("{r2:?}")
    };
    tx.send(pb::StreamRequest {
        request_id: 3,
        op: Some(Op::Commit(pb::CommitRequest {
            allocation_ids: vec![log.allocation_id],
            wait_synced: false,
            generation: log.generation,
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    // An error reply carries its id and leaves the stream open.
    tx.send(pb::StreamRequest {
        request_id: 4,
        op: Some(Op::Allocate(data(0))),
        ..Default::default()
    })
    .await
    .unwrap();
    let r3 = replies.message().await.unwrap().unwrap();
    assert_eq!(r3.request_id, 3);
    assert!(
        matches!(r3.result, Some(pb::stream_reply::Result::Commit(_))),
        "{r3:?}"
    );
    let r4 = replies.message().await.unwrap().unwrap();
    assert_eq!(r4.request_id, 4);
    let Some(pb::stream_reply::Result::Error(e)) = r4.result else {
        panic!("{r4:?}")
    };
    assert_eq!(e.code, Code::InvalidArgument as i32);
    // Only when the throttle drains does request 1 come back.
    h.commit(held).await.unwrap();
    let r1 = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(r1.request_id, 1);
    let Some(pb::stream_reply::Result::Allocate(a1)) = r1.result else {
        panic!("{r1:?}")
    };
    assert!(a1.throttle_wait_us > 0);
    tx.send(pb::StreamRequest {
        request_id: 5,
        op: Some(Op::Commit(pb::CommitRequest {
            allocation_ids: vec![a1.allocation_id],
            wait_synced: true,
            generation: a1.generation,
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let r5 = replies.message().await.unwrap().unwrap();
    assert_eq!(r5.request_id, 5);
    let Some(pb::stream_reply::Result::Commit(c)) = r5.result else {
        panic!("{r5:?}")
    };
    assert!(c.synced);
}

/// The parts of PoolStatus that must not move on a refused request.
type Shape = (u64, Vec<pb::ClassStatus>, Vec<(u32, u64, i32, bool)>);

fn shape(s: &pb::PoolStatus) -> Shape {
    (
        s.open_txg,
        s.classes.clone(),
        s.vdevs
            .iter()
            .map(|v| (v.vdev, v.alloc, v.health, v.online))
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_precise_status_and_changes_nothing() {
    let mut h = start(config()).await;
    let v = h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    // Something committed and synced to free twice.
    let a = h.allocate(8192).await.unwrap();
    h.commit(vec![a.allocation_id]).await.unwrap();
    h.sync().await;
    let ext = a.extents[0];
    h.alloc
        .free(pb::FreeRequest { extents: vec![ext] })
        .await
        .unwrap();
    h.sync().await;
    let before = h.pool().await;

    let mut c = h.alloc.clone();
    let expect = |r: Result<(), tonic::Status>, code: Code, needle: &str| {
        let e = r.expect_err(needle);
        assert_eq!(e.code(), code, "{needle}: {e:?}");
        assert!(
            e.message().to_lowercase().contains(&needle.to_lowercase()),
            "message {:?} should mention {needle:?}",
            e.message()
        );
    };
    let alloc = |r: pb::AllocateRequest| {
        let mut c = c.clone();
        async move { c.allocate(r).await.map(|_| ()) }
    };
    expect(
        alloc(data(0)).await,
        Code::InvalidArgument,
        "at least 1 byte",
    );
    expect(
        alloc(data(16 * MIB + 1)).await,
        Code::InvalidArgument,
        "16 MiB",
    );
    expect(
        alloc(pb::AllocateRequest {
            max_size: 8192,
            ..data(4096)
        })
        .await,
        Code::InvalidArgument,
        "intent-log blocks only",
    );
    expect(
        alloc(pb::AllocateRequest {
            class: pb::AllocationClass::Log as i32,
            max_size: 4096,
            ..data(8192)
        })
        .await,
        Code::InvalidArgument,
        "max_size at least size",
    );
    expect(
        alloc(pb::AllocateRequest {
            copies: 4,
            ..data(4096)
        })
        .await,
        Code::InvalidArgument,
        "not 4",
    );
    expect(
        alloc(pb::AllocateRequest {
            class: 9,
            ..data(4096)
        })
        .await,
        Code::InvalidArgument,
        "class 9",
    );
    // Commit names its generation: without it, refused.
    let commit = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: 0,
        })
        .await
        .map(|_| ());
    expect(commit, Code::InvalidArgument, "generation is required");
    let commit = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![987654],
            wait_synced: false,
            generation: before.generation,
        })
        .await
        .map(|_| ());
    expect(commit, Code::NotFound, "987654");
    let abort = c
        .abort(pb::AbortRequest {
            allocation_ids: vec![987654],
        })
        .await
        .map(|_| ());
    expect(abort, Code::NotFound, "987654");
    // One request names at most 4096 extents.
    let many = c
        .free(pb::FreeRequest {
            extents: (0..4097u64)
                .map(|k| pb::Extent {
                    vdev: 0,
                    offset: k << 20,
                    size: 4096,
                })
                .collect(),
        })
        .await
        .map(|_| ());
    expect(many, Code::InvalidArgument, "at most 4096");
    let free = |e: pb::Extent| {
        let mut c = c.clone();
        async move {
            c.free(pb::FreeRequest { extents: vec![e] })
                .await
                .map(|_| ())
        }
    };
    expect(
        free(pb::Extent { vdev: 77, ..ext }).await,
        Code::NotFound,
        "vdev 77",
    );
    expect(free(ext).await, Code::FailedPrecondition, "not allocated");
    expect(
        free(pb::Extent { offset: 100, ..ext }).await,
        Code::InvalidArgument,
        "aligned",
    );
    expect(
        free(pb::Extent {
            offset: 1 << 40,
            ..ext
        })
        .await,
        Code::InvalidArgument,
        "outside",
    );
    let tun = |n: &str, val: &str| {
        let mut c = c.clone();
        let r = pb::SetTunableRequest {
            name: n.into(),
            value: val.into(),
        };
        async move { c.set_tunable(r).await.map(|_| ()) }
    };
    expect(
        tun("no_such_tunable", "1").await,
        Code::NotFound,
        "no_such_tunable",
    );
    expect(
        tun("metaslab_perf_bias", "7").await,
        Code::InvalidArgument,
        "metaslab_perf_bias",
    );
    expect(
        tun("zfs_txg_timeout", "0").await,
        Code::InvalidArgument,
        "zfs_txg_timeout",
    );
    let st = c
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: 55,
            online: false,
            drain: false,
        })
        .await
        .map(|_| ());
    expect(st, Code::NotFound, "vdev 55");
    let claim = c
        .claim(pb::ClaimRequest {
            extents: vec![],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .map(|_| ());
    expect(claim, Code::InvalidArgument, "no extents");

    let after = h.pool().await;
    assert_eq!(shape(&before), shape(&after));
    assert!(after.vdevs.iter().any(|x| x.vdev == v));
    let _ = &mut c;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_block_may_ask_for_a_size_range() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let r = h
        .alloc
        .allocate(pb::AllocateRequest {
            class: pb::AllocationClass::Log as i32,
            max_size: 128 * 1024,
            ..data(4096)
        })
        .await
        .unwrap()
        .into_inner();
    // A fresh metaslab holds all of max_size in one segment.
    assert_eq!(r.extents.len(), 1);
    assert_eq!(r.extents[0].size, 128 * 1024, "{r:?}");
    assert_eq!(r.psize, 128 * 1024, "the reply says what the block holds");
}

/// Allocators over gRPC: with two allocators (one per CPU here), a
/// request's `affinity_key` picks the allocator its hash names, and a newly
/// activated vdev is the first allocator's rotor while the second starts on
/// the next (`metaslab_group_activate@zfs-2.4.0`): keys of the two
/// allocators start on different vdevs, and each keeps its vdev.
#[tokio::test]
async fn an_affinity_key_keeps_its_allocator() {
    let mut c = config();
    c.tunables = vec!["spa_cpus_per_allocator=1".into()];
    let mut h = start(c).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    h.sync().await;
    // The allocator of a key, as the pool computes it for 2 allocators.
    let mut model = metaslab::Pool::new(metaslab::Tunables::default());
    if model.set_cpus(8) != 2 || std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("one allocator on this machine: nothing to tell apart");
        return;
    }
    let key = |k: usize| (0u64..).find(|&key| model.allocator_for(key) == k).unwrap();
    let mut first = Vec::new();
    for k in [0, 1] {
        let mut vdevs = Vec::new();
        for _ in 0..4 {
            let r = h
                .alloc
                .allocate(pb::AllocateRequest {
                    affinity_key: Some(key(k)),
                    ..data(64 * 1024)
                })
                .await
                .unwrap()
                .into_inner();
            vdevs.push(r.extents[0].vdev);
        }
        assert!(
            vdevs.iter().all(|&v| v == vdevs[0]),
            "allocator {k}: {vdevs:?}"
        );
        first.push(vdevs[0]);
    }
    assert_ne!(
        first[0], first[1],
        "the two allocators start on different vdevs"
    );
}

#[tokio::test]
async fn frees_are_reusable_only_after_two_synced_txgs() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let base = h.normal().await.alloc;
    let a = h.allocate(MIB).await.unwrap();
    h.commit(vec![a.allocation_id]).await.unwrap();
    h.sync().await;
    assert_eq!(h.normal().await.alloc, base + MIB);
    h.alloc
        .free(pb::FreeRequest {
            extents: a.extents.clone(),
        })
        .await
        .unwrap();
    // Deferred frees still count as allocated until their deferral ends.
    h.sync().await;
    assert_eq!(h.normal().await.alloc, base + MIB);
    h.sync().await;
    h.sync().await;
    assert_eq!(h.normal().await.alloc, base);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_identity_and_endpoint_conflicts() {
    let mut h = start(config()).await;
    let v = h.add_vdev(1, GIB).await;
    let w = h.add_vdev(2, GIB).await;
    assert_ne!(v, w);
    // The same device again, from a new endpoint: same vdev, endpoint moved.
    let mut again = register_req(1, GIB);
    again.endpoint = "http://127.0.0.1:2/moved".into();
    let r = h.registry.register(again).await.unwrap().into_inner();
    assert_eq!(r.vdev, v);
    assert!(r.report_interval_ms > 0);
    let s = h.pool().await;
    assert_eq!(s.vdevs.len(), 2);
    assert_eq!(
        s.vdevs.iter().find(|x| x.vdev == v).unwrap().endpoint,
        "http://127.0.0.1:2/moved"
    );
    // A different device claiming a live vdev's endpoint is refused.
    let mut thief = register_req(3, GIB);
    thief.endpoint = "http://127.0.0.1:2/moved".into();
    let e = h.registry.register(thief).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains(&format!("vdev {v}")),
        "{}",
        e.message()
    );
    assert_eq!(h.pool().await.vdevs.len(), 2);
    // Growth reported at registration.
    let r = h
        .registry
        .register(register_req(2, 2 * GIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.vdev, w);
    let s = h.pool().await;
    assert!(s.vdevs.iter().find(|x| x.vdev == w).unwrap().capacity >= 2 * GIB - GIB / 4);
    // Allocations name the agent endpoint of each extent.
    let a = h.allocate(4096).await.unwrap();
    assert_eq!(a.endpoints.len(), a.extents.len());
    let eps: Vec<_> = s.vdevs.iter().map(|x| x.endpoint.clone()).collect();
    assert!(eps.contains(&a.endpoints[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_reloads_what_was_synced() {
    let store = Arc::new(MemStore::new());
    let mut h = start_with(config(), store.clone()).await;
    let v = h.add_vdev(1, GIB).await;
    let a = h.allocate(MIB).await.unwrap();
    h.alloc
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: true,
            generation: a.generation,
        })
        .await
        .unwrap();
    // Committed, not yet synced: the shutdown's last sync persists it.
    let b = h.allocate(MIB).await.unwrap();
    h.commit(vec![b.allocation_id]).await.unwrap();
    let before = h.pool().await;
    let synced = store.synced_txg();
    h.server.shutdown().await.unwrap();
    let mut h2 = start_with(config(), store.clone()).await;
    let s = h2.pool().await;
    assert_eq!(s.guid, before.guid);
    assert!(s.synced_txg >= synced);
    assert_eq!(s.vdevs.len(), 1);
    assert_eq!(s.vdevs[0].vdev, v);
    assert_eq!(s.vdevs[0].name, "fake1");
    // Both are durable (shutdown syncs the last txg); claiming them again
    // exactly succeeds, an overlapping claim names the conflict.
    let e0 = a.extents[0];
    h2.alloc
        .claim(pb::ClaimRequest {
            extents: vec![e0, b.extents[0]],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .unwrap();
    // Part allocated (a, b), part free beyond them.
    let overlap = pb::Extent {
        vdev: e0.vdev,
        offset: e0.offset + 4096,
        size: 64 * MIB,
    };
    let e = h2
        .alloc
        .claim(pb::ClaimRequest {
            extents: vec![overlap],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    // The same device registers again and gets its vdev id back.
    let r = h2
        .registry
        .register(register_req(1, GIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.vdev, v);
}

/// Over gRPC after a restart: a claim names its allocation per extent; an
/// extent claimed for one allocation is refused to another of the same
/// identity, the first one's retry is answered, an allocation older than
/// the previous generation is refused, and ids that do not match the
/// extents one for one are an invalid argument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_names_its_allocation() {
    let store = Arc::new(MemStore::new());
    let mut h = start_with(config(), store.clone()).await;
    let v = h.add_vdev(1, GIB).await;
    let a = h.allocate(MIB).await.unwrap();
    let b = h.allocate(MIB).await.unwrap();
    h.server.shutdown().await.unwrap();
    let h2 = start_with(config(), store.clone()).await;
    // Space of the old generation whose txg was lost: one extent, two
    // allocations of the old generation that (say) were both given it.
    let x = pb::Extent {
        vdev: v,
        offset: 512 * MIB,
        size: MIB,
    };
    let claim = |ids: Vec<u64>| {
        let mut c = h2.alloc.clone();
        async move {
            c.claim(pb::ClaimRequest {
                extents: vec![x],
                per_extent: true,
                allocation_ids: ids,
            })
            .await
        }
    };
    // Until the vdev's agent reports in this generation (naming which
    // allocation last wrote its older ranges), a claim naming an
    // allocation there waits for that report.
    let waiting = tokio::spawn(claim(vec![a.allocation_id]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a claim was answered before the report"
    );
    let r = h2
        .registry
        .clone()
        .register(register_req(1, GIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.vdev, v);
    let _rep = reporter(&h2.registry, v, GIB, Duration::from_millis(50));
    let first = waiting.await.unwrap().unwrap().into_inner();
    assert!(first.results[0].claimed, "{first:?}");
    let other = claim(vec![b.allocation_id]).await.unwrap().into_inner();
    assert!(!other.results[0].claimed, "{other:?}");
    assert_eq!(
        other.results[0].reason,
        pb::ErrorReason::ClaimConflict as i32
    );
    assert!(
        other.results[0].message.contains(&format!(
            "claimed in this generation for allocation {}",
            a.allocation_id
        )),
        "{other:?}"
    );
    let retry = claim(vec![a.allocation_id]).await.unwrap().into_inner();
    assert!(retry.results[0].claimed, "{retry:?}");
    // Older than the generation before this one.
    let old = (a.generation - 1) << 40 | 1;
    let y = pb::Extent {
        offset: 600 * MIB,
        ..x
    };
    let r = h2
        .alloc
        .clone()
        .claim(pb::ClaimRequest {
            extents: vec![y],
            per_extent: true,
            allocation_ids: vec![old],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!r.results[0].claimed, "{r:?}");
    assert!(
        r.results[0].message.contains("older than generation"),
        "{r:?}"
    );
    let e = h2
        .alloc
        .clone()
        .claim(pb::ClaimRequest {
            extents: vec![x, y],
            per_extent: true,
            allocation_ids: vec![a.allocation_id],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_streams_and_waiters_promptly() {
    let mut h = start(config()).await;
    let v = h.add_vdev(1, 4 * GIB).await;
    let rep = reporter(&h.registry, v, 4 * GIB, Duration::from_millis(50));
    let mut watch = h
        .alloc
        .watch_pool(pb::WatchPoolRequest { interval_ms: 20 })
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().is_some());
    let held = h.fill_throttle(MIB).await;
    assert!(!held.is_empty());
    let mut c = h.alloc.clone();
    let waiter = tokio::spawn(async move { c.allocate(data(MIB)).await });
    wait_waiting(&h.alloc, 1).await;
    tokio::time::timeout(Duration::from_secs(5), h.server.shutdown())
        .await
        .expect("shutdown is prompt with streams open")
        .unwrap();
    let e = waiter.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{}", e.message());
    // The watch stream ended rather than hanging.
    let end = tokio::time::timeout(Duration::from_secs(2), async {
        while let Ok(Some(_)) = watch.message().await {}
    })
    .await;
    assert!(end.is_ok());
    rep.abort();
}

/// A free names exactly one committed extent: a span over two clients'
/// blocks, or part of one, is refused (its space would be reused while the
/// other block is live), before and after the blocks' txg is persisted; the
/// exact frees then succeed and a repeated one answers the same txg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_names_exactly_one_committed_extent() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    // Two blocks side by side on the one vdev (the first fit in one metaslab).
    let a = h.allocate(64 * 1024).await.unwrap();
    let b = h.allocate(64 * 1024).await.unwrap();
    h.commit(vec![a.allocation_id, b.allocation_id])
        .await
        .unwrap();
    let (ea, eb) = (a.extents[0], b.extents[0]);
    let (lo, hi) = if ea.offset < eb.offset {
        (ea, eb)
    } else {
        (eb, ea)
    };
    let span = pb::Extent {
        vdev: lo.vdev,
        offset: lo.offset,
        size: hi.offset + hi.size - lo.offset,
    };
    let part = pb::Extent {
        size: lo.size / 2,
        ..lo
    };
    // Inside a block, not at its start: found by the block that starts
    // below it.
    let middle = pb::Extent {
        offset: lo.offset + lo.size / 2,
        size: lo.size / 4,
        ..lo
    };
    for round in ["not yet persisted", "persisted"] {
        // Alone, or after an exact one in the same request (checked as a
        // batch): the whole request is refused.
        for bad in [vec![span], vec![part], vec![middle], vec![hi, part]] {
            let e = h
                .alloc
                .free(pb::FreeRequest { extents: bad })
                .await
                .expect_err("an inexact free was accepted");
            assert_eq!(e.code(), Code::FailedPrecondition, "{round}: {e:?}");
            assert_eq!(reason(&e), "NOT_ALLOCATED", "{round}: {e:?}");
            assert!(
                e.message().contains("not exactly one committed extent"),
                "{e:?}"
            );
        }
        h.sync().await;
    }
    let before = h.normal().await.alloc;
    assert_eq!(
        before,
        ea.size + eb.size,
        "nothing was freed by the refusals"
    );
    let free = |x: pb::Extent| pb::FreeRequest { extents: vec![x] };
    let t1 = h
        .alloc
        .free(free(ea))
        .await
        .expect("exact free")
        .into_inner()
        .txg;
    let t2 = h
        .alloc
        .free(free(ea))
        .await
        .expect("repeated free")
        .into_inner()
        .txg;
    assert_eq!(t1, t2, "a repeated free answers its txg");
    h.alloc.free(free(eb)).await.expect("exact free");
}

/// PlanRebalance on a pool that gained an empty vdev: moves of committed
/// extents from the full vdevs to the new one, within 5 % of what is
/// allocated, lowering the score; refused while a vdev is offline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_rebalance_moves_toward_a_new_vdev_and_waits_for_a_whole_pool() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    // Committed one by one: the throttle admits only a few MiB in flight.
    for _ in 0..256 {
        let id = h.allocate(MIB).await.unwrap().allocation_id;
        h.commit(vec![id]).await.unwrap();
    }
    h.sync().await;
    let new = h.add_vdev(3, GIB).await;
    let req = pb::PlanRebalanceRequest {
        bytes_per_sec: 64 * MIB,
        ..Default::default()
    };
    let p = h
        .alloc
        .plan_rebalance(req)
        .await
        .expect("plan")
        .into_inner();
    let allocated = h.normal().await.alloc;
    assert_eq!(p.limit_bytes, allocated / 20, "5 % of allocated by default");
    assert!(!p.moves.is_empty() && p.bytes <= p.limit_bytes, "{p:?}");
    assert!(p.bytes + MIB > p.limit_bytes, "fills the bound: {p:?}");
    assert!(p.score_after < p.score_before, "{p:?}");
    assert_eq!(p.predicted_ms, p.bytes * 1000 / (64 * MIB));
    for m in &p.moves {
        let e = m.extent.unwrap();
        assert_eq!(m.to_vdev, new);
        assert_ne!(e.vdev, new);
        assert_eq!(e.size, MIB, "a committed block, whole");
    }
    let bad = pb::PlanRebalanceRequest {
        max_misplaced: 1.5,
        ..Default::default()
    };
    let e = h.alloc.plan_rebalance(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: new,
            online: false,
            drain: false,
        })
        .await
        .unwrap();
    let e = h
        .alloc
        .plan_rebalance(pb::PlanRebalanceRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), "POOL_DEGRADED", "{e:?}");
    assert!(e.message().contains(": offline"), "says why: {e:?}");
}

/// A drain plan: the drained vdev must be offline first; then everything on
/// it is planned to move to the others (all of it when the bound allows),
/// and nothing onto it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_plans_every_extent_off_an_offline_vdev() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    h.add_vdev(3, GIB).await;
    for _ in 0..96 {
        let id = h.allocate(MIB).await.unwrap().allocation_id;
        h.commit(vec![id]).await.unwrap();
    }
    h.sync().await;
    let on_a = h
        .pool()
        .await
        .vdevs
        .iter()
        .find(|v| v.vdev == a)
        .unwrap()
        .alloc;
    assert!(on_a > 0);
    let drain = |m| pb::PlanRebalanceRequest {
        max_misplaced: m,
        drain: vec![a],
        ..Default::default()
    };
    let e = h.alloc.plan_rebalance(drain(1.0)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "still allocatable: {e:?}");
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: false,
        })
        .await
        .unwrap();
    let p = h
        .alloc
        .plan_rebalance(drain(1.0))
        .await
        .unwrap()
        .into_inner();
    let off: u64 = p
        .moves
        .iter()
        .filter(|m| m.extent.unwrap().vdev == a)
        .map(|m| m.extent.unwrap().size)
        .sum();
    assert_eq!(off, on_a, "everything on the drained vdev: {p:?}");
    assert!(p.moves.iter().all(|m| m.to_vdev != a));
    // Bounded like any plan by default.
    let p = h
        .alloc
        .plan_rebalance(drain(0.0))
        .await
        .unwrap()
        .into_inner();
    assert!(p.bytes <= p.limit_bytes && p.bytes < on_a, "{p:?}");
}

/// Errors that say what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_true_cause() {
    let mut h = start(config()).await;
    // No vdevs at all: not "the pool is full".
    let e = h.allocate(4096).await.expect_err("no vdevs");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("no vdevs"), "{}", e.message());
    assert_eq!(reason(&e), "VDEVS_OFFLINE");

    // The largest capacity the refusal names is itself accepted.
    let e = h
        .registry
        .register(register_req(1, 1 << 57))
        .await
        .expect_err("2^57 bytes");
    assert_eq!(e.code(), Code::InvalidArgument);
    let named: u64 = e
        .message()
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .find(|&n: &u64| n != 1 << 57)
        .expect("the message names the largest capacity");
    assert_eq!(named, (1 << 57) - 1, "{}", e.message());
    h.registry
        .register(register_req(1, named))
        .await
        .expect("the named capacity registers");

    // A megabyte of tunable name: the error is about the name, short.
    let e = h
        .alloc
        .set_tunable(pb::SetTunableRequest {
            name: "x".repeat(1 << 20),
            value: "1".into(),
        })
        .await
        .expect_err("no such tunable");
    assert_eq!(e.code(), Code::NotFound, "{:?}", e.code());
    assert!(e.message().len() < 4096, "{} bytes", e.message().len());
}

/// A re-Register that changes the vdev's role is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reregister_cannot_change_the_role() {
    let mut h = start(config()).await;
    h.add_vdev(1, GIB).await;
    let e = h
        .registry
        .register(pb::RegisterRequest {
            log: true,
            ..register_req(1, GIB)
        })
        .await
        .expect_err("a normal vdev registering again as a log");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("role"), "{}", e.message());
    h.registry
        .register(register_req(1, GIB))
        .await
        .expect("the same registration again");
}

/// The last normal vdev taking allocations cannot go
/// offline (OpenZFS `vdev_passivate`), refused with its reason code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_allocating_vdev_stays_online() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    let e = h
        .alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: false,
        })
        .await
        .expect_err("offline of the only vdev");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), "LAST_ALLOCATING_VDEV", "{e:?}");
    let b = h.add_vdev(2, GIB).await;
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: false,
        })
        .await
        .expect("offline with another vdev taking allocations");
    let e = h
        .alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: b,
            online: false,
            drain: false,
        })
        .await
        .expect_err("offline of the last one left");
    assert_eq!(reason(&e), "LAST_ALLOCATING_VDEV", "{e:?}");
    h.allocate(4096).await.expect("still allocating");
}

/// `drain` asks for room for the whole vdev first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_without_room_is_refused() {
    let mut h = start(config()).await;
    let a = h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    for _ in 0..57 {
        let r = h.allocate(16 * MIB).await.expect("allocate");
        h.commit(vec![r.allocation_id]).await.unwrap();
    }
    let e = h
        .alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: true,
        })
        .await
        .expect_err("no room for the drained vdev");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), "NO_ROOM_TO_DRAIN", "{e:?}");
    // Plain offline (no drain) is not held to it, as OpenZFS's noalloc.
    h.alloc
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: a,
            online: false,
            drain: false,
        })
        .await
        .expect("offline");
}

/// `Written` (unary and on the stream) ends a block's throttle reservation
/// before its Commit: a waiter behind a full throttle is admitted though
/// nothing was committed, the space stays in flight until the Commit, and
/// a report of another generation, an unknown id, or none is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_blocks_give_back_their_reservation_before_the_commit() {
    let mut h = start(config()).await;
    h.add_vdev(1, 4 * GIB).await;
    h.add_vdev(2, 4 * GIB).await;
    let held = h.fill_throttle(MIB).await;
    let generation = h.pool().await.generation;
    let mut c = h.alloc.clone();
    let waiter = tokio::spawn(async move { c.allocate(data(MIB)).await });
    wait_waiting(&h.alloc, 1).await;

    // Refused: no ids, an unknown id, a generation not this one's.
    let written = |ids: Vec<u64>, generation: u64| pb::WrittenRequest {
        allocation_ids: ids,
        generation,
    };
    let e = h
        .alloc
        .written(written(vec![], generation))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = h
        .alloc
        .written(written(vec![u64::MAX], generation))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "UNKNOWN_ALLOCATION", "{e:?}");
    let e = h
        .alloc
        .written(written(vec![held[0]], 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(
        h.normal().await.waiting,
        1,
        "a refused report releases nothing"
    );

    // Half the held blocks reported over the stream, the rest unary: the
    // waiter gets in with nothing committed, and no reservation is left
    // once it too is reported.
    let half = held.len() / 2;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let mut replies = h
        .alloc
        .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(pb::StreamRequest {
        request_id: 7,
        op: Some(pb::stream_request::Op::Written(written(
            held[..half].to_vec(),
            generation,
        ))),
        ..Default::default()
    })
    .await
    .unwrap();
    let r = replies.message().await.unwrap().unwrap();
    assert_eq!(r.request_id, 7);
    assert!(
        matches!(r.result, Some(pb::stream_reply::Result::Written(_))),
        "{r:?}"
    );
    h.alloc
        .written(written(held[half..].to_vec(), generation))
        .await
        .unwrap();
    let w = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("admitted once the held blocks are written")
        .unwrap()
        .unwrap()
        .into_inner();
    // Repeating a report is a no-op.
    h.alloc
        .written(written(vec![held[0], w.allocation_id], generation))
        .await
        .unwrap();
    let n = h.normal().await;
    assert_eq!((n.reserved, n.waiting), (0, 0), "{n:?}");
    assert!(n.groups.iter().all(|g| g.queue_depth == 0), "{n:?}");
    // Still in flight: the commit makes them part of a txg, once.
    let mut all = held.clone();
    all.push(w.allocation_id);
    h.commit(all.clone()).await.unwrap();
    h.alloc.written(written(all, generation)).await.unwrap();
    let n = h.normal().await;
    assert_eq!(n.reserved, 0, "{n:?}");
}

/// The copies of a block whose commit's txg was lost with the allocator
/// are linked again by the claim that names their allocation, so a later
/// move keeps them apart as it would have before the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_links_a_blocks_copies_again() {
    use aliquot_allocator::store::Store;
    let store = Arc::new(MemStore::new());
    let mut h = start_with(config(), store.clone()).await;
    h.add_vdev(1, GIB).await;
    h.add_vdev(2, GIB).await;
    let a = h
        .alloc
        .allocate(pb::AllocateRequest {
            copies: 2,
            ..data(MIB)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.extents.len(), 2);
    h.server.shutdown().await.unwrap();
    let mut h2 = start_with(config(), store.clone()).await;
    h2.rejoin(1, GIB).await;
    h2.rejoin(2, GIB).await;
    let r = h2
        .alloc
        .claim(pb::ClaimRequest {
            extents: a.extents.clone(),
            per_extent: true,
            allocation_ids: vec![a.allocation_id; 2],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.results.iter().all(|x| x.claimed), "{r:?}");
    h2.sync().await;
    let (e0, e1) = (&a.extents[0], &a.extents[1]);
    assert_eq!(
        store.copies_of((e0.vdev, e0.offset)).await.unwrap(),
        vec![(e1.vdev, e1.offset)],
        "the claimed copies are one block's"
    );
    // Claimed without naming the allocation (id 0): nothing says they are
    // one block's, and nothing links them.
    let b = h2
        .alloc
        .allocate(pb::AllocateRequest {
            copies: 2,
            ..data(MIB)
        })
        .await
        .unwrap()
        .into_inner();
    h2.server.shutdown().await.unwrap();
    let mut h3 = start_with(config(), store.clone()).await;
    h3.rejoin(1, GIB).await;
    h3.rejoin(2, GIB).await;
    let r = h3
        .alloc
        .claim(pb::ClaimRequest {
            extents: b.extents.clone(),
            per_extent: true,
            allocation_ids: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.results.iter().all(|x| x.claimed), "{r:?}");
    h3.sync().await;
    let f = &b.extents[0];
    assert!(
        store
            .copies_of((f.vdev, f.offset))
            .await
            .unwrap()
            .is_empty()
    );
}
