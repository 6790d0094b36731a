//! Restart cost at large extent counts, and the txg sync of many frees on
//! a large store. Prints figures (no harness):
//!
//!   cargo bench -p aliquot-allocator --bench restart
//!
//! `ALIQUOT_BENCH_EXTENTS` (default 10^7) 4 KiB extents are written straight
//! into a store file's space maps, in two layouts: `gapped` (one block every 8 KiB, so
//! nothing coalesces: the worst case) and `packed` (back to back). Each
//! restart runs in a fresh child process (this binary re-executed), so its
//! peak RSS (VmHWM) is the restart's own: open + load + `recovery::rebuild`,
//! i.e. what the allocator does before it serves. "live" is the RSS once the
//! loaded rows are dropped and only the pool remains; the target is
//! peak ≤ 1.5× live and restart ≤ 5 s.
//! `ALIQUOT_BENCH_OWNERS=alternating` adds the worst case of extent owners:
//! every extent the other of two clients' than its neighbours.
//! Then the child frees `ALIQUOT_BENCH_FREES` (default 10^6) of the extents
//! and times `Pool::sync` and `SqliteStore::persist` of that txg (target ≤ 1 s),
//! then a second txg of as many frees spread over the remaining extents,
//! five txgs of 1000 spread frees, and a restart (open + load) that replays
//! what the log space map then holds. `ALIQUOT_BENCH_FLUSH_ALL=1` flushes
//! every dirty metaslab each txg (the baseline without the log's deferral);
//! `ALIQUOT_BENCH_LOG_BLOCK_MAX=N` bounds the log to N blocks of 8192
//! changes (`zfs_unflushed_log_block_max`), so that the restart replays a
//! full log. `ALIQUOT_BENCH_UNCHECKED=1` hands the store every txg as not
//! checked by the pool (`TxgSync::checked` false): it checks the changes
//! against the chunks they fall in, as before the pool's check.
//! Before the frees, the store's exact-extent lookup (`allocated_overlapping`,
//! asked per extent by Claim) is timed over 10^4 extents, and Free's batch
//! form (`allocated_overlapping_many`) over requests of 1024 neighbouring
//! or scattered extents.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use aliquot_allocator::SqliteStore;
use aliquot_allocator::store::{Store, TxgRecord, VdevRecord};
use aliquot_allocator::{owner_map, recovery, spacemap};
use metaslab::{Extent, Pool, Tunables, VdevRole, VdevSpec};

const GIB: u64 = 1 << 30;
const BLOCK: u64 = 4096;
const CHILD_ENV: &str = "ALIQUOT_BENCH_RESTART_CHILD";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// `VmHWM` and `VmRSS` of this process, in MiB.
fn mem_mib() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn stride(layout: &str) -> u64 {
    if layout == "gapped" { 2 * BLOCK } else { BLOCK }
}

