//! A private PostgreSQL server: its own data dir (initdb on first use) and
//! a port on 127.0.0.1, never the system's: for the tests (a temporary
//! directory, a free port) and for `aliquotctl up --ha` (in the pool's data
//! dir, kept across runs). The binaries come from
//! `ALIQUOT_PG_BIN`, Debian's `/usr/lib/postgresql/<version>/bin`, or PATH
//! (`.ci/run` installs Debian's `postgresql` package where they are
//! missing). PostgreSQL refuses to run as root: as root the server runs as
//! the `postgres` user (Debian's package creates it) or `nobody`, and
//! reaches its directory through a handle root opened
//! (`/proc/self/fd/N`), so a private parent folder (`mktemp -d`, `/root`)
//! that user may not pass through is no obstacle.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the server's files live.
enum Dir {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl Dir {
    fn path(&self) -> &Path {
        match self {
            Dir::Temp(t) => t.path(),
            Dir::Kept(p) => p,
        }
    }
}

/// A running PostgreSQL server; stopped (immediate mode) when dropped.
pub struct Postgres {
    pub port: u16,
    dir: Dir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
    /// With `user`: the directory opened by root, handed to initdb and the
    /// server, which open their files beneath it by `/proc/self/fd/N`
    /// (the kernel checks no parent directory's permissions on that way).
    dir_fd: Option<OwnedFd>,
    child: Option<Child>,
    /// fsync off (tests only).
    fast: bool,
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

/// uid and gid of the user `name`, by the C library's user database
/// (getpwnam_r: /etc/passwd, or whatever NSS the host configures).
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids);
    // getpwnam_r only writes through the pointers given, within `buf.len()`.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some((pwd.pw_uid, pwd.pw_gid))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
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
    /// A fresh cluster in a temporary directory on a free port, started.
    /// Panics with what is missing when PostgreSQL is not installed (tests).
    pub fn start() -> Postgres {
        let dir = tempfile::Builder::new()
            .prefix("aliquot-pg-")
            .tempdir()
            .expect("tempdir");
        let mut pg =
            Postgres::prepare(Dir::Temp(dir), free_port()).unwrap_or_else(|e| panic!("{e}"));
        pg.launch_on_a_free_port().unwrap_or_else(|e| panic!("{e}"));
        pg
    }

    /// [`Postgres::start`] with fsync on, as a pool's own server runs: for
    /// benches whose figures must include the disk flush.
    pub fn start_durable() -> Postgres {
        let dir = tempfile::Builder::new()
            .prefix("aliquot-pg-")
            .tempdir()
            .expect("tempdir");
        let mut pg =
            Postgres::prepare(Dir::Temp(dir), free_port()).unwrap_or_else(|e| panic!("{e}"));
        pg.fast = false;
        pg.launch_on_a_free_port().unwrap_or_else(|e| panic!("{e}"));
        pg
    }

    /// `launch`, on another free port when the one picked was taken between
    /// the pick and PostgreSQL's bind (other tests pick ports too).
    fn launch_on_a_free_port(&mut self) -> Result<(), String> {
        let mut tries = 0;
        loop {
            match self.launch() {
                Err(e) if e.contains("Address already in use") && tries < 5 => {
                    tries += 1;
                    self.port = free_port();
                }
                r => return r,
            }
        }
    }

