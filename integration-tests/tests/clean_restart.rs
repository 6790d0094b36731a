//! A SQLite allocator stopped cleanly (SIGTERM: its last txg synced, no
//! claim window open) says so in its store, as a PostgreSQL leader handing
//! over does: the next start opens no claim window. A kill -9 leaves no such
//! mark, and the next start opens one. A kill -9 with changes only in the
//! log space map loses none of them.

use integration_tests::{FilePool, args, json_u64};

fn window_ms(p: &FilePool) -> u64 {
    json_u64(&p.status()["claim_window_remaining_ms"]).expect("claim_window_remaining_ms")
}

/// One 64 MiB file agent, a 30 s claim window and fast txgs.
fn pool(dir: &std::path::Path) -> FilePool {
    let mut p = FilePool::start_with_default_timings(
        dir,
        &args!["--claim-window", "30s", "--zfs-txg-timeout", "200ms"],
    );
    p.add_agent("64MiB");
    p
}

/// `total` written as 1 MiB blocks (the default) nobody keeps a manifest of.
fn write_1mib_blocks(p: &FilePool, total: &str) {
    p.ok(&args![
        "write",
        "--total",
        total,
        "--no-progress",
        "--no-manifest"
    ]);
}

#[test]
fn a_clean_shutdown_opens_no_claim_window_and_a_crash_does() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = pool(tmp.path());
    write_1mib_blocks(&p, "4MiB");
    // SIGTERM: the last txg syncs, the shutdown is marked clean.
    p.alloc.kill();
    p.alloc.restart().expect("restart");
    assert_eq!(window_ms(&p), 0, "a clean shutdown left something to claim");
    write_1mib_blocks(&p, "4MiB");
    // kill -9: nothing says clean; the next start waits for claims.
    p.alloc.kill9();
    p.alloc.restart().expect("restart");
    assert!(window_ms(&p) > 0, "a crash opened no claim window");
}

/// A pool without write tokens: its agents check no token but remember
/// each write's range under the generation they had joined, so after a
/// kill -9 they name what the older generation wrote and their vdevs serve
/// new allocations at once, inside the claim window, with only those
/// ranges held for claims (before, every vdev was kept out for the whole
/// window).
#[test]
fn without_tokens_a_crash_keeps_only_older_writes_out_not_the_vdevs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = pool(tmp.path());
    write_1mib_blocks(&p, "8MiB");
    p.alloc.kill9();
    p.alloc.restart().expect("restart");
    assert!(window_ms(&p) > 0, "a crash opened no claim window");
    p.ok(&args![
        "write",
        "--total",
        "4MiB",
        "--verify",
        "--no-progress",
        "--no-manifest"
    ]);
    let left = window_ms(&p);
    assert!(
        left > 0,
        "the write finished only after the 30 s claim window: the vdev was kept out"
    );
    eprintln!("written inside the claim window ({left} ms of it left)");
}

/// The allocator's store: extents (as `aliquotctl verify` reads them) and
/// the log space map's rows and flushed metaslabs.
fn store_of(p: &FilePool) -> (Vec<(u32, u64, u64)>, i64, i64) {
    use aliquot_allocator::sqlite_store;
    let db = p.dir.join("allocator").join(sqlite_store::DB_FILE);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (_, persisted) = sqlite_store::read_only(&db)
            .await
            .expect("store readable")
            .expect("pool exists");
        aliquot_allocator::recovery::verify(&persisted).expect("consistent");
        let extents = persisted
            .allocated
            .iter()
            .map(|e| (e.vdev, e.offset, e.size))
            .collect();
        let o = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&db)
            .read_only(true);
        let mut c = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&o)
            .await
            .unwrap();
        let (rows, flushed): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT COUNT(*) FROM spacemap_log), (SELECT COUNT(*) FROM metaslab_flushes)",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        (extents, rows, flushed)
    })
}

fn write(p: &FilePool, total: &str) {
    p.ok(&args![
        "write",
        "--total",
        total,
        "--block-size",
        "64KiB",
        "--no-progress",
        "--no-manifest"
    ]);
}

/// The log space map across kill -9: first with nothing flushed (every
/// change only in the log), then with the default policy flushing a few
/// metaslabs a txg (some flushed, others only in the log). Each restart
/// replays the log into exactly the extents the store held before the
/// kill, and `aliquotctl verify` agrees.
#[test]
fn a_crash_with_changes_only_in_the_log_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(
        tmp.path(),
        &args!["--tunable", "zfs_min_metaslabs_to_flush=0"],
    );
    p.add_agent("128MiB");
    p.add_agent("128MiB");
    write(&p, "4MiB");
    let (before, rows, flushed) = store_of(&p);
    assert!(!before.is_empty());
    assert!(
        rows > 0 && flushed == 0,
        "{rows} log rows, {flushed} flushed"
    );
    p.alloc.kill9();
    assert_eq!(store_of(&p).0, before, "the store after kill -9");
    // The operator's tool on the stopped pool replays the log too.
    let out = std::process::Command::new(integration_tests::bin("aliquotctl"))
        .args(["verify", "--db"])
        .arg(p.dir.join("allocator").join("pool.db"))
        .output()
        .expect("run aliquotctl verify");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "aliquotctl verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The default policy: a metaslab or more flushed each txg.
    p.alloc.set_arg("--tunable", "zfs_min_metaslabs_to_flush=1");
    p.alloc.restart().expect("restart");
    assert_eq!(store_of(&p).0, before, "replayed at the restart");
    write(&p, "4MiB");
    let (before, _, flushed) = store_of(&p);
    assert!(flushed > 0, "nothing flushed");
    p.alloc.kill9();
    assert_eq!(store_of(&p).0, before, "the store after kill -9");
    p.alloc.restart().expect("restart");
    assert_eq!(store_of(&p).0, before, "replayed at the restart");
    write(&p, "1MiB");
}
