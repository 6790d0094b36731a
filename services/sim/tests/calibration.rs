//! Calibration against real OpenZFS (2.4.4 unified, 2.3.9 legacy): the t1c
//! and t3 experiments of `scenarios/calibration/` at full scale (6 GiB and
//! 4 GiB pools, under a second each) under both policies, compared with the
//! measured logs at 25/50/75/90 % pool fill and by max spread.

use std::path::Path;

use aliquot_sim::calibration::{Comparison, FillCurve, PassQuarters};
use aliquot_sim::{Scenario, run_one};

fn compare(name: &str, policy: &str, log: &str) -> Comparison {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let sc = Scenario::from_file(&dir.join(format!("{name}.toml"))).unwrap();
    let spec = sc.runs().into_iter().find(|r| r.label == policy).unwrap();
    let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
    assert_eq!(r.stop_reason, "done", "{name} {policy}: {:?}", r.events);
    let measured = FillCurve::from_log(&std::fs::read_to_string(dir.join(log)).unwrap()).unwrap();
    let c = Comparison::new(&measured, &FillCurve::from_run(&r));
    eprintln!("{name} {policy} vs {log}\n{}", c.table());
    c
}

fn assert_close(c: &Comparison, what: &str, points: f64) {
    for (i, d) in c.worst_diff.iter().enumerate() {
        assert!(
            *d <= points,
            "{what}: {d:.1} points off at fill point {i}\n{}",
            c.table()
        );
    }
    assert!(
        c.spread_error() <= 0.30,
        "{what}: max spread off by {:.0} %\n{}",
        100.0 * c.spread_error(),
        c.table()
    );
}

#[test]
fn t1c_unified_matches_openzfs_2_4() {
    assert_close(
        &compare("t1c", "unified", "t1c-2.4.log"),
        "t1c unified",
        5.0,
    );
}

#[test]
fn t1c_legacy_matches_openzfs_2_3() {
    assert_close(&compare("t1c", "legacy", "t1c-2.3.log"), "t1c legacy", 5.0);
}

#[test]
fn t3_unified_matches_openzfs_2_4() {
    assert_close(&compare("t3", "unified", "t3-2.4.log"), "t3 unified", 5.0);
}

#[test]
fn t3_legacy_matches_openzfs_2_3() {
    assert_close(&compare("t3", "legacy", "t3-2.3.log"), "t3 legacy", 5.0);
}

/// t1a: equal memory-speed file vdevs of 1 and 2 GiB; the pool is bound by
/// its 2 CPUs, shared by the sync and the writers (168–361 MiB/s measured
/// on the shared machine; 337 simulated), so neither policy's device queues fill
/// and both keep the vdevs within 2 points (the model without `[cpu]` gave
/// 8.7 and 49.8 points of max spread). Held to the target:
/// ±5 points at each fill point, max spread within ±max(5 points, 30 %).
fn t1a(policy: &str, log: &str) {
    let c = compare("t1a", policy, log);
    for (i, d) in c.worst_diff.iter().enumerate() {
        assert!(
            *d <= 5.0,
            "t1a {policy}: {d:.1} points off at fill point {i}\n{}",
            c.table()
        );
    }
    assert!(
        c.spread_within_target(),
        "t1a {policy}: max spread\n{}",
        c.table()
    );
}

#[test]
fn t1a_unified_cpu_bound_matches_openzfs_2_4() {
    t1a("unified", "t1a-2.4.log");
}

#[test]
fn t1a_legacy_cpu_bound_matches_openzfs_2_3() {
    t1a("legacy", "t1a-2.3.log");
}

