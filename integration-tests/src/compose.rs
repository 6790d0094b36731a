//! Support for tests of the docker compose deployment: find `docker
//! compose` or `docker-compose`, one compose project
//! (torn down with `down -v` when dropped), image tags removed when the test
//! ends, and reading the pool's status from the host.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::run_within;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `docker compose` (v2 plugin) or `docker-compose` (v1), whichever works.
pub fn compose_program() -> Option<Vec<String>> {
    let ok = |prog: &str, args: &[&str]| {
        let mut c = Command::new(prog);
        c.args(args);
        // A missing program is a failed spawn: `run` would panic on it.
        which(prog) && run_within(c, Duration::from_secs(30)).status.success()
    };
    if ok("docker", &["compose", "version"]) {
        Some(vec!["docker".into(), "compose".into()])
    } else if ok("docker-compose", &["version"]) {
        Some(vec!["docker-compose".into()])
    } else {
        None
    }
}

/// `prog` is an executable file in a PATH directory.
fn which(prog: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            std::fs::metadata(d.join(prog))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

pub fn docker_available() -> Result<Vec<String>, String> {
    if !which("docker") {
        return Err("docker CLI not found on PATH".into());
    }
    // Bounded: an engine that accepts the connection but never answers
    // must skip the test, not hang the suite.
    let mut probe = Command::new("docker");
    probe.args(["info", "--format", "{{.ServerVersion}}"]);
    let info = run_within(probe, Duration::from_secs(30));
    if !info.status.success() {
        return Err(format!(
            "docker engine not reachable: {}",
            String::from_utf8_lossy(&info.stderr).trim()
        ));
    }
    compose_program().ok_or_else(|| "neither `docker compose` nor `docker-compose` works".into())
}

/// One compose project; `down -v` when dropped (test passed or not).
pub struct Project {
    pub program: Vec<String>,
    pub name: String,
    pub files: Vec<PathBuf>,
    pub env: Vec<(String, String)>,
    /// `--profile` arguments given to every command.
    pub profiles: Vec<String>,
}

impl Project {
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.program[0]);
        c.args(&self.program[1..]);
        c.arg("--project-name").arg(&self.name);
        for f in &self.files {
            c.arg("-f").arg(f);
        }
        for p in &self.profiles {
            c.args(["--profile", p]);
        }
        c.args(args);
        c.current_dir(repo_root());
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    pub fn run(&self, args: &[&str], timeout: Duration) -> Output {
        run_within(self.cmd(args), timeout)
    }

    pub fn must(&self, args: &[&str], timeout: Duration) -> Output {
        let o = self.run(args, timeout);
        assert!(
            o.status.success(),
            "compose {args:?} failed: {}\nlogs:\n{}",
            text(&o),
            self.logs()
        );
        o
    }

    pub fn logs(&self) -> String {
        let o = self.run(
            &["logs", "--no-color", "--tail", "40"],
            Duration::from_secs(30),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    pub fn container(&self, service: &str) -> String {
        let o = self.must(&["ps", "-q", service], Duration::from_secs(30));
        let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert!(!id.is_empty(), "no container for {service}");
        id
    }

    /// Host address of a published container port.
    pub fn port(&self, service: &str, port: u16) -> String {
        let o = self.must(
            &["port", service, &port.to_string()],
            Duration::from_secs(30),
        );
        let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
        let port = s.rsplit(':').next().expect("host:port");
        format!("127.0.0.1:{port}")
    }

    pub fn health(&self, service: &str) -> String {
        let id = self.container(service);
        let o = run_within(
            {
                let mut c = Command::new("docker");
                c.args(["inspect", "-f", "{{.State.Health.Status}}", &id]);
                c
            },
            Duration::from_secs(20),
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    pub fn wait_healthy(&self, services: &[&str], timeout: Duration) {
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
pub struct ImageGuard(pub String);

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
pub fn status(allocator: &str, certs: &Path) -> serde_json::Value {
    let mut c = Command::new(crate::bin("aliquotctl"));
    c.args(["status", "--json", "--allocator", allocator])
        .arg("--certs-dir")
        .arg(certs);
    let o = run_within(c, Duration::from_secs(30));
    assert!(o.status.success(), "aliquotctl status failed: {}", text(&o));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("status --json is not JSON ({e}): {}", text(&o)))
}

/// Bytes allocated in the normal class (sum over its groups).
pub fn normal_alloc(st: &serde_json::Value) -> u64 {
    st["classes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == "normal")
        .map(|c| crate::json_u64(&c["alloc"]).unwrap_or(0))
        .sum()
}

pub fn groups(st: &serde_json::Value) -> Vec<serde_json::Value> {
    st["classes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == "normal")
        .flat_map(|c| c["groups"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// vdev id → allocated bytes, over the normal class's groups.
pub fn by_vdev(st: &serde_json::Value) -> std::collections::BTreeMap<u64, u64> {
    groups(st)
        .iter()
        .map(|g| {
            (
                g["vdev"].as_u64().unwrap_or(u64::MAX),
                crate::json_u64(&g["alloc"]).unwrap_or(0),
            )
        })
        .collect()
}

pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
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

/// `n` free ports below the kernel's ephemeral range. The services
/// published on port 0 get theirs from Docker out of that range, and a
/// port the kernel handed out for `bind(0)` here could be given to one of
/// them before the agent claims it (seen: "Bind for 127.0.0.1:32785
/// failed: port is already allocated"). Held open until the caller drops
/// them, so no two are the same.
pub fn free_ports_below_ephemeral(n: usize) -> Vec<std::net::TcpListener> {
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

/// A tag suffix unique to this test process and moment, for images and
/// compose projects.
pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{nanos:x}", std::process::id())
}

/// The Aliquot image, built offline (`deploy/build-images.sh`) from the
/// binaries this test run already built, as `tag`; removed when dropped.
pub fn build_image(tag: String) -> ImageGuard {
    crate::bin("aliquotctl");
    let image = ImageGuard(tag);
    let mut build = Command::new(repo_root().join("deploy/build-images.sh"));
    build.args([
        "--bin-dir",
        &crate::bin_dir().display().to_string(),
        "--tag",
        &image.0,
    ]);
    let o = run_within(build, Duration::from_secs(180));
    assert!(o.status.success(), "build-images.sh failed: {}", text(&o));
    image
}

/// The operator's certificate, copied out of its export volume (the
/// one-shot `certs` container, exited, still holds the mount) into `dest`.
pub fn operator_certs(project: &Project, dest: &Path) {
    let certs_container = {
        let o = project.must(&["ps", "-aq", "certs"], Duration::from_secs(30));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let o = run_within(
        {
            let mut c = Command::new("docker");
            c.arg("cp")
                .arg(format!("{certs_container}:/export/operator"))
                .arg(dest);
            c
        },
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "docker cp certs: {}", text(&o));
}
