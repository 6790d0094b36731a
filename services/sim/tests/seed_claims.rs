//! The seed experiments (OpenZFS #17020 tests 1–6, the ZIL metaslab test),
//! run from the shipped scenario files scaled down (capacities, amounts and
//! times divided, bandwidths kept) on the real `metaslab::Pool`, asserting
//! the claims of the seed text: the unified policy's behaviour, and the
//! direction of the legacy policy's faults.

use std::path::Path;

use aliquot_sim::engine::{RunResult, Sample};
use aliquot_sim::report::spread;
use aliquot_sim::{Scenario, log_vdevs, run_one};

fn load(file: &str, scale: u64) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(file);
    Scenario::from_file(&path).unwrap().scaled_down(scale)
}

/// Test 5 scaled down with its dirty-data limit in proportion to the pool:
/// `scaled_down` keeps `dirty_max` (txgs as long in time as at full scale,
/// which tests 1–4 and 6 measure rates by), but a rewrite holds up to a
/// txg of new blocks plus two of deferred frees, and 4 GiB txgs overfill
/// the 32x smaller vdevs where they are 1.6 % of the full-scale ones.
fn load_test5(scale: u64) -> Scenario {
    load_add(scale, "5-add-vdev.toml")
}

/// An add-vdev scenario scaled as [`load_test5`].
fn load_add(scale: u64, file: &str) -> Scenario {
    let mut sc = load(file, scale);
    let l = sc.load.as_mut().unwrap();
    l.dirty_max /= scale;
    sc
}

fn run_label(sc: &Scenario, label: &str) -> RunResult {
    let spec = sc
        .runs()
        .into_iter()
        .find(|r| r.label == label)
        .unwrap_or_else(|| panic!("no run {label}"));
    let r = run_one(sc, &spec, &mut |_| {}).unwrap();
    assert!(
        r.stop_reason == "done" || r.stop_reason == "pool full",
        "{label}: {}",
        r.stop_reason
    );
    assert!(
        r.samples.len() >= 200,
        "{label}: {} samples",
        r.samples.len()
    );
    r
}

fn used(s: &Sample, v: usize) -> f64 {
    s.vdevs[v].used_fraction()
}

/// First sample at which vdev `v` is at least `f` used.
fn when_used(r: &RunResult, v: usize, f: f64) -> usize {
    r.samples
        .iter()
        .position(|s| s.vdevs.len() > v && used(s, v) >= f)
        .unwrap_or_else(|| panic!("vdev {v} never reached {f}"))
}

/// Mean device write rate of vdev `v` between samples `a` and `b`.
fn rate(r: &RunResult, v: usize, a: usize, b: usize) -> f64 {
    let (sa, sb) = (&r.samples[a], &r.samples[b]);
    let bytes = sb.vdevs[v].bytes_done - sa.vdevs.get(v).map_or(0, |x| x.bytes_done);
    bytes as f64 / ((sb.t - sa.t) as f64 / 1e9)
}

fn max_spread(r: &RunResult, sc: &Scenario) -> f64 {
    let is_log = log_vdevs(sc);
    r.samples
        .iter()
        .map(|s| spread(s, &is_log))
        .fold(0.0, f64::max)
}

fn final_spread(r: &RunResult, sc: &Scenario) -> f64 {
    spread(r.samples.last().unwrap(), &log_vdevs(sc))
}

#[test]
fn test1_unequal_ssds_full_speed() {
    let sc = load("1-ssd-128g-256g-full.toml", 32);
    let r = run_label(&sc, "unified");
    // Same speed until the small one is ~25 % used.
    let early = when_used(&r, 0, 0.2);
    let (small, large) = (rate(&r, 0, 1, early), rate(&r, 1, 1, early));
    assert!(
        (small / large - 1.0).abs() < 0.1,
        "early rates {small} vs {large}"
    );
    // Then the small one is throttled.
    let (a, b) = (when_used(&r, 0, 0.5), when_used(&r, 0, 0.7));
    let (small, large) = (rate(&r, 0, a, b), rate(&r, 1, a, b));
    assert!(small < 0.8 * large, "mid rates {small} vs {large}");
    // And they end within a few percent.
    let f = final_spread(&r, &sc);
    assert!(f < 0.05, "final spread {f}");
}