/// t1a's throughput, both policies, within the range of the real runs whose
/// per-txg timings are in `t1a-writers/txg/` (4 and 16 writers, both
/// versions, one day on the shared 2-core machine): the sync and the
/// writers share the CPUs (`[cpu] writer_bandwidth`); with free writers the
/// simulated pool ran at the sync's burst rate, above every real run.
#[test]
fn t1a_throughput_is_within_the_real_runs() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let mut real: Vec<f64> = std::fs::read_dir(dir.join("t1a-writers/txg"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("t1a-") && name.ends_with(".log")
        })
        .map(|p| {
            let log = std::fs::read_to_string(&p).unwrap();
            let line = log
                .lines()
                .find(|l| l.starts_with("# phase fill done:"))
                .unwrap();
            let rate = line.rsplit(" = ").next().unwrap();
            rate.split_whitespace().next().unwrap().parse().unwrap()
        })
        .collect();
    assert!(real.len() >= 4, "{real:?}");
    real.sort_by(f64::total_cmp);
    let (lo, hi) = (real[0], real[real.len() - 1]);
    let sc = Scenario::from_file(&dir.join("t1a.toml")).unwrap();
    for spec in sc.runs() {
        let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
        assert_eq!(r.stop_reason, "done", "{}", spec.label);
        let mibps = r.bytes_committed as f64 / (r.end_time as f64 / 1e9) / 1048576.0;
        eprintln!("t1a {}: {mibps:.0} MiB/s, real {lo:.0}-{hi:.0}", spec.label);
        assert!(
            (lo..=hi).contains(&mibps),
            "t1a {}: {mibps:.0} MiB/s against real {real:?}",
            spec.label
        );
    }
}

/// t2: 2 GiB + 4 GiB memory-speed file vdevs written at 40 MiB/s through
/// the txg pipeline (a rate load allocated at sync). Held to the issue's
/// target: ±5 points at each fill point, max spread within target.
fn t2(policy: &str, log: &str) {
    let c = compare("t2", policy, log);
    for (i, d) in c.worst_diff.iter().enumerate() {
        assert!(
            *d <= 5.0,
            "t2 {policy}: {d:.1} points off at fill point {i}\n{}",
            c.table()
        );
    }
    assert!(
        c.spread_within_target(),
        "t2 {policy}: max spread\n{}",
        c.table()
    );
}

/// 2.4 unified stays within a point.
#[test]
fn t2_unified_rate_load_matches_openzfs_2_4() {
    t2("unified", "t2-2.4.log");
}

/// 2.3 legacy drifts 11 points towards the large vdev: each object's
/// indirect blocks, ditto copies allocated between its data and the next
/// object's, restart the large vdev's turn of the rotor (the second copy
/// lands on the small vdev and the aliquot is compared with the small
/// vdev's smaller share; see `push_txg`). With the metadata all at the end
/// of the txg the simulator drifted 3.9 points the other way.
#[test]
fn t2_legacy_rate_load_matches_openzfs_2_3() {
    t2("legacy", "t2-2.3.log");
}

/// t5c (fill one vdev to 90 %, add a second, rewrite everything twice): the
/// new vdev's share of the device bytes written in each quarter of the
/// first rewrite pass, within 5 points of the measured one (2.4.4: 88, 73,
/// 58, 45 %; 2.3.9: 50 % throughout).
fn t5c_pass1_shares(policy: &str, log: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let sc = Scenario::from_file(&dir.join("t5c.toml")).unwrap();
    let spec = sc.runs().into_iter().find(|r| r.label == policy).unwrap();
    let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
    assert_eq!(r.stop_reason, "done", "t5c {policy}: {:?}", r.events);
    let text = std::fs::read_to_string(dir.join(log)).unwrap();
    let m = PassQuarters::from_log(&text, "rewrite1").unwrap().unwrap();
    let s = PassQuarters::from_run(&r, 1, sc.load.as_ref().unwrap().passes);
    eprintln!("t5c {policy} vs {log}\n{}", PassQuarters::table(&m, &s));
    for (q, (a, b)) in m.new_share_pct().iter().zip(s.new_share_pct()).enumerate() {
        assert!(
            (a - b).abs() <= 5.0,
            "t5c {policy} quarter {}: measured {a:.0} %, simulated {b:.0} %",
            q + 1
        );
    }
}

