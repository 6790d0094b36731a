//! What mutual TLS and write tokens cost: the same pool in this process,
//! three ways — plaintext (`--insecure`, no tokens), mutual TLS without
//! tokens, and mutual TLS with write tokens signed by the allocator and
//! checked by the agents (what `up` runs) — each run on a fresh pool,
//! interleaved (A B C C B A per round, so drift and other load on the
//! machine fall on all alike):
//!
//! * AllocateStream: 1, 8 and 64 clients (`ALIQUOT_BENCH_CLIENTS`, a
//!   comma list) on one connection, each pipelining 32 Allocate+Commit
//!   pairs of 4 KiB (no data), pairs per second;
//! * the `aliquotctl write` data path (`write::write`, the code behind the
//!   command): 1 MiB blocks, 8 in flight, to two simulated agents (no
//!   device time, so the network path is what is measured), freed; its
//!   throughput and this process's CPU per MiB (client, allocator and
//!   agents together); then the same write read back (`--verify`, with
//!   read tokens when the pool has tokens) for the read-back rate.
//!
//! Prints each run and the median ratio of each mode to plaintext.
//! `cargo bench -p aliquotctl --bench tls`; `ALIQUOT_BENCH_ROUNDS` (default
//! 3), `ALIQUOT_BENCH_SECS` per AllocateStream run (default 2),
//! `ALIQUOT_BENCH_WRITE` bytes per write run (default 256MiB; 0 skips the
//! write runs, e.g. to profile AllocateStream alone); `ALIQUOT_BENCH_MODE`
//! (plaintext, mTLS or mTLS+tokens) runs that mode only, for a profile.
//!
//! Then two floors, without sockets: the crypto floor (AES-GCM or ChaCha20
//! alone, a copy a side) and the rustls floor (the same bytes through a
//! rustls client and server connection in memory): what any design on
//! this cipher, and any design on rustls's buffered API, must add to
//! plaintext's CPU. `ALIQUOT_BENCH_ROUNDS=0` prints the floors alone.

use aliquot_agent::measure::median;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aliquot_auth::{ClientTls, ClientTlsArgs, PoolCa, Role, TlsArgs, TlsFiles};
use aliquot_proto::v1 as pb;
use aliquotctl::write::{self, WriteArgs};
use pb::stream_request::Op;
use tokio::sync::mpsc;

const DEPTH: usize = 32;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| units::size_arg(&v).ok())
        .unwrap_or(default)
}

struct Pool {
    name: &'static str,
    tls: ClientTls,
    url: String,
    allocator: aliquot_allocator::Running,
    agents: Vec<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )>,
}

/// A fresh pool: plaintext (`certs` None), or mutual TLS with write tokens
/// signed and checked (`tokens`) or not.
async fn start_pool(name: &'static str, certs: Option<&std::path::Path>, tokens: bool) -> Pool {
    let files = |role, n: &str| certs.map(|d| TlsFiles::in_dir(d, role, n));
    let mut ac = aliquot_allocator::Config::with_listen("127.0.0.1:0".parse().unwrap());
    ac.report_interval = Duration::from_secs(1);
    ac.claim_window = Duration::ZERO;
    if let Some(d) = certs {
        ac.tls = TlsArgs::with_files(files(Role::Allocator, "allocator").unwrap());
        ac.token_key = tokens.then(|| d.to_owned());
        ac.admit_agents = vec![("sim0".into(), None), ("sim1".into(), None)];
    }
    let allocator = aliquot_allocator::start(ac, Arc::new(aliquot_allocator::MemStore::new()))
        .await
        .expect("start allocator");
    let tls = ClientTls::from(files(Role::Client, "bench"));
    let url = tls.url(&allocator.addr.to_string());
    let mut agents = Vec::new();
    for i in 0..2 {
        let mut gc = aliquot_agent::Config::new(aliquot_agent::BackendKind::Sim);
        gc.capacity = Some(64 << 30);
        gc.name = Some(format!("sim{i}"));
        gc.allocator = url.clone();
        if let Some(d) = certs {
            gc.tls = TlsArgs::with_files(files(Role::Agent, &format!("sim{i}")).unwrap());
            gc.token_key = tokens.then(|| d.to_owned());
            // mTLS without tokens must say so.
            gc.unchecked_writes = !tokens;
        }
        let agent = aliquot_agent::Agent::open(&gc).expect("open sim agent");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            aliquot_agent::serve(agent, &gc, listener, async {
                let _ = stopped.await;
            })
            .await
            .expect("agent");
        });
        agents.push((stop, task));
    }
    let mut c = aliquotctl::client::allocator(&tls, &url).await.unwrap();
    loop {
        let st = c
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        // Both vdevs synced in (the normal class: the embedded log class
        // has groups of the same vdevs).
        let ready = st
            .classes
            .iter()
            .filter(|c| c.name == "normal")
            .flat_map(|c| &c.groups)
            .filter(|g| g.capacity > 0)
            .count();
        if ready == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Pool {
        name,
        tls,
        url,
        allocator,
        agents,
    }
}

