//! The high-availability compose shape (deploy/docker-compose.ha.yml), for
//! real: a PostgreSQL image built offline from this host's Debian package
//! (deploy/build-postgres-image.sh), two allocators on it, agents and the
//! loadgen given both. The first allocator leads; the second stands by
//! (its Allocator service NOT_SERVING, the server healthy). The loadgen
//! writes; the leader's container is `docker kill`ed (SIGKILL); the standby
//! serves the same pool, every byte allocated before the kill still
//! allocated, within the lease and a poll; the loadgen writes again through
//! the new leader; the killed allocator comes back as the standby.
//!
//! Needs a Docker engine, compose, and PostgreSQL's server installed on the
//! host (`apt-get install postgresql`, as .ci/run does). Without them the
//! test says why and passes, unless ALIQUOT_REQUIRE_DOCKER is set.

use std::process::Command;
use std::time::{Duration, Instant};

use integration_tests::compose::{
    ImageGuard, Project, build_image, docker_available, free_ports_below_ephemeral, groups,
    normal_alloc, operator_certs, repo_root, run_id, status, text, wait_for,
};
use integration_tests::run_within;

/// The lease the test gives the allocators (the deployment's default is 5s).
const LEASE: Duration = Duration::from_secs(3);

fn skip(why: &str) {
    if std::env::var_os("ALIQUOT_REQUIRE_DOCKER").is_some() {
        panic!("ALIQUOT_REQUIRE_DOCKER is set but the HA compose test cannot run: {why}");
    }
    eprintln!("compose HA test skipped: {why}");
}

/// Whether `status --json` names `url` as the leader.
fn leads(st: &serde_json::Value, url: &str) -> bool {
    st["leadership"]["leader"]
        .as_str()
        .is_some_and(|l| l.starts_with(url))
}

