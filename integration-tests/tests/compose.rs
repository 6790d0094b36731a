//! The docker compose deployment, for real: build the image without a
//! registry (deploy/build-images.sh), `up` deploy/docker-compose.yml with the
//! test override (an OTLP receiver in Jaeger's place, the `jaeger` profile),
//! wait for every health check (gRPC health over mutual TLS), run the loadgen
//! profile, copy the operator's certificate out of the `certs` volume and
//! read the allocation status and the metrics rows through the published TLS
//! ports (plaintext refused), write from the host (`--agent-host`),
//! `docker kill` an agent and see allocation go on, restart the allocator
//! container and see its state survive, find the spans at the receiver, and
//! `down -v`.
//!
//! Needs a Docker engine and compose (`docker compose` or `docker-compose`).
//! Without them the test says why and passes, unless ALIQUOT_REQUIRE_DOCKER
//! is set. Each run has its own compose project and random host ports; a
//! guard runs `down -v` however the test ends.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use aliquot_proto::v1::SummaryRequest;
use aliquot_proto::v1::metrics_client::MetricsClient;
use integration_tests::json_u64;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Run `cmd`, killing it after `timeout`; the output whatever happened.
fn run(mut cmd: Command, timeout: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    // Drain the pipes in threads so a chatty command cannot block on them.
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut so, &mut b);
        b
    });
    let t_err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut se, &mut b);
        b
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let s = child.wait().expect("wait");
            eprintln!("compose test: {what} timed out after {timeout:?}");
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `docker compose` (v2 plugin) or `docker-compose` (v1), whichever works.
fn compose_program() -> Option<Vec<String>> {
    let ok = |prog: &str, args: &[&str]| {
        Command::new(prog)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if ok("docker", &["compose", "version"]) {
        Some(vec!["docker".into(), "compose".into()])
    } else if ok("docker-compose", &["version"]) {
        Some(vec!["docker-compose".into()])
    } else {
        None
    }
}

fn docker_available() -> Result<Vec<String>, String> {
    let info = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .map_err(|e| format!("docker CLI not found: {e}"))?;
    if !info.status.success() {
        return Err(format!(
            "docker engine not reachable: {}",
            String::from_utf8_lossy(&info.stderr).trim()
        ));
    }
    compose_program().ok_or_else(|| "neither `docker compose` nor `docker-compose` works".into())
}

/// One compose project; `down -v` when dropped (test passed or not).
struct Project {
    program: Vec<String>,
    name: String,
    files: Vec<PathBuf>,
    env: Vec<(String, String)>,
}

impl Project {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.program[0]);
        c.args(&self.program[1..]);
        c.arg("--project-name").arg(&self.name);
        for f in &self.files {
            c.arg("-f").arg(f);
        }
        // The OTLP receiver standing in for Jaeger.
        c.args(["--profile", "jaeger"]);
        c.args(args);
        c.current_dir(repo_root());
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    fn run(&self, args: &[&str], timeout: Duration) -> Output {
        run(self.cmd(args), timeout)
    }

    fn must(&self, args: &[&str], timeout: Duration) -> Output {
        let o = self.run(args, timeout);
        assert!(
            o.status.success(),
            "compose {args:?} failed: {}\nlogs:\n{}",
            text(&o),
            self.logs()
        );
        o
    }

    fn logs(&self) -> String {
        let o = self.run(
            &["logs", "--no-color", "--tail", "40"],
            Duration::from_secs(30),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn container(&self, service: &str) -> String {
        let o = self.must(&["ps", "-q", service], Duration::from_secs(30));
        let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert!(!id.is_empty(), "no container for {service}");
        id
    }

    /// Host address of a published container port.
    fn port(&self, service: &str, port: u16) -> String {
        let o = self.must(
            &["port", service, &port.to_string()],
            Duration::from_secs(30),
        );
        let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
        let port = s.rsplit(':').next().expect("host:port");
        format!("127.0.0.1:{port}")
    }

    fn health(&self, service: &str) -> String {
        let id = self.container(service);
        let o = run(
            {
                let mut c = Command::new("docker");
                c.args(["inspect", "-f", "{{.State.Health.Status}}", &id]);
                c
            },
            Duration::from_secs(20),
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    fn wait_healthy(&self, services: &[&str], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let states: Vec<(String, String)> = services
                .iter()
                .map(|s| (s.to_string(), self.health(s)))
                .collect();
            if states.iter().all(|(_, h)| h == "healthy") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not healthy after {timeout:?}: {states:?}\nlogs:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("compose test failed; last logs:\n{}", self.logs());
        }
        let o = self.run(
            &["down", "-v", "--remove-orphans", "-t", "5"],
            Duration::from_secs(120),
        );
        if !o.status.success() {
            eprintln!("compose down -v failed: {}", text(&o));
        }
    }
}

/// The run's image tag, removed when the test ends (after the project's
/// `down`, which is dropped first).
struct ImageGuard(String);

impl Drop for ImageGuard {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rmi", "-f", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// `aliquotctl status --json` from the host against the published port,
/// over mutual TLS with the certificates copied out of the stack.
fn status(allocator: &str, certs: &Path) -> serde_json::Value {
    let mut c = Command::new(integration_tests::bin("aliquotctl"));
    c.args(["status", "--json", "--allocator", allocator])
        .arg("--certs-dir")
        .arg(certs);
    let o = run(c, Duration::from_secs(30));
    assert!(o.status.success(), "aliquotctl status failed: {}", text(&o));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", text(&o)))
}

/// Bytes allocated in the normal class (sum over its groups).
fn normal_alloc(st: &serde_json::Value) -> u64 {
    st["classes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == "normal")
        .map(|c| json_u64(&c["alloc"]).unwrap_or(0))
        .sum()
}

fn groups(st: &serde_json::Value) -> Vec<serde_json::Value> {
    st["classes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == "normal")
        .flat_map(|c| c["groups"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// vdev id → allocated bytes, over the normal class's groups.
fn by_vdev(st: &serde_json::Value) -> std::collections::BTreeMap<u64, u64> {
    groups(st)
        .iter()
        .map(|g| {
            (
                g["vdev"].as_u64().unwrap_or(u64::MAX),
                json_u64(&g["alloc"]).unwrap_or(0),
            )
        })
        .collect()
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn compose_deployment_end_to_end() {
    let program = match docker_available() {
        Ok(p) => p,
        Err(why) => {
            if std::env::var_os("ALIQUOT_REQUIRE_DOCKER").is_some() {
                panic!("ALIQUOT_REQUIRE_DOCKER is set but docker is unusable: {why}");
            }
            eprintln!("compose test skipped: {why}");
            return;
        }
    };
    let started = Instant::now();
    let root = repo_root();

    // 1. The image, from the binaries this test run already builds.
    integration_tests::bin("aliquotctl");
    let bin_dir = integration_tests::bin_dir();
    let mut build = Command::new(root.join("deploy/build-images.sh"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let run_id = format!("{}-{nanos:x}", std::process::id());
    let image = ImageGuard(format!("aliquot:compose-test-{run_id}"));
    build.args([
        "--bin-dir",
        &bin_dir.display().to_string(),
        "--tag",
        &image.0,
    ]);
    let o = run(build, Duration::from_secs(180));
    assert!(o.status.success(), "build-images.sh failed: {}", text(&o));
    let mut env: Vec<(String, String)> = vec![
        ("ALIQUOT_IMAGE".into(), image.0.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "300".into()),
        ("ALIQUOT_LOADGEN_TOTAL".into(), "16MiB".into()),
        ("ALIQUOT_LOADGEN_BLOCK_SIZE".into(), "128KiB".into()),
        ("ALIQUOT_LOADGEN_CONCURRENCY".into(), "4".into()),
        ("COMPOSE_HTTP_TIMEOUT".into(), "120".into()),
    ];
    env.push(("ALIQUOT_OTLP_ENDPOINT".into(), "http://jaeger:4317".into()));
    for p in [
        "ALIQUOT_JAEGER_UI_PORT",
        "ALIQUOT_METRICS_PORT",
        "ALIQUOT_CHARTS_PORT",
        "ALIQUOT_ALLOCATOR_PORT",
    ] {
        env.push((p.into(), "0".into()));
    }
    // An agent listens, advertises and is published on one port (so the
    // host can reach it with --agent-host): free ones, not the defaults.
    let free = free_ports_below_ephemeral(4);
    for (name, l) in ["AGENT1", "AGENT2", "AGENT3", "HDD1"].iter().zip(&free) {
        let port = l.local_addr().expect("addr").port();
        env.push((format!("ALIQUOT_{name}_PORT"), port.to_string()));
    }
    drop(free);
    let project = Project {
        program,
        name: format!("aliquot-test-{run_id}"),
        files: vec![
            root.join("deploy/docker-compose.yml"),
            root.join("deploy/docker-compose.test.yml"),
        ],
        env,
    };

    // 2. Up, and every health check green.
    let services = [
        "jaeger",
        "metrics",
        "allocator",
        "agent1",
        "agent2",
        "agent3",
        "hdd1",
    ];
    project.must(&["up", "-d", "--no-build"], Duration::from_secs(240));
    project.wait_healthy(&services, Duration::from_secs(120));
    let allocator = project.port("allocator", 7000);
    let metrics = project.port("metrics", 7100);

    // Each container holds only its own key (issue 27, item 6): no ca.key
    // anywhere, the token signing key in the allocator only.
    for service in ["metrics", "allocator", "agent1", "agent2", "agent3", "hdd1"] {
        let o = run(
            {
                let mut c = Command::new("docker");
                c.args(["exec", &project.container(service), "sh", "-c"])
                    .arg("for f in /etc/aliquot/certs/*; do echo \"${f##*/}\"; done");
                c
            },
            Duration::from_secs(30),
        );
        assert!(o.status.success(), "list {service}'s certs: {}", text(&o));
        let files = String::from_utf8_lossy(&o.stdout).to_string();
        let has = |f: &str| files.lines().any(|l| l == f);
        assert!(!has("ca.key"), "{service} holds ca.key: {files}");
        assert_eq!(
            has("token.key"),
            service == "allocator",
            "{service}'s token.key: {files}"
        );
        let keys = files.lines().filter(|l| l.ends_with(".key")).count();
        assert_eq!(
            keys,
            1 + usize::from(service == "allocator"),
            "{service} holds another's key: {files}"
        );
    }

    // The operator's certificate, out of its export volume (the one-shot
    // `certs` container, exited, still holds the mount).
    let tmp = tempfile::tempdir().expect("tempdir");
    let certs = tmp.path().join("certs");
    let certs_container = {
        let o = project.must(&["ps", "-aq", "certs"], Duration::from_secs(30));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let o = run(
        {
            let mut c = Command::new("docker");
            c.arg("cp")
                .arg(format!("{certs_container}:/export/operator"))
                .arg(&certs);
            c
        },
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "docker cp certs: {}", text(&o));
    let copied: Vec<String> = std::fs::read_dir(&certs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !copied.iter().any(|f| f == "ca.key" || f == "token.key"),
        "the operator's copy holds the CA's secrets: {copied:?}"
    );
    // Plaintext to the published port is refused.
    let mut plain = Command::new(integration_tests::bin("aliquotctl"));
    plain.args(["status", "--insecure", "--allocator", &allocator]);
    let o = run(plain, Duration::from_secs(30));
    assert!(
        !o.status.success(),
        "plaintext status was served: {}",
        text(&o)
    );

    let st = wait_for("4 vdevs registered", Duration::from_secs(60), || {
        let st = status(&allocator, &certs);
        (groups(&st).len() >= 4).then_some(st)
    });
    assert_eq!(normal_alloc(&st), 0, "a fresh pool has nothing allocated");

    // 3. The loadgen profile writes through the compose network.
    project.must(
        &["--profile", "loadgen", "run", "--rm", "loadgen"],
        Duration::from_secs(180),
    );
    let st = status(&allocator, &certs);
    let after_load = normal_alloc(&st);
    assert!(
        after_load >= 16 << 20,
        "16 MiB written, {after_load} bytes allocated: {st}"
    );
    let per_vdev: Vec<u64> = groups(&st)
        .iter()
        .map(|g| json_u64(&g["alloc"]).unwrap_or(0))
        .collect();
    assert!(
        per_vdev.iter().filter(|a| **a > 0).count() >= 2,
        "the load was spread over the vdevs: {per_vdev:?}"
    );

    // 4. Metrics rows: the allocator's snapshots landed in SQLite.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let operator = aliquot_auth::TlsFiles::in_dir(&certs, aliquot_auth::Role::Admin, "operator");
    let summary = wait_for("metrics samples", Duration::from_secs(60), || {
        rt.block_on(async {
            let ch = tonic::transport::Channel::from_shared(format!("https://{metrics}"))
                .ok()?
                .tls_config(operator.client_config(aliquot_auth::Role::Metrics).ok()?)
                .ok()?
                .connect()
                .await
                .ok()?;
            let mut c = MetricsClient::new(ch);
            let r = c
                .summary(SummaryRequest {
                    pool: String::new(),
                })
                .await
                .ok()?
                .into_inner();
            r.pools
                .into_iter()
                .find(|p| p.samples > 0 && p.vdevs >= 4 && p.total_written_bytes > 0)
        })
    });
    eprintln!(
        "metrics: pool {} samples {} vdevs {} written {}",
        summary.pool, summary.samples, summary.vdevs, summary.total_written_bytes
    );

    // 4b. A write from the host, to the agents' published ports.
    let mut w = Command::new(integration_tests::bin("aliquotctl"));
    w.args([
        "write",
        "--allocator",
        &allocator,
        "--agent-host",
        "127.0.0.1",
        "--total",
        "8MiB",
        "--block-size",
        "128KiB",
        "--verify",
        "--no-progress",
    ])
    .arg("--certs-dir")
    .arg(&certs);
    let o = run(w, Duration::from_secs(120));
    assert!(o.status.success(), "write from the host: {}", text(&o));
    let after_load = normal_alloc(&status(&allocator, &certs));

    // 5. Kill one agent: allocation goes on on the others.
    let victim = project.container("agent1");
    let o = run(
        {
            let mut c = Command::new("docker");
            c.args(["kill", &victim]);
            c
        },
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "docker kill: {}", text(&o));
    std::thread::sleep(Duration::from_secs(1));
    project.must(
        &["--profile", "loadgen", "run", "--rm", "loadgen"],
        Duration::from_secs(180),
    );
    let st = status(&allocator, &certs);
    let after_kill = normal_alloc(&st);
    assert!(
        after_kill >= after_load + (16 << 20),
        "allocation went on after the kill: {after_load} → {after_kill}"
    );

    // 6. Restart the allocator container: its synced state survives.
    let before_restart = by_vdev(&st);
    let guid_before = st["guid"].clone();
    project.must(
        &["restart", "-t", "10", "allocator"],
        Duration::from_secs(120),
    );
    project.wait_healthy(&["allocator"], Duration::from_secs(60));
    let allocator = project.port("allocator", 7000);
    let st = wait_for("vdevs back after restart", Duration::from_secs(60), || {
        let st = status(&allocator, &certs);
        (groups(&st).len() >= 3).then_some(st)
    });
    let after: std::collections::BTreeMap<u64, u64> = by_vdev(&st);
    assert!(
        json_u64(&st["guid"]).is_some(),
        "status --json has the pool guid: {st}"
    );
    // The same pool (the allocator's SQLite store on its volume), and every
    // vdev it knows has exactly the bytes it had (the killed agent's vdev
    // may be known from the store only).
    assert_eq!(
        st["guid"], guid_before,
        "the restarted allocator is a new pool: its state did not survive: {st}"
    );
    for (vdev, alloc) in &after {
        assert_eq!(
            before_restart.get(vdev),
            Some(alloc),
            "vdev {vdev}: allocated bytes before the restart {:?}, after {alloc}: {st}",
            before_restart.get(vdev)
        );
    }
    assert!(
        after.values().sum::<u64>() > 0,
        "state after the restart: {st}"
    );
    assert!(after.len() >= 3, "the live agents re-registered: {st}");

    // 7. Spans reached the receiver standing in for Jaeger.
    let sink = project.container("jaeger");
    let spans = wait_for("spans at the receiver", Duration::from_secs(30), || {
        let o = run(
            {
                let mut c = Command::new("docker");
                c.args(["logs", &sink]);
                c
            },
            Duration::from_secs(30),
        );
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let has = |svc: &str| lines.iter().any(|s| s["service"] == svc);
        (has("aliquotctl")
            && has("aliquot-allocator")
            && has("aliquot-agent")
            && has("aliquot-metrics"))
        .then_some(lines)
    });
    let root = spans
        .iter()
        .find(|s| s["name"] == "aliquotctl.write")
        .expect("an aliquotctl.write root span");
    let trace = root["trace_id"].as_str().expect("trace id");
    let in_trace: std::collections::BTreeSet<&str> = spans
        .iter()
        .filter(|s| s["trace_id"] == trace)
        .filter_map(|s| s["service"].as_str())
        .collect();
    assert!(
        in_trace.contains("aliquot-allocator") && in_trace.contains("aliquot-agent"),
        "the loadgen's trace crosses the containers: {in_trace:?}"
    );

    eprintln!("compose test took {:?} before down", started.elapsed());
    let volumes_label = format!("label=com.docker.compose.project={}", project.name);
    drop(project);

    // 8. `down -v` left nothing of the project behind.
    let o = run(
        {
            let mut c = Command::new("docker");
            c.args(["volume", "ls", "-q", "--filter", &volumes_label]);
            c
        },
        Duration::from_secs(30),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).trim().is_empty(),
        "volumes left after down -v: {}",
        text(&o)
    );
}

/// `n` free ports below the kernel's ephemeral range. The services
/// published on port 0 get theirs from Docker out of that range, and a
/// port the kernel handed out for `bind(0)` here could be given to one of
/// them before the agent claims it (seen: "Bind for 127.0.0.1:32785
/// failed: port is already allocated"). Held open until the caller drops
/// them, so no two are the same.
fn free_ports_below_ephemeral(n: usize) -> Vec<std::net::TcpListener> {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000).max(1));
    // Start somewhere different in each run (several test processes may
    // run at once), then walk down from there.
    let mut at = u32::from(low) - 1 - std::process::id() % span;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(at > 1024, "no free port below the ephemeral range");
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", at as u16)) {
            out.push(l);
        }
        at -= 1;
    }
    out
}
