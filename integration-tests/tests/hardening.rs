//! Against real processes: a peer that opens
//! connections and never finishes a TLS handshake holds at most its caps,
//! for at most the handshake timeout, while other peers are served; and a
//! client that sends write bodies slowly (all but the last KiB, then
//! nothing) pins a bounded amount of agent memory, for at most the body
//! timeout, after which its streams are reset.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aliquot_auth::{Role, TlsFiles};
use aliquot_proto::v1 as pb;
use integration_tests::pool::file_device;
use integration_tests::secure_pool::{SecurePool, SecurePoolSpec};
use integration_tests::{Proc, Security, args, start_agent};
use pb::allocator_client::AllocatorClient;
use tonic::transport::{Channel, Endpoint};

const MIB: usize = 1 << 20;

/// A client channel to `url` whose connections come from `source`.
fn channel_from(url: &str, certs: &Path, source: &str) -> Channel {
    let f = TlsFiles::in_dir(certs, Role::Admin, "op");
    Endpoint::from_shared(url.to_string())
        .unwrap()
        .tls_config(f.client_config(Role::Allocator).unwrap())
        .unwrap()
        .local_address(Some(source.parse().unwrap()))
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_lazy()
}

/// Whether the server closed `s` (EOF or reset) within `wait`.
fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut b = [0u8; 1];
    !matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        || e.kind() == std::io::ErrorKind::TimedOut)
}

/// A TLS allocator with an admin certificate "op" in `dir/certs`, `caps`
/// added to its flags, listening on every address (the other peers come
/// from 127.0.0.2); no agents. Its pool and port.
async fn tls_allocator(dir: &Path, caps: &[String]) -> (SecurePool, u16) {
    aliquot_auth::listen::raise_fd_limit();
    let mut flags = args!["--listen", "0.0.0.0:0"];
    flags.extend(caps.iter().cloned());
    let sp = SecurePool::start(
        dir,
        SecurePoolSpec {
            pool: "hardening",
            agents: &[],
            callers: &[(Role::Admin, "op")],
            allocator_flags: &flags,
        },
    )
    .await;
    let port = sp.alloc.addr("grpc").port();
    (sp, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_finishes_handshakes_holds_only_its_caps() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let (_pool, port) = tls_allocator(
        dir.path(),
        &args![
            "--handshake-timeout",
            "2s",
            "--max-handshakes",
            "32",
            "--max-handshakes-per-peer",
            "16",
            "--max-connections-per-peer",
            "64",
        ],
    )
    .await;
    let target: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let url = format!("https://127.0.0.1:{port}");

    // The attacker, from 127.0.0.1: 200 connections, not a byte sent.
    let mut attack: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(target).expect("connect"))
        .collect();
    // What the caps turn away is closed at once: each connection past the
    // per-peer pending-handshake cap (16) evicts that peer's oldest.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut held = Vec::new();
    let mut closed_at_once = 0;
    for mut s in attack.drain(..) {
        if closed_within(&mut s, Duration::from_millis(20)) {
            closed_at_once += 1;
        } else {
            held.push(s);
        }
    }
    assert!(
        held.len() <= 16,
        "{} connections still held in handshake; the cap is 16",
        held.len()
    );
    assert!(closed_at_once >= 184, "{closed_at_once} closed at once");

    // Another peer is served while the attacker holds its maximum.
    let started = Instant::now();
    let mut other = AllocatorClient::new(channel_from(&url, &certs, "127.0.0.2"));
    other
        .get_pool(pb::GetPoolRequest::default())
        .await
        .expect("another peer is served during the attack");
    let served_in = started.elapsed();

    // The held ones are dropped at the handshake timeout (2 s).
    let started = Instant::now();
    for s in held.iter_mut() {
        let left = Duration::from_secs(6).saturating_sub(started.elapsed());
        assert!(
            closed_within(s, left.max(Duration::from_millis(1))),
            "a handshake outlived its timeout"
        );
    }
    let dropped_after = started.elapsed();
    // And the attacker's own address is served again once it lets go.
    drop(held);
    let mut same = AllocatorClient::new(channel_from(&url, &certs, "127.0.0.1"));
    same.get_pool(pb::GetPoolRequest::default())
        .await
        .expect("127.0.0.1 served after the attack");
    eprintln!(
        "closed at once {closed_at_once}/200; another peer served in {served_in:?}; \
         held handshakes dropped within {dropped_after:?} more"
    );
}

/// The agent's resident set, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib / 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_write_bodies_pin_bounded_memory_and_are_reset() {
    let dir = tempfile::tempdir().unwrap();
    // An agent of no pool, taking any write: the attack is on its
    // transport, not its tokens.
    let agent = start_agent(
        dir.path(),
        Security::Plaintext,
        "none",
        "d0",
        &file_device(&dir.path().join("d0.img"), "1GiB"),
        &args![
            "--insecure",
            "--unchecked-writes",
            "--body-timeout",
            "4s",
            "--connection-buffer",
            "32MiB",
            "--max-buffered",
            "64MiB",
        ],
    );
    let pid = agent.pid().expect("pid");
    // The fast write path's Write, then WriteBatch (decoded by tonic, read
    // under the same budgets first).
    for method in ["Write", "WriteBatch"] {
        stall_writes(&agent, pid, method).await;
    }
}

