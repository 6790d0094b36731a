//! An extent belongs to one client, once — across crashes,
//! restarts, slow clients and bad input. Real allocator processes on
//! 127.0.0.1 with their SQLite stores; vdevs are registered straight over
//! the AgentRegistry API (no data is written: these are allocator rules).

use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{Proc, args, bin, data_request as data, start_allocator};
use pb::agent_registry_client::AgentRegistryClient;
use pb::allocator_client::AllocatorClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const MIB: u64 = 1 << 20;

fn allocator(dir: &Path, extra: &[String]) -> Proc {
    start_allocator(
        dir,
        "allocator",
        &[
            ("--pool", "fence".into()),
            // Nothing syncs unless asked: the tests decide what is durable.
            ("--zfs-txg-timeout", "3600s".into()),
            // Registered vdevs stay alive without an agent reporting.
            ("--report-interval", "600s".into()),
        ],
        extra,
    )
}

async fn client(p: &Proc) -> AllocatorClient<Channel> {
    AllocatorClient::connect(p.url("grpc"))
        .await
        .expect("connect")
}

async fn registry(p: &Proc) -> AgentRegistryClient<Channel> {
    AgentRegistryClient::connect(p.url("grpc"))
        .await
        .expect("connect")
}

fn register_req(guid: u64, capacity: u64) -> pb::RegisterRequest {
    pb::RegisterRequest {
        endpoint: format!("http://127.0.0.1:{}", 1000 + guid % 50000),
        device_guid: guid,
        name: format!("dev{guid}"),
        capacity,
        ashift: 12,
        rotational: false,
        children: 1,
        parity: 0,
        log: false,
        backend: "sim".into(),
        ..Default::default()
    }
}

async fn register(p: &Proc, guid: u64, capacity: u64) -> pb::RegisterReply {
    registry(p)
        .await
        .register(register_req(guid, capacity))
        .await
        .expect("register")
        .into_inner()
}

/// A known device's agent back after an allocator restart: it registers
/// again and reports once. Until then the allocator places nothing on the
/// vdev (its agent may not know the new generation yet).
async fn rejoin(p: &Proc, guid: u64, capacity: u64) {
    let mut r = registry(p).await;
    let vdev = r
        .register(register_req(guid, capacity))
        .await
        .expect("register again")
        .into_inner()
        .vdev;
    let report = pb::AgentReport {
        vdev,
        capacity,
        health: pb::VdevHealth::Healthy as i32,
        ..Default::default()
    };
    r.report(tokio_stream::iter([report]))
        .await
        .expect("report")
        .into_inner()
        .message()
        .await
        .expect("ack")
        .expect("an ack");
}

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

