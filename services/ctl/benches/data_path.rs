//! The data path target (at least 0.9× dd's throughput, at most 0.6 ms of
//! CPU per MiB): `aliquotctl write` of 1 GiB in 1 MiB blocks (32 in
//! flight, freed after) to a local pool of three 2 GiB file agents, all
//! real processes (`aliquotctl up --insecure`, this build's release
//! binary), against `dd if=/dev/zero bs=1M count=1024 conv=notrunc,fsync`
//! on the same filesystem, interleaved per round. Every round overwrites
//! laid-out blocks on both sides: the agents' files are filled with zeros
//! behind their labels ([`lay_out`]), each pool then runs the workload
//! untimed (ALIQUOT_BENCH_WARMUP times, default 1) and dd's file is written
//! once before the rounds and then overwritten in place (`conv=notrunc`),
//! so neither side pays the filesystem's block allocation in sparse files
//! (which cost the agents 2-3x the CPU of later rounds). Prints per round and as
//! medians: wall throughput of each, write/dd, and CPU per MiB of the
//! client (getrusage of reaped children), each agent and the allocator
//! (/proc/PID/stat), and dd.
//!
//! `cargo bench -p aliquotctl --bench data_path`
//! Env: ALIQUOT_BENCH_ROUNDS (3), ALIQUOT_BENCH_DIR (where the temp dir
//! goes, default /work if it exists, else the system temp dir),
//! ALIQUOT_BENCH_TOTAL (1GiB), ALIQUOT_BENCH_AGENT_SIZE (each agent's
//! file, 2GiB; both pools' laid-out files must fit in the page cache),
//! ALIQUOT_BENCH_VS="ENV=VAL ..." (a second
//! pool, B, whose processes get these variables, run interleaved with A;
//! B/A ratios are printed), ALIQUOT_BENCH_SECURE=1 (B is the secure
//! default instead: `up` with mutual TLS and write tokens, `write` with the
//! pool's certificates; with ALIQUOT_BENCH_VS, B gets both; `all`: A and B
//! both secure), ALIQUOT_BENCH_B_BIN=PATH (B runs another build's
//! `aliquotctl`, e.g. one saved before a change).
//!
//! After the rounds, the fresh-space case: per round a
//! new pool with nothing laid out and no warm-up writes once into new space,
//! beside dd and the TCP floor each writing a new file
//! (`ALIQUOT_BENCH_FRESH_ROUNDS`, default the rounds' count).
//!
//! Each round also runs the floor of any design that moves the data over a
//! local socket ([`floor_run`]): a process generating 1 MiB blocks of the
//! same pattern as `aliquotctl write` and sending them over loopback TCP, or
//! over a Unix socket, to a process that pwrites each into a laid-out file
//! (fdatasync at the end): no protocol, no allocator, one stream.
//! Each side reuses one 1 MiB buffer, which stays in the CPU's cache;
//! `ALIQUOT_BENCH_FLOOR_BUFS=32` rotates through 32, as 32 blocks in flight
//! touch 32 MiB (measured: 1.18x the floor's CPU, all of it the
//! generator's user time). Each round also runs the floor shaped
//! like the workload ([`floor_shaped`]): three such pairs at once, one per
//! agent, 11 buffers each.

use aliquot_agent::measure::median;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: f64 = (1u64 << 20) as f64;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_aliquotctl")
}

fn cpu(pid: u32) -> Duration {
    aliquot_agent::measure::process_cpu(&pid.to_string())
}

/// user + system CPU of every reaped child so far.
fn children_cpu() -> Duration {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// How a pool is run: which `aliquotctl`, with what environment, secure or
/// plaintext.
#[derive(Clone)]
struct Side {
    bin: PathBuf,
    env: Vec<(String, String)>,
    secure: bool,
}

struct Pool {
    name: &'static str,
    /// The `aliquotctl` that runs this pool and writes to it.
    bin: PathBuf,
    up: Child,
    url: String,
    /// The secure default (mutual TLS and tokens): `write` is given
    /// `--certs-dir` here instead of `--insecure`.
    certs: Option<PathBuf>,
    allocator: u32,
    agents: Vec<u32>,
}

/// Each agent's file (`ALIQUOT_BENCH_AGENT_SIZE`, default 2GiB). Both
/// pools' laid-out files must fit in the page cache together with room to
/// spare: with 4 GiB agents (24 GiB laid out on a 23 GiB machine) the pool
/// laid out first lost its pages to the second's lay-out and wrote into
/// uncached pages every round, and an A/A run read B/A throughput 1.11,
/// agents' CPU 0.91.
fn agent_size() -> String {
    std::env::var("ALIQUOT_BENCH_AGENT_SIZE").unwrap_or_else(|_| "2GiB".into())
}

/// MemTotal from /proc/meminfo, in bytes (0 if unknown).
fn mem_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib << 10)
}