#[test]
fn test2_unequal_ssds_slow_rate_stay_balanced() {
    let sc = load("2-ssd-128g-256g-rate.toml", 64);
    let r = run_label(&sc, "unified");
    let m = max_spread(&r, &sc);
    assert!(m < 0.02, "max spread {m}");
}

#[test]
fn test3_ssd_and_hdd_full_speed() {
    let sc = load("3-ssd-hdd-full.toml", 32);
    let r = run_label(&sc, "unified");
    let early = when_used(&r, 0, 0.1);
    let (ssd, hdd) = (rate(&r, 0, 1, early), rate(&r, 1, 1, early));
    assert!(ssd >= 2.0 * hdd, "empty: ssd {ssd} vs hdd {hdd}");
    let (a, b) = (when_used(&r, 0, 0.5), when_used(&r, 0, 0.6));
    let (ssd, hdd) = (rate(&r, 0, a, b), rate(&r, 1, a, b));
    assert!(ssd <= 1.3 * hdd, "half full: ssd {ssd} vs hdd {hdd}");
    let f = final_spread(&r, &sc);
    assert!(f < 0.05, "final spread {f}");

    let legacy = run_label(&sc, "legacy");
    let (lu, uu) = (max_spread(&legacy, &sc), max_spread(&r, &sc));
    assert!(lu > uu, "legacy spread {lu} should exceed unified {uu}");
    let (lf, uf) = (final_spread(&legacy, &sc), f);
    assert!(
        lf > uf,
        "legacy final spread {lf} should exceed unified {uf}"
    );
}

#[test]
fn test4_ssd_and_hdd_slow_rate_stay_balanced() {
    let sc = load("4-ssd-hdd-rate.toml", 64);
    let r = run_label(&sc, "unified");
    let m = max_spread(&r, &sc);
    assert!(m < 0.02, "max spread {m}");
}

#[test]
fn test5_added_vdev_rebalances_in_one_overwrite() {
    let sc = load_test5(32);
    let r = run_label(&sc, "unified");
    assert!(max_spread(&r, &sc) > 0.8, "the new vdev starts empty");
    // The first overwrite pass brings the spread under 5 % (the seed: "even
    // with some overshoot", which the end of that pass shows).
    let per_pass = r.bytes_planned / 3;
    let add = r.events.iter().find(|e| e.1 == "add_vdev new").unwrap().0;
    let is_log = log_vdevs(&sc);
    let best = r
        .samples
        .iter()
        .filter(|s| s.t > add && s.committed <= 2 * per_pass)
        .map(|s| spread(s, &is_log))
        .fold(1.0, f64::min);
    assert!(
        best < 0.05,
        "least spread during the first overwrite {best}"
    );
    let f = final_spread(&r, &sc);
    assert!(f < 0.05, "final spread {f}");
}

/// Used fractions (old, new) when the first overwrite pass has committed.
fn after_first_overwrite(r: &RunResult) -> (f64, f64) {
    let per_pass = r.bytes_planned / 3;
    let s = r
        .samples
        .iter()
        .find(|s| s.committed >= 2 * per_pass)
        .expect("end of the first overwrite");
    (used(s, 0), used(s, 1))
}

