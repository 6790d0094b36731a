//! The balancer end to end with real processes: an allocator and file
//! agents, `aliquotctl write --manifest` filling two vdevs, a third vdev
//! added, then `aliquotctl balancer eval/execute/status/verify`, `vdev
//! drain` and `vdev remove`. Checked: the score is bad after the add and
//! falls below 0.05 after `execute`; no plan moves more than its bound
//! (5 % of the allocated bytes); every block reads back intact and no byte
//! leaks (`verify --exclusive`); a drained vdev empties and is removed, for
//! good across an allocator restart; no plan while a vdev is unavailable;
//! and a mover killed mid-plan (abort at a failpoint, and kill -9 at a
//! random instant) resumes without losing, duplicating or leaking a block.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{FilePool, args, bin, ctl, ok_stdout};

const MIB: u64 = 1 << 20;
/// Score above which the pool counts as unbalanced after the add.
const BAD_SCORE: f64 = 0.15;
/// What `execute` must bring the score under.
const GOOD_SCORE: f64 = 0.05;

/// The shared test pool (`integration_tests::FilePool`) with the balancer's
/// checks; a killed mover's unjournaled relocation is released soon
/// (`--lease 2s`).
struct Pool(FilePool);

impl std::ops::Deref for Pool {
    type Target = FilePool;
    fn deref(&self) -> &FilePool {
        &self.0
    }
}

impl std::ops::DerefMut for Pool {
    fn deref_mut(&mut self) -> &mut FilePool {
        &mut self.0
    }
}

impl Pool {
    fn start(dir: &Path) -> Pool {
        Pool(FilePool::start(dir, &args!["--lease", "2s"]))
    }

    fn status(&self) -> serde_json::Value {
        let out = ok_stdout(
            &ctl(&args!["status", "--allocator", self.url, "--json"]),
            "status",
        );
        serde_json::from_str(&out).expect("status json")
    }

