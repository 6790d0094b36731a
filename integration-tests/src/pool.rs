//! The test pool, started one way: [`start_allocator`] and [`start_agent`]
//! start one member (defaults that a test's flags of the same name
//! replace, its port kept across `restart`), and [`FilePool`] is the
//! builder tests stand a pool up with: plaintext, plaintext with write
//! tokens, or mutual TLS (`secure_pool::SecurePool` is a `FilePool` under
//! TLS with a certificate per caller); file or simulated agents; extra
//! flags per process; restart and kill of any member (`Proc`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use crate::{Proc, args, bin, ctl, json_u64, ok_stdout};

/// How the members of a test pool talk.
#[derive(Clone, Copy, Debug)]
pub enum Security<'a> {
    /// Plaintext on loopback (the services are told `--insecure`).
    Plaintext,
    /// Plaintext; the allocator signs write tokens with the key of the
    /// pool CA in this directory and the agents check them.
    Tokens(&'a Path),
    /// Mutual TLS, each member with its certificate from the pool CA in
    /// this directory, and write tokens as with `Tokens`.
    Tls(&'a Path),
}

impl<'a> Security<'a> {
    /// The pool CA's directory, if the pool has one.
    pub fn certs(self) -> Option<&'a Path> {
        match self {
            Security::Plaintext => None,
            Security::Tokens(d) | Security::Tls(d) => Some(d),
        }
    }

    /// Agent `name`'s flags for this mode, as (flag, value).
    fn agent_args(self, name: &str) -> Vec<(&'static str, String)> {
        let mut a = Vec::new();
        if let Some(d) = self.certs() {
            a.push(("--token-key", d.display().to_string()));
        }
        if let Security::Tls(d) = self {
            let f = aliquot_auth::TlsFiles::in_dir(d, aliquot_auth::Role::Agent, name);
            a.push(("--tls-ca", f.ca.display().to_string()));
            a.push(("--tls-cert", f.cert.display().to_string()));
            a.push(("--tls-key", f.key.display().to_string()));
        }
        a
    }

    /// A loopback URL of the gRPC port `port` in this mode.
    pub fn url(self, port: u16) -> String {
        match self {
            Security::Tls(_) => format!("https://127.0.0.1:{port}"),
            _ => format!("http://127.0.0.1:{port}"),
        }
    }
}

/// The listeners a service started with `args` announces: gRPC, and
/// Prometheus where `--prometheus-listen` asks for it.
fn listen_kinds(args: &[String]) -> Vec<&'static str> {
    let mut k = vec!["grpc"];
    if args.iter().any(|a| a == "--prometheus-listen") {
        k.push("prometheus");
    }
    k
}

/// `defaults`, each unless `extra` names the same flag, then `extra`.
fn with_defaults(defaults: &[(&str, String)], extra: &[String]) -> Vec<String> {
    let mut a = Vec::new();
    for (flag, value) in defaults {
        if !extra.iter().any(|e| e == flag) {
            a.extend(args![flag, value]);
        }
    }
    a.extend(extra.iter().cloned());
    a
}

/// An `aliquot-allocator` named `name` (its log `dir/<name>.log`): on an
/// ephemeral loopback port, its data dir `dir/allocator`, then `defaults`,
/// each of these unless `extra` names the same flag, then `extra`. It
/// keeps its port across `restart`, where agents and clients look.
pub fn start_allocator(
    dir: &Path,
    name: &str,
    defaults: &[(&str, String)],
    extra: &[String],
) -> Proc {
    std::fs::create_dir_all(dir).expect("pool dir");
    let mut d = vec![
        ("--listen", "127.0.0.1:0".to_string()),
        ("--data-dir", dir.join("allocator").display().to_string()),
    ];
    d.extend(defaults.iter().cloned());
    let a = with_defaults(&d, extra);
    let mut p = Proc::start(
        name,
        &bin("aliquot-allocator"),
        &a,
        &[],
        &listen_kinds(&a),
        dir,
    )
    .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let addr = p.addr("grpc");
    p.set_arg("--listen", &addr.to_string());
    p
}

