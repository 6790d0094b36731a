//! `vdev remove` of a vdev holding blocks nobody can move for the
//! allocator (written by `aliquotctl write --no-manifest`, copies 1 and 2),
//! across real processes over mutual TLS with three file agents: the
//! allocator's mover copies every block agent to agent (CopyFrom, with
//! tokens it mints) and maps each old address to its new extent. Every
//! block then reads back, byte for byte, through its original address;
//! the removed vdev's agent is stopped and its file deleted, and the reads
//! still work. The leader is killed (-9) mid-evacuation and restarted: it
//! resumes from the store and finishes with exactly one live copy of each
//! block. A copy of a two-copy block never lands on its other copy's vdev.
//! Then a fourth vdev joins and the vdev holding most of the moved blocks'
//! new homes is removed too: those blocks move again, their entries point
//! at the newest homes (no chain), and every block still reads back
//! through its original address with both removed vdevs' agents gone.
//! Refusals: a second removal while the first still copies, and removing a
//! vdev whose blocks do not fit elsewhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aliquot_auth::Role;
use aliquot_proto::v1 as pb;
use integration_tests::pool::{Security, file_device, start_agent};
use integration_tests::secure_pool::{SecurePool, SecurePoolSpec, tls_channel};
use integration_tests::{FilePool, Proc, args, ctl, json_u64, ok_stdout};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::transport::Channel;

const AGENTS: [&str; 3] = ["r0", "r1", "r2"];
/// The vdev that joins after the first removal.
const LATE: &str = "r3";

/// `aliquotctl ARGS` as the operator: its output (success or not).
fn op_out(url: &str, certs: &Path, a: &[String]) -> std::process::Output {
    let mut a = a.to_vec();
    a.extend(args!["--allocator", url, "--certs-dir", certs.display()]);
    ctl(&a)
}

fn op(url: &str, certs: &Path, a: &[String]) -> String {
    ok_stdout(&op_out(url, certs, a), &a.join(" "))
}

/// The copies of each block of several, from the allocator's SQLite file:
/// block -> the (vdev, offset) of each copy, where its bytes are.
async fn copy_sets(db: &Path) -> BTreeMap<i64, Vec<(u32, u64)>> {
    use sqlx::{Connection, Row};
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{}?mode=ro", db.display()))
        .await
        .expect("open the store read-only");
    let mut out: BTreeMap<i64, Vec<(u32, u64)>> = BTreeMap::new();
    for r in sqlx::query("SELECT vdev, start, block FROM block_copies")
        .fetch_all(&mut c)
        .await
        .expect("read block_copies")
    {
        let (v, o, b): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
        out.entry(b).or_default().push((v as u32, o as u64));
    }
    out
}

/// The blocks whose copies share a vdev. The write path may place them so:
/// copy d starts at the vdev after copy d-1's and comes round to it when
/// the others cannot take it at that moment, as OpenZFS's
/// `metaslab.c:metaslab_alloc_dva@zfs-2.4.0` does (another metaslab of
/// the same vdev); what a move must never do is join copies that were apart.
async fn copies_together(db: &Path) -> BTreeSet<i64> {
    copy_sets(db)
        .await
        .into_iter()
        .filter(|(_, set)| {
            let vdevs: BTreeSet<u32> = set.iter().map(|c| c.0).collect();
            vdevs.len() < set.len()
        })
        .map(|(b, _)| b)
        .collect()
}

/// Every block of several copies, but those the write placed `together`,
/// has them on distinct vdevs, each copy a live extent; returns how many
/// such blocks there are.
async fn copies_apart(db: &Path, together: &BTreeSet<i64>) -> usize {
    let sets = copy_sets(db).await;
    let (live, _) = stored(db).await;
    let live: BTreeSet<(u32, u64)> = live.iter().map(|e| (e.vdev, e.offset)).collect();
    for (b, set) in &sets {
        let vdevs: BTreeSet<u32> = set.iter().map(|c| c.0).collect();
        if !together.contains(b) {
            assert_eq!(
                vdevs.len(),
                set.len(),
                "block {b}: two copies on one vdev: {set:?}"
            );
        }
        for c in set {
            assert!(live.contains(c), "block {b}: copy {c:?} is not allocated");
        }
    }
    sets.len()
}