/// The unified rotor's split with nothing else modelled: no txgs, no
/// deferred frees, no device speeds. `filled` of one vdev is rewritten in
/// block order after an equal empty vdev is added; each rewritten block goes
/// to the old vdev with the share `fr_old / (fr_old + fr_new)` of the two
/// free fractions (each group's aliquot is its free fraction over the
/// class's, `metaslab.c:metaslab_class_balance@zfs-2.4.0`, and the rotor
/// rotates at the aliquot when the pool is not busy), and frees its previous
/// copy where it was. Returns the used fractions (old, new) after each pass.
fn pure_policy_rewrites(filled: f64, passes: usize) -> Vec<(f64, f64)> {
    const N: usize = 20_000;
    let b = filled / N as f64;
    let mut on_old = vec![1.0; N];
    let (mut uo, mut un) = (filled, 0.0);
    let mut out = Vec::new();
    for _ in 0..passes {
        for w in on_old.iter_mut() {
            let (fo, fnew) = (1.0 - uo, 1.0 - un);
            let s = fo / (fo + fnew);
            uo += (s - *w) * b;
            un += (*w - s) * b;
            *w = s;
        }
        out.push((uo, un));
    }
    out
}

/// Test 5's overshoot is the policy's, not the seed's guess ("big sizes of
/// TXG relative to device sizes ... and ZFS delayed frees"): the rotor's
/// split with none of those (`pure_policy_rewrites`, 34.1/55.9 % after the
/// first overwrite; real 2.4 in the t5c log: 32/58) and the simulated pool
/// with txgs, deferred frees and devices end the first overwrite within 3
/// points of each other, at full speed and at a rate alike.
#[test]
fn test5_overshoot_is_the_rotor_split() {
    let pure = pure_policy_rewrites(0.9, 2);
    let (po, pn) = pure[0];
    assert!(
        (po - 0.341).abs() < 0.005 && (pn - 0.559).abs() < 0.005,
        "{pure:?}"
    );
    for file in ["5-add-vdev.toml", "experiments/5-add-vdev-rate.toml"] {
        let sc = load_add(32, file);
        let r = run_label(&sc, "unified");
        let (o, n) = after_first_overwrite(&r);
        eprintln!("{file}: after the first overwrite old {o:.3} new {n:.3} (pure {po:.3}/{pn:.3})");
        assert!(
            (o - po).abs() < 0.03 && (n - pn).abs() < 0.03,
            "{file}: {o}/{n}"
        );
    }
}

/// A vdev added while writing at a rate (test 5 at 500 MiB/s, half of one
/// vdev's bandwidth, so the pool is never busy and the rotor follows the
/// aliquots alone): the new vdev takes most writes after the add and two
/// overwrites end balanced, as the rotor's split alone does (1.1 points
/// after the second pass, `pure_policy_rewrites`).
#[test]
fn test5_at_a_rate_ends_balanced() {
    let sc = load_add(32, "experiments/5-add-vdev-rate.toml");
    let r = run_label(&sc, "unified");
    assert!(max_spread(&r, &sc) > 0.8, "the new vdev starts empty");
    let (old, new) = split_after_add(&r);
    assert!(new > 2.0 * old, "new {new} old {old}");
    let f = final_spread(&r, &sc);
    let (po, pn) = pure_policy_rewrites(0.9, 2)[1];
    eprintln!("final spread {f:.4} (pure policy {:.4})", (po - pn).abs());
    assert!(f < 0.05, "final spread {f}");
}

/// Device bytes written to the old (0) and new (1) vdev from the add until
/// half of the first overwrite pass has committed.
fn split_after_add(r: &RunResult) -> (f64, f64) {
    let per_pass = r.bytes_planned / 3;
    let add = r.events.iter().find(|e| e.1 == "add_vdev new").unwrap().0;
    let first = r.samples.iter().find(|s| s.t > add).expect("after the add");
    let last = r
        .samples
        .iter()
        .find(|s| s.committed >= per_pass + per_pass / 2)
        .expect("half an overwrite");
    let old = last.vdevs[0].bytes_done - first.vdevs[0].bytes_done;
    let new = last.vdevs[1].bytes_done - first.vdevs.get(1).map_or(0, |v| v.bytes_done);
    (old as f64, new as f64)
}