    /// The cluster in `dir` (created by initdb if it is not there yet) on
    /// `port` (0: a free one), started. For a pool's own server that
    /// outlives this process only as files: it is stopped when the value is
    /// dropped.
    pub fn start_in(dir: &Path, port: u16) -> Result<Postgres, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let auto = port == 0;
        let port = if auto { free_port() } else { port };
        let mut pg = Postgres::prepare(Dir::Kept(dir.to_path_buf()), port)?;
        if auto {
            pg.launch_on_a_free_port()?;
        } else {
            pg.launch()?;
        }
        Ok(pg)
    }

    fn prepare(dir: Dir, port: u16) -> Result<Postgres, String> {
        let bin = bin_dir().ok_or(
            "PostgreSQL is not installed: install Debian's `postgresql` package (.ci/run does) \
             or set ALIQUOT_PG_BIN to the directory holding initdb and postgres",
        )?;
        // PostgreSQL refuses to run as root.
        let user =
            if is_root() {
                Some(user_ids("postgres").or_else(|| user_ids("nobody")).ok_or(
                    "running as root, and no postgres or nobody user to run PostgreSQL as",
                )?)
            } else {
                None
            };
        // Handed to that user once, when the cluster is made (a kept one's
        // files already belong to it: no walk over its data at each start).
        let fresh = !dir.path().join("data").join("PG_VERSION").exists();
        if let (Some((uid, gid)), true) = (user, fresh) {
            chown_tree(dir.path(), uid, gid)
                .map_err(|e| format!("cannot chown {}: {e}", dir.path().display()))?;
        }
        let fast = matches!(dir, Dir::Temp(_));
        let dir_fd = match user {
            Some(_) => Some(
                std::fs::File::open(dir.path())
                    .map_err(|e| format!("cannot open {}: {e}", dir.path().display()))?
                    .into(),
            ),
            None => None,
        };
        let pg = Postgres {
            port,
            dir,
            bin,
            user,
            dir_fd,
            child: None,
            fast,
        };
        if !pg.data().join("PG_VERSION").exists() {
            let out = pg
                .command("initdb")
                .args(["-D"])
                .arg(pg.server_data())
                .args(["-U", "aliquot", "--auth=trust", "-E", "UTF8", "--no-sync"])
                .output()
                .map_err(|e| format!("cannot run initdb: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "initdb failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        Ok(pg)
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.log()
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The data dir as initdb and the server name it: through the handle
    /// when they run as another user.
    fn server_data(&self) -> PathBuf {
        self.server_dir().join("data")
    }

    /// The directory as initdb and the server name it.
    fn server_dir(&self) -> PathBuf {
        match &self.dir_fd {
            Some(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
            None => self.dir.path().to_path_buf(),
        }
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn command(&self, prog: &str) -> Command {
        let mut c = Command::new(self.bin.join(prog));
        c.stdin(Stdio::null());
        if let Some((uid, gid)) = self.user {
            c.uid(uid).gid(gid);
        }
        match &self.dir_fd {
            Some(fd) => {
                let raw = fd.as_raw_fd();
                // The child starts as the other user: "/" it may enter; the
                // handle stays open across exec (std opens files CLOEXEC).
                c.current_dir("/");
                // SAFETY: fcntl is async-signal-safe and touches only the
                // child's own descriptor table.
                unsafe {
                    c.pre_exec(move || {
                        let flags = libc::fcntl(raw, libc::F_GETFD);
                        if flags < 0
                            || libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            None => {
                c.current_dir(self.dir.path());
            }
        }
        c
    }

    /// The postmaster's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The URL allocators take (`--store`).
    pub fn url(&self) -> String {
        format!("postgres://aliquot@127.0.0.1:{}/postgres", self.port)
    }

    /// Start the server on the existing data dir; returns once it accepts
    /// connections.
    pub fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| format!("cannot open {}: {e}", self.log().display()))?;
        if let Some((uid, gid)) = self.user {
            let _ = std::os::unix::fs::chown(self.log(), Some(uid), Some(gid));
        }
        let start_at = std::fs::metadata(self.log()).map(|m| m.len()).unwrap_or(0);
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.server_data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.server_dir().display()
            ))
            .args(["-c", "max_connections=200"])
            // A test machine does not lose power; crash safety of the
            // server itself is PostgreSQL's, not what the tests check. A
            // pool's own server (`up --ha`) keeps fsync on.
            .args(if self.fast {
                &["-c", "fsync=off"][..]
            } else {
                &[][..]
            })
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start postgres: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read(self.log()).unwrap_or_default();
            let fresh =
                String::from_utf8_lossy(&text[(start_at as usize).min(text.len())..]).to_string();
            if fresh.contains("ready to accept connections") {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                self.child = None;
                return Err(format!("postgres exited ({st}):\n{fresh}"));
            }
            if Instant::now() > deadline {
                return Err(format!("postgres did not start within 60 s:\n{fresh}"));
            }
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
            // Fast shutdown (SIGINT: sessions end, a checkpoint is written);
            // immediate (SIGQUIT), then SIGKILL, if it takes too long.
            self.signal("-INT");
            if let Some(mut c) = self.child.take() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = c.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = Command::new("kill")
                    .args(["-QUIT", &c.id().to_string()])
                    .status();
                std::thread::sleep(Duration::from_millis(500));
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn user_ids_come_from_the_user_database() {
        assert_eq!(super::user_ids("root"), Some((0, 0)));
        assert_eq!(super::user_ids("no-such-user-aliquot"), None);
        assert_eq!(super::user_ids("bad\0name"), None);
    }
}