#[test]
fn t5c_unified_first_rewrite_matches_openzfs_2_4() {
    t5c_pass1_shares("unified", "t5c-2.4.log");
}

#[test]
fn t5c_legacy_first_rewrite_matches_openzfs_2_3() {
    t5c_pass1_shares("legacy", "t5c-2.3.log");
}

/// Median pool fill % over the rewrite passes of t5c: measured (log rows
/// of the `rewriteN` phases) and simulated (samples after the vdev add).
fn t5c_rewrite_fill(policy: &str, log: &str) -> (f64, f64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let text = std::fs::read_to_string(dir.join(log)).unwrap();
    let measured: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("rewrite"))
        .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
        .collect();
    let sc = Scenario::from_file(&dir.join("t5c.toml")).unwrap();
    let spec = sc.runs().into_iter().find(|r| r.label == policy).unwrap();
    let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
    // A second after the add: the fill's last txg is synced by then.
    let added = r
        .events
        .iter()
        .find(|(_, w)| w.contains("add_vdev"))
        .unwrap()
        .0;
    let simulated: Vec<f64> = r
        .samples
        .iter()
        .filter(|s| s.t > added + 1_000_000_000 && s.vdevs.len() == 2)
        .map(|s| {
            let a: u64 = s.vdevs.iter().map(|v| v.alloc).sum();
            let c: u64 = s.vdevs.iter().map(|v| v.capacity).sum();
            100.0 * a as f64 / c as f64
        })
        .collect();
    (median(measured), median(simulated))
}

/// During rewrites the pool holds its data plus the
/// overwritten blocks not yet released. OpenZFS's `vs_alloc` moves only at
/// `metaslab_sync_done`, so it shows two txgs of deferred frees and never
/// the syncing txg's new blocks; the simulator showed both, 2 points over
/// (49.1 % against 47.1 %). Now within a point.
#[test]
fn t5c_rewrites_hold_what_openzfs_holds() {
    for (policy, log) in [("unified", "t5c-2.4.log"), ("legacy", "t5c-2.3.log")] {
        let (m, s) = t5c_rewrite_fill(policy, log);
        eprintln!("t5c {policy}: rewrite pool fill measured {m:.2} %, simulated {s:.2} %");
        assert!(
            (s - m).abs() <= 1.0,
            "t5c {policy}: measured {m:.2} %, simulated {s:.2} %"
        );
    }
}

