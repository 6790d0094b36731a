//! The `aliquot-sim` binary end to end: a small scenario produces
//! summary.json, timeseries.csv and the SVG charts; bad scenarios exit 2
//! naming the key.

use std::process::Command;

const SMALL: &str = r#"
name = "cli-small"
policies = ["unified", "off"]
txg_timeout = "200ms"
[load]
mode = "full"
streams = 2
size = "1GiB"
[[vdev]]
name = "fast"
capacity = "2GiB"
write_bandwidth = "1GiB/s"
latency = "100us"
[[vdev]]
name = "slow"
capacity = "2GiB"
write_bandwidth = "250MiB/s"
latency = "1ms"
rotational = true
"#;

fn sim() -> Command {
    Command::new(env!("CARGO_BIN_EXE_aliquot-sim"))
}

#[test]
fn run_writes_summary_csv_and_charts() {
    let dir = tempfile::tempdir().unwrap();
    let sc = dir.path().join("s.toml");
    std::fs::write(&sc, SMALL).unwrap();
    let out = dir.path().join("out");
    let o = sim()
        .arg("run")
        .arg(&sc)
        .arg("--out")
        .arg(&out)
        .arg("-q")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("unified") && stdout.contains("off"),
        "{stdout}"
    );

    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let runs = s["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert_eq!(r["stop_reason"], "done");
        assert_eq!(r["bytes_written"], 1u64 << 30);
        assert!(r["samples"].as_array().unwrap().len() >= 200);
        assert!(r["mean_throughput_bytes_per_s"].as_f64().unwrap() > 0.0);
        let vdevs = r["vdevs"].as_array().unwrap();
        assert_eq!(vdevs.len(), 2);
        let used: f64 = vdevs
            .iter()
            .map(|v| v["final_used_fraction"].as_f64().unwrap())
            .sum();
        assert!(used > 0.45 && used < 0.55, "{used}");
    }
    let csv = std::fs::read_to_string(out.join("timeseries.csv")).unwrap();
    assert!(csv.starts_with("run,time_s,vdev,used_fraction,write_bytes_per_s"));
    assert!(csv.lines().count() > 800);
    for f in ["unified-used.svg", "unified-throughput.svg", "off-used.svg"] {
        let svg = std::fs::read_to_string(out.join(f)).unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("\nfast\n") && svg.contains("\nslow\n"),
            "{f}"
        );
    }
    let svg = std::fs::read_to_string(out.join("spread.svg")).unwrap();
    assert!(svg.contains("\nunified\n") && svg.contains("\noff\n"));
}

#[test]
fn bad_scenarios_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (text, key) in [
        (
            SMALL.replace("streams = 2", "streams = 2\nsprint = true"),
            "sprint",
        ),
        (SMALL.replace("\"2GiB\"", "\"2 furlongs\""), "not a size"),
        (SMALL.replace("[[vdev]]", "[[nope]]"), "nope"),
        (
            "name = \"x\"\n[load]\nmode = \"full\"\n".to_string(),
            "vdev: no data vdevs",
        ),
        (
            format!("{SMALL}[tunables]\nmetaslab_no_such_thing = 1\n"),
            "tunables.metaslab_no_such_thing",
        ),
    ] {
        let sc = dir.path().join("bad.toml");
        std::fs::write(&sc, &text).unwrap();
        let o = sim().arg("check").arg(&sc).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{key}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(key), "{key}: {err}");
    }
    let o = sim().arg("run").arg("--help").output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("ALIQUOT_SIM_OUT"));
}

#[test]
fn shipped_scenarios_all_check() {
    let o = sim().arg("list").output().unwrap();
    assert!(o.status.success());
    let s = String::from_utf8_lossy(&o.stdout);
    assert_eq!(s.lines().count(), 7, "{s}");
    assert!(!s.contains("INVALID"), "{s}");
}

#[test]
fn compare_prints_the_fill_points_and_draws_both_curves() {
    let dir = tempfile::tempdir().unwrap();
    let cal = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let chart = dir.path().join("c.svg");
    let o = sim()
        .arg("compare")
        .arg(cal.join("t1c.toml"))
        .arg(cal.join("t1c-2.4.log"))
        .args(["--policy", "unified", "--chart"])
        .arg(&chart)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for p in [
        " 25 %",
        " 50 %",
        " 75 %",
        " 90 %",
        "max spread: measured 11.1 pt",
    ] {
        assert!(stdout.contains(p), "{p:?} missing:\n{stdout}");
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.contains("v0-2g simulated") && svg.contains("v1-4g measured (OpenZFS)"));

    let o = sim()
        .arg("compare")
        .arg(cal.join("t1c.toml"))
        .arg(cal.join("t1c-2.4.log"))
        .args(["--policy", "nope", "--chart"])
        .arg(&chart)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--policy"));
}

/// `compare ... | head`: a reader that closes its end before the table is
/// printed ends the output, not the process with a panic.
#[test]
fn compare_into_a_closed_pipe_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let cal = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/calibration");
    let mut child = sim()
        .arg("compare")
        .arg(cal.join("t1c.toml"))
        .arg(cal.join("t1c-2.4.log"))
        .args(["--policy", "unified", "--chart"])
        .arg(dir.path().join("c.svg"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end at once: every write to stdout then fails (EPIPE).
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
}

/// An `at_fill` event the run never reaches is an error (exit 1) that
/// names the event and the fill the run reached, not a run that ends
/// without it.
#[test]
fn an_at_fill_event_never_reached_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let sc = dir.path().join("s.toml");
    // 1 GiB written to 4 GiB: the pool ends a quarter full.
    let text = format!(
        "{SMALL}[[event]]\nat_fill = 0.5\naction = \"add_vdev\"\n\
         vdev = {{ name = \"late\", capacity = \"2GiB\", write_bandwidth = \"1GiB/s\" }}\n"
    );
    std::fs::write(&sc, text).unwrap();
    let o = sim()
        .arg("run")
        .arg(&sc)
        .arg("--out")
        .arg(dir.path().join("out"))
        .args(["-q", "--only", "unified"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("event[0]: at_fill = 0.5 never reached"),
        "{err}"
    );
    // The fill reached is named: a quarter of the pool, as written.
    let reached: f64 = err
        .split("reached ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no fill reached in {err}"));
    assert!((0.2..0.3).contains(&reached), "{reached}: {err}");
}

/// `rebalance` end to end: two full vdevs and an empty one converge in
/// several bounded plans; a malformed vdev exits 2 naming the flag.
#[test]
fn rebalance_what_if_converges_and_refuses_bad_vdevs() {
    let o = sim()
        .args([
            "rebalance",
            "--vdev",
            "10G:8G,10G:8G,10G:0",
            "--rate",
            "100M",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let plans = stdout
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("score"))
        .count();
    assert!(plans > 1, "{stdout}");
    assert!(stdout.contains("(target reached)"), "{stdout}");
    assert!(stdout.contains("moved per point"), "{stdout}");

    let o = sim().args(["rebalance", "--vdev", "10G"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--vdev"));
}