/// Allocate+Commit pairs per second over AllocateStream.
async fn stream_run(p: &Pool, clients: usize, secs: u64) -> f64 {
    let ch = aliquotctl::client::channel(&p.tls, &p.url, Role::Allocator)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = pb::allocator_client::AllocatorClient::new(ch.clone());
        let (stop, pairs) = (stop.clone(), pairs.clone());
        tasks.push(tokio::spawn(async move {
            let (tx, rx) = mpsc::channel(DEPTH * 2);
            let mut replies = c
                .allocate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            let alloc = |id| pb::StreamRequest {
                request_id: id,
                op: Some(Op::Allocate(pb::AllocateRequest {
                    class: pb::AllocationClass::Data as i32,
                    size: 4096,
                    copies: 1,
                    lease_ms: 0,
                    max_size: 0,
                    affinity_key: None,
                })),
                ..Default::default()
            };
            let mut next = 0u64;
            let mut in_flight = 0;
            for _ in 0..DEPTH {
                tx.send(alloc(next)).await.unwrap();
                next += 2;
                in_flight += 1;
            }
            while in_flight > 0 {
                let r = replies.message().await.unwrap().unwrap();
                match r.result {
                    Some(pb::stream_reply::Result::Allocate(a)) => tx
                        .send(pb::StreamRequest {
                            request_id: r.request_id + 1,
                            op: Some(Op::Commit(pb::CommitRequest {
                                allocation_ids: vec![a.allocation_id],
                                generation: a.generation,
                                ..Default::default()
                            })),
                            ..Default::default()
                        })
                        .await
                        .unwrap(),
                    Some(pb::stream_reply::Result::Commit(_)) => {
                        pairs.fetch_add(1, Ordering::Relaxed);
                        in_flight -= 1;
                        if !stop.load(Ordering::Relaxed) {
                            tx.send(alloc(next)).await.unwrap();
                            next += 2;
                            in_flight += 1;
                        }
                    }
                    other => panic!("unexpected reply {other:?}"),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    pairs.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// This process's CPU time (user + system): client, allocator and agents
/// all run here.
fn cpu_now() -> Duration {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// `aliquotctl write` bytes per second (durable: flush and sync included)
/// and the CPU it took per MiB (everything in this process: client,
/// allocator, agents), then a second write with `--verify` for the
/// read-back's rate (with read tokens where the pool has them).
async fn write_run(p: &Pool, total: u64) -> (f64, f64, f64) {
    let mut w = WriteArgs::new(&p.url);
    w.conn.tls = ClientTlsArgs::from_tls(&p.tls);
    w.total = total;
    w.block_size = 1 << 20;
    w.concurrency = 8;
    w.free = true;
    w.no_progress = true;
    let before = cpu_now();
    let r = write::write(&w).await.expect("write");
    let cpu_ms_per_mib =
        (cpu_now() - before).as_secs_f64() * 1e3 / (total as f64 / (1 << 20) as f64);
    w.verify = true;
    let v = write::write(&w).await.expect("write --verify");
    assert!(v.verified_blocks > 0, "nothing was read back");
    (
        r.bytes_per_sec,
        total as f64 / v.verify_secs.max(1e-9),
        cpu_ms_per_mib,
    )
}

/// The least CPU per MiB mutual TLS can add to a 1 MiB write in this
/// process: every byte sealed once (the client) and opened once (the
/// agent), in 16 KiB records as TLS 1.3 carries them, each record first
/// copied into its own buffer (rustls seals a copy of the caller's bytes,
/// and opens in its receive buffer). No socket, no framing, no handshake:
/// what AES-GCM and one copy a side cost, for each cipher our servers
/// offer. (ms per MiB, median of `reps` passes over 64 MiB.)
fn aead_floor(alg: &'static ring::aead::Algorithm, reps: usize) -> f64 {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    const RECORD: usize = 16 << 10;
    let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).unwrap());
    let data = vec![0x5au8; 1 << 20];
    let mut record = Vec::with_capacity(RECORD + alg.tag_len());
    let mut seq = 0u64;
    let nonce = |seq: u64| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&seq.to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let mib = 64;
    let times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..mib {
                for chunk in data.chunks(RECORD) {
                    record.clear();
                    record.extend_from_slice(chunk);
                    key.seal_in_place_append_tag(nonce(seq), Aad::empty(), &mut record)
                        .unwrap();
                    let opened = key
                        .open_in_place(nonce(seq), Aad::empty(), &mut record)
                        .unwrap();
                    std::hint::black_box(opened);
                    seq += 1;
                }
            }
            t.elapsed().as_secs_f64() * 1e3 / mib as f64
        })
        .collect();
    median(times)
}

/// What rustls's buffered API costs on top of [`aead_floor`]: a client and
/// a server connection with the pool's configs (AES-128-GCM, as our servers
/// choose), handshaken in memory, then 1 MiB messages written through the
/// client (`writer()`, `write_tls`) and read by the server as tokio-rustls
/// does (`read_tls` as much as it takes, `process_new_packets` after each,
/// then `reader()` into the caller's buffer). The two hand-overs between
/// them are plain copies standing in for the socket's, so the same loop
/// with plain copies only is measured too and taken off: what is left is
/// rustls's own work per MiB (ms per MiB, median of `reps` passes over 64
/// MiB).
fn rustls_floor(certs: &std::path::Path, reps: usize) -> (f64, f64) {
    use aliquot_auth::rustls::{ClientConnection, Connection, ServerConnection};
    use std::io::{Read, Write};
    let server = TlsFiles::in_dir(certs, Role::Agent, "sim0")
        .rustls_server_config()
        .unwrap();
    let client = TlsFiles::in_dir(certs, Role::Client, "bench")
        .rustls_client_config()
        .unwrap();
    let name = Role::Agent.server_name().try_into().unwrap();
    let mut c = Connection::Client(ClientConnection::new(client, name).unwrap());
    let mut s = Connection::Server(ServerConnection::new(server).unwrap());
    let mut wire = Vec::with_capacity(1 << 20);
    // Everything `from` has to send, read and processed by `to`.
    let pump = |from: &mut Connection, to: &mut Connection, wire: &mut Vec<u8>| {
        wire.clear();
        while from.wants_write() {
            from.write_tls(wire).unwrap();
        }
        let mut rd = &wire[..];
        while !rd.is_empty() {
            to.read_tls(&mut rd).unwrap();
            to.process_new_packets().unwrap();
        }
    };
    // The handshake, and any tickets, each side's records to the other.
    for _ in 0..10 {
        pump(&mut c, &mut s, &mut wire);
        pump(&mut s, &mut c, &mut wire);
        if !c.is_handshaking() && !s.is_handshaking() {
            break;
        }
    }
    assert!(!s.is_handshaking(), "in-memory handshake did not finish");
    let data = vec![0x5au8; 1 << 20];
    let mut out = vec![0u8; 1 << 20];
    let mib = 64;
    let tls: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..mib {
                let (mut sent, mut got) = (0, 0);
                while got < data.len() {
                    // rustls takes what its send buffer holds, then must be
                    // drained: as a socket write would.
                    if sent < data.len() {
                        sent += c.writer().write(&data[sent..]).unwrap();
                    }
                    wire.clear();
                    while c.wants_write() {
                        c.write_tls(&mut wire).unwrap();
                    }
                    let mut rd = &wire[..];
                    while !rd.is_empty() {
                        s.read_tls(&mut rd).unwrap();
                        s.process_new_packets().unwrap();
                        loop {
                            match s.reader().read(&mut out[got..]) {
                                Ok(0) => break,
                                Ok(n) => got += n,
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                                Err(e) => panic!("rustls read: {e}"),
                            }
                        }
                    }
                }
                std::hint::black_box(&out);
            }
            t.elapsed().as_secs_f64() * 1e3 / mib as f64
        })
        .collect();
    // The same hand-overs with plain copies: the socket's stand-in.
    let copies: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..mib {
                for chunk in data.chunks(64 << 10) {
                    wire.clear();
                    wire.extend_from_slice(chunk);
                    for (i, piece) in wire.chunks(4 << 10).enumerate() {
                        let at = (i << 12) % out.len();
                        out[at..at + piece.len()].copy_from_slice(piece);
                    }
                }
                std::hint::black_box(&out);
            }
            t.elapsed().as_secs_f64() * 1e3 / mib as f64
        })
        .collect();
    (median(tls), median(copies))
}