/// Test 6 on real OpenZFS, RAIDZ1 of memory-speed file
/// leaves (`t6-raidz/`): the pool is CPU-bound, and the two throttles'
/// throughput is within a few percent of each other (2.4/2.3 medians 1.11,
/// 0.98, 1.04 at 16K, 128K, 1M). The simulator, bound by its `[cpu]` model,
/// should hold each ratio within ±10 % of the measured one.
fn t6_raidz_ratio(bs: &str) -> (f64, f64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration/t6-raidz");
    let sc = Scenario::from_file(&dir.join("t6-A.toml")).unwrap();
    let runs = sc.runs();
    let mibps = |label: &str| {
        let spec = runs.iter().find(|r| r.label == label).unwrap();
        let r = run_one(&sc, spec, &mut |_| {}).unwrap();
        assert_eq!(r.stop_reason, "done", "{label}");
        r.bytes_committed as f64 / (r.end_time as f64 / 1e9)
    };
    // The median of the three runs of each version in the logs.
    let measured = |version: &str| {
        let mut v: Vec<f64> = (1..=3)
            .map(|i| {
                let name = format!("t6-A-{bs}-{version}-{i}.log");
                let log = std::fs::read_to_string(dir.join(name)).unwrap();
                let line = log
                    .lines()
                    .find(|l| l.starts_with("# throughput fill:"))
                    .unwrap();
                line.rsplit("MiBps=")
                    .next()
                    .unwrap()
                    .trim()
                    .parse::<f64>()
                    .unwrap()
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v[1]
    };
    let real = measured("2.4") / measured("2.3");
    let sim = mibps(&format!("unified-{bs}")) / mibps(&format!("legacy-{bs}"));
    eprintln!("t6-A {bs}: 2.4/2.3 {real:.3}, unified/legacy {sim:.3}");
    (sim, real)
}

#[test]
fn t6_raidz_cpu_bound_ratio_matches_openzfs_at_128k_and_1m() {
    for bs in ["128K", "1M"] {
        let (sim, real) = t6_raidz_ratio(bs);
        assert!(
            (sim / real - 1.0).abs() <= 0.10,
            "{bs}: {sim:.3} against {real:.3}"
        );
    }
}

/// Known gap: at 16K real 2.4 is 11 % faster than 2.3 with no disks at all.
/// `[cpu] after_throttle` and `dispatch` (t6-A.toml) model the one
/// difference found in the source: 2.3's slot limit (32 rising to 100 per
/// vdev, whatever the block size) holds back nearly every 16K block of a
/// txg, and each held block is handed to the issue taskq once more when
/// admitted; 2.4's byte budget holds none. With the hand-off's measured
/// cost (3 us of CPU, `t6-raidz/handoff.rs`) that is worth 1.3 %: the
/// simulator gives 1.007 against 1.114, 9.6 % off (1.013 before a syncing
/// txg went to the pipeline object by object, see `push_txg`), inside the ±10 % but
/// 10 of the 11.4 points unexplained (a held block's hand-off would have
/// to cost ~26 us for the whole gain). Kept ignored until the rest is
/// found; it passes if run.
#[test]
#[ignore = "known gap: the modelled taskq hop gives 1.007 against 1.114 (9.6 % off, within ±10 % but 10 of 11.4 points unexplained); passes if run"]
fn t6_raidz_cpu_bound_ratio_matches_openzfs_at_16k() {
    let (sim, real) = t6_raidz_ratio("16K");
    assert!(
        (sim / real - 1.0).abs() <= 0.10,
        "16K: {sim:.3} against {real:.3}"
    );
}

/// t1a with 4, 8, 16 and 32 writers (`t1a-writers/`: 3–5 real runs of
/// each version at each count, measured on a shared 2-core machine at
/// load 6–18, so their throughput is the machine's, not the pool's; the
/// spreads are what they compare). The simulated run, `t1a.toml` with
/// `streams` changed, against the median of the runs: used % within 5
/// points at every fill point, max spread within ±max(5 points, 30 %).
/// Returns (median measured max spread, simulated max spread).
fn t1a_writers(policy: &str, version: &str, writers: u32) -> (f64, f64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let text = std::fs::read_to_string(dir.join("t1a.toml")).unwrap();
    let text = text.replace("streams = 4", &format!("streams = {writers}"));
    let sc = Scenario::from_toml(&text).unwrap();
    assert_eq!(sc.load.as_ref().unwrap().streams, writers);
    let spec = sc.runs().into_iter().find(|r| r.label == policy).unwrap();
    let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
    assert_eq!(r.stop_reason, "done", "t1a {writers} writers {policy}");
    let sim = FillCurve::from_run(&r);
    let runs: Vec<FillCurve> = (1..=9)
        .filter_map(|k| {
            let name = format!("t1a-writers/t1a-w{writers}-{version}-{k}.log");
            std::fs::read_to_string(dir.join(name)).ok()
        })
        .map(|t| FillCurve::from_log(&t).unwrap())
        .collect();
    assert!(runs.len() >= 2, "{writers} writers {version}: runs missing");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        (v[(n - 1) / 2] + v[n / 2]) / 2.0
    };
    for p in aliquot_sim::calibration::FILL_POINTS {
        let s = sim.used_at(p).unwrap();
        for (i, &u) in s.iter().enumerate() {
            let m = median(runs.iter().map(|c| c.used_at(p).unwrap()[i]).collect());
            eprintln!(
                "t1a {writers} writers {policy}: vdev {i} at {p} %: measured {m:.1}, simulated {u:.1}"
            );
            assert!(
                (u - m).abs() <= 5.0,
                "t1a {writers} writers {policy}: vdev {i} at {p} % fill: median measured {m:.1}, simulated {u:.1}"
            );
        }
    }
    let m = median(runs.iter().map(FillCurve::max_spread).collect());
    let s = sim.max_spread();
    eprintln!(
        "t1a {writers} writers {policy}: max spread median measured {m:.1}, simulated {s:.1}"
    );
    (m, s)
}

fn spread_in_band((measured, simulated): (f64, f64)) -> bool {
    (simulated - measured).abs() <= (0.30 * measured).max(5.0)
}

#[test]
fn t1a_unified_follows_openzfs_2_4_at_8_16_32_writers() {
    for w in [8, 16, 32] {
        let ms = t1a_writers("unified", "2.4", w);
        assert!(spread_in_band(ms), "{w} writers: {ms:?}");
    }
}

/// Real 2.3.9 drifts more with more writers (median max spread 2.3, 2.6,
/// 6.6, 10.6 points at 4, 8, 16, 32): every object's ditto indirect block
/// can restart the large vdev's turn of the legacy rotor (see `push_txg`),
/// and each writer is an object.
#[test]
fn t1a_legacy_follows_openzfs_2_3_at_8_and_16_writers() {
    for w in [8, 16] {
        let ms = t1a_writers("legacy", "2.3", w);
        assert!(spread_in_band(ms), "{w} writers: {ms:?}");
    }
}

/// At 32 writers (real 9.2–13.5, median 10.6). With the writers taking
/// strict turns the simulator drifted 16.0 points: every object wrote the
/// same share of every txg, so the level-1 ditto copies restarted the
/// legacy rotor in lockstep; writers chosen at random (`pump`) give 10.4.
#[test]
fn t1a_legacy_follows_openzfs_2_3_at_32_writers() {
    let ms = t1a_writers("legacy", "2.3", 32);
    assert!(spread_in_band(ms), "32 writers: {ms:?}");
}

/// The mechanism of that drift: with `redundant_metadata = most` (level-1
/// blocks of file data single-copy) real 2.3.9 at 32 writers drifts 3.8
/// points instead of 9.2–13.5 (`t1a-writers/t1a-w32-2.3-most.log`), and
/// the simulator follows it into band.
#[test]
fn t1a_legacy_32_writers_without_ditto_indirect_blocks_matches_openzfs_2_3() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let text = std::fs::read_to_string(dir.join("t1a.toml")).unwrap();
    let text = text
        .replace("streams = 4", "streams = 32")
        .replace("[metadata]", "[metadata]\nredundant_metadata = \"most\"");
    let sc = Scenario::from_toml(&text).unwrap();
    let spec = sc.runs().into_iter().find(|r| r.label == "legacy").unwrap();
    let r = run_one(&sc, &spec, &mut |_| {}).unwrap();
    assert_eq!(r.stop_reason, "done");
    let log = std::fs::read_to_string(dir.join("t1a-writers/t1a-w32-2.3-most.log")).unwrap();
    let c = Comparison::new(
        &FillCurve::from_log(&log).unwrap(),
        &FillCurve::from_run(&r),
    );
    eprintln!(
        "t1a 32 writers legacy, redundant_metadata = most\n{}",
        c.table()
    );
    assert!(c.worst_diff.iter().all(|d| *d <= 5.0), "{}", c.table());
    assert!(c.spread_within_target(), "{}", c.table());
}