/// The flags of a file device: the file `path` (created at start), of
/// `capacity` (e.g. "64MiB").
pub fn file_device(path: &Path, capacity: &str) -> Vec<String> {
    args![
        "--backend",
        "file",
        "--path",
        path.display(),
        "--capacity",
        capacity
    ]
}

/// An `aliquot-agent` named `name` (its log `dir/<name>.log`) of the
/// device `device` (`file_device`, or `--backend sim ...`), registering
/// with `allocators` (one URL, or an HA pair's list), speaking `security`;
/// `extra` agent flags follow. It keeps its port across `restart`, where
/// the pool looks for it. Returns once it listens (not once registered).
pub fn start_agent(
    dir: &Path,
    security: Security,
    allocators: &str,
    name: &str,
    device: &[String],
    extra: &[String],
) -> Proc {
    let mut a = args![
        "--listen",
        "127.0.0.1:0",
        "--allocator",
        allocators,
        "--name",
        name
    ];
    a.extend(device.iter().cloned());
    // The mode's flags, unless `extra` gives its own (another key...).
    a.extend(with_defaults(&security.agent_args(name), extra));
    let kinds = listen_kinds(&a);
    let mut p = Proc::start(name, &bin("aliquot-agent"), &a, &[], &kinds, dir)
        .unwrap_or_else(|e| panic!("start agent {name}: {e}"));
    let addr = p.addr("grpc");
    p.set_arg("--listen", &addr.to_string());
    p
}

/// A pool of real processes for tests: an allocator and file (or
/// simulated) agents in `dir`, with `dir/aliquot-data` as the pool's data
/// dir (where `aliquotctl write` records its manifests: on a plaintext
/// pool the `ctl` helpers pass `--certs-dir dir/aliquot-data/certs` with
/// `--insecure`, as a user in the directory of an `up --insecure` pool
/// would have them by default; under TLS, the pool CA's directory).
pub struct FilePool {
    pub dir: PathBuf,
    pub alloc: Proc,
    pub agents: Vec<Proc>,
    pub url: String,
    /// The pool CA's directory when the pool checks write tokens
    /// (`start_with_write_tokens`, or under TLS): every agent is given it
    /// as `--token-key`.
    pub token_key: Option<PathBuf>,
    /// The pool CA's directory when every member speaks mutual TLS
    /// (`secure_pool::SecurePool`); the `ctl` helpers then act as its
    /// operator certificate.
    pub tls: Option<PathBuf>,
}

impl FilePool {
    /// The allocator (fast txgs and reports, no claim window), plus
    /// `extra` flags, which replace a default of the same flag; no agents
    /// yet.
    pub fn start(dir: &Path, extra: &[String]) -> FilePool {
        Self::start_as(
            dir,
            Security::Plaintext,
            &[
                ("--zfs-txg-timeout", "200ms".into()),
                ("--report-interval", "200ms".into()),
                ("--claim-window", "0s".into()),
            ],
            extra,
        )
    }

    /// The allocator with its own default timings (txg, reports, claim
    /// window), for tests whose assertions are about those defaults; plus
    /// `extra` flags.
    pub fn start_with_default_timings(dir: &Path, extra: &[String]) -> FilePool {
        Self::start_as(dir, Security::Plaintext, &[], extra)
    }

    /// A plaintext pool named `pool` whose allocator signs write tokens and
    /// whose agents check them: a pool CA in `dir/certs` (its key signs,
    /// its directory is every agent's `--token-key`), the allocator's
    /// default timings, plus `extra` flags.
    pub fn start_with_write_tokens(dir: &Path, pool: &str, extra: &[String]) -> FilePool {
        let certs = dir.join("certs");
        aliquot_auth::PoolCa::init(&certs, pool).expect("pool CA");
        let mut a = args!["--pool", pool, "--token-key", certs.display()];
        a.extend(extra.iter().cloned());
        Self::start_as(dir, Security::Tokens(&certs), &[], &a)
    }