fn start_pool(name: &'static str, dir: &Path, side: &Side) -> Pool {
    let (env, secure) = (&side.env, side.secure);
    let data = dir.join(name);
    let mut up = Command::new(&side.bin)
        .arg("up")
        .args((!secure).then_some("--insecure"))
        .args(["--ephemeral", "--no-metrics"])
        .args(["--agents", &vec![agent_size(); 3].join(",")])
        .arg("--data-dir")
        .arg(&data)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start aliquotctl up");
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("pool {name}: up exited; logs in {}", data.display()));
        if let Some(a) = line.trim().strip_prefix("LISTEN grpc ") {
            break format!("{}://{a}", if secure { "https" } else { "http" });
        }
    };
    // Keep draining so `up` never blocks on its stdout.
    std::thread::spawn(move || for _ in lines {});
    let mut allocator = 0;
    let mut agents = Vec::new();
    let tasks = std::fs::read_dir(format!("/proc/{}/task", up.id())).unwrap();
    for t in tasks.flatten() {
        let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in kids
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
        {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(" serve agent ") {
                agents.push(pid);
            } else if cmd.contains(" serve allocator ") {
                allocator = pid;
            }
        }
    }
    assert!(
        allocator != 0 && agents.len() == 3,
        "pool {name}: processes not found"
    );
    Pool {
        name,
        bin: side.bin.clone(),
        up,
        url,
        certs: secure.then(|| data.join("certs")),
        allocator,
        agents,
    }
}

/// Write zeros over every agent's data area (behind the label) once, before
/// any timed write: the agents' files are created sparse, and the first
/// write into a hole makes ext4 allocate blocks at writeback, in the
/// agent's `sync_file_range`. Allocating all of them over the rounds
/// would be most of the agents' CPU and would differ round to round. The
/// pool is the bench's own and holds nothing yet.
fn lay_out(p: &Pool) {
    let mut files = std::collections::BTreeSet::new();
    for pid in &p.agents {
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
        {
            if let Ok(path) = std::fs::read_link(fd.path())
                && std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() >= 1 << 30)
            {
                files.insert(path);
            }
        }
    }
    assert_eq!(files.len(), 3, "pool {}: agent files {files:?}", p.name);
    for f in files {
        let mib = std::fs::metadata(&f).unwrap().len() >> 20;
        dd_zeros(&f, 1, mib - 1);
    }
}

/// `dd if=/dev/zero` over `count` MiB of `f` from MiB `seek`, in place,
/// fsynced.
fn dd_zeros(f: &Path, seek: u64, count: u64) {
    let st = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", f.display()))
        .args(["bs=1M", &format!("seek={seek}"), &format!("count={count}")])
        .arg("conv=notrunc,fsync")
        .stderr(Stdio::null())
        .status()
        .expect("run dd");
    assert!(st.success(), "dd over {}: {st}", f.display());
}

fn stop_pool(mut p: Pool) {
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(p.up.id() as i32, libc::SIGINT) };
    let _ = p.up.wait();
}

/// CPU per MiB: client, agents (each), allocator; and MiB/s.
#[derive(Clone)]
struct WriteRun {
    mib_s: f64,
    client: f64,
    agents: Vec<f64>,
    allocator: f64,
}

impl WriteRun {
    fn total(&self) -> f64 {
        self.client + self.agents.iter().sum::<f64>() + self.allocator
    }
}

fn ms_per_mib(d: Duration, mib: f64) -> f64 {
    d.as_secs_f64() * 1e3 / mib
}

