//! The write path across real processes: `aliquot-allocator` and
//! `aliquot-agent` binaries on ephemeral loopback ports. A client allocates
//! at the allocator, writes to the agents the reply names, reads back,
//! commits; the policy's effects (deferred frees, perf bias, unavailable
//! vdevs, leases, refused input) are observed over gRPC.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

/// The allocator with its default timings, except that only the tests
/// close txgs, so deferral can be counted.
fn test_pool(dir: &Path, extra: &[&str]) -> FilePool {
    let mut a = args!["--zfs-txg-timeout", "600s"];
    a.extend(extra.iter().map(|s| s.to_string()));
    FilePool::start_with_default_timings(dir, &a)
}

fn strs(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

async fn client(p: &FilePool) -> AllocatorClient<Channel> {
    AllocatorClient::connect(p.url.clone())
        .await
        .expect("connect allocator")
}

async fn pool_status(c: &mut AllocatorClient<Channel>) -> pb::PoolStatus {
    c.get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner()
}

fn normal(s: &pb::PoolStatus) -> &pb::ClassStatus {
    s.classes
        .iter()
        .find(|c| c.name == "normal")
        .expect("normal class")
}

/// Wait until `n` vdevs are registered, healthy and allocatable.
async fn wait_vdevs(c: &mut AllocatorClient<Channel>, n: usize) -> pb::PoolStatus {
    let start = Instant::now();
    loop {
        let s = pool_status(c).await;
        let ready = normal(&s).groups.iter().filter(|g| g.allocatable).count();
        if ready >= n {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{n} vdevs never became allocatable: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn data(size: u64, copies: u32) -> pb::AllocateRequest {
    pb::AllocateRequest {
        class: pb::AllocationClass::Data as i32,
        size,
        copies,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    }
}

/// Agent clients by endpoint, connected on first use.
#[derive(Default)]
struct Agents(HashMap<String, VdevAgentClient<Channel>>);

impl Agents {
    async fn get(&mut self, endpoint: &str) -> VdevAgentClient<Channel> {
        if let Some(c) = self.0.get(endpoint) {
            return c.clone();
        }
        let c = VdevAgentClient::connect(endpoint.to_string())
            .await
            .expect("connect agent");
        self.0.insert(endpoint.to_string(), c.clone());
        c
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_write_read_commit_then_frees_wait_two_txgs() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = test_pool(dir.path(), &[]);
    pool.add_agent("1GiB");
    pool.add_agent("1GiB");
    let mut c = client(&pool).await;
    wait_vdevs(&mut c, 2).await;
    let mut agents = Agents::default();

    // Blocks of several sizes, two copies each: on two distinct vdevs.
    let mut written = Vec::new();
    for (i, size) in [4096u64, 65536, 128 << 10, MIB].into_iter().enumerate() {
        let a = c.allocate(data(size, 2)).await.unwrap().into_inner();
        assert_eq!(a.extents.len(), 2);
        assert_eq!(a.endpoints.len(), 2);
        assert_ne!(
            a.extents[0].vdev, a.extents[1].vdev,
            "copies on distinct vdevs"
        );
        let payload = pattern(i as u64 + 1, size as usize);
        for (e, ep) in a.extents.iter().zip(&a.endpoints) {
            assert!(e.size >= size);
            let mut buf = payload.clone();
            buf.resize(e.size as usize, 0);
            let w = agents
                .get(ep)
                .await
                .write(pb::WriteRequest {
                    offset: e.offset,
                    data: buf.into(),
                    ..Default::default()
                })
                .await
                .expect("write to agent")
                .into_inner();
            assert_eq!(w.bytes, e.size);
        }
        let commit = c
            .commit(pb::CommitRequest {
                allocation_ids: vec![a.allocation_id],
                wait_synced: true,
                generation: a.generation,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(commit.synced);
        written.push((a, payload));
    }
    // Read every copy back: intact.
    for (a, payload) in &written {
        for (e, ep) in a.extents.iter().zip(&a.endpoints) {
            let r = agents
                .get(ep)
                .await
                .read(pb::ReadRequest {
                    offset: e.offset,
                    size: e.size,
                    token: Default::default(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(&r.data[..payload.len()], &payload[..], "data at {e:?}");
        }
    }
    let s = pool_status(&mut c).await;
    assert_eq!(normal(&s).reserved, 0, "commits released the throttle");
    let alloc_before_free = normal(&s).alloc;

    // Free them all: the space stays allocated (deferred) until the txg of
    // the free and 2 more have synced.
    let extents: Vec<pb::Extent> = written
        .iter()
        .flat_map(|(a, _)| a.extents.clone())
        .collect();
    let freed: u64 = extents.iter().map(|e| e.size).sum();
    let f = c
        .free(pb::FreeRequest {
            extents: extents.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let sync = |txg| pb::SyncTxgRequest {
        txg,
        generation: f.generation,
    };
    c.sync_txg(sync(f.txg)).await.unwrap();
    assert_eq!(
        normal(&pool_status(&mut c).await).alloc,
        alloc_before_free,
        "deferred after 1 sync"
    );
    c.sync_txg(sync(0)).await.unwrap();
    assert_eq!(
        normal(&pool_status(&mut c).await).alloc,
        alloc_before_free,
        "deferred after 2 syncs"
    );
    c.sync_txg(sync(0)).await.unwrap();
    let after = normal(&pool_status(&mut c).await).alloc;
    assert_eq!(
        after,
        alloc_before_free - freed,
        "reusable after the deferral"
    );
    // Freed once means a second free is refused.
    let e = c
        .free(pb::FreeRequest {
            extents: vec![extents[0]],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
}

/// Bytes per vdev from a load of `clients` writers that together allocate,
/// write and commit `total` bytes in `block`s (a byte budget, not a time:
/// the same amount however loaded the machine is).
async fn load(
    c: &AllocatorClient<Channel>,
    clients: usize,
    block: u64,
    total: u64,
) -> HashMap<u32, u64> {
    let budget = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(total / block));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = c.clone();
        let budget = budget.clone();
        tasks.push(tokio::spawn(async move {
            let mut agents = Agents::default();
            let mut bytes: HashMap<u32, u64> = HashMap::new();
            let payload = vec![0xa5u8; block as usize];
            let take = || {
                budget
                    .fetch_update(
                        std::sync::atomic::Ordering::Relaxed,
                        std::sync::atomic::Ordering::Relaxed,
                        |n| n.checked_sub(1),
                    )
                    .is_ok()
            };
            while take() {
                let a = c.allocate(data(block, 1)).await.unwrap().into_inner();
                let e = a.extents[0];
                agents
                    .get(&a.endpoints[0])
                    .await
                    .write(pb::WriteRequest {
                        offset: e.offset,
                        data: payload.clone().into(),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                c.commit(pb::CommitRequest {
                    allocation_ids: vec![a.allocation_id],
                    wait_synced: false,
                    generation: a.generation,
                })
                .await
                .unwrap();
                *bytes.entry(e.vdev).or_default() += e.size;
            }
            bytes
        }));
    }
    let mut total: HashMap<u32, u64> = HashMap::new();
    for t in tasks {
        for (v, b) in t.await.unwrap() {
            *total.entry(v).or_default() += b;
        }
    }
    total
}

/// Busy as OpenZFS 2.4 decides it (`metaslab_class_rotate`): dirty data
/// above 45 % of `zfs_dirty_data_max` (here `--txg-dirty-max` 256 MiB, the
/// open and syncing txgs' bytes), nothing else. GetPool's `busy` says so
/// before and after each phase (the txg closes only at 256 MiB, the
/// timeout being 600 s), and the quotas keep equal vdevs even when not
/// busy and, busy or not, with `metaslab_perf_bias = 0`. (While busy with
/// `metaslab_perf_bias = 1` the 3x faster vdev took 0.44, 0.48 and 0.69 of
/// 64 MiB of 32 closed-loop writers in three runs: printed, not asserted,
/// as it is not steady.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_is_dirty_data_past_45_percent_and_quotas_keep_vdevs_even() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = test_pool(dir.path(), &["--txg-dirty-max", "256MiB"]);
    let sim = |bw| {
        [
            "--capacity",
            "16GiB",
            "--bandwidth",
            bw,
            "--latency",
            "200us",
        ]
    };
    pool.add_sim_agent("slow", 11, &strs(&sim("20MiB/s")));
    pool.add_sim_agent("fast", 12, &strs(&sim("60MiB/s")));
    let mut c = client(&pool).await;
    let s = wait_vdevs(&mut c, 2).await;
    let id = |name: &str| s.vdevs.iter().find(|v| v.name == name).unwrap().vdev;
    let (slow, fast) = (id("slow"), id("fast"));
    let share = |b: &HashMap<u32, u64>, what: &str| {
        let f = b.get(&fast).copied().unwrap_or(0);
        let sl = b.get(&slow).copied().unwrap_or(0);
        let share = f as f64 / (f + sl) as f64;
        println!(
            "{what}: fast {} MiB, slow {} MiB, fast share {share:.2}",
            f >> 20,
            sl >> 20
        );
        share
    };
    let busy_now = |s: &pb::PoolStatus| normal(s).busy;

    // Not busy: 64 MiB dirty at most, under 45 % of 256 MiB.
    assert!(!busy_now(&pool_status(&mut c).await));
    let calm = load(&c, 32, 256 << 10, 64 * MIB).await;
    assert!(!busy_now(&pool_status(&mut c).await), "64 MiB is not busy");
    let calm = share(&calm, "perf_bias=1, not busy");
    assert!(
        (0.4..=0.6).contains(&calm),
        "not busy, quotas keep equal vdevs even: {calm:.2}"
    );

    // Busy: commit blocks of the load's size (unwritten: only the dirty
    // bytes matter; a larger block would raise `alloc_io_size` and with it
    // every quota) until GetPool says busy, past 115.2 MiB.
    let mut filler = 0;
    while !busy_now(&pool_status(&mut c).await) {
        for _ in 0..8 {
            let a = c.allocate(data(256 << 10, 1)).await.unwrap().into_inner();
            c.commit(pb::CommitRequest {
                allocation_ids: vec![a.allocation_id],
                wait_synced: false,
                generation: a.generation,
            })
            .await
            .unwrap();
        }
        filler += 8;
        assert!(
            filler <= 1024,
            "not busy after {filler} x 256 KiB committed"
        );
    }
    // 64 MiB more stays under the 256 MiB that closes the txg.
    let busy = load(&c, 32, 256 << 10, 64 * MIB).await;
    assert!(
        busy_now(&pool_status(&mut c).await),
        "still busy: the txg did not close"
    );
    share(&busy, "perf_bias=1, busy");

    c.set_tunable(pb::SetTunableRequest {
        name: "metaslab_perf_bias".into(),
        value: "0".into(),
    })
    .await
    .unwrap();
    assert!(busy_now(&pool_status(&mut c).await));
    let even = load(&c, 32, 256 << 10, 64 * MIB).await;
    let even = share(&even, "perf_bias=0");
    assert!(
        (0.4..=0.6).contains(&even),
        "strict quotas keep equal vdevs even: {even:.2}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_is_unavailable_within_3s_and_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = test_pool(dir.path(), &[]);
    for (name, guid) in [("a", 21), ("b", 22), ("c", 23)] {
        pool.add_sim_agent(name, guid, &args!["--capacity", "4GiB"]);
    }
    let mut c = client(&pool).await;
    let s = wait_vdevs(&mut c, 3).await;
    let v = s.vdevs.iter().find(|x| x.name == "c").unwrap().vdev;
    let health = |s: &pb::PoolStatus| s.vdevs.iter().find(|x| x.vdev == v).unwrap().health;

    pool.agents[2].kill9();
    let killed = Instant::now();
    loop {
        if health(&pool_status(&mut c).await) == pb::VdevHealth::Unavailable as i32 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_millis(4500),
            "not unavailable after {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = killed.elapsed();
    println!("unavailable {took:?} after the kill");
    // Allocation continues on the others.
    // (Committed one by one: held allocations would fill the throttle.)
    for _ in 0..30 {
        let a = c.allocate(data(128 << 10, 2)).await.unwrap().into_inner();
        assert!(
            a.extents.iter().all(|e| e.vdev != v),
            "allocated on the dead vdev: {a:?}"
        );
        c.commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: a.generation,
        })
        .await
        .unwrap();
    }

    // Restarted on the same port with the same device guid: same vdev, back.
    pool.agents[2].restart().expect("restart agent");
    let start = Instant::now();
    loop {
        let s = pool_status(&mut c).await;
        if health(&s) == pb::VdevHealth::Healthy as i32 {
            assert_eq!(s.vdevs.len(), 3, "rejoined as the same vdev");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "did not rejoin: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut on_v = 0;
    for _ in 0..60 {
        let a = c.allocate(data(128 << 10, 1)).await.unwrap().into_inner();
        on_v += a.extents.iter().filter(|e| e.vdev == v).count();
        c.commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: a.generation,
        })
        .await
        .unwrap();
    }
    assert!(on_v > 0, "the rejoined vdev takes allocations again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncommitted_allocation_expires_at_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = test_pool(dir.path(), &["--lease", "700ms"]);
    pool.add_sim_agent("a", 31, &args!["--capacity", "2GiB"]);
    let mut c = client(&pool).await;
    let s0 = wait_vdevs(&mut c, 1).await;
    let base = normal(&s0).alloc;
    let a = c.allocate(data(MIB, 1)).await.unwrap().into_inner();
    let s1 = pool_status(&mut c).await;
    assert_eq!(normal(&s1).reserved, MIB);
    assert!(normal(&s1).alloc > base);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let s2 = pool_status(&mut c).await;
    assert_eq!(normal(&s2).reserved, 0, "throttle bytes returned");
    let e = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: false,
            generation: a.generation,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "lease expired: {e:?}");
    // The space is deferred like a free (a late writer may still land on
    // it), then returned after the deferral's syncs.
    for _ in 0..4 {
        c.sync_txg(pb::SyncTxgRequest::default()).await.unwrap();
    }
    assert_eq!(
        normal(&pool_status(&mut c).await).alloc,
        base,
        "space returned"
    );
}

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
async fn bad_input_gets_a_precise_status_and_leaves_the_pool_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = test_pool(dir.path(), &[]);
    pool.add_agent("1GiB");
    let mut c = client(&pool).await;
    wait_vdevs(&mut c, 1).await;
    let a = c.allocate(data(8192, 1)).await.unwrap().into_inner();
    c.commit(pb::CommitRequest {
        allocation_ids: vec![a.allocation_id],
        wait_synced: true,
        generation: a.generation,
    })
    .await
    .unwrap();
    let e0 = a.extents[0];
    c.free(pb::FreeRequest { extents: vec![e0] }).await.unwrap();
    c.sync_txg(pb::SyncTxgRequest {
        txg: 0,
        ..Default::default()
    })
    .await
    .unwrap();
    let before = pool_status(&mut c).await;
    let cap = before.vdevs[0].capacity;

    let check = |r: Result<(), tonic::Status>, code: Code, needle: &str| {
        let e = r.expect_err(needle);
        assert_eq!(e.code(), code, "{needle}: {e:?}");
        assert!(
            e.message().to_lowercase().contains(&needle.to_lowercase()),
            "{:?} should mention {needle:?}",
            e.message()
        );
    };
    let mut k = c.clone();
    check(
        k.allocate(data(0, 1)).await.map(|_| ()),
        Code::InvalidArgument,
        "at least 1 byte",
    );
    check(
        k.allocate(data(16 * MIB + 1, 1)).await.map(|_| ()),
        Code::InvalidArgument,
        "16 MiB",
    );
    check(
        k.allocate(data(4096, 4)).await.map(|_| ()),
        Code::InvalidArgument,
        "copies",
    );
    check(
        k.commit(pb::CommitRequest {
            allocation_ids: vec![424242],
            wait_synced: false,
            generation: before.generation,
        })
        .await
        .map(|_| ()),
        Code::NotFound,
        "424242",
    );
    check(
        k.free(pb::FreeRequest {
            extents: vec![pb::Extent { vdev: 9, ..e0 }],
        })
        .await
        .map(|_| ()),
        Code::NotFound,
        "vdev 9",
    );
    check(
        k.set_vdev_state(pb::SetVdevStateRequest {
            vdev: 9,
            online: false,
            drain: false,
        })
        .await
        .map(|_| ()),
        Code::NotFound,
        "vdev 9",
    );
    check(
        k.free(pb::FreeRequest { extents: vec![e0] })
            .await
            .map(|_| ()),
        Code::FailedPrecondition,
        "not allocated",
    );
    check(
        k.set_tunable(pb::SetTunableRequest {
            name: "metaslab_nonsense".into(),
            value: "1".into(),
        })
        .await
        .map(|_| ()),
        Code::NotFound,
        "metaslab_nonsense",
    );
    check(
        k.set_tunable(pb::SetTunableRequest {
            name: "metaslab_perf_bias".into(),
            value: "9".into(),
        })
        .await
        .map(|_| ()),
        Code::InvalidArgument,
        "metaslab_perf_bias",
    );
    // A write outside the agent's device is refused by the agent.
    let ep = &before.vdevs[0].endpoint;
    let mut agent = VdevAgentClient::connect(ep.clone()).await.unwrap();
    let w = agent
        .write(pb::WriteRequest {
            offset: cap,
            data: vec![0; 4096].into(),
            ..Default::default()
        })
        .await
        .map(|_| ());
    let e = w.expect_err("write past the end");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    let after = pool_status(&mut c).await;
    assert_eq!(
        shape(&before),
        shape(&after),
        "refused requests changed nothing"
    );
}
