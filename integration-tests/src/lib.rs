//! Support for tests across real processes: find (building if needed) the
//! workspace's binaries, start them on ephemeral loopback ports, learn their
//! addresses from the `LISTEN <kind> <addr>` lines every Aliquot service
//! prints on stdout, and kill them (gently or with SIGKILL).
//!
//! Services refuse to start without certificates or an explicit
//! `--insecure`: processes started here get `ALIQUOT_INSECURE=1` (plaintext
//! on loopback) unless their arguments or environment bring TLS files or
//! say otherwise. Security tests pass certificates; see `tests/security.rs`.

/// A private PostgreSQL server per test (the `local-postgres` crate).
pub use local_postgres as postgres;

pub mod compose;
pub mod pg_proxy;
pub mod pool;
pub mod secure_pool;
pub mod throttle;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use pool::{FilePool, Security, start_agent, start_allocator};

/// The directory holding the workspace's binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/debug/deps/<test>-<hash> → target/debug
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.to_path_buf()
}

/// Path of a workspace binary, building all binaries once per test process
/// (`cargo test` builds only test harnesses of other packages' binaries).
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        // With the crash points the mover's crash tests drive (the test
        // build of this package enables them too, so one build serves both).
        cmd.args([
            "build",
            "--workspace",
            "--bins",
            "--features",
            "aliquotctl/failpoints",
        ]);
        // Cargo gives a test process this package's CARGO_PKG_*,
        // CARGO_MANIFEST_* & co.; build scripts that rerun when those change
        // (ring's does) would then be rebuilt here, and again by the next
        // `cargo test` from a shell, with everything above them: ~1.5 min a
        // test binary on 2 cores. Build with the invoking shell's view.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("CARGO_PKG_")
                || k.starts_with("CARGO_MANIFEST_")
                || k.starts_with("CARGO_CRATE_")
                || k.starts_with("CARGO_BIN_")
                || k == "CARGO_PRIMARY_PACKAGE"
                || k == "CARGO_TARGET_TMPDIR"
                || k == "OUT_DIR"
            {
                cmd.env_remove(k.as_ref());
            }
        }
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let status = cmd
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build");
        assert!(
            status.success(),
            "cargo build --workspace --bins --features aliquotctl/failpoints failed"
        );
    });
    let p = bin_dir().join(name);
    assert!(p.exists(), "binary {} not found", p.display());
    p
}

/// A running service process; killed when dropped.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    /// `kind → address` from the LISTEN lines (e.g. "grpc", "http").
    pub addrs: HashMap<String, SocketAddr>,
    pub log: PathBuf,
    bin: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    kinds: Vec<String>,
}

