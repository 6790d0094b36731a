//! Every `/metrics` endpoint passes Debian's `promtool check metrics` (issue
//! 31 item 3): the metrics service, the allocator and the agents, scraped as
//! promtool and curl do (no `Accept`: the 0.0.4 text format) after real
//! writes, and in OpenMetrics when asked as Prometheus asks. No sample is a
//! `u64::MAX` "no limit". AllocateStream is counted per allocation; the
//! allocator's per-vdev space counters add up to what was written and freed. `deploy/prometheus-rules.yml` passes `promtool
//! check rules` (and `promtool test rules` with its test file), and
//! `deploy/prometheus.yml` `promtool check config`.
//! promtool comes from the `prometheus` package (`.ci/run` installs it).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{FilePool, Proc, args, ctl, metrics_service, ok_stdout};

/// What Prometheus 2.x sends.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/\
    openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

fn promtool() -> &'static str {
    let ok = Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "promtool not found: install Debian's `prometheus` package (.ci/run does)"
    );
    "promtool"
}

/// (content type, body) of `GET url` with this Accept header (none: curl's
/// `*/*`).
fn scrape(url: &str, accept: Option<&str>) -> (String, String) {
    let mut c = Command::new("curl");
    c.args(["-sS", "--max-time", "10", "-D", "-", url]);
    if let Some(a) = accept {
        c.args(["-H", &format!("Accept: {a}")]);
    }
    let o = c.output().expect("run curl");
    assert!(
        o.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8(o.stdout).expect("utf-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("headers");
    let ct = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (ct, body.to_string())
}

/// `promtool check metrics` of `body`: its exit status and what it said.
fn check_metrics(body: &str) -> (bool, String) {
    use std::io::Write;
    let mut p = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    p.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let o = p.wait_with_output().unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

fn start(dir: &Path) -> (Proc, Proc, Vec<Proc>) {
    let met = metrics_service(dir);
    let mut pool = FilePool::start_with_default_timings(
        dir,
        &args![
            "--metrics",
            met.url("grpc"),
            "--snapshot-interval",
            "200ms",
            "--zfs-txg-timeout",
            "200ms",
            "--prometheus-listen",
            "127.0.0.1:0",
        ],
    );
    for _ in 0..2 {
        pool.add_agent_with("256MiB", &args!["--prometheus-listen", "127.0.0.1:0"]);
    }
    let FilePool { alloc, agents, .. } = pool;
    (met, alloc, agents)
}

#[test]
fn every_endpoint_passes_promtool_and_negotiates_openmetrics() {
    promtool();
    let dir = tempfile::tempdir().unwrap();
    let (met, alloc, agents) = start(dir.path());
    // Real traffic: allocations (streamed), writes, commits, a sync.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = ctl(&args![
            "write",
            "--allocator",
            alloc.url("grpc"),
            "--total",
            "16MiB",
            "--no-manifest",
            "--no-progress"
        ]);
        if o.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "write: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // And blocks given back: 4 MiB written and freed (--free).
    ok_stdout(
        &ctl(&args![
            "write",
            "--allocator",
            alloc.url("grpc"),
            "--total",
            "4MiB",
            "--free",
            "--no-progress"
        ]),
        "write --free",
    );
    let pool = format!("http://{}/metrics", met.addr("http"));
    // The metrics service has a snapshot with both vdevs.
    let deadline = Instant::now() + Duration::from_secs(20);
    while scrape(&pool, None)
        .1
        .matches("aliquot_vdev_capacity_bytes{")
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "no snapshot with 2 vdevs");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut endpoints = vec![
        ("metrics service", pool.clone()),
        (
            "allocator",
            format!("http://{}/metrics", alloc.addr("prometheus")),
        ),
    ];
    for a in &agents {
        endpoints.push((
            a.name.as_str(),
            format!("http://{}/metrics", a.addr("prometheus")),
        ));
    }
    for (what, url) in &endpoints {
        let (ct, body) = scrape(url, None);
        assert!(ct.starts_with("text/plain; version=0.0.4"), "{what}: {ct}");
        assert!(
            body.contains("# TYPE aliquot_grpc_server_requests_total counter"),
            "{what}: {body}"
        );
        let (ok, said) = check_metrics(&body);
        assert!(ok && said.trim().is_empty(), "{what}: promtool: {said}");
        // No "no limit" as 1.8e19.
        for l in body.lines().filter(|l| !l.starts_with('#')) {
            let v: f64 = l
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            assert!(v < 1e18, "{what}: {l}");
        }
        let (ct, om) = scrape(url, Some(PROMETHEUS_ACCEPT));
        assert!(
            ct.starts_with("application/openmetrics-text"),
            "{what}: {ct}"
        );
        assert!(om.ends_with("# EOF\n"), "{what}");
    }
    // AllocateStream (write's default API) counted per allocation, with
    // its latency, not once per stream.
    let (_, body) = scrape(&endpoints[1].1, None);
    let count = |op: &str| -> f64 {
        let key = format!(
            "aliquot_grpc_server_stream_messages_total{{method=\"/aliquot.v1.Allocator/AllocateStream\",op=\"{op}\",code=\"OK\"}} "
        );
        body.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(count("allocate") >= 16.0, "{body}");
    assert!(count("commit") >= 1.0, "{body}");
    assert!(
        body.contains(&format!(
            "aliquot_grpc_server_stream_message_duration_seconds_count{{method=\"/aliquot.v1.Allocator/AllocateStream\",op=\"allocate\"}} {}",
            count("allocate")
        )),
        "{body}"
    );
    // Per-vdev space counters: 20 MiB committed in 20 extents, 4 MiB freed
    // in 4, summed over the vdevs (the allocator's own /metrics).
    let sum = |name: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    const MIB: f64 = (1u64 << 20) as f64;
    assert_eq!(sum("aliquot_vdev_alloc_bytes_total"), 20.0 * MIB, "{body}");
    assert_eq!(sum("aliquot_vdev_allocs_total"), 20.0, "{body}");
    assert_eq!(sum("aliquot_vdev_free_bytes_total"), 4.0 * MIB, "{body}");
    assert_eq!(sum("aliquot_vdev_frees_total"), 4.0, "{body}");
    assert!(
        body.contains("aliquot_vdev_alloc_bytes_total{vdev=\"0\",name=\"file0\"}"),
        "{body}"
    );
    let (_, body) = scrape(&pool, None);
    assert!(
        body.contains("# TYPE aliquot_pool_dropped_snapshots_total counter"),
        "{body}"
    );

    // The shipped rules and scrape config.
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let o = Command::new(promtool())
        .args(["check", "rules"])
        .arg(deploy.join("prometheus-rules.yml"))
        .output()
        .unwrap();
    let said = ok_stdout(&o, "promtool check rules");
    assert!(said.contains("SUCCESS"), "{said}");
    // The rules fire on made-up series as their test file expects.
    let o = Command::new(promtool())
        .args(["test", "rules"])
        .arg(deploy.join("prometheus-rules.test.yml"))
        .output()
        .unwrap();
    let said = ok_stdout(&o, "promtool test rules");
    assert!(said.contains("SUCCESS"), "{said}");
    let o = Command::new(promtool())
        .args(["check", "config", "--syntax-only"])
        .arg(deploy.join("prometheus.yml"))
        .output()
        .unwrap();
    ok_stdout(&o, "promtool check config");
    drop(agents);
}

/// The samples of `name` in a 0.0.4 text body: (labels as `{...}`, value).
fn samples<'a>(body: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
    body.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = rest.rsplit_once(' ')?;
            labels.starts_with('{').then_some((labels, value))
        })
        .collect()
}

