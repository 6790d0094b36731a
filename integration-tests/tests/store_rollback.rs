//! Across real processes: the allocator's store is checked
//! against what the devices' labels saw. Agents write the pool's guid and
//! its last synced txg to their labels at every report; at registration the
//! allocator refuses a store older than a label (an older copy of the data
//! dir restored) and a new pool over devices labelled for another (a lost
//! data dir), naming what it found and how to recover; `--rewind-to`
//! accepts a rollback explicitly. The WAL is checkpointed at every txg, so
//! deleting it loses nothing.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aliquot_agent::uberblock::Uberblocks;
use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args, data_request as data};
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

fn lazy(url: &str) -> Channel {
    Channel::from_shared(url.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

/// This test's clients and paths on the shared test pool
/// (`integration_tests::FilePool`).
trait Pool {
    /// The allocator's data dir: its store.
    fn store_dir(&self) -> PathBuf;
    fn img(&self, i: usize) -> PathBuf;
    fn client(&self) -> AllocatorClient<Channel>;
    fn agent(&self, endpoint: &str) -> VdevAgentClient<Channel>;
}

impl Pool for FilePool {
    fn store_dir(&self) -> PathBuf {
        self.dir.join("allocator")
    }
    fn img(&self, i: usize) -> PathBuf {
        self.dir.join(format!("file{i}.img"))
    }
    fn client(&self) -> AllocatorClient<Channel> {
        AllocatorClient::new(lazy(&self.url))
    }
    fn agent(&self, endpoint: &str) -> VdevAgentClient<Channel> {
        VdevAgentClient::new(lazy(endpoint))
    }
}

/// Pool `name` with `agents` file agents of 128 MiB.
fn start(dir: &Path, name: &str, agents: usize) -> FilePool {
    let mut p = FilePool::start(dir, &args!["--pool", name, "--report-interval", "100ms"]);
    for _ in 0..agents {
        p.add_agent("128MiB");
    }
    p
}

/// Allocate until the pool serves (agents registered and reported).
async fn allocate(c: &mut AllocatorClient<Channel>) -> pb::AllocateReply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => return r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "never allocatable: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn pattern(seed: u64) -> Vec<u8> {
    (0..MIB)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8)
        .collect()
}

/// Write `n` durable 1 MiB blocks; the extents and their contents.
async fn write_blocks(p: &FilePool, n: u64, seed: u64) -> Vec<(pb::Extent, String, Vec<u8>)> {
    let mut c = p.client();
    let mut out = Vec::new();
    for k in 0..n {
        let a = allocate(&mut c).await;
        let bytes = pattern(seed + k);
        p.agent(&a.endpoints[0])
            .write(pb::WriteRequest {
                offset: a.extents[0].offset,
                data: bytes.clone().into(),
                token: Default::default(),
            })
            .await
            .expect("write");
        p.agent(&a.endpoints[0])
            .flush(pb::FlushRequest {})
            .await
            .expect("flush");
        c.commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: true,
            generation: a.generation,
        })
        .await
        .expect("commit");
        out.push((a.extents[0], a.endpoints[0].clone(), bytes));
    }
    out
}

async fn synced_txg(p: &FilePool) -> u64 {
    p.client()
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner()
        .synced_txg
}

/// The mark in a device's label, read as the agent reads it.
fn label_txg(img: &Path) -> u64 {
    Uberblocks::open(File::open(img).unwrap())
        .unwrap()
        .current()
        .map_or(0, |m| m.txg)
}

