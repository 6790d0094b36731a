//! The README walked as written, so that it cannot drift from the tools:
//! every fenced block of README.md tagged `readme-walk` (```` ```sh
//! readme-walk ````) is run line by line through `sh`, in README order, in
//! a fresh directory (so `./aliquot-data` is the pool's, as for a reader in
//! a fresh clone), against the pool the first `aliquotctl up` starts. Each
//! command must exit 0; a comment quoting output that ends in an ellipsis
//! (`# … "file0 (0) is empty: …"`) must match what the command printed.
//!
//! What the walk does not run verbatim, and why (`Walk::line`):
//! * `cargo build --release` and `alias aliquotctl=…`: the test's binaries
//!   are on PATH (`integration_tests::bin` built them);
//! * `pip install ./clients/python`: installed once per test process
//!   (`python_client_path`), given as PYTHONPATH;
//! * the first `aliquotctl up` runs in the background, small (three 256 MiB
//!   vdevs, fast txgs, ephemeral ports: tests run side by side); the `up`
//!   lines after it are alternatives to it and are not run;
//! * `aliquotctl serve …` runs in the background until the walk ends; the
//!   walk waits until its vdev is healthy in `status`;
//! * sizes are scaled down (`SCALE`), and the well-known allocator address
//!   is this pool's; clients find the pool by ALIQUOT_ALLOCATOR and
//!   ALIQUOT_METRICS (every flag is also an environment variable).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{TermOnDrop, bin, bin_dir, python, python_client_path};

const TAG: &str = "readme-walk";

/// README sizes → test sizes (a 1 GiB write on 256 MiB vdevs would fill them).
const SCALE: &[(&str, &str)] = &[
    ("--total 1GiB", "--total 64MiB"),
    ("--capacity 4GiB", "--capacity 256MiB"),
];

/// What `up` gets besides the README's flags.
const UP_EXTRA: &str = "--ephemeral --agents 256MiB,256MiB,256MiB \
                        --snapshot-interval 200ms --zfs-txg-timeout 300ms";

/// Longest a single README command may take here.
const LINE_TIMEOUT: Duration = Duration::from_secs(240);

/// The tagged blocks' commands, in README order: comment-only and empty
/// lines dropped, `\` continuations joined.
fn walk_lines(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for l in readme.lines() {
        if let Some(info) = l.trim_start().strip_prefix("```") {
            if in_block {
                in_block = false;
            } else {
                in_block = info.split_whitespace().any(|w| w == TAG);
            }
            continue;
        }
        if !in_block {
            continue;
        }
        let t = l.trim();
        if let Some(head) = t.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(t);
        let line = std::mem::take(&mut pending);
        if !line.is_empty() && !line.starts_with('#') {
            out.push(line);
        }
    }
    out
}

/// The command part of a README line and its comment (after ` # `).
fn split_comment(line: &str) -> (&str, &str) {
    match line.find(" # ") {
        Some(i) => (line[..i].trim(), line[i + 3..].trim()),
        None => (line.trim(), ""),
    }
}

/// Output the comment quotes, as `"TEXT …"`: TEXT.
fn quoted_output(comment: &str) -> Option<&str> {
    let start = comment.find('"')? + 1;
    let len = comment[start..].find('"')?;
    let q = &comment[start..start + len];
    q.strip_suffix('…').map(str::trim_end)
}

struct Walk {
    dir: PathBuf,
    path_env: String,
    pythonpath: String,
    allocator: Option<String>,
    metrics: Option<String>,
    background: Vec<TermOnDrop>,
    up_seen: bool,
    transcript: String,
}