fn write_run(p: &Pool, total: &str, mib: f64) -> WriteRun {
    let a0: Vec<Duration> = p.agents.iter().map(|&a| cpu(a)).collect();
    let l0 = cpu(p.allocator);
    let c0 = children_cpu();
    let t = Instant::now();
    let mut cmd = Command::new(&p.bin);
    cmd.args(["write", "--allocator", &p.url]);
    match &p.certs {
        Some(c) => cmd.arg("--certs-dir").arg(c),
        None => cmd.arg("--insecure"),
    };
    let st = cmd
        .args([
            "--total",
            total,
            "--block-size",
            "1MiB",
            "--concurrency",
            "32",
        ])
        .args(["--free", "--no-progress"])
        .stdout(Stdio::null())
        .status()
        .expect("run aliquotctl write");
    let wall = t.elapsed();
    assert!(
        st.success(),
        "pool {}: aliquotctl write failed: {st}",
        p.name
    );
    let client = children_cpu() - c0;
    WriteRun {
        mib_s: mib / wall.as_secs_f64(),
        client: ms_per_mib(client, mib),
        agents: p
            .agents
            .iter()
            .zip(a0)
            .map(|(&a, c)| ms_per_mib(cpu(a) - c, mib))
            .collect(),
        allocator: ms_per_mib(cpu(p.allocator) - l0, mib),
    }
}

/// The fresh-space case: what a user's first GiB does.
/// A new pool (no layout, no warm-up) writes once into new space; the pool
/// and its files are removed after.
fn fresh_pool_run(dir: &Path, name: String, side: &Side, total: &str, mib: f64) -> WriteRun {
    let name: &'static str = Box::leak(name.into_boxed_str());
    let p = start_pool(name, dir, side);
    let r = write_run(&p, total, mib);
    stop_pool(p);
    let _ = std::fs::remove_dir_all(dir.join(name));
    r
}

/// dd and the TCP floor, each writing a new file (removed after), beside
/// the fresh pools: dd's (MiB/s, CPU ms/MiB) and the floor's.
fn fresh_dd_and_floor(dir: &Path, round: usize, mib: f64) -> ((f64, f64), (f64, f64)) {
    let f = dir.join(format!("dd-fresh{round}.img"));
    let c0 = children_cpu();
    let t = Instant::now();
    // A new file: notrunc has nothing to keep.
    dd_zeros(&f, 0, mib as u64);
    let d = (
        mib / t.elapsed().as_secs_f64(),
        ms_per_mib(children_cpu() - c0, mib),
    );
    let _ = std::fs::remove_file(&f);
    let ff = dir.join(format!("floor-fresh{round}.img"));
    let floor = floor_into(dir, &ff, mib, "tcp");
    let _ = std::fs::remove_file(&ff);
    (d, floor)
}

/// dd: MiB/s and CPU per MiB, overwriting `dir/dd.img` in place.
fn dd_run(dir: &Path, mib: f64) -> (f64, f64) {
    let f = dir.join("dd.img");
    let c0 = children_cpu();
    let t = Instant::now();
    dd_zeros(&f, 0, mib as u64);
    let wall = t.elapsed();
    let used = children_cpu() - c0;
    (mib / wall.as_secs_f64(), ms_per_mib(used, mib))
}

/// Child roles of the floor run (this bench binary again, told by env). The
/// receiver binds, prints `ready ADDR` (`unix:PATH`, or the TCP port it got)
/// and the sender connects to ADDR.
const FLOOR_ROLE: &str = "ALIQUOT_BENCH_FLOOR_ROLE";
const FLOOR_ADDR: &str = "ALIQUOT_BENCH_FLOOR_ADDR";
const FLOOR_FILE: &str = "ALIQUOT_BENCH_FLOOR_FILE";
const FLOOR_MIB: &str = "ALIQUOT_BENCH_FLOOR_MIB";
const FLOOR_BUFS: &str = "ALIQUOT_BENCH_FLOOR_BUFS";