/// Wait until every agent's label recorded at least `txg`.
async fn labels_reach(p: &FilePool, txg: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0..p.agents.len() {
        while label_txg(&p.img(i)) < txg {
            assert!(
                Instant::now() < deadline,
                "label of d{i} never reached txg {txg}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The refusal a client sees once an agent proved the store old.
async fn refused(p: &FilePool) -> tonic::Status {
    let mut c = p.client();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => panic!("a rolled-back store allocated {:?}", r.into_inner().extents),
            Err(e) if reason(&e) == "STORE_ROLLED_BACK" => return e,
            Err(e) => {
                // Until an agent registers: nothing is allocatable either
                // (a PostgreSQL allocator turning from standby to leader
                // also drops the connections its standby server held: a
                // call on one then ends as a transport error, or as
                // cancelled when the connection closed under it).
                assert!(
                    e.code() == Code::Unavailable
                        || (e.code() == Code::Unknown && e.message() == "transport error")
                        || (e.code() == Code::Cancelled && e.message() == "operation was canceled"),
                    "{e}"
                );
                assert!(Instant::now() < deadline, "never refused: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn check_blocks(p: &FilePool, blocks: &[(pb::Extent, String, Vec<u8>)]) {
    for (e, ep, bytes) in blocks {
        let back = p
            .agent(ep)
            .read(pb::ReadRequest {
                offset: e.offset,
                size: e.size,
                token: Default::default(),
            })
            .await
            .expect("read")
            .into_inner()
            .data;
        assert!(back == *bytes, "block at {e:?} was overwritten");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_store_is_refused_until_an_operator_rewinds() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = start(dir.path(), "rollback", 2);
    let first = write_blocks(&p, 4, 1).await;
    let t1 = synced_txg(&p).await;
    labels_reach(&p, t1).await;

    // A crash, and the WAL deleted: every txg was checkpointed into the
    // file, so nothing is lost.
    p.alloc.kill9();
    let wal = p.store_dir().join("pool.db-wal");
    let _ = std::fs::remove_file(&wal);
    // Keep this copy of the store: the "backup" restored below.
    let backup = dir.path().join("backup");
    copy_dir(&p.store_dir(), &backup);
    p.alloc.restart().expect("restart without the WAL");
    assert_eq!(synced_txg(&p).await, t1, "a deleted WAL lost nothing");

    // More durable blocks: the labels move past the backup.
    let second = write_blocks(&p, 4, 100).await;
    let t2 = synced_txg(&p).await;
    assert!(t2 > t1);
    labels_reach(&p, t2).await;

    // Restore the older store: refused as soon as an agent registers.
    p.alloc.kill9();
    std::fs::remove_dir_all(p.store_dir()).unwrap();
    copy_dir(&backup, &p.store_dir());
    p.alloc.restart().expect("restart on the old store");
    let e = refused(&p).await;
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(
        e.message().contains("the store is older than the pool"),
        "{e}"
    );
    assert!(
        e.message().contains(&format!("--rewind-to {t1}")),
        "names the way out: {e}"
    );
    let info = e.get_details_error_info().unwrap();
    assert_eq!(info.metadata["store_txg"], t1.to_string());
    assert!(info.metadata["label_txg"].parse::<u64>().unwrap() >= t2);
    // Nothing was written: the store did not move, the newer blocks are
    // intact on the devices.
    assert_eq!(synced_txg(&p).await, t1);
    check_blocks(&p, &second).await;

    // A wrong --rewind-to: the allocator does not start, and says which.
    p.alloc.set_arg("--rewind-to", &(t1 + 1).to_string());
    let err = p.alloc.restart().expect_err("a wrong rewind txg");
    assert!(
        err.to_string().contains(&format!("--rewind-to {t1}")),
        "{err}"
    );
    // The operator accepts the loss: served again, labels rewritten.
    p.alloc.set_arg("--rewind-to", &t1.to_string());
    p.alloc.restart().expect("rewound");
    let a = allocate(&mut p.client()).await;
    assert!(a.extents[0].size > 0);
    check_blocks(&p, &first).await;
    // The acceptance is durable: a later start needs no flag.
    p.alloc.remove_arg("--rewind-to");
    p.alloc.restart().expect("restart after the rewind");
    allocate(&mut p.client()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_store_or_another_pool_does_not_take_over_labelled_devices() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = start(dir.path(), "lost", 1);
    let blocks = write_blocks(&p, 4, 7).await;
    let t = synced_txg(&p).await;
    labels_reach(&p, t).await;

    // The whole data dir is lost: the allocator starts a new, empty pool;
    // the agent's device carries the old pool's label and is refused.
    p.alloc.kill9();
    std::fs::remove_dir_all(p.store_dir()).unwrap();
    p.alloc.restart().expect("restart on an empty data dir");
    let mut c = p.client();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(st.vdevs.is_empty(), "the labelled device joined a new pool");
    let e = c.allocate(data(MIB)).await.unwrap_err();
    assert_ne!(e.code(), Code::Ok);
    let log = std::fs::read_to_string(&p.agents[0].log).unwrap();
    assert!(log.contains("is labelled for pool"), "agent log: {log}");
    assert!(
        log.contains("POOL_MISMATCH") || log.contains("not this pool"),
        "{log}"
    );
    // The refused agent says so: an ERROR, and health NOT_SERVING (what a
    // compose health check asks), not "unreachable, retrying".
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("the pool refuses this device")),
        "{log}"
    );
    let mut health =
        tonic_health::pb::health_client::HealthClient::new(lazy(&p.agents[0].url("grpc")));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("agent health")
            .into_inner();
        if h.status == tonic_health::pb::health_check_response::ServingStatus::NotServing as i32 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a refused agent still says it serves"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check_blocks(&p, &blocks).await;

    // The same for an agent pointed at another pool's allocator.
    let other_dir = dir.path().join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let other = start(&other_dir, "other", 0);
    p.agents[0].set_arg("--allocator", &other.alloc.url("grpc"));
    p.agents[0]
        .restart()
        .expect("agent restarted towards pool B");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = other
        .client()
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(st.vdevs.is_empty(), "another pool's device joined");
    check_blocks(&p, &blocks).await;
}

/// Where the allocator keeps its store in a waiting-out run, and how an
/// older copy of it is saved and restored.
enum Backing {
    /// The data dir's SQLite files, copied.
    Sqlite,
    /// A PostgreSQL server of the test's own, dumped with `pg_dump` and
    /// restored with `psql`.
    Postgres(integration_tests::postgres::Postgres),
}

impl Backing {
    /// The allocator flags for this store.
    fn args(&self) -> Vec<String> {
        match self {
            Backing::Sqlite => Vec::new(),
            // One allocator; a short lease so a restart after -9 takes the
            // pool back quickly.
            Backing::Postgres(pg) => args!["--store", pg.url(), "--leader-lease", "1s"],
        }
    }

    fn pg_tool(&self, tool: &str) -> std::process::Command {
        let Backing::Postgres(pg) = self else {
            unreachable!("a PostgreSQL tool without PostgreSQL")
        };
        let bin = integration_tests::postgres::bin_dir().expect("PostgreSQL binaries");
        let mut c = std::process::Command::new(bin.join(tool));
        c.args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "aliquot",
        ]);
        c.args(["-d", "postgres"]);
        c
    }

    /// Save the store as it is now (the allocator is stopped).
    fn save(&self, p: &FilePool, to: &Path) {
        match self {
            Backing::Sqlite => copy_dir(&p.store_dir(), to),
            Backing::Postgres(_) => {
                std::fs::create_dir_all(to).unwrap();
                let o = self
                    .pg_tool("pg_dump")
                    .args(["--clean", "--if-exists", "-f"])
                    .arg(to.join("dump.sql"))
                    .output()
                    .expect("run pg_dump");
                assert!(o.status.success(), "pg_dump: {o:?}");
            }
        }
    }

    /// Put the saved copy back in place of the store (the allocator is
    /// stopped).
    fn restore(&self, p: &FilePool, from: &Path) {
        match self {
            Backing::Sqlite => {
                std::fs::remove_dir_all(p.store_dir()).unwrap();
                copy_dir(from, &p.store_dir());
            }
            Backing::Postgres(_) => {
                let o = self
                    .pg_tool("psql")
                    .args(["-q", "-v", "ON_ERROR_STOP=1", "-f"])
                    .arg(from.join("dump.sql"))
                    .output()
                    .expect("run psql");
                assert!(o.status.success(), "psql restore: {o:?}");
            }
        }
    }
}

/// The synced txg, once the allocator answers GetPool (a PostgreSQL one
/// answers NOT_LEADER until it took the pool).
async fn synced_txg_when_up(p: &FilePool) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match p.client().get_pool(pb::GetPoolRequest {}).await {
            Ok(r) => return r.into_inner().synced_txg,
            Err(e) => {
                assert!(Instant::now() < deadline, "GetPool never answered: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The waiting-out attack: an older copy of the store restored, the
/// allocator left running on it with txgs every 10 ms (first with no agent
/// connected, then refused by their labels), then plain restarts. No txg
/// syncs past the refusal nor before a label vouched for the store, and
/// every restart, each in a generation number the devices already saw, is
/// refused again; only `--rewind-to` serves it.
async fn a_refused_store_stays_refused(backing: Backing, dir: &Path) {
    let mut a = args!["--pool", "waitout", "--report-interval", "100ms"];
    a.extend(backing.args());
    let mut p = FilePool::start(dir, &a);
    // A PostgreSQL allocator takes the pool after it listens.
    synced_txg_when_up(&p).await;
    for _ in 0..2 {
        p.add_agent("64MiB");
    }
    let first = write_blocks(&p, 4, 1).await;
    let t1 = synced_txg(&p).await;
    labels_reach(&p, t1).await;
    p.alloc.kill9();
    let backup = dir.join("backup");
    backing.save(&p, &backup);
    p.alloc.restart().expect("restart");
    let second = write_blocks(&p, 4, 100).await;
    let t2 = synced_txg_when_up(&p).await;
    labels_reach(&p, t2).await;

    // The older copy back, and no agent: txgs of 10 ms for 2 s would be
    // ~200 empty txgs past the labels' if the store moved unchecked.
    for a in &mut p.agents {
        a.kill();
    }
    p.alloc.kill9();
    backing.restore(&p, &backup);
    p.alloc.set_arg("--zfs-txg-timeout", "10ms");
    p.alloc.restart().expect("restart on the older store");
    let at_restore = synced_txg_when_up(&p).await;
    assert!(at_restore < t2, "the copy is older: {at_restore} vs {t2}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        synced_txg_when_up(&p).await,
        at_restore,
        "txgs synced before any device's label vouched for the store"
    );
    for a in &mut p.agents {
        a.restart().expect("agent back");
    }
    let e = refused(&p).await;
    assert!(
        e.message().contains("the store is older than the pool"),
        "{e}"
    );
    // Refused running: 3 s of 10 ms txgs, none synced.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        synced_txg_when_up(&p).await,
        at_restore,
        "a refused store synced txgs"
    );
    // Plain restarts, by -9 and by SIGTERM: each opens a generation the
    // labels may already name; each is refused, none syncs.
    for round in 0..3 {
        if round == 1 {
            p.alloc.kill();
        } else {
            p.alloc.kill9();
        }
        p.alloc.restart().expect("plain restart");
        let e = refused(&p).await;
        assert!(
            e.message().contains(&format!("--rewind-to {at_restore}")),
            "round {round}: {e}"
        );
        assert_eq!(synced_txg_when_up(&p).await, at_restore, "round {round}");
    }
    check_blocks(&p, &second).await;

    // The operator accepts the loss on purpose: served.
    p.alloc.set_arg("--rewind-to", &at_restore.to_string());
    p.alloc.restart().expect("rewound");
    allocate(&mut p.client()).await;
    check_blocks(&p, &first).await;
    p.alloc.remove_arg("--rewind-to");
    p.alloc.restart().expect("restart after the rewind");
    allocate(&mut p.client()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_sqlite_store_cannot_be_waited_out() {
    let dir = tempfile::tempdir().unwrap();
    a_refused_store_stays_refused(Backing::Sqlite, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_store_restored_from_a_dump_cannot_be_waited_out() {
    let dir = tempfile::tempdir().unwrap();
    let pg = integration_tests::postgres::Postgres::start();
    a_refused_store_stays_refused(Backing::Postgres(pg), dir.path()).await;
}