/// 48 unary calls of `method` on one connection, each declaring 16 MiB and
/// sending all but the last KiB: bounded memory, every stream answered at
/// the body timeout, memory given back after.
async fn stall_writes(agent: &Proc, pid: u32, method: &str) {
    let before = rss_mib(pid);
    let tcp = tokio::net::TcpStream::connect(agent.addr("grpc"))
        .await
        .unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(16 << 20)
        .handshake::<_, bytes_of::Bytes>(tcp)
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let mut responses = Vec::new();
    let mut bodies = Vec::new();
    let size = 16 * MIB;
    let started = Instant::now();
    for _ in 0..48 {
        let req = tonic::codegen::http::Request::post(format!(
            "http://{}/aliquot.v1.VdevAgent/{method}",
            agent.addr("grpc")
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let (resp, mut body) = client.send_request(req, false).expect("open a stream");
        let mut prefix = vec![0u8];
        prefix.extend_from_slice(&((size + 16) as u32).to_be_bytes());
        body.send_data(prefix.into(), false).unwrap();
        body.send_data(vec![7u8; size - 1024].into(), false)
            .unwrap();
        responses.push(resp);
        bodies.push(body);
        client = client.ready().await.unwrap();
    }
    // The peak is sampled for the whole attack, answers included: as the
    // first streams are answered their window is released and the client
    // sends more of the others' bodies, so memory can still rise then.
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn({
        let sampling = sampling.clone();
        async move {
            let mut peak = before;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(rss_mib(pid));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            peak.max(rss_mib(pid))
        }
    });

    // After the body timeout, every stream is answered or reset.
    let mut timed_out = 0;
    let mut reset = 0;
    for r in responses {
        match tokio::time::timeout(Duration::from_secs(30), r).await {
            Ok(Ok(resp)) => {
                let status = resp
                    .headers()
                    .get("grpc-status")
                    .map(|v| v.to_str().unwrap_or_default().to_string());
                assert_eq!(status.as_deref(), Some("4"), "DEADLINE_EXCEEDED: {resp:?}");
                timed_out += 1;
            }
            Ok(Err(_)) => reset += 1,
            Err(_) => panic!("{method}: a stalled stream was neither answered nor reset in 30 s"),
        }
    }
    eprintln!(
        "{method}: all streams answered {:?} after the attack began",
        started.elapsed()
    );
    drop(bodies);
    sampling.store(false, Ordering::Relaxed);
    let peak = sampler.await.unwrap();
    // Bound: 64 MiB of HTTP/2 connection window not yet read, 32 MiB read
    // under the connection's budget, the read buffers they sit in, and the
    // process's own (before); unbounded, the same attack held 785 MiB.
    assert!(
        peak < before + 256,
        "{method}: agent RSS {before} -> {peak} MiB under 48 stalled 16 MiB calls"
    );
    // The agent gives idle memory back (`malloc_trim` at the first
    // once-a-second check that finds its body budget idle again; a thread
    // arena's free top stays, so not all of it): at least a quarter of what
    // the attack took, within 10 s on a loaded machine.
    let given_back = peak - (peak - before) / 4;
    let mut after = rss_mib(pid);
    let giving_back = Instant::now();
    while after >= given_back && giving_back.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = rss_mib(pid);
    }
    assert!(
        after < given_back,
        "{method}: agent RSS {after} MiB 10 s after the streams ended: {before} before, \
         {peak} at the peak"
    );
    eprintln!(
        "{method}: agent RSS before {before} MiB, peak {peak} MiB, after {after} MiB; \
         {timed_out} answered DEADLINE_EXCEEDED, {reset} reset"
    );
}

/// `h2`'s body type is `bytes::Bytes`; tonic re-exports the same crate.
mod bytes_of {
    pub use tonic::codegen::Bytes;
}

/// Idle connections (never a ClientHello) from the very address of an
/// authenticated client do not shut it out: pending handshakes do not count
/// against the per-peer cap, and a new one past their own bound evicts the
/// oldest, so every one of the client's calls, each on a new connection,
/// is answered while ~1000 idle connections are kept open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_lock_out_a_client_on_the_same_address() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let (_pool, port) = tls_allocator(dir.path(), &args!["--max-connections-per-peer", "64"]).await;
    let target: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let idle: Vec<TcpStream> = (0..1000)
        .filter_map(|_| TcpStream::connect(target).ok())
        .collect();
    assert!(
        idle.len() >= 900,
        "only {} idle connections opened",
        idle.len()
    );
    let mut answered = 0;
    for i in 0..30 {
        let mut c = AllocatorClient::new(channel_from(&url, &certs, "127.0.0.1"));
        match c.get_pool(pb::GetPoolRequest::default()).await {
            Ok(_) => answered += 1,
            Err(e) => panic!("call {i} from the client on 127.0.0.1 refused: {e}"),
        }
    }
    eprintln!(
        "{answered}/30 GetPool calls answered with {} idle connections open",
        idle.len()
    );
    drop(idle);
}
