//! Vdev admission across real processes over mutual TLS: an agent
//! certificate no operator admitted cannot add capacity by registering a
//! device. Its device waits as pending (shown by `status`), takes nothing,
//! and joins when an operator runs `aliquotctl vdev add`; `--admit-agent
//! NAME:SIZE` admits a certificate's first device ahead, up to SIZE only.

use std::path::Path;
use std::time::{Duration, Instant};

use aliquot_auth::Role;
use integration_tests::secure_pool::{SecurePool, SecurePoolSpec};
use integration_tests::{args, ctl, json_u64, ok_stdout};

/// `aliquotctl ARGS --allocator URL --certs-dir CERTS` (the operator's
/// certificate), which must succeed: its stdout.
fn op(url: &str, certs: &Path, a: &[String]) -> String {
    let mut a = a.to_vec();
    a.extend(args!["--allocator", url, "--certs-dir", certs.display()]);
    ok_stdout(&ctl(&a), &a.join(" "))
}

fn status(url: &str, certs: &Path) -> serde_json::Value {
    serde_json::from_str(&op(url, certs, &args!["status", "--json"])).expect("status json")
}

fn names(v: &serde_json::Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .expect(key)
        .iter()
        .map(|x| x["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Poll `status` until `f` holds (≤ 30 s).
fn wait_status(url: &str, certs: &Path, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(url, certs);
        if f(&s) {
            return;
        }
        assert!(Instant::now() < until, "{what}: status is {s:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn alloc_of(s: &serde_json::Value, name: &str) -> Option<u64> {
    s["vdevs"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == name)
        .and_then(|v| json_u64(&v["alloc"]))
}

#[test]
fn a_fresh_agent_certificate_waits_as_pending_until_vdev_add() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // No agent admitted by the harness: the operator admitted file0's
    // device, and file4's up to 64 MiB.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(SecurePool::start(
        dir,
        SecurePoolSpec {
            pool: "adm",
            agents: &[],
            callers: &[
                (Role::Agent, "file0"),
                (Role::Agent, "file3"),
                (Role::Agent, "file4"),
                (Role::Admin, aliquot_auth::client::OPERATOR),
            ],
            allocator_flags: &args!["--admit-agent", "file0:256MiB,file4:64MiB"],
        },
    ));
    let (url, certs) = (pool.url.clone(), pool.certs.clone());

    let _file0 = pool.start_agent("file0", "128MiB", &[]);
    wait_status(&url, &certs, "file0 joins (admitted ahead)", |s| {
        names(s, "vdevs") == ["file0"]
    });
    // Not admitted at all, and admitted for less than it offers.
    let _file3 = pool.start_agent("file3", "128MiB", &[]);
    let _file4 = pool.start_agent("file4", "128MiB", &[]);
    wait_status(&url, &certs, "file3 and file4 wait as pending", |s| {
        let mut p = names(s, "pending_vdevs");
        p.sort();
        p == ["file3", "file4"]
    });
    let table = op(&url, &certs, &args!["status"]);
    assert!(
        table.contains("pending: file3") && table.contains("`aliquotctl vdev add file3`"),
        "{table}"
    );

    // Writes meanwhile land on file0 only: the pending devices hold no space.
    op(
        &url,
        &certs,
        &args![
            "write",
            "--total",
            "24MiB",
            "--block-size",
            "1MiB",
            "--no-progress",
            "--no-manifest"
        ],
    );
    let s = status(&url, &certs);
    assert_eq!(names(&s, "vdevs"), ["file0"], "{s:#}");
    assert!(alloc_of(&s, "file0").unwrap_or(0) >= 24 << 20, "{s:#}");

    // The operator adds file3: it joins, durable, and takes writes.
    let out = op(&url, &certs, &args!["vdev", "add", "file3"]);
    assert!(out.contains("vdev file3 (1) added"), "{out}");
    wait_status(&url, &certs, "file3 is a healthy vdev", |s| {
        s["vdevs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "file3" && v["health"] == "healthy")
    });
    let s = status(&url, &certs);
    assert_eq!(names(&s, "pending_vdevs"), ["file4"], "{s:#}");
    op(
        &url,
        &certs,
        &args![
            "write",
            "--total",
            "48MiB",
            "--block-size",
            "1MiB",
            "--verify",
            "--no-progress",
            "--no-manifest"
        ],
    );
    let s = status(&url, &certs);
    assert!(
        alloc_of(&s, "file3").unwrap_or(0) > 0,
        "nothing placed on the added vdev: {s:#}"
    );

    // Adding what does not wait is refused with the pending list.
    let mut bad = args!["vdev", "add", "nosuch", "--wait", "0s"];
    bad.extend(args!["--allocator", url, "--certs-dir", certs.display()]);
    let o = ctl(&bad);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("file4"), "{err}");
}
