//! High availability across real processes and a real PostgreSQL server
//! (started by the test on a private port and data dir): two allocators share
//! one store; one leads, the other stands by answering NOT_LEADER. A leader
//! killed with -9 is replaced within its lease plus two seconds and nothing
//! durable is lost or handed out twice; a leader paused (SIGSTOP) past its
//! lease and woken after a takeover persists nothing, serves nothing, and its
//! write tokens are refused by the agents.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::pg_proxy::PgProxy;
use integration_tests::pool::file_device;
use integration_tests::postgres::Postgres;
use integration_tests::{
    Proc, Security, args, bin, data_request as data, lazy_channel as channel, signal, start_agent,
};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const LEASE: &str = "2s";
const LEASE_MS: u64 = 2000;
const AGENTS: usize = 2;

/// One test at a time: each runs a PostgreSQL server, two allocators and
/// two agents, and two of them assert takeover times that a machine running
/// six such pools at once on two cores could not keep.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

struct Ha {
    pg: Postgres,
    certs: std::path::PathBuf,
    allocators: Vec<Proc>,
    agents: Vec<Proc>,
}

impl Ha {
    fn start(dir: &Path) -> Ha {
        Ha::start_with_lease(dir, LEASE)
    }

    fn start_with_lease(dir: &Path, lease: &str) -> Ha {
        Ha::start_with(dir, lease, "500ms", "1s")
    }

    fn start_with(dir: &Path, lease: &str, claim_window: &str, txg_timeout: &str) -> Ha {
        let pg = Postgres::start();
        let url = pg.url();
        Ha::start_on(
            dir,
            lease,
            claim_window,
            txg_timeout,
            pg,
            [url.clone(), url],
        )
    }

    /// `start_with_lease` with each allocator's `--store` URL given (e.g.
    /// through a `PgProxy` of its own).
    fn start_on(
        dir: &Path,
        lease: &str,
        claim_window: &str,
        txg_timeout: &str,
        pg: Postgres,
        stores: [String; 2],
    ) -> Ha {
        let certs = dir.join("certs");
        aliquot_auth::PoolCa::init(&certs, "ha").unwrap();
        let mut ha = Ha {
            pg,
            certs,
            allocators: Vec::new(),
            agents: Vec::new(),
        };
        for (i, store) in stores.iter().enumerate() {
            let a = args![
                "--listen",
                "127.0.0.1:0",
                "--store",
                store,
                "--pool",
                "ha",
                "--leader-lease",
                lease,
                "--token-key",
                ha.certs.display(),
                "--report-interval",
                "200ms",
                "--claim-window",
                claim_window,
                "--zfs-txg-timeout",
                txg_timeout,
            ];
            let mut p = Proc::start(
                &format!("allocator{i}"),
                &bin("aliquot-allocator"),
                &a,
                &[],
                &["grpc"],
                dir,
            )
            .expect("start allocator");
            let addr = p.addr("grpc");
            p.set_arg("--listen", &addr.to_string());
            ha.allocators.push(p);
        }
        ha.start_agents(dir);
        ha
    }

    /// The file agents, given every allocator's URL.
    fn start_agents(&mut self, dir: &Path) {
        let list = self.urls().join(",");
        for i in 0..AGENTS {
            let name = format!("d{i}");
            let device = file_device(&dir.join(format!("{name}.img")), "256MiB");
            let p = start_agent(
                dir,
                Security::Tokens(&self.certs),
                &list,
                &name,
                &device,
                &[],
            );
            self.agents.push(p);
        }
    }

    fn urls(&self) -> Vec<String> {
        self.allocators.iter().map(|p| p.url("grpc")).collect()
    }