/// The durable extents, by vdev, from the allocator's SQLite file.
async fn stored(db: &Path) -> (Vec<pb::Extent>, Vec<(pb::Extent, pb::Extent)>) {
    let (_, p) = aliquot_allocator::sqlite_store::read_only(db)
        .await
        .expect("read the store")
        .expect("a pool");
    let e = |e: metaslab::Extent| pb::Extent {
        vdev: e.vdev,
        offset: e.offset,
        size: e.size,
    };
    (
        p.allocated.iter().map(e).collect(),
        p.mappings.iter().map(|m| (e(m.from), e(m.to))).collect(),
    )
}

struct Pool {
    certs: PathBuf,
    op: AllocatorClient<Channel>,
    /// One connection per agent endpoint, for the many reads.
    agents: BTreeMap<String, VdevAgentClient<Channel>>,
}

impl Pool {
    async fn status(&mut self) -> pb::PoolStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.op.get_pool(pb::GetPoolRequest {}).await {
                Ok(p) => return p.into_inner(),
                Err(e) => {
                    assert!(Instant::now() < deadline, "GetPool: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// Read `e` through its address as the operator: ReadTokens names
    /// where the block is now, its agent serves it there.
    async fn read(&mut self, e: pb::Extent) -> (pb::Extent, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = match self
                .op
                .read_tokens(pb::ReadTokensRequest { extents: vec![e] })
                .await
            {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    assert!(Instant::now() < deadline, "ReadTokens {e:?}: {s}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let at = r.locations[0];
            let st = self.status().await;
            let endpoint = st
                .vdevs
                .iter()
                .find(|v| v.vdev == at.vdev)
                .map(|v| v.endpoint.clone())
                .expect("the new home's vdev");
            let certs = self.certs.clone();
            let ag = self.agents.entry(endpoint.clone()).or_insert_with(|| {
                VdevAgentClient::new(tls_channel(
                    &endpoint,
                    &certs,
                    Role::Admin,
                    aliquot_auth::client::OPERATOR,
                    Role::Agent,
                ))
            });
            match ag
                .read(pb::ReadRequest {
                    offset: at.offset,
                    size: at.size,
                    token: r.tokens[0].clone(),
                })
                .await
            {
                Ok(d) => return (at, d.into_inner().data.to_vec()),
                Err(s) => {
                    assert!(Instant::now() < deadline, "read {e:?} at {at:?}: {s}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn wait_evacuated(&mut self, vdev: u32) -> pb::Evacuation {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = self.status().await;
            if let Some(e) = st.evacuation.as_ref().filter(|e| e.vdev == vdev && e.done) {
                return e.clone();
            }
            assert!(
                Instant::now() < deadline,
                "evacuation of vdev {vdev} never finished: {:?}",
                st.evacuation
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// `aliquotctl write`'s pattern: word j of a block is word 0 xor j × the
/// golden ratio, so a block that is not one (zeros, another's bytes cut
/// short) is seen without knowing the run's nonce.
fn is_a_block(d: &[u8]) -> bool {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let w = |j: usize| u64::from_le_bytes(d[8 * j..8 * j + 8].try_into().unwrap());
    d.len() >= 16 && (0..d.len() / 8).all(|j| w(j) == w(0) ^ (j as u64).wrapping_mul(GOLDEN))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vdev_remove_moves_every_block_and_old_addresses_keep_reading() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let agents: Vec<(&str, &str)> = AGENTS.iter().map(|n| (*n, "64MiB")).collect();
    let SecurePool { pool, certs } = SecurePool::start(
        dir,
        SecurePoolSpec {
            pool: "removal",
            agents: &agents,
            // The vdev that joins after the first removal: admitted now.
            callers: &[
                (Role::Admin, aliquot_auth::client::OPERATOR),
                (Role::Agent, LATE),
            ],
            // Slow enough that the kill below lands mid-evacuation.
            allocator_flags: &args!["--move-rate", "2MiB/s", "--admit-agent", LATE],
        },
    )
    .await;
    let FilePool {
        mut alloc,
        agents,
        url,
        ..
    } = pool;
    let data_dir = dir.join("allocator");
    let mut agents: BTreeMap<String, Proc> =
        agents.into_iter().map(|p| (p.name.clone(), p)).collect();
    let mut pool = Pool {
        certs: certs.clone(),
        op: AllocatorClient::new(tls_channel(
            &url,
            &certs,
            Role::Admin,
            aliquot_auth::client::OPERATOR,
            Role::Allocator,
        )),
        agents: BTreeMap::new(),
    };

    // Blocks without a manifest, one copy and two.
    for (copies, total) in [("1", "9MiB"), ("2", "6MiB")] {
        op(
            &url,
            &certs,
            &args![
                "write",
                "--total",
                total,
                "--block-size",
                "256KiB",
                "--copies",
                copies,
                "--no-progress",
                "--no-manifest"
            ],
        );
    }
    let db = data_dir.join(aliquot_allocator::sqlite_store::DB_FILE);
    let (before, mappings) = stored(&db).await;
    assert!(mappings.is_empty());
    // 6 MiB of 256 KiB blocks with two copies, each linked.
    let together = copies_together(&db).await;
    if !together.is_empty() {
        eprintln!(
            "{} of 24 blocks were written with both copies on one vdev",
            together.len()
        );
    }
    assert_eq!(copies_apart(&db, &together).await, 24);
    let mut bytes = BTreeMap::new();
    for &e in &before {
        let (at, d) = pool.read(e).await;
        assert_eq!(at, e);
        assert!(is_a_block(&d), "block {e:?} does not hold a written block");
        bytes.insert((e.vdev, e.offset), d);
    }
    let st = pool.status().await;
    let victim = st
        .vdevs
        .iter()
        .max_by_key(|v| v.alloc)
        .expect("a vdev")
        .clone();
    let on_victim: Vec<pb::Extent> = before
        .iter()
        .filter(|e| e.vdev == victim.vdev)
        .copied()
        .collect();
    assert!(on_victim.len() >= 4, "{before:?}");
    let victim_bytes: u64 = on_victim.iter().map(|e| e.size).sum();

    // Removal starts an evacuation.
    let out = op(&url, &certs, &args!["vdev", "remove", victim.name]);
    assert!(out.contains("is being removed"), "{out}");
    // Another removal waits while this one copies.
    let other = st
        .vdevs
        .iter()
        .find(|v| v.vdev != victim.vdev)
        .unwrap()
        .clone();
    let refused = op_out(&url, &certs, &args!["vdev", "remove", other.name]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("one removal at a time"),
        "{err}"
    );

    // Kill -9 of the leader once some blocks moved, not all.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let e = pool.status().await.evacuation.expect("an evacuation");
        assert!(!e.done, "finished before the kill: {e:?}");
        if e.copied_extents > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "nothing moved: {e:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    alloc.kill9();
    let (_, mid) = stored(&db).await;
    assert!(
        mid.len() < on_victim.len(),
        "every block had moved before the kill: {} of {}",
        mid.len(),
        on_victim.len()
    );
    alloc.restart().expect("allocator restarts");
    // The restart resumes from the store; faster now, set at run time.
    let t = pool
        .op
        .set_tunable(pb::SetTunableRequest {
            name: "move_rate".into(),
            value: "256MiB/s".into(),
        })
        .await;
    if let Err(s) = t {
        // The first call after the restart may race its listener.
        tokio::time::sleep(Duration::from_millis(500)).await;
        pool.op
            .set_tunable(pb::SetTunableRequest {
                name: "move_rate".into(),
                value: "256MiB/s".into(),
            })
            .await
            .unwrap_or_else(|e| panic!("set move_rate: {s}; again: {e}"));
    }
    let ev = pool.wait_evacuated(victim.vdev).await;
    assert_eq!(ev.total_extents, on_victim.len() as u64, "{ev:?}");
    assert_eq!(ev.total_bytes, victim_bytes, "{ev:?}");
    assert_eq!(ev.copied_bytes, victim_bytes, "{ev:?}");
    assert_eq!(ev.mapping_entries, on_victim.len() as u64, "{ev:?}");
    assert_eq!(ev.mapping_bytes, 32 * on_victim.len() as u64, "{ev:?}");
    let table = op(&url, &certs, &args!["status"]);
    assert!(
        table.contains(&format!("remove: {} ({})", victim.name, victim.vdev))
            && table.contains("done, indirect"),
        "{table}"
    );
    let js: serde_json::Value =
        serde_json::from_str(&op(&url, &certs, &args!["status", "--json"])).unwrap();
    assert_eq!(
        json_u64(&js["evacuation"]["copied_bytes"]),
        Some(victim_bytes)
    );
    assert_eq!(js["evacuation"]["done"], true);

    // Exactly one live copy of each block: one entry per old extent, its
    // new extent allocated off the victim, and nothing else new.
    let (after, mappings) = stored(&db).await;
    assert_eq!(mappings.len(), on_victim.len());
    let live: std::collections::BTreeSet<_> =
        after.iter().map(|e| (e.vdev, e.offset, e.size)).collect();
    for (from, to) in &mappings {
        assert_eq!(from.vdev, victim.vdev);
        assert_ne!(to.vdev, victim.vdev);
        assert_eq!(from.size, to.size);
        assert!(live.contains(&(to.vdev, to.offset, to.size)), "{to:?}");
    }
    let not_victim = |v: &[pb::Extent]| v.iter().filter(|e| e.vdev != victim.vdev).count();
    assert_eq!(not_victim(&after), not_victim(&before) + on_victim.len());
    assert_eq!(
        after.iter().filter(|e| e.vdev == victim.vdev).count(),
        on_victim.len(),
        "the old extents stay allocated behind their entries"
    );

    assert_eq!(copies_apart(&db, &together).await, 24);

    // The victim's agent stopped, its file gone: every block still reads,
    // byte for byte, through its original address.
    let mut gone = agents.remove(&victim.name).unwrap();
    gone.kill();
    std::fs::remove_file(dir.join(format!("{}.img", victim.name))).unwrap();
    for &e in &before {
        let (at, d) = pool.read(e).await;
        if e.vdev == victim.vdev {
            assert_ne!(
                at.vdev, victim.vdev,
                "{e:?} still served by the removed vdev"
            );
        }
        assert!(
            d == bytes[&(e.vdev, e.offset)],
            "block {e:?} read at {at:?} differs from what was written"
        );
    }

    // A fourth vdev joins; the vdev holding most of the moved blocks' new
    // homes is removed while the victim is still indirect.
    agents.insert(
        LATE.to_string(),
        start_agent(
            dir,
            Security::Tls(&certs),
            &url,
            LATE,
            &file_device(&dir.join(format!("{LATE}.img")), "64MiB"),
            &[],
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let late = loop {
        let p = pool.status().await;
        if let Some(v) = p
            .vdevs
            .iter()
            .find(|v| v.name == LATE && v.last_report.is_some())
        {
            break v.clone();
        }
        assert!(Instant::now() < deadline, "{LATE} never reported: {p:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut homes: BTreeMap<u32, usize> = BTreeMap::new();
    for (_, to) in &mappings {
        *homes.entry(to.vdev).or_default() += 1;
    }
    let (&second, _) = homes.iter().max_by_key(|(_, n)| **n).unwrap();
    let second = st.vdevs.iter().find(|v| v.vdev == second).unwrap().clone();
    let t = Instant::now();
    let out = op(&url, &certs, &args!["vdev", "remove", second.name]);
    assert!(out.contains("is being removed"), "{out}");
    let ev2 = pool.wait_evacuated(second.vdev).await;
    eprintln!(
        "second removal: {} extents, {} bytes copied in {:.2?} (move_rate 256MiB/s)",
        ev2.total_extents,
        ev2.copied_bytes,
        t.elapsed()
    );
    let (after2, mappings2) = stored(&db).await;
    let live: std::collections::BTreeSet<_> =
        after2.iter().map(|e| (e.vdev, e.offset, e.size)).collect();
    let on_second = before.iter().filter(|e| e.vdev == second.vdev).count();
    // One entry per old extent of either vdev, each one hop to a live
    // extent on neither removed vdev (never another entry's old extent).
    assert_eq!(mappings2.len(), on_victim.len() + on_second);
    let olds: std::collections::BTreeSet<_> =
        mappings2.iter().map(|(f, _)| (f.vdev, f.offset)).collect();
    for (from, to) in &mappings2 {
        assert!([victim.vdev, second.vdev].contains(&from.vdev), "{from:?}");
        assert!(![victim.vdev, second.vdev].contains(&to.vdev), "{to:?}");
        assert!(live.contains(&(to.vdev, to.offset, to.size)), "{to:?}");
        assert!(!olds.contains(&(to.vdev, to.offset)), "a chain at {to:?}");
    }
    assert!(
        mappings2.iter().any(|(_, to)| to.vdev == late.vdev),
        "nothing moved to {LATE}"
    );
    assert_eq!(copies_apart(&db, &together).await, 24);
    let mut gone = agents.remove(&second.name).unwrap();
    gone.kill();
    std::fs::remove_file(dir.join(format!("{}.img", second.name))).unwrap();
    for &e in &before {
        let (at, d) = pool.read(e).await;
        assert!(
            ![victim.vdev, second.vdev].contains(&at.vdev),
            "{e:?} still served at {at:?}"
        );
        assert!(
            d == bytes[&(e.vdev, e.offset)],
            "block {e:?} read at {at:?} differs from what was written"
        );
    }
    drop(agents);
}
