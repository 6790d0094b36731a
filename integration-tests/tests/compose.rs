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

use std::process::Command;
use std::time::{Duration, Instant};

use aliquot_proto::v1::SummaryRequest;
use aliquot_proto::v1::metrics_client::MetricsClient;
use integration_tests::compose::{
    Project, build_image, by_vdev, docker_available, free_ports_below_ephemeral, groups,
    normal_alloc, operator_certs, repo_root, run_id, status, text, wait_for,
};
use integration_tests::json_u64;
use integration_tests::run_within;

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
    let run_id = run_id();
    let image = build_image(format!("aliquot:compose-test-{run_id}"));
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
        // The OTLP receiver standing in for Jaeger.
        profiles: vec!["jaeger".into()],
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

    // Each container holds only its own key: no ca.key
    // anywhere, the token signing key in the allocator only.
    for service in ["metrics", "allocator", "agent1", "agent2", "agent3", "hdd1"] {
        let o = run_within(
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
    operator_certs(&project, &certs);
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
    let o = run_within(plain, Duration::from_secs(30));
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
    let o = run_within(w, Duration::from_secs(120));
    assert!(o.status.success(), "write from the host: {}", text(&o));
    let after_load = normal_alloc(&status(&allocator, &certs));

    // 5. Kill one agent: allocation goes on on the others.
    let victim = project.container("agent1");
    let o = run_within(
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
        let o = run_within(
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
    let o = run_within(
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