fn main() {
    // As `aliquotctl` and `aliquot-agent` do at startup: without it every
    // 1 MiB buffer is a fresh mmap, and page faults were 15 % of this
    // process's profile, a cost neither binary pays.
    aliquot_agent::tune_allocator();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let rounds = env_u64("ALIQUOT_BENCH_ROUNDS", 3) as usize;
        let secs = env_u64("ALIQUOT_BENCH_SECS", 2);
        let total = env_u64("ALIQUOT_BENCH_WRITE", 256 << 20);
        let clients: Vec<usize> = std::env::var("ALIQUOT_BENCH_CLIENTS")
            .unwrap_or_else(|_| "1,8,64".into())
            .split(',')
            .filter_map(|c| c.trim().parse().ok())
            .filter(|&c| c > 0)
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let ca = PoolCa::init(dir.path(), "bench").unwrap();
        for (role, n) in [
            (Role::Allocator, "allocator"),
            (Role::Agent, "sim0"),
            (Role::Agent, "sim1"),
            (Role::Client, "bench"),
        ] {
            ca.issue(role, n, &[]).unwrap();
        }
        println!(
            "TLS cost bench: {rounds} rounds of 6 runs (plaintext, mTLS, mTLS+tokens, then \
             back), each on a fresh pool, {} cores; AllocateStream {clients:?} clients x {DEPTH} \
             pipelined 4 KiB pairs for {secs} s each; write {} in 1 MiB blocks, 8 in flight, 2 sim agents",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            units::format_bytes(total)
        );
        type Mode = (&'static str, bool, bool);
        let modes: [Mode; 3] = [
            ("plaintext", false, false),
            ("mTLS", true, false),
            ("mTLS+tokens", true, true),
        ];
        // Per mode, per round: the ratio to plaintext (stream per client
        // count, write, verify).
        let n = clients.len();
        let mut ratios = vec![(vec![Vec::new(); n], Vec::new(), Vec::new()); 3];
        let mut cpu_ratios = vec![Vec::new(); 3];
        // Plaintext's CPU per MiB, per round.
        let mut plain_cpu = Vec::new();
        for round in 0..rounds {
            let mut s = vec![[0.0f64; 3]; n];
            let mut w = [0.0f64; 3];
            let mut v = [0.0f64; 3];
            let mut cpu = [0.0f64; 3];
            let only = std::env::var("ALIQUOT_BENCH_MODE").ok();
            for (i, k) in [0usize, 1, 2, 2, 1, 0].into_iter().enumerate() {
                let (name, tls, tokens) = modes[k];
                if only.as_deref().is_some_and(|m| m != name) {
                    continue;
                }
                let p = start_pool(name, tls.then(|| dir.path()), tokens).await;
                let mut line = format!("round {round} run {i} {:<12}", p.name);
                for (j, &c) in clients.iter().enumerate() {
                    let pairs = stream_run(&p, c, secs).await;
                    line.push_str(&format!("  stream x{c} {pairs:>7.0}/s"));
                    s[j][k] += pairs;
                }
                if total > 0 {
                    let (bps, read_bps, ms) = write_run(&p, total).await;
                    line.push_str(&format!(
                        "   write {:>7.1} MiB/s {ms:.2} CPU-ms/MiB   verify {:>7.1} MiB/s",
                        bps / (1 << 20) as f64,
                        read_bps / (1 << 20) as f64
                    ));
                    w[k] += bps;
                    v[k] += read_bps;
                    cpu[k] += ms;
                }
                println!("{line}");
                for (stop, task) in p.agents {
                    let _ = stop.send(());
                    let _ = task.await;
                }
                p.allocator.shutdown().await.unwrap();
            }
            for k in 1..3 {
                for (r, sj) in ratios[k].0.iter_mut().zip(&s) {
                    r.push(sj[k] / sj[0]);
                }
                if total > 0 {
                    ratios[k].1.push(w[k] / w[0]);
                    ratios[k].2.push(v[k] / v[0]);
                    cpu_ratios[k].push(cpu[k] / cpu[0]);
                }
            }
            if total > 0 {
                // Two plaintext runs a round (A B C C B A).
                plain_cpu.push(cpu[0] / 2.0);
            }
        }
        // What the CPU ratio could be at best: plaintext's CPU per MiB plus
        // one seal and one open of every byte.
        let plain_ms = median(plain_cpu);
        for (name, alg) in [
            ("AES-128-GCM", &ring::aead::AES_128_GCM),
            ("AES-256-GCM", &ring::aead::AES_256_GCM),
            ("ChaCha20-Poly1305", &ring::aead::CHACHA20_POLY1305),
        ] {
            let c = aead_floor(alg, 5);
            let best = if plain_ms > 0.0 {
                format!(
                    "; plaintext's {plain_ms:.2} ms/MiB plus this is {:.2}x: the least CPU ratio \
                     mTLS can reach here",
                    (plain_ms + c) / plain_ms
                )
            } else {
                String::new()
            };
            println!("crypto floor {name}: seal + open of 1 MiB in 16 KiB records, a copy each: {c:.3} ms/MiB{best}");
        }
        let (tls, copies) = rustls_floor(dir.path(), 5);
        let aes = aead_floor(&ring::aead::AES_128_GCM, 5);
        println!(
            "rustls floor: 1 MiB through a rustls client and server in memory (AES-128-GCM) \
             {tls:.3} ms/MiB, less {copies:.3} for the two hand-overs a socket would copy: \
             {:.3} ms/MiB of rustls's own work, {:.2}x the crypto floor ({aes:.3}){}",
            tls - copies,
            (tls - copies) / aes,
            if plain_ms > 0.0 {
                format!(
                    "; plaintext's {plain_ms:.2} ms/MiB plus this is {:.2}x",
                    (plain_ms + tls - copies) / plain_ms
                )
            } else {
                String::new()
            }
        );
        // No rounds (ALIQUOT_BENCH_ROUNDS=0): the floors only.
        for (k, (name, _, _)) in modes.iter().enumerate().skip(1).filter(|_| rounds > 0) {
            let mut line = format!("{name} / plaintext (median of rounds):");
            for (j, c) in clients.iter().enumerate() {
                let r = median(ratios[k].0[j].clone());
                line.push_str(&format!(" AllocateStream x{c} {r:.2} ({:+.0}%),", (r - 1.0) * 100.0));
            }
            if total > 0 {
                let (w, v) = (median(ratios[k].1.clone()), median(ratios[k].2.clone()));
                let c = median(cpu_ratios[k].clone());
                line.push_str(&format!(
                    " write {w:.2} ({:+.0}%) at {c:.2}x the CPU per MiB, verify {v:.2} ({:+.0}%)",
                    (w - 1.0) * 100.0,
                    (v - 1.0) * 100.0
                ));
            }
            println!("{line}");
        }
    });
}
