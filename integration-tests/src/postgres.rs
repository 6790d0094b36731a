//! A private PostgreSQL server for a test: its own data dir (initdb) and a
//! free port on 127.0.0.1, never the system's. The binaries come from
//! `ALIQUOT_PG_BIN`, Debian's `/usr/lib/postgresql/<version>/bin`, or PATH
//! (`.ci/run` installs Debian's `postgresql` package where they are
//! missing). PostgreSQL refuses to run as root: as root the server runs as
//! the `postgres` user (Debian's package creates it) or `nobody`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running PostgreSQL server; stopped (immediate mode) when dropped.
pub struct Postgres {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
    child: Option<Child>,
}

/// Where `initdb` and `postgres` are, if anywhere.
pub fn bin_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("ALIQUOT_PG_BIN") {
        return Some(PathBuf::from(d));
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    if let Some(d) = versions.pop() {
        return Some(d);
    }
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p).find(|d| d.join("initdb").exists() && d.join("postgres").exists())
    })
}

/// uid and gid of `name` from /etc/passwd.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 3 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

fn chown_tree(p: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::chown(p, Some(uid), Some(gid))?;
    if p.is_dir() {
        for e in std::fs::read_dir(p)? {
            chown_tree(&e?.path(), uid, gid)?;
        }
    }
    Ok(())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Postgres {
    /// initdb a fresh cluster and start it. Panics with what is missing
    /// when PostgreSQL is not installed.
    pub fn start() -> Postgres {
        let bin = bin_dir().expect(
            "PostgreSQL is not installed: .ci/run installs Debian's `postgresql` package \
             (or set ALIQUOT_PG_BIN to the directory holding initdb and postgres)",
        );
        let dir = tempfile::Builder::new()
            .prefix("aliquot-pg-")
            .tempdir()
            .expect("tempdir");
        let user = if is_root() {
            Some(
                user_ids("postgres")
                    .or_else(|| user_ids("nobody"))
                    .expect("a postgres or nobody user to run PostgreSQL as"),
            )
        } else {
            None
        };
        if let Some((uid, gid)) = user {
            chown_tree(dir.path(), uid, gid).expect("chown the data dir");
        }
        let mut pg = Postgres {
            port: free_port(),
            dir,
            bin,
            user,
            child: None,
        };
        let out = pg
            .command("initdb")
            .args(["-D"])
            .arg(pg.data())
            .args(["-U", "aliquot", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg.launch();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn command(&self, prog: &str) -> Command {
        let mut c = Command::new(self.bin.join(prog));
        c.current_dir(self.dir.path()).stdin(Stdio::null());
        if let Some((uid, gid)) = self.user {
            c.uid(uid).gid(gid);
        }
        c
    }

    /// The URL allocators take (`--store`).
    pub fn url(&self) -> String {
        format!("postgres://aliquot@127.0.0.1:{}/postgres", self.port)
    }

    /// Start the server on the existing data dir; returns once it accepts
    /// connections.
    pub fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("postgres log");
        let start_at = std::fs::metadata(self.log()).map(|m| m.len()).unwrap_or(0);
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            // A test machine does not lose power; crash safety of the
            // server itself is PostgreSQL's, not what these tests check.
            .args(["-c", "fsync=off", "-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read(self.log()).unwrap_or_default();
            let fresh =
                String::from_utf8_lossy(&text[(start_at as usize).min(text.len())..]).to_string();
            if fresh.contains("ready to accept connections") {
                return;
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                panic!("postgres exited ({st}):\n{fresh}");
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start:\n{fresh}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
        }
    }

    /// Fast shutdown (SIGINT: sessions are ended, the server checkpoints);
    /// waits until it exited.
    pub fn stop_fast(&mut self) {
        self.signal("-INT");
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// Pause (SIGSTOP) or resume (SIGCONT) the whole server: the postmaster
    /// and every backend, as a partition would leave it unreachable.
    pub fn pause(&self, on: bool) {
        let Some(c) = &self.child else { return };
        let sig = if on { "-STOP" } else { "-CONT" };
        let _ = Command::new("pkill")
            .args([sig, "-P", &c.id().to_string()])
            .status();
        self.signal(sig);
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.pause(false);
            // Immediate shutdown: no checkpoint, backends end at once.
            self.signal("-QUIT");
            if let Some(mut c) = self.child.take() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = c.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