fn overlaps(a: &pb::Extent, b: &pb::Extent) -> bool {
    a.vdev == b.vdev && a.offset < b.offset + b.size && b.offset < a.offset + a.size
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_allocator_on_a_locked_data_dir_exits_and_the_first_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let first = allocator(dir.path(), &[]);
    let started = Instant::now();
    let second = Proc::start(
        "second",
        &bin("aliquot-allocator"),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--pool",
            "fence",
            "--data-dir",
            dir.path().join("allocator").display()
        ],
        &[],
        &["grpc"],
        dir.path(),
    );
    let err = second.err().expect("the second allocator must not serve");
    let msg = err.to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "it exits at once"
    );
    assert!(
        msg.contains("in use by another allocator"),
        "names the reason: {msg}"
    );
    assert!(
        msg.contains(&format!("pid {}", first.pid().unwrap())),
        "names the holder: {msg}"
    );
    // The first one is untouched.
    let st = client(&first)
        .await
        .get_pool(pb::GetPoolRequest {})
        .await
        .expect("first still serves")
        .into_inner();
    assert_eq!(st.generation, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txg_lost_in_a_crash_is_not_reported_synced_and_claim_wins_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let extra = args!["--claim-window", "3s"];
    let mut alloc = allocator(dir.path(), &extra);
    register(&alloc, 7, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let a = c.allocate(data(MIB)).await.unwrap().into_inner();
    let g1 = a.generation;
    let committed = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: g1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!committed.synced);
    let txg = committed.txg;

    // kill -9 before the txg syncs, and restart on the same store.
    alloc.kill9();
    alloc.restart().expect("restart");
    let restarted = Instant::now();
    let mut c = client(&alloc).await;
    rejoin(&alloc, 7, 256 * MIB).await;
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.generation, g1 + 1, "a new generation at every start");
    assert!(st.claim_window_remaining_ms > 0, "the claim window is open");

    let e = c
        .sync_txg(pb::SyncTxgRequest {
            txg,
            generation: g1,
        })
        .await
        .expect_err("txg {txg} never synced in generation {g1}");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert_eq!(reason(&e), "ALLOCATOR_RESTARTED", "{e:?}");
    let info = e.get_details_error_info().unwrap();
    assert_eq!(info.metadata["txg"], txg.to_string());
    // A Commit of an id of the old generation says so too.
    let e = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: g1,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "ALLOCATOR_RESTARTED", "{e:?}");

    // Another client asks for space at once; it must wait for the window:
    // this test's agent (a bare report) cannot name what generation 1
    // wrote on its vdev, which therefore serves nothing until the window
    // ends.
    let mut other = c.clone();
    let waiter = tokio::spawn(async move {
        let r = other.allocate(data(MIB)).await.unwrap().into_inner();
        (r, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let claimed = c
        .claim(pb::ClaimRequest {
            extents: a.extents.clone(),
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect("claim inside the window")
        .into_inner();
    assert_eq!(claimed.generation, g1 + 1);
    let claimed_at = Instant::now();
    let (b, placed_at) = waiter.await.unwrap();
    assert!(
        placed_at > claimed_at,
        "nobody allocates before the window closes"
    );
    assert!(
        placed_at.duration_since(restarted) >= Duration::from_millis(2500),
        "allocate waited for the window"
    );
    assert!(
        !b.extents.iter().any(|x| overlaps(x, &a.extents[0])),
        "the claimed extent was not handed out again: {:?} vs {:?}",
        b.extents,
        a.extents
    );
    // The claim is durable in the new generation.
    let s = c
        .sync_txg(pb::SyncTxgRequest {
            txg: claimed.txg,
            generation: claimed.generation,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(s.synced_txg >= claimed.txg);
}

/// Two restarts: generation 1 loses txg T in a crash; generation 2 reuses
/// the number T for its own txg and syncs it; after the next restart a
/// client of generation 1 must still hear that ITS txg T is lost. (Checked
/// against the synced txg at the open of generation 3 alone, it would be
/// told T is durable while its block is in no store.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txg_lost_in_one_generation_stays_lost_after_a_later_one_reuses_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let mut alloc = allocator(dir.path(), &args!["--claim-window", "0s"]);
    register(&alloc, 11, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let commit = |a: &pb::AllocateReply| pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        wait_synced: false,
        generation: a.generation,
    };

    // Generation 1: commit in txg T, crash before it syncs.
    let a = c.allocate(data(MIB)).await.unwrap().into_inner();
    let g1 = a.generation;
    let t = c.commit(commit(&a)).await.unwrap().into_inner().txg;
    alloc.kill9();
    alloc.restart().expect("restart into generation 2");

    // Generation 2 reuses the number T for its own txg, and syncs it.
    let mut c = client(&alloc).await;
    rejoin(&alloc, 11, 256 * MIB).await;
    let b = c.allocate(data(MIB)).await.unwrap().into_inner();
    let g2 = b.generation;
    assert_eq!(g2, g1 + 1);
    let tb = c.commit(commit(&b)).await.unwrap().into_inner().txg;
    assert_eq!(tb, t, "txg numbers are reused after a crash");
    let synced = c
        .sync_txg(pb::SyncTxgRequest {
            txg: tb,
            generation: g2,
        })
        .await
        .unwrap()
        .into_inner()
        .synced_txg;
    assert!(synced >= t);
    alloc.kill9();
    alloc.restart().expect("restart into generation 3");

    let mut c = client(&alloc).await;
    let e = c
        .sync_txg(pb::SyncTxgRequest {
            txg: t,
            generation: g1,
        })
        .await
        .expect_err("generation 1's txg T never synced");
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert_eq!(reason(&e), "ALLOCATOR_RESTARTED", "{e:?}");
    // Generation 2's txg T did sync.
    let ok = c
        .sync_txg(pb::SyncTxgRequest {
            txg: t,
            generation: g2,
        })
        .await
        .expect("generation 2's txg T synced")
        .into_inner();
    assert!(ok.synced_txg >= t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_space_is_not_handed_out_while_a_late_writer_could_land() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &[]);
    register(&alloc, 9, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let slow = c
        .allocate(pb::AllocateRequest {
            lease_ms: 200,
            ..data(MIB)
        })
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Fill the pool: no new extent may overlap the expired one while no
    // txg synced (its late write could still land).
    let mut placed = 0;
    loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => {
                let r = r.into_inner();
                assert!(
                    !r.extents.iter().any(|x| overlaps(x, &slow.extents[0])),
                    "expired space reused at once: {:?}",
                    r.extents
                );
                c.commit(pb::CommitRequest {
                    allocation_ids: vec![r.allocation_id],
                    generation: r.generation,
                    ..Default::default()
                })
                .await
                .unwrap();
                placed += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                break;
            }
        }
    }
    assert!(placed > 50, "the pool filled ({placed} blocks)");
    let e = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![slow.allocation_id],
            generation: slow.generation,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);
    assert_eq!(reason(&e), "LEASE_EXPIRED", "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_commit_and_free_return_the_first_answer() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &[]);
    register(&alloc, 11, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let a = c.allocate(data(MIB)).await.unwrap().into_inner();
    let commit = pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        wait_synced: false,
        generation: a.generation,
    };
    let first = c.commit(commit.clone()).await.unwrap().into_inner();
    let again = c.commit(commit.clone()).await.unwrap().into_inner();
    assert_eq!(first.txg, again.txg, "a repeated commit answers its txg");
    c.sync_txg(pb::SyncTxgRequest {
        txg: first.txg,
        generation: a.generation,
    })
    .await
    .unwrap();
    let synced_again = c.commit(commit).await.unwrap().into_inner();
    assert_eq!(synced_again.txg, first.txg);
    assert!(synced_again.synced);

    let free = pb::FreeRequest {
        extents: a.extents.clone(),
    };
    let f1 = c.free(free.clone()).await.unwrap().into_inner();
    let f2 = c.free(free.clone()).await.unwrap().into_inner();
    assert_eq!(f1.txg, f2.txg, "a repeated free answers its txg");
    c.sync_txg(pb::SyncTxgRequest {
        txg: f1.txg,
        generation: f1.generation,
    })
    .await
    .unwrap();
    let e = c.free(free).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "after the sync: {e:?}");
    assert_eq!(reason(&e), "NOT_ALLOCATED");
    // A class left unset is refused, not taken for DATA.
    let e = c
        .allocate(pb::AllocateRequest {
            class: 0,
            ..data(MIB)
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_of_a_sub_range_or_a_span_across_extents_fails() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &[]);
    let v = register(&alloc, 13, 256 * MIB).await.vdev;
    let mut c = client(&alloc).await;
    let ext = |offset: u64, size: u64| pb::Extent {
        vdev: v,
        offset,
        size,
    };
    let k = 128 << 10;
    let (a, b) = (ext(0, k), ext(k, k));
    let r = c
        .claim(pb::ClaimRequest {
            extents: vec![a, b],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect("free space is claimed")
        .into_inner();
    // Before and after the sync (the store then holds them).
    for synced in [false, true] {
        if synced {
            c.sync_txg(pb::SyncTxgRequest {
                txg: r.txg,
                generation: r.generation,
            })
            .await
            .unwrap();
        }
        for bad in [ext(0, k / 2), ext(k / 2, k), ext(0, 2 * k)] {
            let e = c
                .claim(pb::ClaimRequest {
                    extents: vec![bad],
                    per_extent: false,
                    allocation_ids: Vec::new(),
                })
                .await
                .expect_err("a sub-range or span must fail");
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            assert_eq!(reason(&e), "CLAIM_CONFLICT", "{e:?}");
            assert!(e.message().contains("overlaps"), "{}", e.message());
        }
        // Exactly the extent: already theirs.
        c.claim(pb::ClaimRequest {
            extents: vec![b],
            per_extent: false,
            allocation_ids: Vec::new(),
        })
        .await
        .expect("exact claim of allocated space");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_registrations_and_reports_are_refused_and_the_store_still_opens() {
    let dir = tempfile::tempdir().unwrap();
    let mut alloc = allocator(dir.path(), &[]);
    let mut r = registry(&alloc).await;
    let bad = [
        pb::RegisterRequest {
            capacity: 1 << 63,
            ..register_req(21, 0)
        },
        pb::RegisterRequest {
            name: "x".repeat(70_000),
            ..register_req(22, 256 * MIB)
        },
        pb::RegisterRequest {
            name: "bad\nname".into(),
            ..register_req(23, 256 * MIB)
        },
        pb::RegisterRequest {
            ashift: 40,
            ..register_req(24, 256 * MIB)
        },
        pb::RegisterRequest {
            children: 3,
            parity: 3,
            ..register_req(25, 256 * MIB)
        },
    ];
    for req in bad {
        let e = r.register(req).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let good = register(&alloc, 26, 256 * MIB).await;
    // A report of 8x the capacity does not grow the vdev.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::AgentReport {
        vdev: good.vdev,
        capacity: 8 * 256 * MIB,
        health: pb::VdevHealth::Healthy as i32,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut acks = r
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let ack = acks.message().await.unwrap().expect("an ack");
    assert_eq!(ack.generation, good.generation);
    let mut c = client(&alloc).await;
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.vdevs.len(), 1, "only the good vdev: {:?}", st.vdevs);
    assert_eq!(
        st.vdevs[0].capacity,
        256 * MIB,
        "a report never grows a vdev"
    );
    drop(tx);
    c.sync_txg(pb::SyncTxgRequest::default()).await.unwrap();
    // The store opens again.
    alloc.kill9();
    alloc.restart().expect("the allocator starts on its store");
    let st = client(&alloc)
        .await
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.vdevs.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_bounded_and_renewable() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &args!["--max-lease", "2s", "--lease", "1s"]);
    register(&alloc, 31, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let e = c
        .allocate(pb::AllocateRequest {
            lease_ms: u32::MAX,
            ..data(MIB)
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max-lease"), "{}", e.message());
    let a = c
        .allocate(pb::AllocateRequest {
            lease_ms: 400,
            ..data(MIB)
        })
        .await
        .unwrap()
        .into_inner();
    // Renewed past its first deadline, it can still be committed.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        c.renew_lease(pb::RenewLeaseRequest {
            allocation_ids: vec![a.allocation_id],
            lease_ms: 400,
        })
        .await
        .expect("renew");
    }
    c.commit(pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        generation: a.generation,
        ..Default::default()
    })
    .await
    .expect("commit after renewals");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_blocks_on_a_full_pool_end_in_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &[]);
    register(&alloc, 41, 128 * MIB).await;
    let mut c = client(&alloc).await;
    let log = pb::AllocateRequest {
        class: pb::AllocationClass::Log as i32,
        size: MIB,
        copies: 1,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    };
    let mut n = 0;
    let e = loop {
        match c.allocate(log).await {
            Ok(r) => {
                let r = r.into_inner();
                c.commit(pb::CommitRequest {
                    allocation_ids: vec![r.allocation_id],
                    generation: r.generation,
                    ..Default::default()
                })
                .await
                .unwrap();
                n += 1;
                assert!(n < 1000, "the pool never filled");
            }
            Err(e) => break e,
        }
    };
    // Nothing is freed, so no txg sync can help: not "wait for txg N".
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        ["NO_SPACE", "FRAGMENTED"].contains(&reason(&e).as_str()),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_bricked_by_a_bad_vdev_row_is_named_and_repaired_without_sql() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let mut alloc = allocator(dir.path(), &[]);
    register(&alloc, 51, 256 * MIB).await;
    let mut c = client(&alloc).await;
    let a = c.allocate(data(MIB)).await.unwrap().into_inner();
    c.commit(pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        wait_synced: true,
        generation: a.generation,
    })
    .await
    .unwrap();
    alloc.kill();
    // What an older allocator let a Register(capacity = 2^62) store.
    let db = dir.path().join("allocator/pool.db");
    {
        let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
            .await
            .unwrap();
        sqlx::query("UPDATE vdevs SET capacity = ?, metaslab_shift = 46, metaslab_size = ?")
            .bind(1i64 << 62)
            .bind(1i64 << 46)
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
    }
    assert!(alloc.restart().is_err(), "the allocator refuses the store");
    let data_dir = dir.path().join("allocator");
    let out = integration_tests::ctl(&args!["verify", "--data-dir", data_dir.display()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vdev 0"), "the row is named: {err}");
    let out = integration_tests::ctl(&args![
        "verify",
        "--data-dir",
        data_dir.display(),
        "--repair-vdev",
        "0",
        "--capacity",
        "256MiB"
    ]);
    integration_tests::ok_stdout(&out, "verify --repair-vdev");
    alloc.restart().expect("the repaired pool opens");
    let st = client(&alloc)
        .await
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.vdevs[0].capacity, 256 * MIB);
    assert_eq!(st.vdevs[0].alloc, a.extents[0].size, "the block survived");
}

/// `aliquotctl vdev expand`: the explicit growth path (reports never grow a
/// vdev), through the real binary against a real allocator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliquotctl_vdev_expand_grows_a_vdev_and_refuses_shrinking() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = allocator(dir.path(), &[]);
    let vdev = register(&alloc, 31, 256 * MIB).await.vdev;
    // Its agent says the device now holds 1 GiB (a report never grows the
    // vdev; `vdev expand` may, up to that).
    let report = pb::AgentReport {
        vdev,
        capacity: 1024 * MIB,
        health: pb::VdevHealth::Healthy as i32,
        ..Default::default()
    };
    registry(&alloc)
        .await
        .report(tokio_stream::iter([report]))
        .await
        .expect("report")
        .into_inner()
        .message()
        .await
        .expect("ack")
        .expect("an ack");
    let ctl = |capacity: &str| {
        std::process::Command::new(bin("aliquotctl"))
            .env(integration_tests::INSECURE_ENV, "1")
            .args(["vdev", "--allocator", &alloc.url("grpc"), "expand"])
            .arg(vdev.to_string())
            .arg(capacity)
            .output()
            .expect("run aliquotctl")
    };
    let out = ctl("1GiB");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("is 1.00 GiB"), "{stdout}");
    let st = client(&alloc)
        .await
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.vdevs[0].capacity, 1024 * MIB);
    let out = ctl("2GiB");
    assert!(!out.status.success(), "growing past the device must fail");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("grow the device first"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl("128MiB");
    assert!(!out.status.success(), "shrinking must fail");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot shrink"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