#[test]
fn compose_ha_standby_takes_over_a_killed_leader() {
    let program = match docker_available() {
        Ok(p) => p,
        Err(why) => return skip(&why),
    };
    let has_pg = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().any(|e| e.path().join("bin/postgres").exists()))
        .unwrap_or(false);
    if !has_pg {
        return skip("no PostgreSQL server under /usr/lib/postgresql (apt-get install postgresql)");
    }
    let started = Instant::now();
    let root = repo_root();

    // 1. Both images, offline, from what this machine has.
    let run_id = run_id();
    let image = build_image(format!("aliquot:compose-ha-{run_id}"));
    let pg_image = ImageGuard(format!("aliquot/postgres:compose-ha-{run_id}"));
    let mut build = Command::new(root.join("deploy/build-postgres-image.sh"));
    build.args(["--tag", &pg_image.0]);
    let o = run_within(build, Duration::from_secs(180));
    assert!(
        o.status.success(),
        "build-postgres-image.sh failed: {}",
        text(&o)
    );

    let mut env: Vec<(String, String)> = vec![
        ("ALIQUOT_IMAGE".into(), image.0.clone()),
        ("ALIQUOT_POSTGRES_IMAGE".into(), pg_image.0.clone()),
        ("ALIQUOT_PG_PASSWORD".into(), format!("pw-{run_id}")),
        (
            "ALIQUOT_LEADER_LEASE".into(),
            format!("{}s", LEASE.as_secs()),
        ),
        ("ALIQUOT_LOADGEN_TOTAL".into(), "16MiB".into()),
        ("ALIQUOT_LOADGEN_BLOCK_SIZE".into(), "128KiB".into()),
        ("ALIQUOT_LOADGEN_CONCURRENCY".into(), "4".into()),
        ("COMPOSE_HTTP_TIMEOUT".into(), "120".into()),
    ];
    for p in [
        "ALIQUOT_METRICS_PORT",
        "ALIQUOT_CHARTS_PORT",
        "ALIQUOT_ALLOCATOR_PORT",
        "ALIQUOT_ALLOCATOR_B_PORT",
    ] {
        env.push((p.into(), "0".into()));
    }
    let free = free_ports_below_ephemeral(4);
    for (name, l) in ["AGENT1", "AGENT2", "AGENT3", "HDD1"].iter().zip(&free) {
        let port = l.local_addr().expect("addr").port();
        env.push((format!("ALIQUOT_{name}_PORT"), port.to_string()));
    }
    drop(free);
    let project = Project {
        program,
        name: format!("aliquot-ha-test-{run_id}"),
        files: vec![
            root.join("deploy/docker-compose.yml"),
            root.join("deploy/docker-compose.ha.yml"),
        ],
        env,
        profiles: Vec::new(),
    };

    // 2. Up; every health check green (both allocators: the server as a
    //    whole serves on a standby too).
    let services = [
        "postgres",
        "metrics",
        "allocator",
        "allocator-b",
        "agent1",
        "agent2",
        "agent3",
        "hdd1",
    ];
    project.must(&["up", "-d", "--no-build"], Duration::from_secs(240));
    project.wait_healthy(&services, Duration::from_secs(150));
    let a = project.port("allocator", 7000);
    let b = project.port("allocator-b", 7000);
    let both = format!("{a},{b}");

    let tmp = tempfile::tempdir().expect("tempdir");
    let certs = tmp.path().join("certs");
    operator_certs(&project, &certs);

    // The first allocator leads, on PostgreSQL, and sees the second.
    let st = wait_for("4 vdevs and a standby", Duration::from_secs(60), || {
        let st = status(&both, &certs);
        let l = &st["leadership"];
        (groups(&st).len() >= 4
            && l["store"] == "postgres"
            && l["standbys"].as_array().is_some_and(|s| !s.is_empty()))
        .then_some(st)
    });
    assert!(
        leads(&st, "https://allocator:7000"),
        "the first allocator leads: {st}"
    );
    let guid = st["guid"].clone();

    // 3. The loadgen writes through the leader.
    project.must(
        &["--profile", "loadgen", "run", "--rm", "loadgen"],
        Duration::from_secs(180),
    );
    let before = normal_alloc(&status(&both, &certs));
    assert!(before >= 16 << 20, "16 MiB written, {before} allocated");

    // 4. SIGKILL the leader's container: the standby serves the same pool,
    //    nothing allocated lost, within the lease and a poll.
    let leader = project.container("allocator");
    let killed = Instant::now();
    let o = run_within(
        {
            let mut c = Command::new("docker");
            c.args(["kill", &leader]);
            c
        },
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "docker kill: {}", text(&o));
    let st = wait_for("the standby to lead", Duration::from_secs(60), || {
        let mut c = Command::new(integration_tests::bin("aliquotctl"));
        c.args(["status", "--json", "--allocator", &b])
            .arg("--certs-dir")
            .arg(&certs);
        let o = run_within(c, Duration::from_secs(10));
        if !o.status.success() {
            return None;
        }
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        leads(&st, "https://allocator-b:7000").then_some(st)
    });
    let takeover = killed.elapsed();
    eprintln!("compose HA: takeover {takeover:?} after the kill (lease {LEASE:?})");
    assert_eq!(st["guid"], guid, "the standby serves the same pool: {st}");
    assert_eq!(
        normal_alloc(&st),
        before,
        "every byte allocated before the kill is allocated after it: {st}"
    );
    // Docker's own kill and a status round trip ride on the lease: a
    // generous bound, the measured time is printed.
    assert!(
        takeover < LEASE + Duration::from_secs(15),
        "takeover took {takeover:?}"
    );

    // 5. The loadgen (given both allocators) writes through the new leader.
    project.must(
        &["--profile", "loadgen", "run", "--rm", "loadgen"],
        Duration::from_secs(180),
    );
    let after = normal_alloc(&status(&b, &certs));
    assert!(
        after >= before + (16 << 20),
        "writes go on after the takeover: {before} → {after}"
    );

    // 6. The killed allocator comes back as the standby (restart policy
    //    does not restart a `docker kill`ed container: start it).
    project.must(&["start", "allocator"], Duration::from_secs(60));
    project.wait_healthy(&["allocator"], Duration::from_secs(60));
    let st = wait_for(
        "the old leader standing by",
        Duration::from_secs(60),
        || {
            let st = status(&both, &certs);
            let l = &st["leadership"];
            (leads(&st, "https://allocator-b:7000")
                && l["standbys"].as_array().is_some_and(|s| {
                    s.iter()
                        .any(|x| x.as_str().is_some_and(|x| x.contains("allocator:7000")))
                }))
            .then_some(st)
        },
    );
    assert_eq!(normal_alloc(&st), after, "{st}");
    eprintln!("compose HA test took {:?} before down", started.elapsed());
}