/// A store holding one 1 TiB vdev and `n` extents in `layout`.
async fn build(path: &Path, n: u64, layout: &str) {
    let store = SqliteStore::open(path, "bench", None).await.unwrap();
    store.create(7).await.unwrap();
    let mut pool = Pool::new(Tunables::default());
    let spec = VdevSpec {
        capacity: 1024 * GIB,
        ashift: 12,
        children: 1,
        parity: 0,
        rotational: false,
        role: VdevRole::Normal,
        metaslab_shift: None,
    };
    let id = pool.add_vdev(spec).unwrap();
    let stats = pool.stats();
    let mut s = stats.vdevs[0].spec.clone();
    s.metaslab_shift = Some(stats.vdevs[0].metaslab_shift);
    store
        .persist(&TxgRecord {
            sync: pool.sync(),
            vdevs: vec![VdevRecord {
                id,
                guid: 1,
                name: "bench".into(),
                endpoint: "http://127.0.0.1:1".into(),
                spec: s,
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    store.close().await;
    // The space maps themselves, written directly (the store's own persist
    // path is what the txg of frees measures; here only the file matters).
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!(
        "sqlite://{}",
        path.display()
    ))
    .await
    .unwrap();
    let st = stride(layout);
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let per = spacemap::CHUNK_EXTENTS as u64;
    let mut run: Vec<(u64, u64)> = Vec::with_capacity(per as usize);
    for first in (0..n).step_by(per as usize) {
        run.clear();
        run.extend((first..(first + per).min(n)).map(|k| (k * st, BLOCK)));
        let c = spacemap::Chunk::encode(id, &run);
        sqlx::query(
            "INSERT INTO spacemaps (pool, vdev, start, width, data) VALUES (1, ?, ?, ?, ?)",
        )
        .bind(id as i64)
        .bind(c.start as i64)
        .bind(c.width as i64)
        .bind(c.data)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    // Owners: `ALIQUOT_BENCH_OWNERS=alternating` gives every
    // extent the other of two owners than its neighbours: one owner run per
    // extent, the worst case (one client per pool is one run per vdev).
    if std::env::var("ALIQUOT_BENCH_OWNERS").as_deref() == Ok("alternating") {
        for (idx, name) in [(1i64, "client/a"), (2, "client/b")] {
            sqlx::query("INSERT INTO owners (pool, idx, identity) VALUES (1, ?, ?)")
                .bind(idx)
                .bind(name)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        let runs: Vec<(u64, u64, u32)> = (0..n)
            .map(|k| (k * st, k * st + BLOCK, 1 + (k % 2) as u32))
            .collect();
        for (window, data) in owner_map::rows(&runs) {
            sqlx::query("INSERT INTO owner_maps (pool, vdev, start, data) VALUES (1, ?, ?, ?)")
                .bind(id as i64)
                .bind(window as i64)
                .bind(data)
                .execute(&mut *tx)
                .await
                .unwrap();
        }
    }
    tx.commit().await.unwrap();
    sqlx::query("UPDATE vdevs SET allocated = ? WHERE pool = 1 AND id = ?")
        .bind((n * BLOCK) as i64)
        .bind(id as i64)
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::Connection::close(conn).await.unwrap();
}

/// The measured part, in a child process.
async fn child(path: &Path, layout: &str) {
    let t = Instant::now();
    let store = SqliteStore::open(path, "bench", None).await.unwrap();
    if let Ok(v) = std::env::var("ALIQUOT_BENCH_LOG_BLOCK_MAX") {
        // A smaller replay bound: the log fills to it, and a restart
        // replays a full log.
        let mut t = store.log_tunables().expect("an SQL store");
        t.zfs_unflushed_log_block_max = v.parse().expect("ALIQUOT_BENCH_LOG_BLOCK_MAX: a number");
        store.set_log_tunables(t);
    }
    if std::env::var("ALIQUOT_BENCH_FLUSH_ALL").as_deref() == Ok("1") {
        // The baseline: every dirty metaslab flushed each txg (a txg
        // rewrites every chunk it touched, as before the log space map).
        store.set_log_tunables(aliquot_allocator::spacemap_log::LogTunables {
            zfs_min_metaslabs_to_flush: u64::MAX,
            ..Default::default()
        });
    }
    let opened = t.elapsed();
    let p = store.load().await.unwrap().expect("a pool");
    let loaded = t.elapsed();
    let mut pool = recovery::rebuild(Tunables::default(), &p).expect("consistent");
    let mut p = p;
    let owner_runs = p.owner_runs.len();
    let mut owners = aliquot_allocator::extent_owners::ExtentOwners::restore(
        std::mem::take(&mut p.owner_identities),
        std::mem::take(&mut p.owner_runs),
    );
    let ready = t.elapsed();
    let (rows, ranges) = (
        env_u64("ALIQUOT_BENCH_EXTENTS", 10_000_000),
        p.allocated.len(),
    );
    drop(p);
    if owner_runs > 0 {
        println!(
            "{layout:>6} {owner_runs} owner runs loaded ({} in memory)",
            owners.runs()
        );
    }
    let (peak, live) = mem_mib();
    println!(
        "{layout:>6} {rows:>9} extents ({ranges:>9} ranges) | open {:>6.2} s, load {:>6.2} s, rebuild {:>6.2} s: serving after {:>6.2} s | peak RSS {peak:>7.0} MiB, live {live:>7.0} MiB ({:.2}x)",
        opened.as_secs_f64(),
        (loaded - opened).as_secs_f64(),
        (ready - loaded).as_secs_f64(),
        ready.as_secs_f64(),
        peak / live.max(1.0),
    );

    let st = stride(layout);
    // Claim's and Free's exact-extent check asks the store per extent.
    let probes = 10_000u64;
    let t = Instant::now();
    for k in 0..probes {
        let e = Extent {
            vdev: 0,
            offset: (k * 7919 % rows) * st,
            size: BLOCK,
        };
        let hit = store.allocated_overlapping(e).await.unwrap();
        assert_eq!(hit, vec![e]);
    }
    println!(
        "{layout:>6} allocated_overlapping (the exact-extent check): {:.1} us per extent",
        t.elapsed().as_secs_f64() * 1e6 / probes as f64
    );
    // Free checks a whole request at once (`allocated_overlapping_many`):
    // requests of 1024 extents, neighbours (a run of blocks, as a manifest
    // lists them) or scattered over the vdev (its spans halved down to
    // single lookups).
    for (what, step) in [("neighbours", 1), ("scattered", 7919)] {
        let batches = 10u64;
        let t = Instant::now();
        for b in 0..batches {
            let batch: Vec<Extent> = (0..1024u64)
                .map(|k| Extent {
                    vdev: 0,
                    offset: ((b * 1024 + k) * step % rows) * st,
                    size: BLOCK,
                })
                .collect();
            let hits = store.allocated_overlapping_many(&batch).await.unwrap();
            assert!(hits.iter().zip(&batch).all(|(h, e)| h == &[*e]));
        }
        println!(
            "{layout:>6} allocated_overlapping_many, 1024 {what}: {:.2} us per extent",
            t.elapsed().as_secs_f64() * 1e6 / (batches * 1024) as f64
        );
    }

    let unchecked = std::env::var("ALIQUOT_BENCH_UNCHECKED").as_deref() == Ok("1");
    let frees = env_u64("ALIQUOT_BENCH_FREES", 1_000_000).min(rows);
    let ext: Vec<Extent> = (0..frees)
        .map(|k| Extent {
            vdev: 0,
            offset: k * st,
            size: BLOCK,
        })
        .collect();
    pool.free(&ext).unwrap();
    let t = Instant::now();
    owners.freed(&ext);
    let owner_changes = owners.take_changes();
    let owner_time = t.elapsed();
    drop(ext);
    let t = Instant::now();
    let sync = pool.sync();
    let pool_sync = t.elapsed();
    let mut rec = TxgRecord {
        sync,
        vdevs: Vec::new(),
        owners: owner_changes,
        ..Default::default()
    };
    rec.sync.checked &= !unchecked;
    let t = Instant::now();
    store.persist(&rec).await.unwrap();
    let persist = t.elapsed();
    if owner_runs > 0 {
        println!(
            "{layout:>6} owners of {frees} frees: {:.3} s in memory (persisted with the txg below)",
            owner_time.as_secs_f64()
        );
    }
    println!(
        "{layout:>6} txg of {frees} frees | Pool::sync {:>7.3} s, persist {:>7.3} s, total {:>7.3} s",
        pool_sync.as_secs_f64(),
        persist.as_secs_f64(),
        (pool_sync + persist).as_secs_f64(),
    );

    // The same number of frees spread evenly over the remaining extents:
    // every space-map chunk is rewritten (the first txg touched a prefix).
    let step = ((rows - frees) / frees.max(1)).max(1);
    let ext: Vec<Extent> = (0..frees)
        .map(|j| frees + j * step)
        .take_while(|&k| k < rows)
        .map(|k| Extent {
            vdev: 0,
            offset: k * st,
            size: BLOCK,
        })
        .collect();
    let n = ext.len();
    pool.free(&ext).unwrap();
    owners.freed(&ext);
    drop(ext);
    let t = Instant::now();
    let sync = pool.sync();
    let owner_changes = owners.take_changes();
    let pool_sync = t.elapsed();
    let mut rec = TxgRecord {
        sync,
        vdevs: Vec::new(),
        owners: owner_changes,
        ..Default::default()
    };
    rec.sync.checked &= !unchecked;
    let t = Instant::now();
    store.persist(&rec).await.unwrap();
    let persist = t.elapsed();
    println!(
        "{layout:>6} txg of {n} spread frees | Pool::sync {:>7.3} s, persist {:>7.3} s, total {:>7.3} s",
        pool_sync.as_secs_f64(),
        persist.as_secs_f64(),
        (pool_sync + persist).as_secs_f64(),
    );

    // Small txgs on the large store: 1000 frees spread over what is left
    // (the log space map's flushes of earlier txgs go on meanwhile).
    // Extents neither txg above freed: beside the spread frees, a step apart.
    let step2 = ((rows - frees) / 1000).max(1);
    let mut times = Vec::new();
    for round in 0..5u64 {
        let ext: Vec<Extent> = (0..1000u64)
            .map(|j| frees + j * step2 + 1 + round)
            .filter(|&k| k < rows && (k - frees) % step != 0)
            .map(|k| Extent {
                vdev: 0,
                offset: k * st,
                size: BLOCK,
            })
            .collect();
        pool.free(&ext).unwrap();
        owners.freed(&ext);
        let sync = pool.sync();
        let mut rec = TxgRecord {
            sync,
            owners: owners.take_changes(),
            ..Default::default()
        };
        rec.sync.checked &= !unchecked;
        let t = Instant::now();
        store.persist(&rec).await.unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{layout:>6} txg of 1000 spread frees: persist median {:.1} ms (of 5: {:?})",
        times[2],
        times
            .iter()
            .map(|t| (t * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
    store.close().await;
    // A restart now replays what the log holds.
    let t = Instant::now();
    let store = SqliteStore::open(path, "bench", None).await.unwrap();
    let p = store.load().await.unwrap().unwrap();
    let replayed = store.log_size().await.expect("loaded");
    println!(
        "{layout:>6} restart with the log: open + load {:.3} s ({} extents; the log {} changes in {} rows, {} blocks)",
        t.elapsed().as_secs_f64(),
        p.allocated.len(),
        replayed.0,
        replayed.1,
        replayed.2,
    );
    store.close().await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let (layout, path) = spec.split_once(':').expect("layout:path");
        child(Path::new(path), layout).await;
        return;
    }
    let n = env_u64("ALIQUOT_BENCH_EXTENTS", 10_000_000);
    let exe = std::env::current_exe().unwrap();
    for layout in ["gapped", "packed"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.db");
        let t = Instant::now();
        build(&path, n, layout).await;
        eprintln!(
            "{layout}: built {n} extents in {:.1} s ({} MiB file)",
            t.elapsed().as_secs_f64(),
            std::fs::metadata(&path).map(|m| m.len() >> 20).unwrap_or(0)
        );
        let status = Command::new(&exe)
            .env("ALIQUOT_BENCH_EXTENTS", n.to_string())
            .env(CHILD_ENV, format!("{layout}:{}", path.display()))
            .status()
            .unwrap();
        assert!(status.success(), "restart child failed: {status}");
    }
}