fn floor_child(role: &str) {
    use std::io::{Read as _, Write as _};
    use std::os::unix::fs::FileExt as _;
    let addr = std::env::var(FLOOR_ADDR).unwrap();
    let blocks: u64 = std::env::var(FLOOR_MIB).unwrap().parse().unwrap();
    // ALIQUOT_BENCH_FLOOR_BUFS=N: rotate through N buffers, as a pool with
    // N blocks in flight touches N, instead of one that stays in cache.
    let nbufs: usize = std::env::var(FLOOR_BUFS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut bufs = vec![vec![0u8; 1 << 20]; nbufs];
    if role == "recv" {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(std::env::var(FLOOR_FILE).unwrap())
            .unwrap();
        let mut s: Box<dyn std::io::Read> = match addr.strip_prefix("unix:") {
            Some(p) => {
                let l = std::os::unix::net::UnixListener::bind(p).unwrap();
                println!("ready {addr}");
                Box::new(l.accept().unwrap().0)
            }
            None => {
                let l = std::net::TcpListener::bind(&addr).unwrap();
                println!("ready {}", l.local_addr().unwrap());
                Box::new(l.accept().unwrap().0)
            }
        };
        for b in 0..blocks {
            let buf = &mut bufs[b as usize % nbufs];
            s.read_exact(buf).unwrap();
            f.write_all_at(buf, b << 20).unwrap();
        }
        f.sync_data().unwrap();
    } else {
        let mut s: Box<dyn std::io::Write> = match addr.strip_prefix("unix:") {
            Some(p) => Box::new(std::os::unix::net::UnixStream::connect(p).unwrap()),
            None => {
                let s = std::net::TcpStream::connect(&addr).unwrap();
                s.set_nodelay(true).unwrap();
                Box::new(s)
            }
        };
        for b in 0..blocks {
            let buf = &mut bufs[b as usize % nbufs];
            aliquotctl::pattern::fill(buf, 1, b);
            s.write_all(buf).unwrap();
        }
    }
}

/// The floor over `transport` ("tcp" or "unix"): MiB/s and CPU per MiB of
/// sender and receiver together.
fn floor_run(dir: &Path, mib: f64, transport: &str) -> (f64, f64) {
    let file = dir.join("floor.img");
    if !file.exists() {
        dd_zeros(&file, 0, mib as u64);
    }
    floor_into(dir, &file, mib, transport)
}

/// The floor writing into `file` (laid out, or new and empty: the fresh
/// case).
fn floor_into(dir: &Path, file: &Path, mib: f64, transport: &str) -> (f64, f64) {
    floor_pairs(dir, &[file.to_path_buf()], mib, transport, None)
}

/// The floor shaped like the workload: `SHAPED_STREAMS` sender/receiver
/// pairs at once (one per agent), each moving a third of the bytes into a
/// laid-out file of its own and rotating through `SHAPED_BUFS` buffers
/// (together about the 32 blocks `write` keeps in flight). Every byte takes
/// the same four passes as in the one-stream floor; what it adds is what
/// concurrency costs on this machine: more processes than cores, and
/// buffers that no longer stay in the CPU's cache.
fn floor_shaped(dir: &Path, mib: f64) -> (f64, f64) {
    let part = (mib as u64).div_ceil(SHAPED_STREAMS as u64);
    let files: Vec<PathBuf> = (0..SHAPED_STREAMS)
        .map(|i| {
            let f = dir.join(format!("floor-shaped{i}.img"));
            if !f.exists() {
                dd_zeros(&f, 0, part);
            }
            f
        })
        .collect();
    floor_pairs(dir, &files, mib, "tcp", Some(SHAPED_BUFS))
}

const SHAPED_STREAMS: usize = 3;
const SHAPED_BUFS: usize = 11;

/// One sender/receiver pair per file, all at once, `mib` split evenly
/// among them; `bufs` overrides `ALIQUOT_BENCH_FLOOR_BUFS`. MiB/s of the
/// whole and CPU per MiB of every process together.
fn floor_pairs(
    dir: &Path,
    files: &[PathBuf],
    mib: f64,
    transport: &str,
    bufs: Option<usize>,
) -> (f64, f64) {
    let me = std::env::current_exe().unwrap();
    let part = ((mib as u64).div_ceil(files.len() as u64)).to_string();
    let c0 = children_cpu();
    let mut receivers = Vec::new();
    let mut targets = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let sock = dir.join(format!("floor{i}.sock"));
        let _ = std::fs::remove_file(&sock);
        let addr = match transport {
            "unix" => format!("unix:{}", sock.display()),
            _ => "127.0.0.1:0".into(),
        };
        let mut recv = Command::new(&me);
        recv.env(FLOOR_ROLE, "recv")
            .env(FLOOR_ADDR, &addr)
            .env(FLOOR_FILE, file)
            .env(FLOOR_MIB, &part)
            .stdout(Stdio::piped());
        if let Some(n) = bufs {
            recv.env(FLOOR_BUFS, n.to_string());
        }
        let mut recv = recv.spawn().expect("start floor receiver");
        let mut ready = String::new();
        BufReader::new(recv.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        // The address to send to: the socket's, or the port the receiver got.
        let to = ready
            .trim()
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("floor receiver said {ready:?}"))
            .to_string();
        receivers.push(recv);
        targets.push(to);
    }
    let t = Instant::now();
    let senders: Vec<Child> = targets
        .iter()
        .map(|to| {
            let mut send = Command::new(&me);
            send.env(FLOOR_ROLE, "send")
                .env(FLOOR_ADDR, to)
                .env(FLOOR_MIB, &part);
            if let Some(n) = bufs {
                send.env(FLOOR_BUFS, n.to_string());
            }
            send.spawn().expect("run floor sender")
        })
        .collect();
    for mut c in senders.into_iter().chain(receivers) {
        let st = c.wait().expect("floor process");
        assert!(st.success(), "floor {transport}: {st}");
    }
    let wall = t.elapsed();
    (
        mib / wall.as_secs_f64(),
        ms_per_mib(children_cpu() - c0, mib),
    )
}