impl Proc {
    /// Start `bin` with `args`, wait (≤ 60 s) until it printed a LISTEN line
    /// for every kind in `kinds`. stderr goes to `log_dir/<name>.log`.
    pub fn start(
        name: &str,
        bin: &Path,
        args: &[String],
        envs: &[(String, String)],
        kinds: &[&str],
        log_dir: &Path,
    ) -> anyhow::Result<Proc> {
        let mut p = Proc {
            name: name.to_string(),
            child: None,
            addrs: HashMap::new(),
            log: log_dir.join(format!("{name}.log")),
            bin: bin.to_path_buf(),
            args: args.to_vec(),
            envs: envs.to_vec(),
            kinds: kinds.iter().map(|s| s.to_string()).collect(),
        };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        if wants_plaintext(&self.args, &self.envs) {
            cmd.env(INSECURE_ENV, "1");
        }
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut it = line.split_whitespace();
                if it.next() == Some("LISTEN")
                    && let (Some(kind), Some(addr)) = (it.next(), it.next())
                    && let Ok(a) = addr.parse::<SocketAddr>()
                {
                    let _ = tx.send((kind.to_string(), a));
                }
            }
        });
        self.child = Some(child);
        self.addrs.clear();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !self.kinds.iter().all(|k| self.addrs.contains_key(k)) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok((k, a)) => {
                    self.addrs.insert(k, a);
                }
                Err(_) => {
                    let tail = self.log_tail();
                    self.kill();
                    anyhow::bail!("{} did not start listening; log:\n{tail}", self.name);
                }
            }
        }
        Ok(())
    }

    /// Address of a listener, e.g. `addr("grpc")`.
    pub fn addr(&self, kind: &str) -> SocketAddr {
        self.addrs[kind]
    }

    /// `http://addr` of a listener.
    pub fn url(&self, kind: &str) -> String {
        format!("http://{}", self.addr(kind))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            for _ in 0..100 {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again with the same arguments (after `kill`/`kill9`).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        self.spawn()
    }

    /// Replace one `--flag value` pair's value for the next `restart` (e.g.
    /// pin the port an agent listened on so the allocator can reach it).
    pub fn set_arg(&mut self, flag: &str, value: &str) {
        if let Some(i) = self.args.iter().position(|a| a == flag)
            && i + 1 < self.args.len()
        {
            self.args[i + 1] = value.to_string();
            return;
        }
        self.args.push(flag.to_string());
        self.args.push(value.to_string());
    }

    /// Drop one `--flag value` pair for the next `restart`.
    pub fn remove_arg(&mut self, flag: &str) {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            self.args.drain(i..(i + 2).min(self.args.len()));
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Strings from anything displayable, for argument lists.
#[macro_export]
macro_rules! args {
    ($($a:expr),* $(,)?) => { ::std::vec::Vec::<String>::from([$($a.to_string()),*]) };
}

/// `--tls-ca/--tls-cert/--tls-key` of the certificate `certs issue` wrote
/// for `role` `name` in the CA directory `certs`.
pub fn tls_args(certs: &Path, role: aliquot_auth::Role, name: &str) -> Vec<String> {
    let f = aliquot_auth::TlsFiles::in_dir(certs, role, name);
    args![
        "--tls-ca",
        f.ca.display(),
        "--tls-cert",
        f.cert.display(),
        "--tls-key",
        f.key.display()
    ]
}

/// The variable that is `--insecure` for every service and client.
pub const INSECURE_ENV: &str = "ALIQUOT_INSECURE";

/// True unless `args`/`envs` bring certificates or set the mode themselves.
pub fn wants_plaintext(args: &[String], envs: &[(String, String)]) -> bool {
    let tls_flag = |a: &String| {
        matches!(
            a.as_str(),
            "--tls-ca" | "--ca" | "--cert" | "--certs-dir" | "--insecure"
        )
    };
    !args.iter().any(tls_flag)
        && !envs.iter().any(|(k, _)| {
            k == INSECURE_ENV || k.starts_with("ALIQUOT_TLS_") || k == "ALIQUOT_CERTS_DIR"
        })
}

/// `cmd` speaking plaintext (`ALIQUOT_INSECURE=1`), for tests of a pool
/// started with `--insecure`.
pub fn insecure(cmd: &mut Command) -> &mut Command {
    cmd.env(INSECURE_ENV, "1")
}

/// Run the `aliquotctl` binary to completion (plaintext unless `args`
/// bring certificates; see the module docs).
pub fn ctl(args: &[String]) -> Output {
    let mut cmd = Command::new(bin("aliquotctl"));
    cmd.args(args).env_remove("ALIQUOT_ALLOCATOR");
    if wants_plaintext(args, &[]) {
        cmd.env(INSECURE_ENV, "1");
    }
    // Bounded (10 min, far past any command a test runs): a command that
    // hangs fails its test, saying so, instead of stalling the suite.
    run_within(cmd, Duration::from_secs(600))
}

/// Run `cmd`, killing it after `timeout`; the output whatever happened.
/// The command runs in a process group of its own and the whole group is
/// killed: a script's children (docker CLIs under build-images.sh) would
/// otherwise hold its output pipes open and the reads below never end.
pub fn run_within(mut cmd: Command, timeout: Duration) -> Output {
    use std::os::unix::process::CommandExt;
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    // Drain the pipes in threads so a chatty command cannot block on them.
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let (tx_out, rx_out) = std::sync::mpsc::channel();
    let (tx_err, rx_err) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut so, &mut b);
        let _ = tx_out.send(b);
    });
    std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut se, &mut b);
        let _ = tx_err.send(b);
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = child.kill();
            let s = child.wait().expect("wait");
            eprintln!("{what} timed out after {timeout:?}");
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // A process that left the group still holds a pipe: give up its output
    // rather than wait for it.
    let grace = Duration::from_secs(10);
    Output {
        status,
        stdout: rx_out.recv_timeout(grace).unwrap_or_default(),
        stderr: rx_err.recv_timeout(grace).unwrap_or_default(),
    }
}

pub fn ok_stdout(o: &Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed ({}):\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

/// Pids whose parent is `pid` (from /proc).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so split after ')'.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid: u32 = after.split_whitespace().nth(1).unwrap().parse().unwrap();
        if ppid == pid {
            v.push(p);
        }
    }
    v
}

/// A 64-bit integer from `status --json` (the proto3 JSON mapping writes
/// them as strings) or from a report that writes numbers.
pub fn json_u64(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str()?.parse().ok())
}