    /// The allocator speaking `security` (its flags for that mode are the
    /// caller's, in `extra`), `defaults` unless `extra` names them; no
    /// agents yet.
    pub fn start_as(
        dir: &Path,
        security: Security,
        defaults: &[(&str, String)],
        extra: &[String],
    ) -> FilePool {
        let alloc = start_allocator(dir, "allocator", defaults, extra);
        let url = security.url(alloc.addr("grpc").port());
        std::fs::create_dir_all(dir.join("aliquot-data")).expect("data dir");
        FilePool {
            dir: dir.to_path_buf(),
            alloc,
            agents: Vec::new(),
            url,
            token_key: security.certs().map(Path::to_path_buf),
            tls: match security {
                Security::Tls(d) => Some(d.to_path_buf()),
                _ => None,
            },
        }
    }

    /// How this pool's members talk.
    pub fn security(&self) -> Security<'_> {
        match (&self.tls, &self.token_key) {
            (Some(d), _) => Security::Tls(d),
            (None, Some(k)) => Security::Tokens(k),
            (None, None) => Security::Plaintext,
        }
    }

    /// A file agent `name` on `dir/<name>.img` of `capacity`, with `extra`
    /// agent flags, not waited for nor kept in `agents` (an agent not
    /// admitted waits as pending).
    pub fn start_agent(&self, name: &str, capacity: &str, extra: &[String]) -> Proc {
        let path = self.dir.join(format!("{name}.img"));
        start_agent(
            &self.dir,
            self.security(),
            &self.url,
            name,
            &file_device(&path, capacity),
            extra,
        )
    }

    /// A file agent `file<N>` of `capacity` (e.g. "128MiB"); waits until
    /// the pool lists it.
    pub fn add_agent(&mut self, capacity: &str) {
        self.add_agent_with(capacity, &[]);
    }

    /// `add_agent` with `extra` agent flags. The agent keeps its port
    /// across `restart`, so the allocator finds it where it registered.
    pub fn add_agent_with(&mut self, capacity: &str, extra: &[String]) {
        let name = format!("file{}", self.agents.len());
        let path = self.dir.join(format!("{name}.img"));
        self.add_file_agent(&name, &path, capacity, extra);
    }

    /// A file agent named `name` on the file `path` (which may be on a
    /// file system of its own), with `extra` agent flags.
    pub fn add_file_agent(&mut self, name: &str, path: &Path, capacity: &str, extra: &[String]) {
        self.spawn_agent(name, file_device(path, capacity), extra);
    }

    /// A simulated device named `name` (`--guid` fixed, so a restart is
    /// the same vdev), with `extra` agent flags (`--capacity`,
    /// `--sim-throughput`...); waits until the pool lists it.
    pub fn add_sim_agent(&mut self, name: &str, guid: u64, extra: &[String]) {
        self.spawn_agent(name, args!["--backend", "sim", "--guid", guid], extra);
    }

    fn spawn_agent(&mut self, name: &str, device: Vec<String>, extra: &[String]) {
        let p = start_agent(&self.dir, self.security(), &self.url, name, &device, extra);
        self.agents.push(p);
        let n = self.agents.len();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.status()["vdevs"].as_array().map_or(0, |v| v.len()) != n {
            assert!(
                std::time::Instant::now() < deadline,
                "{n} vdevs did not register"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pool's data dir.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("aliquot-data")
    }

    /// Where `write` records its manifests by default.
    pub fn manifest_dir(&self) -> PathBuf {
        self.data_dir().join("manifests")
    }

    /// `aliquotctl ARGS` against this pool, to completion.
    pub fn run(&self, a: &[String]) -> Output {
        let mut a = a.to_vec();
        a.extend(args!["--allocator", self.url]);
        match &self.tls {
            Some(certs) => a.extend(args!["--certs-dir", certs.display()]),
            None => a.extend(args![
                "--insecure",
                "--certs-dir",
                self.data_dir().join("certs").display()
            ]),
        }
        ctl(&a)
    }

    /// `aliquotctl ARGS`, which must succeed: its stdout.
    pub fn ok(&self, a: &[String]) -> String {
        ok_stdout(&self.run(a), &a.join(" "))
    }

    pub fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.ok(&args!["status", "--json"])).expect("status json")
    }

    /// Allocated bytes per vdev name.
    pub fn alloc_by_name(&self) -> HashMap<String, u64> {
        self.status()["vdevs"]
            .as_array()
            .expect("vdevs")
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap_or_default().to_string(),
                    json_u64(&v["alloc"]).unwrap_or(0),
                )
            })
            .collect()
    }
}