fn show(label: &str, r: &WriteRun, dd: f64) {
    let agents: Vec<String> = r.agents.iter().map(|a| format!("{a:.2}")).collect();
    println!(
        "  {label}: {:7.1} MiB/s ({:.2}× dd)  CPU ms/MiB total {:.2}: client {:.2}, agents {} (sum {:.2}), allocator {:.2}",
        r.mib_s,
        r.mib_s / dd,
        r.total(),
        r.client,
        agents.join("/"),
        r.agents.iter().sum::<f64>(),
        r.allocator
    );
}

/// A run's figures, as pools are compared: MiB/s, then CPU ms/MiB in
/// total, of the client, of the agents and of the allocator.
fn figures(r: &WriteRun) -> [f64; 5] {
    [
        r.mib_s,
        r.total(),
        r.client,
        r.agents.iter().sum(),
        r.allocator,
    ]
}

/// Prints the medians of `runs` (and their throughput against dd's) and
/// returns the medians of their [`figures`].
fn summary(label: &str, runs: &[WriteRun], dds: &[(f64, f64)]) -> [f64; 5] {
    let ratio = median(runs.iter().zip(dds).map(|(r, d)| r.mib_s / d.0).collect());
    let s: [f64; 5] = std::array::from_fn(|i| median(runs.iter().map(|r| figures(r)[i]).collect()));
    println!(
        "{label}: {:.1} MiB/s, {:.2}× dd; CPU ms/MiB total {:.2} = client {:.2} + agents {:.2} + allocator {:.2}",
        s[0], ratio, s[1], s[2], s[3], s[4]
    );
    s
}

