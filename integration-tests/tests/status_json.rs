//! `aliquotctl status` as a script reads it, against a
//! real pool: `--json` carries what the table shows (the health line and
//! its reasons, each vdev's VAR, the class's MIN/MAX VAR, STDDEV and
//! spread), and `status --watch` into a pipe writes tables one after
//! another with no screen-clearing codes.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use integration_tests::{FilePool, args, bin};

#[test]
fn json_has_the_tables_figures_and_watch_to_a_pipe_does_not_clear() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("128MiB");
    p.add_agent("256MiB");
    p.ok(&args![
        "write",
        "--total",
        "32MiB",
        "--no-progress",
        "--no-manifest"
    ]);
    p.ok(&args!["vdev", "offline", "file1"]);

    let v = p.status();
    assert_eq!(v["health"], "DEGRADED", "{v}");
    assert_eq!(
        v["health_reasons"],
        serde_json::json!(["file1 (1) offline"]),
        "{v}"
    );
    let table = p.ok(&args!["status"]);
    assert!(
        table.contains("health DEGRADED: file1 (1) offline"),
        "{table}"
    );
    let normal = v["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "normal")
        .expect("normal class")
        .clone();
    let b = &normal["balance"];
    let (lo, hi, sd, spread) = (
        b["min_var"].as_f64().unwrap(),
        b["max_var"].as_f64().unwrap(),
        b["stddev"].as_f64().unwrap(),
        b["spread"].as_f64().unwrap(),
    );
    // The table's footer, from the same figures.
    let footer = format!(
        "normal: MIN/MAX VAR: {lo:.2}/{hi:.2}  STDDEV: {:.2}%  SPREAD: {:.2}%",
        sd * 100.0,
        spread * 100.0
    );
    assert!(table.contains(&footer), "{footer}\n{table}");
    let vars: Vec<f64> = normal["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["var"].as_f64().expect("var"))
        .collect();
    assert_eq!(vars.len(), 2);
    let (mn, mx) = (
        vars.iter().copied().fold(f64::INFINITY, f64::min),
        vars.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    assert!((mn - lo).abs() < 1e-9 && (mx - hi).abs() < 1e-9, "{vars:?}");

    // --watch into a pipe: tables, no ESC.
    let mut w = Command::new(bin("aliquotctl"))
        .args(args![
            "status",
            "--watch",
            "--interval",
            "200ms",
            "--allocator",
            p.url,
            "--insecure"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("status --watch");
    std::thread::sleep(Duration::from_millis(1500));
    let _ = w.kill();
    let mut out = String::new();
    w.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let _ = w.wait();
    assert!(!out.contains('\x1b'), "escape codes in a pipe: {out:?}");
    assert!(out.matches("health DEGRADED").count() >= 2, "{out}");
}