/// Data committed from the add until the spread first falls under 5 %, as a
/// share of one pass.
fn rebalance_passes(r: &RunResult, sc: &Scenario) -> f64 {
    let per_pass = r.bytes_planned / 3;
    let add = r.events.iter().find(|e| e.1 == "add_vdev new").unwrap().0;
    let at_add = r.samples.iter().find(|s| s.t >= add).unwrap().committed;
    let is_log = log_vdevs(sc);
    let s = r
        .samples
        .iter()
        .find(|s| s.t > add && s.vdevs.len() == 2 && spread(s, &is_log) < 0.05)
        .expect("rebalanced");
    (s.committed - at_add) as f64 / per_pass as f64
}

/// The seed: after a vdev add under the old throttle "the new vdev does not
/// have any real preference, unless the old one is already much slower".
/// Under full-speed load the legacy queue-depth throttle keeps both equal
/// devices busy, so writes split ~1:1 whatever the space bias says, while
/// the unified policy throttles the full vdev. (In time both rebalance
/// together here: a 1:1 split of a full overwrite of the old vdev's data
/// balances exactly at the end of that pass; legacy just needs all of it.)
#[test]
fn test5_legacy_has_no_preference_for_the_new_vdev() {
    let sc = load_test5(32);
    let u = run_label(&sc, "unified");
    let l = run_label(&sc, "legacy");
    let (uo, un) = split_after_add(&u);
    let (lo, ln) = split_after_add(&l);
    eprintln!(
        "new/old after the add: unified {:.2} legacy {:.2}",
        un / uo,
        ln / lo
    );
    assert!(un > 2.0 * uo, "unified: new {un} old {uo}");
    assert!((ln / lo - 1.0).abs() < 0.2, "legacy: new {ln} old {lo}");
    let (pu, pl) = (rebalance_passes(&u, &sc), rebalance_passes(&l, &sc));
    eprintln!("passes to rebalance: unified {pu:.2} legacy {pl:.2}");
    assert!(pu < 0.9 && pl > pu + 0.1, "unified {pu} legacy {pl}");
}

/// Steady-state write rate: data committed between 20 % and 80 % of the plan.
fn steady_rate(r: &RunResult) -> f64 {
    let a = r
        .samples
        .iter()
        .find(|s| s.committed * 5 >= r.bytes_planned)
        .unwrap();
    let b = r
        .samples
        .iter()
        .find(|s| s.committed * 5 >= r.bytes_planned * 4)
        .unwrap();
    (b.committed - a.committed) as f64 / ((b.t - a.t) as f64 / 1e9)
}

#[test]
fn test6_raidz_new_at_least_old_gain_largest_at_small_blocks() {
    let sc = load("6-raidz-hdd-blocksizes.toml", 16);
    let mut gains = Vec::new();
    for bs in ["16K", "128K", "1M", "16M"] {
        let new = steady_rate(&run_label(&sc, &format!("unified-{bs}")));
        let old = steady_rate(&run_label(&sc, &format!("legacy-{bs}")));
        let gain = new / old;
        eprintln!(
            "{bs}: unified {:.0} MiB/s legacy {:.0} MiB/s gain {gain:.3}",
            new / 1048576.0,
            old / 1048576.0
        );
        assert!(gain >= 0.98, "{bs}: new/old = {gain}");
        gains.push(gain);
    }
    let best_small = gains[0].max(gains[1]);
    let best_large = gains[2].max(gains[3]);
    assert!(best_small > best_large + 0.02, "gains {gains:?}");
}

/// Test 6's old → new throughput ratio at full scale on the per-leaf
/// device model, simulated against the seed's (about 12 s per block size
/// in a release build).
fn test6_ratio_off(bs: &str, old: f64, new: f64) -> f64 {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/6-raidz-hdd-blocksizes.toml");
    let sc = Scenario::from_file(&path).unwrap();
    let rate = |label: &str| {
        let r = run_label(&sc, label);
        r.bytes_committed as f64 / (r.end_time as f64 / 1e9)
    };
    let sim = rate(&format!("unified-{bs}")) / rate(&format!("legacy-{bs}"));
    let off = sim / (new / old) - 1.0;
    eprintln!(
        "{bs}: simulated new/old {sim:.3}, seed {:.3}, {:+.1} %",
        new / old,
        100.0 * off
    );
    off
}