    /// The allocator that serves Allocate (with every vdev reported in),
    /// waiting up to `within`; returns its index and the time it took.
    async fn leader(&self, within: Duration) -> (usize, Duration) {
        let t0 = Instant::now();
        loop {
            for (i, url) in self.urls().iter().enumerate() {
                if self.allocators[i].pid().is_none() {
                    continue;
                }
                let mut c = AllocatorClient::new(channel(url));
                // A paused allocator never answers: probe briefly.
                let probe = tokio::time::timeout(
                    Duration::from_millis(300),
                    c.get_pool(pb::GetPoolRequest {}),
                );
                let Ok(Ok(st)) = probe.await else {
                    continue;
                };
                let st = st.into_inner();
                let ready = st.vdevs.len() == AGENTS
                    && st
                        .vdevs
                        .iter()
                        .all(|v| v.health == pb::VdevHealth::Healthy as i32);
                if !ready {
                    continue;
                }
                if let Ok(Ok(r)) =
                    tokio::time::timeout(Duration::from_millis(300), c.allocate(data(4096))).await
                {
                    let r = r.into_inner();
                    let _ = c
                        .abort(pb::AbortRequest {
                            allocation_ids: vec![r.allocation_id],
                        })
                        .await;
                    return (i, t0.elapsed());
                }
            }
            assert!(
                t0.elapsed() < within,
                "no allocator served Allocate within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Ha {
    /// `leader`, for an allocator other than `old` (which may still serve
    /// until its lease runs out); the time it took.
    async fn leader_besides(&self, old: usize, within: Duration) -> (usize, Duration) {
        let t0 = Instant::now();
        loop {
            let (i, _) = self.leader(within.saturating_sub(t0.elapsed())).await;
            if i != old {
                return (i, t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One durable block: allocated, written through its agent with its
/// token, committed and synced.
async fn write_durable(
    c: &mut AllocatorClient<Channel>,
    size: u64,
    seed: u8,
) -> Result<pb::Extent, tonic::Status> {
    write_block(c, size, seed, true).await
}

/// One block written through its agent and committed, synced or not.
async fn write_block(
    c: &mut AllocatorClient<Channel>,
    size: u64,
    seed: u8,
    synced: bool,
) -> Result<pb::Extent, tonic::Status> {
    let a = c.allocate(data(size)).await?.into_inner();
    let e = a.extents[0];
    let mut agent = VdevAgentClient::new(channel(&a.endpoints[0]));
    // An agent whose RegisterReply is still in flight answers UNAVAILABLE
    // (it does not know the pool's generation yet): retry briefly.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let w = agent
            .write(pb::WriteRequest {
                offset: e.offset,
                data: vec![seed; size as usize].into(),
                token: a.tokens[0].clone(),
            })
            .await;
        match w {
            Ok(_) => break,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => return Err(s),
        }
    }
    let r = c
        .commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: synced,
            generation: a.generation,
        })
        .await?
        .into_inner();
    assert_eq!(r.synced, synced, "wait_synced commit came back unsynced");
    Ok(e)
}

/// The bytes of `e` as its agent reads them, with the owner's read token.
async fn read_back(
    c: &mut AllocatorClient<Channel>,
    endpoints: &[String],
    e: &pb::Extent,
) -> Vec<u8> {
    let token = c
        .read_tokens(pb::ReadTokensRequest { extents: vec![*e] })
        .await
        .expect("read tokens")
        .into_inner()
        .tokens
        .pop()
        .unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    for ep in endpoints {
        let mut agent = VdevAgentClient::new(channel(ep));
        loop {
            match agent
                .read(pb::ReadRequest {
                    offset: e.offset,
                    size: e.size,
                    token: token.clone(),
                })
                .await
            {
                Ok(r) => return r.into_inner().data.to_vec(),
                Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // Another vdev's agent: try the next.
                Err(_) => break,
            }
        }
    }
    panic!("no agent read {e:?}");
}

fn key(e: &pb::Extent) -> (u32, u64, u64) {
    (e.vdev, e.offset, e.size)
}

/// Every durable extent is in the store, exactly, and nothing else of
/// ours overlaps it.
async fn check_store(pg: &Postgres, durable: &BTreeSet<(u32, u64, u64)>) {
    let p = aliquot_allocator::pg_store::read_only(&pg.url(), "ha")
        .await
        .expect("store readable")
        .expect("pool exists");
    aliquot_allocator::recovery::verify(&p).expect("store consistent");
    let exact: BTreeSet<(u32, u64, u64)> = p
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    for d in durable {
        assert!(
            exact.contains(d),
            "durable extent {d:?} is not allocated in the store after the takeover"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_within_its_lease_and_nothing_durable_is_lost() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut ha = Ha::start(dir.path());
    let (mut leader, _) = ha.leader(Duration::from_secs(30)).await;
    let standby = 1 - leader;
    // The standby names the leader.
    let mut s = AllocatorClient::new(channel(&ha.urls()[standby]));
    let e = s
        .allocate(data(4096))
        .await
        .expect_err("a standby serves nothing");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(reason(&e), "NOT_LEADER", "{e}");
    let info = e.get_details_error_info().expect("error info");
    assert_eq!(info.metadata["leader"], ha.urls()[leader], "{e}");
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(channel(&ha.urls()[standby]));
    let h = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "aliquot.v1.Allocator".into(),
        })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(
        h.status,
        tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
    );

    let mut durable: BTreeSet<(u32, u64, u64)> = BTreeSet::new();
    let mut takeovers = Vec::new();
    for round in 0..3u8 {
        let mut c = AllocatorClient::new(channel(&ha.urls()[leader]));
        for i in 0..8u8 {
            let e = write_durable(&mut c, 64 << 10, round * 16 + i)
                .await
                .unwrap_or_else(|e| panic!("round {round}: write: {e}"));
            assert!(durable.insert(key(&e)), "extent {e:?} handed out twice");
        }
        // Committed but not synced: may be lost with the leader (the
        // client is told so by ALLOCATOR_RESTARTED), never half-kept.
        ha.allocators[leader].kill9();
        let (next, took) = ha.leader(Duration::from_millis(LEASE_MS + 8000)).await;
        assert_ne!(next, leader, "the killed allocator cannot lead");
        takeovers.push(took);
        eprintln!("takeover {round}: a standby served Allocate {took:?} after the kill");
        check_store(&ha.pg, &durable).await;
        // New allocations never overlap a durable extent.
        let mut c = AllocatorClient::new(channel(&ha.urls()[next]));
        for _ in 0..16 {
            let a = c
                .allocate(data(64 << 10))
                .await
                .expect("allocate")
                .into_inner();
            for e in &a.extents {
                assert!(
                    !durable
                        .iter()
                        .any(|d| d.0 == e.vdev && d.1 < e.offset + e.size && e.offset < d.1 + d.2),
                    "new leader placed {e:?} over a durable extent"
                );
            }
            c.abort(pb::AbortRequest {
                allocation_ids: vec![a.allocation_id],
            })
            .await
            .expect("abort");
        }
        ha.allocators[leader]
            .restart()
            .expect("restart as a standby");
        leader = next;
    }
    let max = takeovers.iter().max().unwrap();
    // The bound: lease + 2 s (agents re-register within it too).
    assert!(
        *max < Duration::from_millis(LEASE_MS + 2000),
        "takeovers took {takeovers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_woken_after_a_takeover_persists_and_serves_nothing() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let ha = Ha::start(dir.path());
    let (old, _) = ha.leader(Duration::from_secs(30)).await;
    let mut c = AllocatorClient::new(channel(&ha.urls()[old]));
    // Durable before the pause.
    let kept = write_durable(&mut c, 64 << 10, 7).await.expect("write");
    // An allocation whose write is still to come, and a commit still in
    // the open txg, both of the old generation.
    let pending = c.allocate(data(64 << 10)).await.unwrap().into_inner();
    let unsynced = c.allocate(data(64 << 10)).await.unwrap().into_inner();
    c.commit(pb::CommitRequest {
        allocation_ids: vec![unsynced.allocation_id],
        wait_synced: false,
        generation: unsynced.generation,
    })
    .await
    .expect("commit");
    // Make sure the pending txg is still open when it stops.
    signal(&ha.allocators[old], "-STOP");
    let (new, took) = ha.leader(Duration::from_millis(LEASE_MS + 15000)).await;
    assert_ne!(new, old);
    eprintln!("takeover from a paused leader after {took:?}");
    let mut n = AllocatorClient::new(channel(&ha.urls()[new]));
    let g2 = n
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner()
        .generation;
    assert!(g2 > pending.generation);
    // The agents know the new generation: the old token is refused.
    let mut agent = VdevAgentClient::new(channel(&pending.endpoints[0]));
    let w = agent
        .write(pb::WriteRequest {
            offset: pending.extents[0].offset,
            data: vec![1u8; (64 << 10) as usize].into(),
            token: pending.tokens[0].clone(),
        })
        .await
        .expect_err("a write with the deposed generation's token");
    assert_eq!(w.code(), Code::PermissionDenied, "{w}");

    // The old leader wakes: it serves nothing from the first call on. A
    // call may meet its server going away (it notices it was replaced and
    // stops): a transport error; once it stands by, NOT_LEADER.
    signal(&ha.allocators[old], "-CONT");
    let refused = |e: &tonic::Status| {
        let r = reason(e);
        assert!(
            r == "NOT_LEADER" || (r.is_empty() && e.code() != Code::Ok),
            "a deposed leader answered {e}"
        );
        r == "NOT_LEADER"
    };
    let mut not_leader = false;
    for _ in 0..3 {
        let e = c
            .allocate(data(4096))
            .await
            .expect_err("a deposed leader allocates nothing");
        not_leader |= refused(&e);
        let e = c
            .sync_txg(pb::SyncTxgRequest {
                txg: unsynced.txg,
                generation: unsynced.generation,
            })
            .await
            .expect_err("a deposed leader syncs nothing");
        not_leader |= refused(&e);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(not_leader, "never told NOT_LEADER");
    // ... persists nothing (its open txg held the unsynced commit) ...
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let p = aliquot_allocator::pg_store::read_only(&ha.pg.url(), "ha")
        .await
        .unwrap()
        .unwrap();
    let have: BTreeSet<(u32, u64, u64)> = p
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    assert!(have.contains(&key(&kept)), "a durable extent vanished");
    let u = unsynced.extents[0];
    assert!(
        !have.contains(&key(&u)),
        "the deposed leader persisted its open txg ({u:?})"
    );
    // ... and stands by, naming the new leader.
    let e = c.get_pool(pb::GetPoolRequest {}).await;
    let e = match e {
        Err(e) => e,
        Ok(_) => panic!("the deposed leader still answers GetPool as a leader"),
    };
    assert_eq!(reason(&e), "NOT_LEADER", "{e}");
    let info = e.get_details_error_info().unwrap();
    assert_eq!(info.metadata["leader"], ha.urls()[new]);
    // The new leader serves on.
    write_durable(&mut n, 64 << 10, 9)
        .await
        .expect("write on the new leader");
}

/// The path between the leader and PostgreSQL cut inside a txg's
/// transaction for three leases: the leader's sessions bound their
/// statements by the lease and their idle transactions and lock waits by
/// half of it, so the server ends the cut transaction, its `leaders` row
/// lock goes, and the standby takes the pool while the path is still cut.
/// Once the path is back, the cut transaction has committed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_inside_a_txg_transaction_does_not_block_the_takeover() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start();
    let proxies = [PgProxy::start(pg.port).await, PgProxy::start(pg.port).await];
    let ha = Ha::start_on(
        dir.path(),
        "3s",
        "500ms",
        "1s",
        pg,
        [proxies[0].url(), proxies[1].url()],
    );
    let lease = Duration::from_secs(3);
    let (old, _) = ha.leader(Duration::from_secs(30)).await;
    let mut c = AllocatorClient::new(channel(&ha.urls()[old]));
    let kept = write_durable(&mut c, 64 << 10, 3).await.expect("write");
    // Cut at the next transaction: the txg holding this commit.
    proxies[old].arm();
    let unsynced = c.allocate(data(64 << 10)).await.unwrap().into_inner();
    c.commit(pb::CommitRequest {
        allocation_ids: vec![unsynced.allocation_id],
        wait_synced: false,
        generation: unsynced.generation,
    })
    .await
    .expect("commit");
    proxies[old].wait_frozen(Duration::from_secs(10)).await;
    let cut = Instant::now();
    let (new, _) = ha
        .leader_besides(old, 3 * lease + Duration::from_secs(30))
        .await;
    let took = cut.elapsed();
    eprintln!("takeover {took:?} after the leader's path to PostgreSQL was cut mid-transaction");
    assert_ne!(new, old, "the cut-off leader kept the pool");
    assert!(
        took < 3 * lease,
        "no takeover while the path was cut ({took:?}): the cut transaction held it up"
    );
    // The cut lasts three leases in all.
    tokio::time::sleep((3 * lease).saturating_sub(cut.elapsed())).await;
    proxies[old].thaw();
    // The old leader hears its answers now: it stands by, and what its
    // cut transaction held never lands.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.get_pool(pb::GetPoolRequest {}).await {
            Err(e) if reason(&e) == "NOT_LEADER" => break,
            r => {
                assert!(
                    Instant::now() < deadline,
                    "the cut-off leader never said NOT_LEADER: {r:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let p = aliquot_allocator::pg_store::read_only(&ha.pg.url(), "ha")
        .await
        .unwrap()
        .unwrap();
    aliquot_allocator::recovery::verify(&p).expect("store consistent");
    let have: BTreeSet<(u32, u64, u64)> = p
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect();
    assert!(have.contains(&key(&kept)), "a durable extent vanished");
    assert!(
        !have.contains(&key(&unsynced.extents[0])),
        "the cut transaction's txg landed"
    );
    let mut n = AllocatorClient::new(channel(&ha.urls()[new]));
    write_durable(&mut n, 64 << 10, 4)
        .await
        .expect("write on the new leader");
}

/// The leader stopped (SIGSTOP) for three leases at least under two agents
/// and a 32-way `aliquotctl write` given both allocators: the agents leave
/// the silent leader (their report stream's acks stop), the write's calls
/// fail over (HTTP/2 keepalive), the standby serves while the old leader is
/// still stopped, and the write finishes, verified. Woken, the old leader
/// persists nothing and answers NOT_LEADER.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_strands_neither_agents_nor_writers() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // The default claim window: the write claims what the stopped leader's
    // lost txgs held once its calls have failed over (keepalive, 3 s).
    let pg = Postgres::start();
    let url = pg.url();
    let ha = Ha::start_on(dir.path(), LEASE, "10s", "1s", pg, [url.clone(), url]);
    let (old, _) = ha.leader(Duration::from_secs(30)).await;
    let manifest = dir.path().join("run.manifest");
    let w = spawn_write(&ha, &manifest);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A commit the stopped leader may still hold unsynced in its open txg
    // (the write's synced commits close txgs often, so it may have synced
    // before the stop: then there is nothing to prove with it).
    let mut c = AllocatorClient::new(channel(&ha.urls()[old]));
    let unsynced = c.allocate(data(64 << 10)).await.unwrap().into_inner();
    c.commit(pb::CommitRequest {
        allocation_ids: vec![unsynced.allocation_id],
        wait_synced: false,
        generation: unsynced.generation,
    })
    .await
    .expect("commit");
    signal(&ha.allocators[old], "-STOP");
    let stopped = Instant::now();
    let (new, took) = ha
        .leader_besides(old, Duration::from_millis(3 * LEASE_MS + 30000))
        .await;
    eprintln!("the standby served {took:?} after the leader stopped");
    // The old leader is still stopped: the agents left it for the standby.
    assert_ne!(new, old, "a stopped allocator cannot serve");
    tokio::time::sleep(Duration::from_millis(3 * LEASE_MS).saturating_sub(stopped.elapsed())).await;
    let u = key(&unsynced.extents[0]);
    let held = !allocated(&ha.pg).await.contains(&u);
    signal(&ha.allocators[old], "-CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.get_pool(pb::GetPoolRequest {}).await {
            Err(e) if reason(&e) == "NOT_LEADER" => break,
            Ok(_) => panic!("the woken leader answered GetPool as the leader"),
            Err(e) => {
                assert!(Instant::now() < deadline, "never NOT_LEADER: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Allocate too (a call may meet the server going away as it turns
    // standby: a transport error, then NOT_LEADER).
    loop {
        match c.allocate(data(4096)).await {
            Err(e) if reason(&e) == "NOT_LEADER" => break,
            Ok(a) => panic!("the woken leader allocated {:?}", a.into_inner().extents),
            Err(e) => {
                assert!(Instant::now() < deadline, "never NOT_LEADER: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    finish_write(&ha, w, &manifest).await;
    // The write ran for seconds after the wake: had the old leader
    // persisted its open txg, the held commit would be in the store (no
    // block of the write has its size).
    if held {
        assert!(
            !allocated(&ha.pg).await.contains(&u),
            "the woken leader persisted its open txg ({u:?})"
        );
    } else {
        eprintln!("the held commit synced before the stop: nothing to prove with it");
    }
}

/// The extents the store holds allocated.
async fn allocated(pg: &Postgres) -> BTreeSet<(u32, u64, u64)> {
    aliquot_allocator::pg_store::read_only(&pg.url(), "ha")
        .await
        .unwrap()
        .unwrap()
        .allocated
        .iter()
        .map(|e| (e.vdev, e.offset, e.size))
        .collect()
}

/// The run: a 32-way `aliquotctl write` given both allocators,
/// the leader killed with -9 under it. The standby takes over, the write
/// follows it and finishes (claiming what the lost txg held), and every
/// block of its manifest is allocated in the store, which verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_given_both_allocators_finishes_across_a_leader_kill() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // The default claim window (10 s): the writer claims what the lost txg
    // held once it has found the new leader. A 500 ms window is shorter
    // than that search on a loaded machine (the lost txg's blocks were then
    // given out again, rightly, and the writer reported them lost).
    let mut ha = Ha::start_with(dir.path(), LEASE, "10s", "1s");
    let (leader, _) = ha.leader(Duration::from_secs(30)).await;
    let manifest = dir.path().join("run.manifest");
    let w = spawn_write(&ha, &manifest);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ha.allocators[leader].kill9();
    let (next, took) = ha.leader(Duration::from_millis(LEASE_MS + 8000)).await;
    assert_ne!(next, leader);
    eprintln!("takeover under the write: {took:?}");
    finish_write(&ha, w, &manifest).await;
}

/// A 32-way `aliquotctl write` of 160 MiB given both allocators, verified,
/// with its manifest at `manifest`.
fn spawn_write(ha: &Ha, manifest: &Path) -> std::process::Child {
    std::process::Command::new(bin("aliquotctl"))
        .args(args![
            "write",
            "--allocator",
            ha.urls().join(","),
            "--total",
            "160MiB",
            "--block-size",
            "1MiB",
            "--concurrency",
            "32",
            "--rate",
            "40MiB/s",
            "--manifest",
            manifest.display(),
            "--verify",
            "--no-progress",
        ])
        .env(integration_tests::INSECURE_ENV, "1")
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn aliquotctl write")
}

/// The write finished and verified, every block of its manifest is
/// allocated in the store, and the store verifies.
async fn finish_write(ha: &Ha, w: std::process::Child, manifest: &Path) {
    let out = tokio::task::spawn_blocking(move || w.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the run failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("verified"), "{stdout}");
    let m = aliquotctl::manifest::Manifest::load(manifest).expect("manifest");
    assert_eq!(m.blocks.len(), 160, "every block is in the manifest");
    let durable: BTreeSet<(u32, u64, u64)> = m
        .blocks
        .values()
        .flat_map(|copies| copies.iter().map(|c| (c.at.vdev, c.at.offset, c.at.size)))
        .collect();
    check_store(&ha.pg, &durable).await;
    let v = integration_tests::ctl(&args!["verify", "--store", ha.pg.url(), "--pool", "ha"]);
    let text = integration_tests::ok_stdout(&v, "verify --store");
    assert!(text.contains("ha"), "{text}");
}

/// `aliquotctl free` given both allocators, the leader killed with -9
/// under it: the free follows the standby and finishes (no `.freeing` file
/// left), and the store then holds exactly another run's blocks, intact: a
/// Free whose answer the kill lost is neither lost nor repeated blindly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_given_both_allocators_finishes_across_a_leader_kill() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut ha = Ha::start(dir.path());
    let (leader, _) = ha.leader(Duration::from_secs(30)).await;
    let both = ha.urls().join(",");
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    for m in [&a, &b] {
        let o = integration_tests::ctl(&args![
            "write",
            "--allocator",
            both,
            "--total",
            "4MiB",
            "--block-size",
            "64KiB",
            "--no-progress",
            "--manifest",
            m.display()
        ]);
        integration_tests::ok_stdout(&o, "write");
    }
    let keep: BTreeSet<(u32, u64, u64)> = aliquotctl::manifest::Manifest::load(&b)
        .unwrap()
        .extents()
        .iter()
        .map(|(_, c)| (c.at.vdev, c.at.offset, c.at.size))
        .collect();
    let f = std::process::Command::new(bin("aliquotctl"))
        .args(args![
            "free",
            "--allocator",
            both,
            "--manifest",
            a.display(),
            "--chunk",
            "8"
        ])
        .env(integration_tests::INSECURE_ENV, "1")
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn aliquotctl free");
    // Kill the leader once the first chunk is freed (journaled).
    let freeing = dir.path().join("a.jsonl.freeing");
    let t0 = Instant::now();
    while !std::fs::read_to_string(&freeing).is_ok_and(|t| t.contains("\"freed\"")) {
        assert!(t0.elapsed() < Duration::from_secs(60), "no chunk was freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ha.allocators[leader].kill9();
    let m = aliquotctl::manifest::Manifest::load(&freeing).expect("the free still runs");
    assert!(
        m.freed < m.extents().len() as u64,
        "the free had finished before the kill: the test proves nothing"
    );
    let out = tokio::task::spawn_blocking(move || f.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "free failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("freed 64 blocks"), "{stdout}");
    assert!(!freeing.exists() && !a.exists(), "free left its manifest");
    assert_eq!(
        allocated(&ha.pg).await,
        keep,
        "the store holds exactly run b"
    );
    let o = integration_tests::ctl(&args![
        "balancer",
        "verify",
        "--allocator",
        both,
        "--manifest",
        b.display()
    ]);
    let text = integration_tests::ok_stdout(&o, "balancer verify");
    assert!(text.contains("all intact"), "{text}");
}

/// With the leader stopped and its 10 s lease still running, `status`,
/// `allocator status` and `write` given both allocators wait for a leader,
/// saying whose lease they wait for and when it ends, and run once the
/// standby took over (instead of exiting on the first refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_given_several_allocators_wait_for_a_leader() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let ha = Ha::start_with_lease(dir.path(), "10s");
    let (old, _) = ha.leader(Duration::from_secs(30)).await;
    let old_url = ha.urls()[old].clone();
    // Once the standby has read the lease, it names the leader.
    let mut s = AllocatorClient::new(channel(&ha.urls()[1 - old]));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let e = s
            .get_pool(pb::GetPoolRequest {})
            .await
            .expect_err("a standby");
        let named = e
            .get_details_error_info()
            .and_then(|i| i.metadata.get("leader").cloned());
        if named.as_ref() == Some(&old_url) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the standby never named the leader: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(&ha.allocators[old], "-STOP");
    let both = ha.urls().join(",");
    let run = |a: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(bin("aliquotctl"))
                .args(a)
                .env(integration_tests::INSECURE_ENV, "1")
                .env_remove("ALIQUOT_ALLOCATOR")
                .output()
                .expect("run aliquotctl")
        })
    };
    let wait = args!["--allocator", both, "--leader-wait", "60s"];
    let status = run([args!["status"], wait.clone()].concat());
    let allocator_status = run([args!["allocator", "status"], wait.clone()].concat());
    let write = run([
        args![
            "write",
            "--total",
            "8MiB",
            "--block-size",
            "1MiB",
            "--verify",
            "--no-progress"
        ],
        wait,
    ]
    .concat());
    let said = format!("no leader answers yet: {old_url} holds the lease, which ends in");
    let mut outs = Vec::new();
    for (what, o) in [
        ("status", status),
        ("allocator status", allocator_status),
        ("write", write),
    ] {
        let o = o.await.unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{what} failed:\n{stderr}\n{stdout}");
        assert!(
            stderr.contains(&said),
            "{what} did not say what it waited for:\n{stderr}"
        );
        outs.push(stdout);
    }
    signal(&ha.allocators[old], "-CONT");
    let new_url = &ha.urls()[1 - old];
    assert!(
        outs[1].contains(&format!("leader      {new_url}")),
        "{}",
        outs[1]
    );
    assert!(outs[2].contains("verified"), "{}", outs[2]);
}

/// A graceful handover does not wait for the lease: `aliquotctl allocator
/// step-down` and SIGTERM each move the pool to the standby, which serves
/// (agents reported in) well before a 10 s lease could have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_down_and_sigterm_hand_over_without_waiting_for_the_lease() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // A claim window far longer than the test: a leader after a clean
    // handover must open none at all.
    let ha = Ha::start_with(dir.path(), "10s", "300s", "1s");
    let (leader, _) = ha.leader(Duration::from_secs(30)).await;
    let both = ha.urls().join(",");
    let window = |i: usize| {
        let url = ha.urls()[i].clone();
        async move {
            AllocatorClient::new(channel(&url))
                .get_pool(pb::GetPoolRequest {})
                .await
                .expect("get pool")
                .into_inner()
                .claim_window_remaining_ms
        }
    };
    // The leader lists the standby once it has seen it poll (refreshed at
    // each renewal, every third of the lease).
    let all = both.clone();
    let (listed_leader, listed_standby) =
        tokio::task::spawn_blocking(move || integration_tests::leader_and_standby(&all))
            .await
            .unwrap();
    assert_eq!(listed_leader, ha.urls()[leader]);
    assert_eq!(listed_standby, ha.urls()[1 - leader]);
    let o = integration_tests::ctl(&args!["allocator", "status", "--allocator", both]);
    let text = integration_tests::ok_stdout(&o, "allocator status");
    assert!(text.contains("postgres"), "{text}");

    let t0 = Instant::now();
    let o = integration_tests::ctl(&args!["allocator", "step-down", "--allocator", both]);
    let text = integration_tests::ok_stdout(&o, "allocator step-down");
    let (next, _) = ha.leader(Duration::from_secs(8)).await;
    let took = t0.elapsed();
    eprintln!("step-down: {text} serving Allocate {took:?} after it was asked");
    assert_ne!(next, leader, "the standby leads");
    assert!(took < Duration::from_secs(3), "step-down took {took:?}");
    assert_eq!(
        window(next).await,
        0,
        "a clean step-down leaves nothing to claim"
    );

    // SIGTERM: the same handover on the way out.
    let t0 = Instant::now();
    signal(&ha.allocators[next], "-TERM");
    let (again, _) = ha.leader(Duration::from_secs(8)).await;
    let took = t0.elapsed();
    eprintln!("SIGTERM handover: serving Allocate {took:?} after the signal");
    assert_eq!(again, leader);
    assert!(
        took < Duration::from_secs(3),
        "SIGTERM handover took {took:?}"
    );
    assert_eq!(
        window(again).await,
        0,
        "a clean SIGTERM leaves nothing to claim"
    );
}

/// PostgreSQL itself restarted under load (fast shutdown, start): the
/// leader retries its txg and acknowledges nothing it did not persist; then
/// PostgreSQL unreachable (paused) for longer than the lease: no allocator
/// serves meanwhile, and one serves again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_or_unreachable_loses_nothing_acknowledged() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut ha = Ha::start(dir.path());
    let (leader, _) = ha.leader(Duration::from_secs(30)).await;
    let url = ha.urls()[leader].clone();
    let durable = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (durable, stop, urls) = (durable.clone(), stop.clone(), ha.urls());
        tokio::spawn(async move {
            let mut n = 0u8;
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Whoever leads: a failed block is simply not durable.
                for u in &urls {
                    let mut c = AllocatorClient::new(channel(u));
                    n = n.wrapping_add(1);
                    match write_durable(&mut c, 16 << 10, n).await {
                        Ok(e) => {
                            ok += 1;
                            assert!(durable.lock().unwrap().insert(key(&e)), "{e:?} twice");
                        }
                        Err(_) => failed += 1,
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let at_restart = durable.lock().unwrap().len();
    ha.pg.stop_fast();
    tokio::time::sleep(Duration::from_millis(300)).await;
    ha.pg.launch().expect("postgres back");
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let before_pause = durable.lock().unwrap().len();
    assert!(at_restart > 0, "nothing was written");
    assert!(
        before_pause > at_restart,
        "no block became durable after PostgreSQL restarted ({at_restart} before)"
    );

    // Unreachable past the lease: nobody serves.
    ha.pg.pause(true);
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 1000)).await;
    for u in ha.urls() {
        let mut c = AllocatorClient::new(channel(&u));
        let r = tokio::time::timeout(Duration::from_secs(3), c.allocate(data(4096))).await;
        if let Ok(Ok(a)) = r {
            panic!(
                "{u} allocated {:?} with the store unreachable past the lease",
                a.into_inner().extents
            );
        }
    }
    ha.pg.pause(false);
    let (again, took) = ha.leader(Duration::from_secs(30)).await;
    eprintln!(
        "serving again {took:?} after PostgreSQL came back (allocator {again}, was {leader} at {url})"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = writer.await.unwrap();
    eprintln!("writes: {ok} durable, {failed} refused or failed across the faults");
    let durable = durable.lock().unwrap().clone();
    check_store(&ha.pg, &durable).await;
}

fn allocator_exit(args: &[String]) -> (i32, String) {
    let o = std::process::Command::new(bin("aliquot-allocator"))
        .args(args)
        .env(integration_tests::INSECURE_ENV, "1")
        .output()
        .expect("run aliquot-allocator");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// Bad input is refused with a clear error and nothing written: a wrong
/// URL, a URL of another database kind, a pool of another guid, a schema
/// newer than the binary. Two pools in one database each have their own
/// leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_stores_are_refused_and_two_pools_share_a_database() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pg = Postgres::start();
    let common = |store: &str, pool: &str| {
        args![
            "--listen",
            "127.0.0.1:0",
            "--store",
            store,
            "--pool",
            pool,
            "--leader-lease",
            "1s"
        ]
    };
    // Nothing listens there.
    let (code, err) = allocator_exit(&common("postgres://aliquot@127.0.0.1:1/postgres", "p"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot reach the store"), "{err}");
    // Not PostgreSQL.
    let (code, err) = allocator_exit(&common("mysql://u@h/db", "p"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("expected a postgres:// URL"), "{err}");

    // Two pools, one database, each led by its own allocator.
    let mut procs = Vec::new();
    for pool in ["a", "b"] {
        let p = Proc::start(
            &format!("alloc-{pool}"),
            &bin("aliquot-allocator"),
            &common(&pg.url(), pool),
            &[],
            &["grpc"],
            dir.path(),
        )
        .expect("start");
        procs.push(p);
    }
    let mut guids = Vec::new();
    for p in &procs {
        let mut c = AllocatorClient::new(channel(&p.url("grpc")));
        let deadline = Instant::now() + Duration::from_secs(20);
        let st = loop {
            match c.get_pool(pb::GetPoolRequest {}).await {
                Ok(st) => break st.into_inner(),
                Err(e) => {
                    assert!(Instant::now() < deadline, "{}: never led: {e}", p.name);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        assert_eq!(st.generation, 1, "each pool has its own leadership");
        guids.push(st.guid);
    }
    assert_ne!(guids[0], guids[1]);
    drop(procs);

    // Pool "a" of another guid: refused before anything is written.
    let mut a = common(&pg.url(), "a");
    a.extend(args!["--pool-guid", "0x1234"]);
    let (code, err) = allocator_exit(&a);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not the expected 0x1234"), "{err}");

    // A schema from a newer binary.
    let db = sqlx::PgPool::connect(&pg.url()).await.unwrap();
    sqlx::query("CREATE DATABASE newer")
        .execute(&db)
        .await
        .unwrap();
    let newer_url = pg.url().replace("/postgres", "/newer");
    let newer = sqlx::PgPool::connect(&newer_url).await.unwrap();
    sqlx::query(
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
            installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL,
            checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
    )
    .execute(&newer)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99990101, 'from the future', true, '\\x00', 0)",
    )
    .execute(&newer)
    .await
    .unwrap();
    let (code, err) = allocator_exit(&common(&newer_url, "p"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("newer than this binary"), "{err}");
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_one(&newer)
    .await
    .unwrap();
    assert_eq!(tables, 1, "nothing was created in the newer database");
}

/// Does process `pid` hold the socket listening on 127.0.0.1:`port`?
fn listens_on(pid: u32, port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    // "sl local_address rem_address st ... inode": st 0A is LISTEN.
    let inode = tcp.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let local_port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
        (local_port == port && f.get(3) == Some(&"0A")).then(|| f.get(9).map(|s| s.to_string()))?
    });
    let Some(inode) = inode else { return false };
    let want = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == want))
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .unwrap_or_default()
}

/// `aliquotctl up --ha`: a pool with its own PostgreSQL and two
/// allocators. A write runs across a kill -9 of the leading allocator; `up`
/// starts it again as the standby, and the pool serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_ha_serves_across_a_killed_allocator() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let up = Proc::start(
        "up",
        &bin("aliquotctl"),
        &args![
            "up",
            "--ha",
            "--insecure",
            "--ephemeral",
            "--no-metrics",
            "--data-dir",
            dir.path().join("pool").display(),
            "--agents",
            "512MiB,512MiB"
        ],
        &[],
        &["grpc"],
        dir.path(),
    )
    .expect("up --ha");
    // The allocators are `up`'s children running `aliquot-allocator`.
    let allocators = || -> Vec<u32> {
        integration_tests::children_of(up.pid().unwrap())
            .into_iter()
            .filter(|p| cmdline(*p).contains("aliquot-allocator"))
            .collect()
    };
    assert_eq!(allocators().len(), 2, "two allocators");
    // The leader and the standby, as the leader lists them.
    let url = up.url("grpc");
    let (leader, standby) =
        tokio::task::spawn_blocking(move || integration_tests::leader_and_standby(&url))
            .await
            .unwrap();
    let both = format!("{leader},{standby}");
    let port: u16 = leader.rsplit(':').next().unwrap().parse().unwrap();
    let leader_pid = allocators()
        .into_iter()
        .find(|p| listens_on(*p, port))
        .expect("the leader's process");
    let w = std::process::Command::new(bin("aliquotctl"))
        .args(args![
            "write",
            "--allocator",
            both,
            "--insecure",
            "--total",
            "96MiB",
            "--rate",
            "32MiB/s",
            "--verify",
            "--no-progress"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    std::process::Command::new("kill")
        .args(["-9", &leader_pid.to_string()])
        .status()
        .unwrap();
    let out = tokio::task::spawn_blocking(move || w.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the write failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verified"), "{stdout}");
    // `up` started the killed allocator again: two, one standing by.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = integration_tests::ctl(&args!["allocator", "status", "--allocator", both]);
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        if o.status.success() && allocators().len() == 2 && !text.contains("none seen") {
            break;
        }
        assert!(Instant::now() < deadline, "no standby again:\n{text}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // ... and said who leads after the restart, as it found out.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let log = std::fs::read_to_string(&up.log).unwrap_or_default();
        let said = log
            .lines()
            .find(|l| l.contains(" leads (generation "))
            .map(str::to_string);
        if let Some(l) = said {
            assert!(l.contains(&leader) || l.contains(&standby), "{l}");
            break;
        }
        assert!(Instant::now() < deadline, "up never said who leads:\n{log}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// kill -9 of the leader while blocks of a txg that never synced are on the
/// agents, with a claim window far longer than the takeover: the new leader
/// serves Allocate while its window is still open (only what the agents name
/// as written by the older generation is kept out); nothing new is placed
/// over a lost block or a durable one; every lost block is claimed (each
/// extent answered) and reads back intact with the durable ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_serves_inside_the_claim_window_and_keeps_what_lost_txgs_wrote() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // Txgs close only when asked: the committed blocks below stay unsynced.
    let t0 = Instant::now();
    let mut ha = Ha::start_with(dir.path(), LEASE, "120s", "1s");
    let (leader, _) = ha.leader(Duration::from_secs(60)).await;
    eprintln!("{:?}: leader {leader}", t0.elapsed());
    // From now on txgs close only when asked (the setting is stored, so the
    // next leader keeps it): the committed blocks below stay unsynced.
    AllocatorClient::new(channel(&ha.urls()[leader]))
        .set_tunable(pb::SetTunableRequest {
            name: "zfs_txg_timeout".into(),
            value: "600".into(),
        })
        .await
        .expect("set zfs_txg_timeout");
    let mut c = AllocatorClient::new(channel(&ha.urls()[leader]));
    let mut durable: Vec<(pb::Extent, u8)> = Vec::new();
    for i in 0..4u8 {
        let e = write_block(&mut c, 64 << 10, i, true)
            .await
            .expect("durable write");
        durable.push((e, i));
    }
    let mut lost: Vec<(pb::Extent, u8)> = Vec::new();
    for i in 0..16u8 {
        let e = write_block(&mut c, 64 << 10, 100 + i, false)
            .await
            .expect("committed write");
        lost.push((e, 100 + i));
    }
    let before = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    eprintln!("{:?}: blocks written; kill -9", t0.elapsed());
    ha.allocators[leader].kill9();

    let (next, took) = ha.leader(Duration::from_secs(60)).await;
    eprintln!(
        "{:?}: allocator {next} serves Allocate {took:?} after the kill",
        t0.elapsed()
    );
    assert_ne!(next, leader);
    let mut c = AllocatorClient::new(channel(&ha.urls()[next]));
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(st.generation > before.generation);
    assert!(
        st.claim_window_remaining_ms > 0,
        "Allocate was served before the claim window ended"
    );
    // The lost blocks are in no store: only the agents' records name them.
    let p = aliquot_allocator::pg_store::read_only(&ha.pg.url(), "ha")
        .await
        .expect("store readable")
        .expect("pool exists");
    for (e, _) in &lost {
        assert!(
            !p.allocated
                .iter()
                .any(|a| (a.vdev, a.offset, a.size) == key(e)),
            "{e:?} synced: the test lost nothing"
        );
    }
    // New allocations: never over a lost block's extent or a durable one.
    let taken: Vec<pb::Extent> = lost.iter().chain(&durable).map(|(e, _)| *e).collect();
    let mut ids = Vec::new();
    for _ in 0..64 {
        let a = c
            .allocate(data(64 << 10))
            .await
            .expect("allocate inside the claim window")
            .into_inner();
        for e in &a.extents {
            assert!(
                !taken.iter().any(|t| t.vdev == e.vdev
                    && t.offset < e.offset + e.size
                    && e.offset < t.offset + t.size),
                "new leader placed {e:?} over a block of the lost txg or a durable one"
            );
        }
        ids.push(a.allocation_id);
    }
    c.abort(pb::AbortRequest {
        allocation_ids: ids,
    })
    .await
    .expect("abort");
    // Every lost block is claimed, extent by extent.
    let r = c
        .claim(pb::ClaimRequest {
            extents: lost.iter().map(|(e, _)| *e).collect(),
            per_extent: true,
            allocation_ids: Vec::new(),
        })
        .await
        .expect("claim")
        .into_inner();
    assert_eq!(r.results.len(), lost.len());
    let refused: Vec<_> = r.results.iter().filter(|x| !x.claimed).collect();
    assert!(
        refused.is_empty(),
        "claims refused inside the window: {refused:?}"
    );
    c.sync_txg(pb::SyncTxgRequest {
        txg: r.txg,
        generation: r.generation,
    })
    .await
    .expect("the claims' txg syncs");
    eprintln!("{:?}: claimed and synced", t0.elapsed());
    let endpoints: Vec<String> = ha.agents.iter().map(|p| p.url("grpc")).collect();
    let (mut lost_n, mut wrong) = (0, 0);
    for (e, seed) in lost.iter().chain(&durable) {
        let got = read_back(&mut c, &endpoints, e).await;
        if got.len() != e.size as usize {
            lost_n += 1;
        } else if got.iter().any(|b| b != seed) {
            wrong += 1;
        }
    }
    assert_eq!((lost_n, wrong), (0, 0), "blocks lost / read back wrong");
    eprintln!("{:?}: read back", t0.elapsed());
    let all: BTreeSet<(u32, u64, u64)> = lost.iter().chain(&durable).map(|(e, _)| key(e)).collect();
    check_store(&ha.pg, &all).await;
}

/// PostgreSQL unreachable (paused) for 15 s under a 32-way `aliquotctl
/// write` given both allocators, with the allocators' default lease, claim
/// window and txg timeout: the write waits out the outage, claims what the
/// lost txgs held inside the window (a refused claim fails the run), and
/// finishes verified (0 blocks read back wrong); every block of its
/// manifest is allocated in the store, and no two blocks overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_survives_a_15s_postgres_outage_with_the_defaults() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let ha = Ha::start_with(dir.path(), "5s", "10s", "5s");
    ha.leader(Duration::from_secs(30)).await;
    let manifest = dir.path().join("run.manifest");
    let t0 = Instant::now();
    let w = spawn_write(&ha, &manifest);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ha.pg.pause(true);
    tokio::time::sleep(Duration::from_secs(15)).await;
    ha.pg.pause(false);
    let (_, took) = ha.leader(Duration::from_secs(30)).await;
    eprintln!("serving again {took:?} after a 15 s PostgreSQL outage");
    finish_write(&ha, w, &manifest).await;
    eprintln!("the write finished {:?} after it started", t0.elapsed());
    let m = aliquotctl::manifest::Manifest::load(&manifest).expect("manifest");
    let mut extents: Vec<(u32, u64, u64)> = m
        .blocks
        .values()
        .flat_map(|copies| copies.iter().map(|c| (c.at.vdev, c.at.offset, c.at.size)))
        .collect();
    assert_disjoint(&mut extents);
}

/// No two of `extents` (vdev, offset, size) overlap (sorts them).
fn assert_disjoint(extents: &mut [(u32, u64, u64)]) {
    extents.sort();
    for w in extents.windows(2) {
        assert!(
            w[0].0 != w[1].0 || w[0].1 + w[0].2 <= w[1].1,
            "two blocks overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
}

/// The Python client's writer for the outage test (`sync` or `async`).
const PY_OUTAGE_WRITER: &str = include_str!("py/outage_writer.py");

/// `a_write_survives_a_15s_postgres_outage_with_the_defaults` for the
/// Python client: 8 writers of durable 256 KiB blocks given both
/// allocators (`mode` picks `Pool` or `AsyncPool`), PostgreSQL paused for
/// 15 s under them with the default lease, claim window and txg timeout.
/// With `kill_leader` the leader is also killed (-9) 5 s into the outage,
/// so the standby takes over once PostgreSQL is back and the writers must
/// claim what the lost txgs held (without it, the leader may renew its own
/// lease after the outage and keep its generation: nothing to claim).
/// No write fails, no claim is refused, every acknowledged block reads back
/// as written, no two overlap, and every one is allocated in the store,
/// which verifies.
/// The Python `Pool` and `AsyncPool` write at once, each in its own process,
/// through a 15 s PostgreSQL outage (and a kill -9 of the leader inside it
/// when `kill_leader`), with the default lease and claim window.
async fn python_writes_through_a_15s_postgres_outage(kill_leader: bool) {
    let _serial = SERIAL.lock().await;
    let py = integration_tests::python();
    let pypath = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let dir = tempfile::tempdir().unwrap();
    let mut ha = Ha::start_with(dir.path(), "5s", "10s", "5s");
    let (before, _) = ha.leader(Duration::from_secs(30)).await;
    let gen_before = generation(&ha, before).await;
    let stop = dir.path().join("stop");
    let t0 = Instant::now();
    let mut writers = Vec::new();
    for mode in ["sync", "async"] {
        let started = dir.path().join(format!("started-{mode}"));
        let w = std::process::Command::new(&py)
            .arg("-c")
            .arg(PY_OUTAGE_WRITER)
            .args([mode, &ha.urls().join(",")])
            .arg(&started)
            .arg(&stop)
            .env("PYTHONPATH", &pypath)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn the python writer");
        let pid = w.id();
        let out = tokio::task::spawn_blocking(move || w.wait_with_output().unwrap());
        writers.push((mode, started, pid, out));
    }
    for (mode, started, _, _) in &writers {
        while !started.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the python {mode} writer acknowledged no block"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ha.pg.pause(true);
    if kill_leader {
        tokio::time::sleep(Duration::from_secs(5)).await;
        ha.allocators[before].kill9();
        tokio::time::sleep(Duration::from_secs(10)).await;
    } else {
        tokio::time::sleep(Duration::from_secs(15)).await;
    }
    ha.pg.pause(false);
    let (after, took) = ha.leader(Duration::from_secs(30)).await;
    eprintln!(
        "allocator {after} generation {} (allocator {before} generation {gen_before} before) \
         serving again {took:?} after a 15 s PostgreSQL outage",
        generation(&ha, after).await
    );
    // Some blocks after the outage too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    std::fs::write(&stop, b"").unwrap();
    let mut extents: Vec<(u32, u64, u64)> = Vec::new();
    for (mode, _, pid, out) in writers {
        let out = match tokio::time::timeout(Duration::from_secs(180), out).await {
            Ok(o) => o.unwrap(),
            Err(_) => {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
                panic!("the python {mode} writer did not finish within 180 s of the stop");
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the python {mode} writer failed:\n{stderr}\n{stdout}"
        );
        let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
        eprintln!(
            "python {mode}: {} blocks acknowledged, longest wait {} s, {} claims ({} refused, {} \
             windows closed), run {:?}",
            r["acked"],
            r["longest_wait_s"],
            r["claims"],
            r["refused"],
            r["window_closed"],
            t0.elapsed()
        );
        assert_eq!(
            r["failures"],
            serde_json::json!([]),
            "{mode}: writes failed"
        );
        assert_eq!(r["wrong"], 0, "{mode}: blocks read back wrong");
        assert_eq!(r["refused"], 0, "{mode}: claims refused inside the window");
        assert_eq!(
            r["synced"], true,
            "{mode}: a durable write came back unsynced"
        );
        if kill_leader {
            assert!(
                r["claims"].as_u64().unwrap() > 0,
                "{mode}: the takeover left the writer nothing to claim: the test proved nothing"
            );
        }
        assert!(
            r["acked"].as_u64().unwrap() > 0,
            "{mode}: nothing acknowledged"
        );
        extents.extend(r["extents"].as_array().unwrap().iter().map(|e| {
            let n = |i: usize| e[i].as_u64().unwrap();
            (n(0) as u32, n(1), n(2))
        }));
    }
    if kill_leader {
        assert_ne!(after, before, "the killed leader serves");
    }
    // Both writers' blocks together: no two overlap, every one is stored.
    assert_disjoint(&mut extents);
    check_store(&ha.pg, &extents.into_iter().collect()).await;
}

/// The generation allocator `i` serves.
async fn generation(ha: &Ha, i: usize) -> u64 {
    AllocatorClient::new(channel(&ha.urls()[i]))
        .get_pool(pb::GetPoolRequest {})
        .await
        .expect("get pool")
        .into_inner()
        .generation
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_pools_write_through_a_15s_postgres_outage_with_the_defaults() {
    python_writes_through_a_15s_postgres_outage(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_pools_claim_through_a_15s_postgres_outage_and_a_killed_leader() {
    python_writes_through_a_15s_postgres_outage(true).await;
}

/// `aliquotctl migrate-store`, stderr and stdout.
fn migrate_store(from: &Path, to: &str) -> std::process::Output {
    integration_tests::ctl(&args![
        "migrate-store",
        "--from",
        from.display(),
        "--to",
        to
    ])
}

fn said(o: &std::process::Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A pool written on SQLite (real allocator, agents and files), stopped,
/// moved into PostgreSQL with `aliquotctl migrate-store`, is served from
/// there by an allocator on `--store`: the same agents re-register, every
/// block reads back byte for byte with its owner's read tokens, the store
/// verifies, and new writes go on. Refused: a move while the SQLite
/// allocator runs (nothing written), and a second move into the store now
/// holding the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_pool_moved_into_postgres_serves_every_block() {
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let pg = Postgres::start();
    let url = pg.url();
    let certs = dir.join("certs");
    aliquot_auth::PoolCa::init(&certs, "ha").unwrap();
    let data_dir = dir.join("sqlite");
    let common = args![
        "--pool",
        "ha",
        "--token-key",
        certs.display(),
        "--report-interval",
        "200ms",
        "--claim-window",
        "500ms",
        "--zfs-txg-timeout",
        "1s",
    ];
    let mut a = args!["--listen", "127.0.0.1:0", "--data-dir", data_dir.display()];
    a.extend(common.iter().cloned());
    let sqlite = Proc::start(
        "allocator-sqlite",
        &bin("aliquot-allocator"),
        &a,
        &[],
        &["grpc"],
        dir,
    )
    .expect("start the SQLite allocator");
    let addr = sqlite.addr("grpc");
    let mut ha = Ha {
        pg,
        certs,
        allocators: vec![sqlite],
        agents: Vec::new(),
    };
    ha.start_agents(dir);
    ha.leader(Duration::from_secs(60)).await;
    let mut c = AllocatorClient::new(channel(&ha.urls()[0]));
    let mut blocks = Vec::new();
    for k in 0..48u8 {
        let size = 4096 * (1 + k as u64 % 4);
        let e = write_durable(&mut c, size, k + 1)
            .await
            .unwrap_or_else(|e| panic!("write {k}: {e}"));
        blocks.push((e, k + 1));
    }
    // Some freed: the store's log space map holds frees as well.
    let freed: Vec<pb::Extent> = blocks.drain(..8).map(|(e, _)| e).collect();
    let f = c
        .free(pb::FreeRequest {
            extents: freed.clone(),
        })
        .await
        .expect("free")
        .into_inner();
    c.sync_txg(pb::SyncTxgRequest {
        txg: f.txg,
        generation: f.generation,
    })
    .await
    .expect("the frees sync");

    // The allocator runs: refused, nothing written.
    let o = migrate_store(&data_dir, &url);
    assert!(!o.status.success(), "moved a running pool: {}", said(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("in use"),
        "{}",
        said(&o)
    );
    // (It did not even create the schema: the lock is taken first.)
    assert!(
        !matches!(
            aliquot_allocator::pg_store::read_only(&url, "ha").await,
            Ok(Some(_))
        ),
        "a refused move wrote the pool"
    );

    ha.allocators[0].kill();
    let o = migrate_store(&data_dir, &url);
    assert!(o.status.success(), "migrate-store: {}", said(&o));
    eprintln!("{}", said(&o));
    assert!(!data_dir.join("pool.db").exists(), "the SQLite file stays");
    let moved = data_dir.join("pool.db.moved");
    assert!(moved.exists());

    // The destination verifies, with exactly the live blocks.
    let v = integration_tests::ctl(&args!["verify", "--store", url, "--pool", "ha", "--json"]);
    let v: serde_json::Value =
        serde_json::from_str(&integration_tests::ok_stdout(&v, "verify")).expect("json");
    assert_eq!(v["extents"], blocks.len() as u64, "{v}");

    // A second move into it (from the renamed file) is refused.
    let o = migrate_store(&moved, &url);
    assert!(!o.status.success(), "moved twice: {}", said(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("already holds a pool"),
        "{}",
        said(&o)
    );

    // An allocator on PostgreSQL where the SQLite one listened: the agents
    // come back to it, their devices' labels accepted.
    let mut a = args![
        "--listen",
        addr.to_string(),
        "--store",
        url,
        "--leader-lease",
        LEASE
    ];
    a.extend(common.iter().cloned());
    ha.allocators[0] = Proc::start(
        "allocator-pg",
        &bin("aliquot-allocator"),
        &a,
        &[],
        &["grpc"],
        dir,
    )
    .expect("start the PostgreSQL allocator");
    ha.leader(Duration::from_secs(60)).await;
    let mut c = AllocatorClient::new(channel(&ha.urls()[0]));
    let endpoints: Vec<String> = ha.agents.iter().map(|p| p.url("grpc")).collect();
    let mut wrong = 0;
    for (e, seed) in &blocks {
        let got = read_back(&mut c, &endpoints, e).await;
        if got.len() != e.size as usize || got.iter().any(|b| b != seed) {
            wrong += 1;
        }
    }
    assert_eq!(wrong, 0, "blocks read back wrong after the move");
    for e in &freed {
        let r = c
            .read_tokens(pb::ReadTokensRequest { extents: vec![*e] })
            .await;
        assert!(r.is_err(), "a read token for freed {e:?} after the move");
    }
    let mut durable: BTreeSet<(u32, u64, u64)> = blocks.iter().map(|(e, _)| key(e)).collect();
    for k in 0..8u8 {
        let e = write_durable(&mut c, 8192, 200 + k)
            .await
            .unwrap_or_else(|e| panic!("write after the move: {e}"));
        assert!(durable.insert(key(&e)), "{e:?} handed out twice");
    }
    check_store(&ha.pg, &durable).await;
}

/// The client's leader channel, its first allocator a standby: a call the
/// standby refuses (NOT_LEADER, nothing done) is sent again to the leader
/// it names, so the caller sees the leader's answer, for GetPool as for
/// Allocate; with no leader wait the standby's refusal is the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_a_standby_refuses_is_sent_again_to_the_leader() {
    use aliquot_client::leader::LeaderChannel;
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let ha = Ha::start(dir.path());
    let (leader, _) = ha.leader(Duration::from_secs(30)).await;
    let urls = ha.urls();
    let standby_first = |wait: Duration| {
        let order = [1 - leader, leader];
        LeaderChannel::new(
            order
                .iter()
                .map(|&i| (urls[i].clone(), channel(&urls[i])))
                .collect(),
            wait,
        )
    };
    let ch = standby_first(Duration::ZERO);
    let e = AllocatorClient::new(ch.clone())
        .get_pool(pb::GetPoolRequest {})
        .await
        .expect_err("without a leader wait, the standby's refusal");
    assert_eq!(reason(&e), "NOT_LEADER", "{e}");

    let ch = standby_first(Duration::from_secs(10));
    let st = AllocatorClient::new(ch.clone())
        .get_pool(pb::GetPoolRequest {})
        .await
        .expect("the leader's answer")
        .into_inner();
    assert_eq!(st.name, "ha");
    assert_eq!(ch.current(), urls[leader]);
    let mut c = AllocatorClient::new(standby_first(Duration::from_secs(10)));
    let a = c
        .allocate(data(4096))
        .await
        .expect("Allocate served by the leader")
        .into_inner();
    c.abort(pb::AbortRequest {
        allocation_ids: vec![a.allocation_id],
    })
    .await
    .expect("abort");
}