    fn wait(&self, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if ok(&self.status()) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Until every vdev's health is `healthy`.
    fn wait_healthy(&self, what: &str) {
        self.wait(what, |s| {
            s["vdevs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|v| v["health"] == "healthy")
        });
    }

    fn ctl(&self, a: &[String]) -> String {
        let mut a = a.to_vec();
        a.extend(args!["--allocator", self.url]);
        ok_stdout(&ctl(&a), &a.join(" "))
    }

    fn json(&self, a: &[String]) -> serde_json::Value {
        let mut a = a.to_vec();
        a.push("--json".into());
        let out = self.ctl(&a);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    fn score(&self) -> f64 {
        let e = self.json(&args!["balancer", "eval"]);
        e["classes"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["class"] == "normal"))
            .and_then(|c| c["score"].as_f64())
            .expect("normal class score")
    }

    fn allocated(&self) -> u64 {
        let s = self.status();
        s["vdevs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["alloc"].as_str().unwrap().parse::<u64>().unwrap())
            .sum()
    }

    fn manifest(&self) -> PathBuf {
        self.dir.join("manifest.jsonl")
    }

    fn verify_exclusive(&self) {
        let m = self.manifest();
        let out = self.ctl(&args![
            "balancer",
            "verify",
            "--manifest",
            m.display(),
            "--exclusive"
        ]);
        assert!(out.contains("all intact"), "{out}");
    }

    /// `balancer execute` as a child process (for kills), plaintext.
    fn execute_child(&self, extra: &[String], failpoint: Option<&str>) -> std::process::Child {
        let mut cmd = Command::new(bin("aliquotctl"));
        cmd.args(args![
            "balancer",
            "execute",
            "--manifest",
            self.manifest().display(),
            "--allocator",
            self.url,
            "--json"
        ])
        .args(extra)
        .env("ALIQUOT_INSECURE", "1")
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if let Some(f) = failpoint {
            cmd.env("ALIQUOT_FAILPOINT", f);
        }
        cmd.spawn().expect("spawn execute")
    }
}

/// Moves the manifest's journal leaves pending (neither moved nor dropped).
fn unresolved(manifest: &Path) -> u64 {
    let body = std::fs::read_to_string(manifest).unwrap();
    let count = |k: &str| body.lines().filter(|l| l.starts_with(k)).count() as u64;
    count("{\"pending\"") - count("{\"moved\"") - count("{\"dropped\"")
}

/// The moves a mover its failpoint aborted left open in the journal: at
/// least one (the mover's stderr says why if none).
fn left_open(p: &Pool, out: &std::process::Output) -> u64 {
    assert!(!out.status.success(), "the failpoint aborts the mover");
    let open = unresolved(&p.manifest());
    assert!(
        open >= 1,
        "no move left open in the journal; the mover said: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    open
}

fn report(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "execute failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("execute json")
}

/// The normal class's misplaced bytes in `balancer eval --json`.
fn misplaced(eval: &serde_json::Value) -> u64 {
    eval["classes"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["class"] == "normal"))
        .and_then(|c| c["misplaced"].as_str())
        .and_then(|m| m.parse().ok())
        .expect("normal class misplaced")
}

/// Write 96 MiB to two vdevs with a manifest, then add an empty third.
fn filled(dir: &Path) -> Pool {
    let mut p = Pool::start(dir);
    p.add_agent("128MiB");
    p.add_agent("128MiB");
    let m = p.manifest();
    p.ctl(&args![
        "write",
        "--total",
        "96MiB",
        "--block-size",
        "1MiB",
        "--concurrency",
        "8",
        "--manifest",
        m.display(),
        "--no-progress"
    ]);
    p.add_agent("128MiB");
    // A loaded machine can leave a vdev flagged for a report or two after
    // the write (its last writes slow, or a report late): plans wait for a
    // whole pool, so the tests start from one.
    p.wait_healthy("every vdev healthy");
    p
}

#[test]
fn execute_balances_a_new_vdev_within_bounds_and_every_block_survives() {
    let tmp = tempfile::tempdir().unwrap();
    let p = filled(tmp.path());
    let before = p.score();
    assert!(
        before > BAD_SCORE,
        "a new empty vdev is a bad score: {before}"
    );
    let allocated = p.allocated();
    let misplaced = misplaced(&p.json(&args!["balancer", "eval"]));
    let m = p.manifest();
    let r = p.json(&args![
        "balancer",
        "execute",
        "--manifest",
        m.display(),
        "--rate",
        "256MiB/s",
        "--budget",
        "4MiB",
        "--target-score",
        "0.02",
        "--no-progress"
    ]);
    let plans = r["plans"].as_array().unwrap();
    assert!(plans.len() >= 2, "4 MiB per plan takes several: {r}");
    // The budget (4 MiB) is below the misplaced bound (5 % ≈ 4.8 MiB).
    let bound = (allocated / 20).min(4 * MIB);
    for pl in plans {
        let moved = pl["moved_bytes"].as_u64().unwrap();
        assert!(moved <= bound, "a plan moved {moved} > bound {bound}: {r}");
        assert!(moved <= pl["planned_bytes"].as_u64().unwrap(), "{pl}");
        assert_eq!(pl["foreign_moves"].as_u64(), Some(0), "{pl}");
        // Every skip is counted under exactly one reason.
        let by_reason: u64 = pl["skipped_by_reason"]
            .as_object()
            .unwrap_or_else(|| panic!("no skipped_by_reason: {pl}"))
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(Some(by_reason), pl["skipped"].as_u64(), "{pl}");
    }
    let after = p.score();
    assert!(after < GOOD_SCORE, "score {before} → {after}: {r}");
    assert!(r["moved_bytes"].as_u64().unwrap() > 16 * MIB, "{r}");
    // The plan's lower bound is eval's misplaced bytes (both the excess of
    // the over-full vdevs over their shares; eval rounds each share down).
    let bound = r["lower_bound_bytes"].as_u64().unwrap();
    assert!(
        bound.abs_diff(misplaced) <= 8,
        "bound {bound}, eval {misplaced}: {r}"
    );
    p.verify_exclusive();
    let st = p.json(&args!["balancer", "status"]);
    let durable: u64 = st["durable_moves"].as_str().unwrap().parse().unwrap();
    assert_eq!(durable, r["moved"].as_u64().unwrap(), "{st}");
    eprintln!(
        "balancer figures: score {before:.4} → {after:.4}, {} moved ({:.2} × the lower bound \
         {bound}) in {:.2} s over {} plans",
        r["moved_bytes"],
        r["moved_bytes"].as_u64().unwrap() as f64 / bound as f64,
        r["secs"].as_f64().unwrap(),
        plans.len()
    );
}

/// A batch that takes longer than the allocator's lease (2 s here: the
/// plan's 4 moves, paced at 1 MiB/s, take about 3 s) still commits: the mover renews the
/// leases of the relocations it holds. Without that, on a loaded machine
/// every Commit of a plan was refused LEASE_EXPIRED and the plan moved
/// nothing (the drain test below failed that way).
#[test]
fn a_batch_slower_than_the_lease_still_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let p = filled(tmp.path());
    let slow = args![
        "--rate",
        "1MiB/s",
        "--batch",
        "8",
        "--budget",
        "8MiB",
        "--max-plans",
        "1",
        "--concurrency",
        "1",
        "--no-progress"
    ];
    let out = p.execute_child(&slow, None).wait_with_output().unwrap();
    let r = report(&out);
    let pl = &r["plans"][0];
    assert!(
        pl["secs"].as_f64().unwrap() > 2.0,
        "slower than the lease: {r}"
    );
    assert_eq!(pl["skipped"].as_u64(), Some(0), "{r}");
    assert!(pl["moved"].as_u64().unwrap() >= 4, "{r}");
    p.verify_exclusive();
}

#[test]
fn drain_then_remove_empties_a_vdev_for_good_and_plans_wait_for_a_whole_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = filled(tmp.path());
    let m = p.manifest();
    // An unavailable vdev: no plan, and execute says so.
    let mut gone = p.agents.remove(2);
    gone.kill9();
    p.wait("file2 unavailable", |s| {
        s["vdevs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "file2" && v["health"] == "unavailable")
    });
    let o = ctl(&args![
        "balancer",
        "execute",
        "--manifest",
        m.display(),
        "--allocator",
        p.url
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("POOL_DEGRADED") || err.contains("not healthy"),
        "{err}"
    );
    gone.restart().unwrap();
    p.agents.push(gone);
    p.wait_healthy("file2 back");

    let out = p.ctl(&args!["vdev", "drain", "file0"]);
    assert!(out.contains("offline"), "{out}");
    // (`vdev remove` now would have the allocator move file0's blocks
    // itself: tests/vdev_removal.rs. Here the client's mover drains it.)
    // As the README runs it (the default bound per plan, many plans): the
    // drain stops once file0 is empty, saying what comes next, and does
    // not plan on among the other vdevs.
    let r = p.json(&args![
        "balancer",
        "execute",
        "--manifest",
        m.display(),
        "--drain",
        "file0",
        "--no-progress"
    ]);
    eprintln!("drain: {r}");
    assert_eq!(
        r["stopped"], "file0 (0) is empty: `aliquotctl vdev remove file0` takes it out of the pool",
        "{r}"
    );
    assert_eq!(r["left"], serde_json::json!([]), "{r}");
    let st = p.json(&args!["balancer", "status"]);
    // What it said works at once: its frees are settled.
    let out = p.ctl(&args!["vdev", "remove", "file0"]);
    assert!(out.contains("removed"), "{out} (status before: {st})");
    p.verify_exclusive();
    let names = |s: &serde_json::Value| -> Vec<String> {
        s["vdevs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&p.status()), vec!["file1", "file2"]);
    // Removed for good: after an allocator restart too, and its agent's
    // reports are refused.
    p.alloc.kill9();
    p.alloc.restart().unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(names(&p.status()), vec!["file1", "file2"]);
    p.verify_exclusive();
    // The store check agrees, and a removed vdev is no mismatch with the
    // running allocator.
    let out = ok_stdout(
        &ctl(&args![
            "verify",
            "--data-dir",
            p.dir.join("allocator").display(),
            "--allocator",
            p.url
        ]),
        "verify",
    );
    assert!(out.contains("file0 (removed)"), "{out}");
    assert!(out.contains("running allocator agrees"), "{out}");
}

#[test]
fn a_mover_killed_mid_plan_resumes_without_losing_or_leaking_a_block() {
    let tmp = tempfile::tempdir().unwrap();
    let p = filled(tmp.path());
    let slow = args!["--rate", "16MiB/s", "--concurrency", "1", "--no-progress"];
    // Aborted right after journaling a batch's pending moves (its Commit not
    // sent): the resumed run aborts those relocations, the blocks stay put.
    let out = p
        .execute_child(&slow, Some("mover-after-pending:3"))
        .wait_with_output()
        .unwrap();
    let open = left_open(&p, &out);
    let r = report(
        &p.execute_child(&args!["--max-plans", "1", "--no-progress"], None)
            .wait_with_output()
            .unwrap(),
    );
    assert_eq!(r["resumed_dropped"].as_u64(), Some(open), "{r}");
    assert_eq!(r["resumed_moved"].as_u64(), Some(0), "{r}");
    p.verify_exclusive();
    // Aborted after a batch's Commit was answered, before `moved` was
    // journaled: the resumed run finds those moves durable and records them.
    let out = p
        .execute_child(&slow, Some("mover-after-commit:2"))
        .wait_with_output()
        .unwrap();
    let open = left_open(&p, &out);
    let r = report(
        &p.execute_child(&args!["--max-plans", "1", "--no-progress"], None)
            .wait_with_output()
            .unwrap(),
    );
    assert_eq!(r["resumed_moved"].as_u64(), Some(open), "{r}");
    assert_eq!(r["resumed_dropped"].as_u64(), Some(0), "{r}");
    p.verify_exclusive();
    // kill -9 at a random instant, then run to the end.
    let mut child = p.execute_child(&slow, None);
    let wait_ms = 300 + (std::process::id() as u64 % 700);
    std::thread::sleep(Duration::from_millis(wait_ms));
    let _ = child.kill();
    let _ = child.wait();
    // An unjournaled relocation holds its space until its lease (2 s) ends.
    std::thread::sleep(Duration::from_millis(2500));
    let r = report(
        &p.execute_child(&args!["--target-score", "0.02", "--no-progress"], None)
            .wait_with_output()
            .unwrap(),
    );
    eprintln!("killed after {wait_ms} ms; resumed run: {r}");
    assert!(p.score() < GOOD_SCORE, "{r}");
    p.verify_exclusive();
}