/// A sample's value is 1 (the encoder writes `1.0`).
fn one(v: &str) -> bool {
    v.parse::<f64>() == Ok(1.0)
}

/// A vdev set offline is exported as OFFLINE (its pool DEGRADED), and the
/// shipped `AliquotVdevNotOnline` fires on the series as scraped; a class
/// the throttle does not bound has no `aliquot_class_limit_bytes` sample,
/// a throttled one has, and promtool still passes the body.
#[test]
fn an_offline_vdev_is_offline_to_prometheus_and_unthrottled_classes_have_no_limit() {
    let dir = tempfile::tempdir().unwrap();
    let met = metrics_service(dir.path());
    // Enough metaslabs for an embedded log class of some space, as `up`
    // asks (the class the throttle does not bound).
    let mut pool = FilePool::start(
        dir.path(),
        &args![
            "--metrics",
            met.url("grpc"),
            "--snapshot-interval",
            "200ms",
            "--tunable",
            "zfs_vdev_min_ms_count=128"
        ],
    );
    pool.add_agent("256MiB");
    pool.add_agent("256MiB");
    let first = pool.ok(&args!["vdev", "offline", "file1"]);
    assert!(first.contains("is offline"), "{first}");
    // Twice: says it was already.
    let again = pool.ok(&args!["vdev", "offline", "file1"]);
    assert!(again.contains("file1 (1) is already offline"), "{again}");
    let url = format!("http://{}/metrics", met.addr("http"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (_, body) = scrape(&url, None);
        if samples(&body, "aliquot_vdev_health")
            .iter()
            .any(|(l, v)| l.contains("name=\"file1\"") && l.contains("state=\"OFFLINE\"") && one(v))
        {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "file1 never exported OFFLINE:\n{body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let health = samples(&body, "aliquot_vdev_health");
    let on = |name: &str| -> Vec<&str> {
        health
            .iter()
            .filter(|(l, v)| l.contains(&format!("name=\"{name}\"")) && one(v))
            .map(|(l, _)| *l)
            .collect()
    };
    assert_eq!(on("file1").len(), 1, "one state at a time: {health:?}");
    assert!(on("file0")[0].contains("state=\"ONLINE\""), "{health:?}");
    let pool_state: Vec<(&str, &str)> = samples(&body, "aliquot_pool_health")
        .into_iter()
        .filter(|(_, v)| one(v))
        .collect();
    assert_eq!(pool_state.len(), 1, "{body}");
    assert!(pool_state[0].0.contains("state=\"DEGRADED\""), "{body}");

    // The shipped rule fires on these series (as scraped, held for 10 min).
    let mut series = String::new();
    for (labels, value) in &health {
        series.push_str(&format!(
            "      - series: 'aliquot_vdev_health{labels}'\n        values: '{value}x10'\n"
        ));
    }
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus-rules.yml");
    let file1 = on("file1")[0];
    let vdev = file1
        .split("vdev=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("vdev label");
    let test = format!(
        "rule_files:\n  - {}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{series}    \
         alert_rule_test:\n      - eval_time: 5m\n        alertname: AliquotVdevNotOnline\n        exp_alerts:\n          \
         - exp_labels:\n              severity: critical\n              pool: aliquot\n              vdev: \"{vdev}\"\n              \
         name: file1\n              state: ONLINE\n            exp_annotations:\n              summary: \"vdev file1 ({vdev}) \
         of pool aliquot is not ONLINE\"\n              description: \"aliquotctl status shows its state and why; the agent's \
         log says more.\"\n",
        rules.canonicalize().unwrap().display()
    );
    let test_file = dir.path().join("offline.test.yml");
    std::fs::write(&test_file, &test).unwrap();
    let o = Command::new(promtool())
        .args(["test", "rules"])
        .arg(&test_file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "promtool test rules on the scraped series:\n{test}\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    // Class limits: a sample exactly for the classes the throttle bounds.
    let st = pool.status();
    let limits = samples(&body, "aliquot_class_limit_bytes");
    let mut unthrottled = 0;
    for c in st["classes"].as_array().expect("classes") {
        let name = c["name"].as_str().unwrap();
        let throttled = c["throttle_enabled"].as_bool().unwrap_or(false);
        unthrottled += usize::from(!throttled);
        let has = limits
            .iter()
            .any(|(l, _)| l.contains(&format!("class=\"{name}\"")));
        assert_eq!(
            has, throttled,
            "class {name} (throttle {throttled}): limit samples {limits:?}"
        );
    }
    assert!(unthrottled > 0, "no unthrottled class to check: {st}");
    let (ok, said) = check_metrics(&body);
    assert!(ok && said.trim().is_empty(), "promtool: {said}");
    drop(pool);
}