/// Test 6 at full scale (`cargo test --release -p aliquot-sim --test
/// seed_claims -- --ignored`): the seed's old → new ratio within ±10 % at
/// 16K, 1M and 16M.
#[test]
#[ignore = "full scale: run with --release -- --ignored"]
fn test6_full_scale_ratios_near_the_seed() {
    for (bs, old, new) in [
        ("16K", 3076.0, 3621.0),
        ("1M", 4434.0, 4541.0),
        ("16M", 4105.0, 4145.0),
    ] {
        let off = test6_ratio_off(bs, old, new);
        assert!(off.abs() <= 0.10, "{bs}: {off}");
    }
}

/// Test 6 at 128K: the seed's 1.229 within ±10 %. A known gap: the simulator
/// gives about 1.010 (−18 %), so this fails until the cause is found; it is not
/// held as a passing range.
#[test]
#[ignore = "known gap: fails, -18 % against the seed at 128K"]
fn test6_128k_ratio_near_the_seed() {
    let off = test6_ratio_off("128K", 3773.0, 4638.0);
    assert!(off.abs() <= 0.10, "128K: {off}");
}

/// The ZIL seed test (the shipped file is at the seed's proportions:
/// 4 × 32 GiB of 256 MiB metaslabs, 16 CPUs), scaled down 8× with its
/// proportions kept: capacities, times and the 1 s metaslab load cost
/// divided by 8 and the metaslabs 8× smaller (4 GiB vdevs of 32 MiB
/// metaslabs, 128 per vdev as at full scale, so the embedded log's 64 are
/// still there; `scaled_down` alone leaves 16 and no embedded log). The
/// seed: the embedded log gives ~50 % more sync writes, because without it
/// the ZIL waits for metaslab loads. Held: the gain within the seed's ±15
/// points (+43.5 % here, +53.9 % at full scale), lower latency with it
/// on, no txg-wait fallback in either (the gain is not theirs), and the
/// ZIL's time stalled on loads (its own loads plus the preloads its
/// blocks waited for) larger with it off.
#[test]
fn test7_embedded_log_gain_comes_from_load_stalls() {
    let f = 8;
    let mut sc = load("7-zil-embedded-log.toml", f);
    sc.metaslab_load_cost /= f;
    let log = sc.log.as_mut().expect("a [log]");
    log.metaslab_load_cost /= f;
    for v in &mut sc.variants {
        for (name, value) in &mut v.tunables {
            if name.ends_with("_ms_shift") {
                // 256 MiB → 32 MiB metaslabs.
                *value = (value.parse::<u64>().unwrap() - 3).to_string();
            }
        }
    }
    let on = run_label(&sc, "unified-elog-on");
    let off = run_label(&sc, "unified-elog-off");
    let (lon, loff) = (on.log.unwrap(), off.log.unwrap());
    eprintln!("on: {lon:?}\noff: {loff:?}");
    assert!(lon.tier_embedded_log > 0, "{lon:?}");
    assert_eq!(loff.tier_embedded_log, 0, "{loff:?}");
    let gain = lon.ops_per_sec / loff.ops_per_sec - 1.0;
    eprintln!("gain {:+.1} %", 100.0 * gain);
    assert!((0.35..=0.65).contains(&gain), "gain {gain}");
    assert!(
        lon.latency_mean < loff.latency_mean,
        "latency on {lon:?} off {loff:?}"
    );
    assert_eq!(
        (lon.txg_wait_fallbacks, loff.txg_wait_fallbacks),
        (0, 0),
        "fallbacks"
    );
    let stalled = |l: &aliquot_sim::engine::LogResult| l.load_stall + l.preload_wait;
    assert!(loff.preload_waits > 0, "{loff:?}");
    assert!(
        stalled(&loff) > stalled(&lon),
        "stalled on loads: off {} on {} ns",
        stalled(&loff),
        stalled(&lon)
    );
}