impl Walk {
    fn sh(&self, cmd: &str) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(cmd)
            .current_dir(&self.dir)
            .env("PATH", &self.path_env)
            .env("PYTHONPATH", &self.pythonpath)
            .env_remove("ALIQUOT_INSECURE")
            .env_remove("ALIQUOT_DATA_DIR")
            .env_remove("ALIQUOT_CERTS_DIR")
            .env_remove("ALIQUOT_ALLOCATOR")
            .env_remove("ALIQUOT_METRICS");
        if let Some(a) = &self.allocator {
            c.env("ALIQUOT_ALLOCATOR", format!("https://{a}"));
        }
        if let Some(m) = &self.metrics {
            c.env("ALIQUOT_METRICS", m);
        }
        c
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "README walk: {what}\n--- walk so far ---\n{}",
            self.transcript
        )
    }

    fn line(&mut self, line: &str) {
        let (cmd, comment) = split_comment(line);
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let is_ctl = words.first() == Some(&"aliquotctl");
        if cmd == "cargo build --release"
            || cmd.starts_with("alias aliquotctl=")
            || cmd == "pip install ./clients/python"
        {
            self.transcript
                .push_str(&format!("(done by the test) {cmd}\n"));
            return;
        }
        if is_ctl && words.get(1) == Some(&"up") {
            if self.up_seen {
                self.transcript
                    .push_str(&format!("(an alternative to the first up) {cmd}\n"));
            } else {
                self.up_seen = true;
                self.start_up(cmd);
            }
            return;
        }
        let mut cmd = cmd.to_string();
        for (from, to) in SCALE {
            cmd = cmd.replace(from, to);
        }
        if let Some(a) = &self.allocator {
            cmd = cmd.replace("127.0.0.1:7000", a);
        }
        if is_ctl && words.get(1) == Some(&"serve") {
            self.start_serve(&cmd);
            return;
        }
        self.transcript.push_str(&format!("$ {cmd}\n"));
        let out = self.run(&cmd);
        self.transcript.push_str(&out);
        if let Some(q) = quoted_output(comment)
            && !out.contains(q)
        {
            self.fail(&format!("`{cmd}` did not print {q:?}"));
        }
        // The snippet prints the block's txg and whether it read back equal.
        if words.first() == Some(&"python3") && !out.trim_end().ends_with(" True") {
            self.fail("the Python snippet did not read back what it wrote");
        }
    }

    /// Run `cmd` to completion within LINE_TIMEOUT; its stdout and stderr.
    fn run(&mut self, cmd: &str) -> String {
        let log = self.dir.join("walk-line.log");
        let f = std::fs::File::create(&log).unwrap();
        let mut child = self
            .sh(cmd)
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("sh");
        let deadline = Instant::now() + LINE_TIMEOUT;
        let st = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let out = std::fs::read_to_string(&log).unwrap_or_default();
                self.transcript.push_str(&out);
                self.fail(&format!("`{cmd}` ran past {LINE_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        if !st.success() {
            self.transcript.push_str(&out);
            self.fail(&format!("`{cmd}` failed ({st})"));
        }
        out
    }

    /// The README's `aliquotctl up`, in the background at test scale;
    /// returns once it printed its addresses.
    fn start_up(&mut self, cmd: &str) {
        let cmd = format!("exec {cmd} {UP_EXTRA}");
        self.transcript.push_str(&format!("$ {cmd} &\n"));
        let log = self.dir.join("up.stderr");
        let mut child = self
            .sh(&cmd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("aliquotctl up");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        self.background.push(TermOnDrop(child));
        loop {
            let Some(Ok(l)) = lines.next() else {
                let errs = std::fs::read_to_string(&log).unwrap_or_default();
                self.fail(&format!("up ended before LISTEN:\n{errs}"));
            };
            self.transcript.push_str(&l);
            self.transcript.push('\n');
            // "  metrics    https://127.0.0.1:PORT   charts …"
            if let Some(rest) = l.trim().strip_prefix("metrics") {
                self.metrics = rest.split_whitespace().next().map(str::to_string);
            }
            if let Some(a) = l.strip_prefix("LISTEN grpc ") {
                self.allocator = Some(a.to_string());
                break;
            }
        }
        std::thread::spawn(move || lines.for_each(drop));
        if self.metrics.is_none() {
            self.fail("up printed no metrics address");
        }
    }

    /// `aliquotctl serve agent … --name NAME …` in the background; returns
    /// once vdev NAME is healthy in `status`.
    fn start_serve(&mut self, cmd: &str) {
        self.transcript.push_str(&format!("$ {cmd} &\n"));
        let name = cmd
            .split_whitespace()
            .skip_while(|w| *w != "--name")
            .nth(1)
            .unwrap_or_else(|| self.fail("serve without --name"))
            .to_string();
        let log = self.dir.join(format!("serve-{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child: Child = self
            .sh(&format!("exec {cmd}"))
            .stdin(Stdio::piped())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .expect("serve");
        self.background.push(TermOnDrop(child));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = self.sh("aliquotctl status --json").output().unwrap();
            let st: serde_json::Value =
                serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
            let healthy = st["vdevs"].as_array().is_some_and(|v| {
                v.iter()
                    .any(|v| v["name"] == name.as_str() && v["health"] == "healthy")
            });
            if healthy {
                self.transcript
                    .push_str(&format!("({name} joined the pool, healthy)\n"));
                return;
            }
            // Under mutual TLS a new device waits for the operator's
            // `vdev add`, the README's next line.
            let pending = st["pending_vdevs"]
                .as_array()
                .is_some_and(|v| v.iter().any(|v| v["name"] == name.as_str()));
            if pending {
                self.transcript
                    .push_str(&format!("({name} waits as a pending vdev)\n"));
                return;
            }
            if Instant::now() > deadline {
                let l = std::fs::read_to_string(&log).unwrap_or_default();
                self.fail(&format!("{name} did not join in 60 s: {st}\n{l}"));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

#[test]
fn readme_flows_run_as_written() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let lines = walk_lines(&readme);
    // The sections the walk stands for: a local pool by hand, adding a
    // vdev, balancing and removal, the Python client.
    for must in [
        "aliquotctl up",
        "aliquotctl serve agent",
        "aliquotctl balancer execute --drain file0",
        "aliquotctl vdev remove file0",
        "python3 -c",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(must)),
            "no README block tagged {TAG} runs `{must}`"
        );
    }
    bin("aliquotctl");
    let py = python();
    let tmp = tempfile::tempdir().unwrap();
    let mut walk = Walk {
        dir: tmp.path().to_path_buf(),
        path_env: format!(
            "{}:{}",
            bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        ),
        pythonpath: python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR"))),
        allocator: None,
        metrics: None,
        background: Vec::new(),
        up_seen: false,
        transcript: String::new(),
    };
    for l in &lines {
        walk.line(l);
    }
    // The pool still works after the walk: a write and its read-back.
    walk.line("aliquotctl write --total 8MiB --verify");
    assert!(
        tmp.path().join("balance.svg").exists(),
        "history --svg wrote no chart"
    );
    println!("{}", walk.transcript);
    // Agents, then the rest, stop (up last: it stops its children).
    while let Some(p) = walk.background.pop() {
        drop(p);
    }
}
