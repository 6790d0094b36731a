//! aliquotctl end to end with the real binary: `up` a pool of child
//! processes in a temp dir on ephemeral ports, `write --verify` through it,
//! check `status` (JSON sums and the table's header), tunable and vdev errors,
//! and that SIGINT to `up` leaves no child behind.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use integration_tests::{Proc, args, bin, children_of, ctl, json_u64, ok_stdout};

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s[s.rfind(')').unwrap() + 2..].starts_with('Z'),
        Err(_) => false,
    }
}

fn start_up(dir: &Path, extra: &[String]) -> Proc {
    let mut a = args![
        "up",
        "--data-dir",
        dir.display(),
        "--ephemeral",
        "--agents",
        "256MiB,512MiB,1GiB",
        "--zfs-txg-timeout",
        "1s"
    ];
    a.extend(extra.iter().cloned());
    Proc::start("aliquotctl-up", &bin("aliquotctl"), &a, &[], &["grpc"], dir)
        .expect("aliquotctl up")
}

#[test]
fn up_write_verify_status_tunables_and_clean_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let mut up = start_up(tmp.path(), &args!["--no-metrics"]);
    let url = up.url("grpc");
    let up_pid = up.pid().unwrap();
    let kids = children_of(up_pid);
    assert_eq!(kids.len(), 4, "allocator + 3 agents, got {kids:?}");
    // The sparse device files are where `up` said.
    for i in 0..3 {
        assert!(tmp.path().join(format!("vdevs/file{i}.img")).exists());
    }

    // write --verify: every block read back and compared.
    let out = ctl(&args![
        "write",
        "--allocator",
        url,
        "--total",
        "8MiB",
        "--block-size",
        "128KiB",
        "--concurrency",
        "8",
        "--verify",
        "--json"
    ]);
    let report: serde_json::Value =
        serde_json::from_str(&ok_stdout(&out, "write --verify")).unwrap();
    assert_eq!(report["blocks"], 64);
    assert_eq!(report["verified_blocks"], 64);
    assert_eq!(report["bytes"], 8 << 20);
    assert!(report["synced_txg"].as_u64().unwrap() > 0);
    for k in ["allocate", "write", "commit"] {
        assert_eq!(report[k]["count"], 64, "{k} latencies recorded");
        assert!(report[k]["p99_us"].as_u64().unwrap() >= report[k]["p50_us"].as_u64().unwrap());
    }

    // status --json: the keys, and the allocated bytes add up.
    let st: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args!["status", "--allocator", url, "--json"]),
        "status --json",
    ))
    .unwrap();
    let classes = st["classes"].as_array().unwrap();
    for c in classes {
        for k in [
            "name",
            "space",
            "alloc",
            "reserved",
            "alloc_max",
            "alloc_io_size",
            "busy",
            "groups",
        ] {
            assert!(c.get(k).is_some(), "class key {k} in {c}");
        }
    }
    let normal = classes
        .iter()
        .find(|c| c["name"] == "normal")
        .expect("normal class");
    let groups = normal["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 3);
    for g in groups {
        for k in [
            "vdev",
            "capacity",
            "alloc",
            "children",
            "parity",
            "aliquot",
            "queue_target",
            "queue_depth",
            "fragmentation",
            "health",
        ] {
            assert!(g.get(k).is_some(), "group key {k} in {g}");
        }
        assert_eq!(g["health"], "healthy");
        assert_eq!(g["queue_depth"], "0", "everything committed");
        // What the writer placed on each vdev is what the allocator holds.
        let placed = report["vdev_bytes"][g["vdev"].to_string()]
            .as_u64()
            .unwrap_or(0);
        assert_eq!(json_u64(&g["alloc"]).unwrap(), placed, "vdev {}", g["vdev"]);
    }
    let sum: u64 = groups.iter().map(|g| json_u64(&g["alloc"]).unwrap()).sum();
    assert_eq!(sum, json_u64(&normal["alloc"]).unwrap());
    // The proto3 JSON mapping: 64-bit integers are strings.
    assert!(
        normal["alloc"].is_string() && st["guid"].is_string(),
        "{st}"
    );
    assert_eq!(sum, 8 << 20);
    assert_eq!(normal["reserved"], "0");

    // balancer eval: the allocator's score, and per vdev the bytes above
    // its share, adding up to what a rebalance would move.
    let ev: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args!["balancer", "eval", "--json", "--allocator", url]),
        "balancer eval --json",
    ))
    .unwrap();
    let ec = &ev["classes"][0];
    assert_eq!(ec["class"], "normal", "{ev}");
    let score = ec["score"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&score), "{ev}");
    assert_eq!(
        ec["score"], normal["balance_score"],
        "eval and status agree"
    );
    let excess: Vec<i64> = ec["vdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["excess"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(excess.len(), 3);
    assert_eq!(
        json_u64(&ec["misplaced"]).unwrap() as i64,
        excess.iter().filter(|&&e| e > 0).sum::<i64>()
    );
    // Excess sums to ~0 (targets are the class's fill times each size).
    assert!(excess.iter().sum::<i64>().abs() <= 3, "{excess:?}");
    let text = ok_stdout(
        &ctl(&args!["balancer", "eval", "--allocator", url]),
        "balancer eval",
    );
    assert!(
        text.starts_with("pool aliquot class normal: score "),
        "{text}"
    );
    // balancer plan (the store's extents on SQLite): within its bound, never
    // worse, every move a block this write placed.
    let plan: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args![
            "balancer",
            "plan",
            "--max-misplaced",
            "0.5",
            "--json",
            "--allocator",
            url
        ]),
        "balancer plan --json",
    ))
    .unwrap();
    let bytes = json_u64(&plan["bytes"]).unwrap();
    assert!(bytes <= json_u64(&plan["limit_bytes"]).unwrap(), "{plan}");
    assert!(
        plan["score_after"].as_f64().unwrap() <= plan["score_before"].as_f64().unwrap(),
        "{plan}"
    );
    eprintln!(
        "plan on the test pool: {} moves, {bytes} bytes",
        plan["moves"].as_array().unwrap().len()
    );
    for m in plan["moves"].as_array().unwrap() {
        assert_eq!(json_u64(&m["size"]), Some(128 << 10), "{m}");
        assert_ne!(m["vdev"], m["to_vdev"]);
    }
    // vdev drain: offline, then the plan of everything on it.
    let drained = ok_stdout(
        &ctl(&args![
            "vdev",
            "drain",
            "file2",
            "--max-misplaced",
            "1",
            "--allocator",
            url
        ]),
        "vdev drain file2",
    );
    assert!(
        drained.starts_with("vdev file2 (2) is offline"),
        "{drained}"
    );
    assert!(
        drained.contains("file2 (2) -> "),
        "moves off file2: {drained}"
    );
    ok_stdout(
        &ctl(&args!["vdev", "online", "file2", "--allocator", url]),
        "vdev online file2",
    );
    // `up` numbers vdevs in the order given (256M, 512M, 1G): by id the
    // sizes are 1:2:4, less label and metaslab rounding.
    let mut by_id: Vec<(u64, u64)> = groups
        .iter()
        .map(|g| {
            (
                g["vdev"].as_u64().unwrap(),
                json_u64(&g["capacity"]).unwrap(),
            )
        })
        .collect();
    by_id.sort();
    let caps: Vec<u64> = by_id.iter().map(|&(_, c)| c).collect();
    assert!(
        caps[0] < caps[1] && caps[1] < caps[2],
        "1:2:4 sizes, got {caps:?}"
    );
    assert!(caps[2] > 3 * caps[0], "1:2:4 sizes, got {caps:?}");

    // The table: header and one row per vdev.
    let table = ok_stdout(&ctl(&args!["status", "--allocator", url]), "status");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("pool aliquot  guid "), "{table}");
    assert_eq!(lines[1], "health ONLINE", "{table}");
    let header: Vec<&str> = lines[3].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "SIZE",
            "ALLOC",
            "FREE",
            "CAP",
            "VAR",
            "FRAG",
            "HEALTH",
            "QDEPTH",
            "QTARGET",
            "ALIQUOT",
            "EMBLOG",
            "ALLOC'ABLE"
        ],
        "{table}"
    );
    for i in 0..3 {
        let row = lines
            .iter()
            .find(|l| l.trim_start().starts_with(&format!("file{i} (")))
            .unwrap_or_else(|| panic!("no row for file{i}:\n{table}"));
        assert!(row.contains("HEALTHY"), "{row}");
    }
    assert!(lines.iter().any(|l| l.starts_with("CLASS")), "{table}");

    // Tunables: list, a good set, a bad name, a bad value.
    let list = ok_stdout(&ctl(&args!["tunables", "--allocator", url]), "tunables");
    assert!(list.contains("metaslab_aliquot"), "{list}");
    let bad = ctl(&args![
        "tunables",
        "--allocator",
        url,
        "set",
        "no_such_tunable",
        "1"
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("unknown tunable \"no_such_tunable\"") && !err.contains("did you mean"),
        "{err}"
    );
    // A typo gets the closest name.
    let bad = ctl(&args![
        "tunables",
        "set",
        "metaslab_perf_bais=0",
        "--allocator",
        url
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("did you mean \"metaslab_perf_bias\""), "{err}");
    let bad = ctl(&args![
        "tunables",
        "--allocator",
        url,
        "set",
        "metaslab_perf_bias",
        "banana"
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("InvalidArgument"), "{err}");
    let set = ok_stdout(
        &ctl(&args![
            "tunables",
            "--allocator",
            url,
            "set",
            "metaslab_perf_bias",
            "0"
        ]),
        "tunables set",
    );
    assert!(set.starts_with("metaslab_perf_bias = 0"), "{set}");
    // NAME=VALUE, as `up --tunable` takes it.
    let set = ok_stdout(
        &ctl(&args![
            "tunables",
            "--allocator",
            url,
            "set",
            "metaslab_perf_bias=1"
        ]),
        "tunables set NAME=VALUE",
    );
    assert!(set.starts_with("metaslab_perf_bias = 1"), "{set}");
    let bad = ctl(&args!["vdev", "--allocator", url, "offline", "999"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("no vdev named or numbered \"999\"") && err.contains("file0 (0)"),
        "{err}"
    );
    // Vdevs by name, `name (id)` back; the flag may follow the subcommand.
    let off = ok_stdout(
        &ctl(&args!["vdev", "offline", "file1", "--allocator", url]),
        "vdev offline file1",
    );
    assert_eq!(off.trim(), "vdev file1 (1) is offline");
    let table = ok_stdout(&ctl(&args!["status", "--allocator", url]), "status");
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with("file1 (1)"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("OFFLINE"), "{row}");
    let on = ok_stdout(
        &ctl(&args!["vdev", "online", "file1", "--allocator", url]),
        "vdev online file1",
    );
    assert_eq!(on.trim(), "vdev file1 (1) is healthy");
    let bad = ctl(&args!["vdev", "offline", "flie1", "--allocator", url]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("did you mean \"file1\""), "{err}");

    // status is unchanged by the rejected requests.
    let st2: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args!["status", "--allocator", url, "--json"]),
        "status",
    ))
    .unwrap();
    assert_eq!(st2["alloc"], st["alloc"]);

    // status --watch follows WatchPool: two snapshots, txgs moving on.
    let mut watch = Command::new(bin("aliquotctl"))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "status",
            "--allocator",
            url,
            "--watch",
            "--json",
            "--interval",
            "300ms"
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let a: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let b: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert!(
        json_u64(&b["time_ms"]) > json_u64(&a["time_ms"]),
        "{a} then {b}"
    );
    assert_eq!(b["alloc"], st["alloc"]);
    watch.kill().unwrap();
    watch.wait().unwrap();

    // write --batch: small blocks gathered into WriteBatch requests, every
    // block still read back and compared.
    let out = ctl(&args![
        "write",
        "--allocator",
        url,
        "--total",
        "2MiB",
        "--block-size",
        "4KiB",
        "--concurrency",
        "32",
        "--batch",
        "16",
        "--verify",
        "--json"
    ]);
    let batched: serde_json::Value =
        serde_json::from_str(&ok_stdout(&out, "write --batch")).unwrap();
    assert_eq!(batched["batch"], 16);
    assert_eq!(batched["blocks"], 512);
    assert_eq!(batched["verified_blocks"], 512);
    assert_eq!(batched["retries"], 0);
    // More than 8 MiB a request is refused before anything is written.
    let out = ctl(&args![
        "write",
        "--allocator",
        url,
        "--total",
        "1MiB",
        "--block-size",
        "1MiB",
        "--batch",
        "16"
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("smaller --batch"),
        "{out:?}"
    );

    // SIGINT to `up`: it stops every child and exits 0.
    assert!(kids.iter().all(|&k| alive(k)));
    Command::new("kill")
        .args(["-INT", &up_pid.to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    while up.is_running() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "up did not stop; log:\n{}",
            up.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for k in kids {
        assert!(!alive(k), "child {k} still running after up stopped");
    }
    let log = up.log_tail();
    assert!(log.contains("pool stopped"), "{log}");
    assert!(
        !log.contains("SIGKILL"),
        "children should stop on SIGTERM:\n{log}"
    );
}

#[test]
fn up_reports_a_dead_agent_and_usage_errors_exit_2() {
    let bad = ctl(&args!["up", "--sim", "tape:1GiB:1MiB/s"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(String::from_utf8_lossy(&bad.stderr).contains("hdd or ssd"));

    let tmp = tempfile::tempdir().unwrap();
    let mut up = start_up(
        tmp.path(),
        &args!["--no-metrics", "--sim", "ssd:256MiB:1GiB/s"],
    );
    let kids = children_of(up.pid().unwrap());
    assert_eq!(kids.len(), 5);
    let st: serde_json::Value = serde_json::from_str(&ok_stdout(
        &ctl(&args!["status", "--allocator", up.url("grpc"), "--json"]),
        "status",
    ))
    .unwrap();
    let names: Vec<&str> = st["vdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"ssd0") && names.contains(&"file2"),
        "{names:?}"
    );
    // Kill one agent behind up's back: up reports it and keeps the pool.
    let agent = *kids.last().unwrap();
    Command::new("kill")
        .args(["-KILL", &agent.to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    while !up.log_tail().contains("exited (signal: 9") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no death report:\n{}",
            up.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(up.is_running());
    up.kill();
    for k in kids {
        assert!(!alive(k), "child {k} still running");
    }
}

#[test]
fn demo_runs_end_to_end_with_metrics_and_a_chart() {
    let tmp = tempfile::tempdir().unwrap();
    let out = ctl(&args![
        "demo",
        "--data-dir",
        tmp.path().display(),
        "--ephemeral",
        "--agents",
        "128MiB,256MiB,512MiB",
        "--fill",
        "10",
        "--block-size",
        "256KiB"
    ]);
    let text = ok_stdout(&out, "demo");
    assert!(text.contains("verified: "), "{text}");
    // The log burst is served by the embedded log metaslabs.
    assert!(text.contains("log tiers:  embedded_log "), "{text}");
    assert!(text.contains("NAME "), "status table in:\n{text}");
    assert!(text.contains("== demo done"), "{text}");
    let chart = tmp.path().join("demo/balance.svg");
    let svg = std::fs::read_to_string(&chart)
        .unwrap_or_else(|e| panic!("{}: {e}\n{text}", chart.display()));
    assert!(svg.contains("<svg"), "not an SVG");
    // Every child was stopped: none is left holding the demo's files.
    let logs = std::fs::read_dir(tmp.path().join("demo/logs"))
        .unwrap()
        .count();
    assert_eq!(logs, 5, "allocator, metrics and 3 agents logged");
    assert!(!text.contains("SIGKILL"), "{text}");
}

/// aliquotctl links no server: it runs the service binaries found beside it
/// (or on PATH). Alone in a directory with an empty PATH, `serve`, `up` and
/// `verify` each name the binary missing and how to build it; beside them,
/// `serve X` is the binary itself (its own `--help`).
#[test]
fn service_binaries_are_found_beside_aliquotctl_or_named_when_missing() {
    // In target/ (one file system): a hard link, not a copy of the binary.
    let tmp = tempfile::tempdir_in(integration_tests::bin_dir()).unwrap();
    let lone = tmp.path().join("aliquotctl");
    if std::fs::hard_link(bin("aliquotctl"), &lone).is_err() {
        std::fs::copy(bin("aliquotctl"), &lone).unwrap();
    }
    let data = tmp.path().join("pool");
    let data = data.display().to_string();
    for (argv, missing) in [
        (vec!["serve", "agent", "--help"], "aliquot-agent"),
        (
            vec!["up", "--data-dir", &data, "--ephemeral", "--insecure"],
            "aliquot-metrics",
        ),
        (vec!["verify", "--data-dir", &data], "aliquot-allocator"),
    ] {
        let o = Command::new(&lone)
            .args(&argv)
            .env("PATH", "")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{argv:?}: {err}");
        assert!(
            err.contains(&format!("{missing} not found")) && err.contains("cargo build --release"),
            "{argv:?} does not name {missing} and how to build it: {err}"
        );
    }
    let help = ok_stdout(
        &ctl(&args!["serve", "allocator", "--help"]),
        "serve allocator --help",
    );
    assert!(
        help.contains("aliquot-allocator") && help.contains("--rewind-to"),
        "not the allocator's own help:\n{help}"
    );
}