/// `kill SIG` the process (e.g. "-STOP", "-CONT", "-TERM"); it must run.
pub fn signal(p: &Proc, sig: &str) {
    let pid = p.pid().expect("the process runs").to_string();
    let ok = Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// An Allocate of one DATA block of `size` bytes, one copy, default lease.
pub fn data_request(size: u64) -> aliquot_proto::v1::AllocateRequest {
    aliquot_proto::v1::AllocateRequest {
        class: aliquot_proto::v1::AllocationClass::Data as i32,
        size,
        copies: 1,
        lease_ms: 0,
        max_size: 0,
        affinity_key: None,
    }
}

/// A plaintext channel connected on first use: 2 s to connect, 5 s a call,
/// and no Nagle (with it, delayed ACKs add ~40 ms to each small RPC).
pub fn lazy_channel(url: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .expect("a URL")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy()
}

/// The leader's and a standby's URLs of the allocators at `allocators`, as
/// `aliquotctl allocator status` shows them once the leader has seen a
/// standby poll (waits up to 20 s for that; blocking).
pub fn leader_and_standby(allocators: &str) -> (String, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let o = ctl(&[
            "allocator".into(),
            "status".into(),
            "--allocator".into(),
            allocators.into(),
        ]);
        let text = ok_stdout(&o, "allocator status");
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|l| l.trim().split(' ').next().unwrap_or("").to_string())
        };
        if let (Some(l), Some(s)) = (field("leader"), field("standbys"))
            && s.starts_with("http")
        {
            return (l, s);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no standby listed:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// A metrics service in `dir` (its SQLite file `dir/metrics.db`), with its
/// gRPC and HTTP listeners on ephemeral ports.
pub fn metrics_service(dir: &Path) -> Proc {
    let a = args![
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--db",
        dir.join("metrics.db").display(),
    ];
    Proc::start(
        "metrics",
        &bin("aliquot-metrics"),
        &a,
        &[],
        &["grpc", "http"],
        dir,
    )
    .expect("start metrics")
}

/// The Python interpreter the tests run: `ALIQUOT_TEST_PYTHON`, else
/// `python3`.
pub fn python() -> String {
    std::env::var("ALIQUOT_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Where the Python client (clients/python) is importable from:
/// `ALIQUOT_PYTHONPATH` (.ci/run installs it there), or a fresh install
/// into `target_tmp/python-client` (pass the test's `CARGO_TARGET_TMPDIR`).
pub fn python_client_path(py: &str, target_tmp: &Path) -> String {
    if let Ok(p) = std::env::var("ALIQUOT_PYTHONPATH") {
        return p;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root");
    // Once per test process: two tests installing into one directory at
    // once race in pip's own clean-up of the target (FileNotFoundError).
    static INSTALLED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| install_python_client(py, repo, &target_tmp.join("python-client")))
        .clone()
}

fn install_python_client(py: &str, repo: &Path, dir: &Path) -> String {
    let st = Command::new(py)
        .args(["-m", "pip", "install", "--quiet", "--upgrade", "--target"])
        .arg(dir)
        .arg(format!(
            "{}[reflection]",
            repo.join("clients/python").display()
        ))
        .status()
        .unwrap_or_else(|e| panic!("cannot run {py} -m pip: {e}"));
    assert!(st.success(), "pip install clients/python failed");
    dir.display().to_string()
}

/// A child process (e.g. `aliquotctl up`) sent SIGTERM and reaped when
/// dropped, so a failing test does not leave a pool running.
pub struct TermOnDrop(pub Child);

impl Drop for TermOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        // Bounded: a child whose shutdown hangs is killed (and the test that
        // dropped it ends) rather than holding the suite forever.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "pid {} did not exit within 60 s of SIGTERM: killed",
            self.0.id()
        );
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A small tmpfs mounted for a test's life, to fill a real file system
/// (unmounted, lazily, on drop). Mounting needs root (CAP_SYS_ADMIN), which
/// the project's test machines have; the test fails, saying so, where it is
/// missing.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test fills a real file system: it mounts a small tmpfs, which needs root \
             (CAP_SYS_ADMIN): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(at.to_path_buf())
    }

    pub fn resize(&self, size: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .expect("run mount")
            .success();
        assert!(ok, "remount {}", self.0.display());
    }

    /// Fill what is left of the file system with the file `name` (written
    /// until ENOSPC); removing the file gives the space back.
    pub fn fill(&self, name: &str) -> PathBuf {
        use std::io::Write;
        let path = self.0.join(name);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("ballast file");
        let chunk = vec![0xeeu8; 4096];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => panic!("fill {}: {e}", path.display()),
            }
        }
        let _ = f.sync_all();
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