/// B's figures over A's: the median of per-round ratios, and of medians.
fn ratios(label: &str, ra: &[WriteRun], rb: &[WriteRun], sa: [f64; 5], sb: [f64; 5]) {
    let r = |i: usize| {
        median(
            ra.iter()
                .zip(rb)
                .map(|(x, y)| figures(y)[i] / figures(x)[i])
                .collect(),
        )
    };
    println!(
        "{label} (median of per-round ratios): throughput {:.2}, CPU total {:.2}, client {:.2}, agents {:.2}, allocator {:.2}  (of medians: {:.2} / {:.2})",
        r(0),
        r(1),
        r(2),
        r(3),
        r(4),
        sb[0] / sa[0],
        sb[1] / sa[1]
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if let Ok(role) = std::env::var(FLOOR_ROLE) {
        return floor_child(&role);
    }
    let rounds = std::env::var("ALIQUOT_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3usize);
    let total = std::env::var("ALIQUOT_BENCH_TOTAL").unwrap_or_else(|_| "1GiB".into());
    let mib = units::size_arg(&total).expect("ALIQUOT_BENCH_TOTAL") as f64 / MIB;
    let vs: Vec<(String, String)> = std::env::var("ALIQUOT_BENCH_VS")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let secure = std::env::var("ALIQUOT_BENCH_SECURE").unwrap_or_default();
    let b_bin = std::env::var_os("ALIQUOT_BENCH_B_BIN").map(PathBuf::from);
    let side_a = Side {
        bin: bin().into(),
        env: Vec::new(),
        secure: secure == "all",
    };
    let side_b = Side {
        bin: b_bin.clone().unwrap_or_else(|| bin().into()),
        env: vs.clone(),
        secure: secure == "1" || secure == "all",
    };
    let has_b = side_b.secure != side_a.secure || !vs.is_empty() || b_bin.is_some();
    let base: PathBuf = std::env::var_os("ALIQUOT_BENCH_DIR")
        .map(PathBuf::from)
        .or_else(|| Path::new("/work").is_dir().then(|| "/work".into()))
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("aliquot-data-path.")
        .tempdir_in(&base)
        .expect("temp dir");
    println!(
        "data path: aliquotctl write --total {total} --block-size 1MiB --concurrency 32 --free, 3 file agents of {} in {}; dd bs=1M count={} conv=notrunc,fsync; {rounds} rounds{}",
        agent_size(),
        dir.path().display(),
        mib as u64,
        if has_b {
            let how = |s: &Side| {
                if s.secure {
                    "the secure default (mTLS + tokens)"
                } else {
                    "plaintext"
                }
            };
            format!(
                "; A {}, B {}{}{}",
                how(&side_a),
                how(&side_b),
                if vs.is_empty() {
                    String::new()
                } else {
                    format!(" with {vs:?}")
                },
                b_bin
                    .as_ref()
                    .map(|b| format!(", run by {}", b.display()))
                    .unwrap_or_default()
            )
        } else {
            String::new()
        }
    );
    let laid_out = units::size_arg(&agent_size()).expect("ALIQUOT_BENCH_AGENT_SIZE")
        * 3
        * if has_b { 2 } else { 1 };
    let mem = mem_total();
    if laid_out > mem / 3 * 2 {
        println!(
            "warning: the pools' laid-out files ({} GiB) are more than two thirds of memory ({} GiB): \
             the pool laid out first loses its cached pages, a bias against A \
             (ALIQUOT_BENCH_AGENT_SIZE)",
            laid_out >> 30,
            mem >> 30
        );
    }
    let warmup = std::env::var("ALIQUOT_BENCH_WARMUP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1usize);
    let a = start_pool("A", dir.path(), &side_a);
    let b = has_b.then(|| start_pool("B", dir.path(), &side_b));
    lay_out(&a);
    if let Some(b) = &b {
        lay_out(b);
    }
    for _ in 0..warmup {
        write_run(&a, &total, mib);
        if let Some(b) = &b {
            write_run(b, &total, mib);
        }
    }
    dd_run(dir.path(), mib);
    println!(
        "warm-up: agents' files laid out with zeros, {warmup} untimed run(s) per pool, dd's file laid out"
    );
    let (mut ra, mut rb, mut dds) = (Vec::new(), Vec::new(), Vec::new());
    let mut floors: Vec<[(f64, f64); 3]> = Vec::new();
    for round in 0..rounds {
        // A B dd, then dd B A: drift falls on all alike.
        let fwd = round % 2 == 0;
        let mut order: Vec<u8> = vec![0, 1, 2];
        if !fwd {
            order.reverse();
        }
        let mut d = (0.0, 0.0);
        for o in order {
            match o {
                0 => ra.push(write_run(&a, &total, mib)),
                1 => {
                    if let Some(b) = &b {
                        rb.push(write_run(b, &total, mib));
                    }
                }
                _ => d = dd_run(dir.path(), mib),
            }
        }
        dds.push(d);
        let f = [
            floor_run(dir.path(), mib, "tcp"),
            floor_run(dir.path(), mib, "unix"),
            floor_shaped(dir.path(), mib),
        ];
        floors.push(f);
        println!(
            "round {}: dd {:7.1} MiB/s, CPU {:.2} ms/MiB; floor over TCP {:.1} MiB/s, {:.2} ms/MiB; over a Unix socket {:.1} MiB/s, {:.2} ms/MiB; shaped {:.1} MiB/s, {:.2} ms/MiB",
            round + 1,
            d.0,
            d.1,
            f[0].0,
            f[0].1,
            f[1].0,
            f[1].1,
            f[2].0,
            f[2].1
        );
        show("A", ra.last().unwrap(), d.0);
        if let Some(r) = rb.last() {
            show("B", r, d.0);
        }
    }
    // New space: a fresh pool per round, dd and the floor into new files.
    let fresh_rounds = std::env::var("ALIQUOT_BENCH_FRESH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(rounds);
    // (A's run, B's run if any, dd's, the floor's) per round.
    let mut fresh = Vec::new();
    for round in 0..fresh_rounds {
        // A then B, then B then A: drift falls on both alike.
        let run_a = || fresh_pool_run(dir.path(), format!("fresh-a{round}"), &side_a, &total, mib);
        let run_b = || {
            has_b.then(|| {
                fresh_pool_run(dir.path(), format!("fresh-b{round}"), &side_b, &total, mib)
            })
        };
        let (r, rb) = if round % 2 == 0 {
            let r = run_a();
            (r, run_b())
        } else {
            let rb = run_b();
            (run_a(), rb)
        };
        let (d, f) = fresh_dd_and_floor(dir.path(), round, mib);
        println!(
            "fresh round {}: dd {:7.1} MiB/s, CPU {:.2} ms/MiB; floor over TCP {:.1} MiB/s, {:.2} ms/MiB",
            round + 1,
            d.0,
            d.1,
            f.0,
            f.1
        );
        show("fresh A", &r, d.0);
        println!(
            "  fresh A: CPU {:.2}× the floor's",
            r.total() / f.1.max(1e-9)
        );
        if let Some(rb) = &rb {
            show("fresh B", rb, d.0);
            println!(
                "  fresh B: CPU {:.2}× the floor's",
                rb.total() / f.1.max(1e-9)
            );
        }
        fresh.push((r, rb, d, f));
    }
    println!("medians:");
    println!(
        "dd: {:.1} MiB/s, CPU {:.2} ms/MiB",
        median(dds.iter().map(|d| d.0).collect()),
        median(dds.iter().map(|d| d.1).collect())
    );
    for (i, t) in [
        "loopback TCP",
        "a Unix socket",
        "loopback TCP, shaped like the workload (3 streams, 33 buffers)",
    ]
    .iter()
    .enumerate()
    {
        println!(
            "floor over {t}: {:.1} MiB/s, CPU {:.2} ms/MiB (senders + receivers)",
            median(floors.iter().map(|f| f[i].0).collect()),
            median(floors.iter().map(|f| f[i].1).collect())
        );
    }
    let floor_tcp = median(floors.iter().map(|f| f[0].1).collect());
    let floor_shaped = median(floors.iter().map(|f| f[2].1).collect());
    let sa = summary("A", &ra, &dds);
    println!(
        "A: CPU {:.2}× the TCP floor's, {:.2}× the shaped floor's",
        sa[1] / floor_tcp.max(1e-9),
        sa[1] / floor_shaped.max(1e-9)
    );
    if b.is_some() {
        let sb = summary("B", &rb, &dds);
        println!(
            "B: CPU {:.2}× the TCP floor's, {:.2}× the shaped floor's",
            sb[1] / floor_tcp.max(1e-9),
            sb[1] / floor_shaped.max(1e-9)
        );
        ratios("B/A", &ra, &rb, sa, sb);
    }
    if !fresh.is_empty() {
        let dd_fresh: Vec<(f64, f64)> = fresh.iter().map(|(_, _, d, _)| *d).collect();
        let floor = median(fresh.iter().map(|(_, _, _, f)| f.1).collect());
        println!(
            "fresh space: dd {:.1} MiB/s; floor into a new file {:.2} ms/MiB",
            median(dd_fresh.iter().map(|d| d.0).collect()),
            floor,
        );
        let runs: Vec<WriteRun> = fresh.iter().map(|(r, ..)| r.clone()).collect();
        let fa = summary("fresh A", &runs, &dd_fresh);
        println!("fresh A: CPU {:.2}× the floor's", fa[1] / floor.max(1e-9));
        if has_b {
            let runs_b: Vec<WriteRun> = fresh.iter().filter_map(|(_, r, ..)| r.clone()).collect();
            let fb = summary("fresh B", &runs_b, &dd_fresh);
            println!("fresh B: CPU {:.2}× the floor's", fb[1] / floor.max(1e-9));
            ratios("fresh B/A", &runs, &runs_b, fa, fb);
        }
    }
    stop_pool(a);
    if let Some(b) = b {
        stop_pool(b);
    }
}
