//! Shared helpers: constructed snapshots, an in-process service on port 0
//! over a temp-dir SQLite file, and a gRPC client.
#![allow(dead_code)]

use aliquot_metrics::{Config, Running};
use aliquot_proto::v1::metrics_client::MetricsClient;
use aliquot_proto::v1::{ClassSample, PoolEvent, PoolSnapshot, VdevHealth, VdevSample};
use clap::Parser;
use tonic::transport::Channel;

pub const GIB: u64 = 1 << 30;
pub const MIB: f64 = 1048576.0;
/// 2026-12-02 00:00:00 UTC, a round start for constructed histories.
pub const T0: i64 = 1_796_169_600_000;

/// A snapshot whose vdev `i` is `used[i]` full (1 GiB each), writing 1 MiB/s.
pub fn snap(pool: &str, time_ms: i64, used: &[f64]) -> PoolSnapshot {
    PoolSnapshot {
        pool: pool.to_string(),
        time_ms,
        txg: (time_ms / 1000) as u64,
        vdevs: used
            .iter()
            .enumerate()
            .map(|(i, u)| VdevSample {
                vdev: i as u32,
                name: format!("disk{i}"),
                capacity: GIB,
                allocated: (u * GIB as f64) as u64,
                free_fraction: 1.0 - u,
                fragmentation: 10 + i as i32,
                aliquot: 1 << 20,
                queue_target: 4 << 20,
                queue_depth: (i as u64 + 1) << 20,
                write_bytes_per_sec: MIB,
                read_bytes_per_sec: 0.0,
                latency_p50_us: 100,
                latency_p99_us: 900 + i as u64,
                health: VdevHealth::Healthy as i32,
                offline: false,
            })
            .collect(),
        classes: vec![ClassSample {
            name: "normal".into(),
            alloc_max: 64 << 20,
            reserved: 1 << 20,
            busy: false,
            waiting: 0,
            waiting_bytes: 0,
            throttle_enabled: true,
        }],
        events: vec![],
        dropped_snapshots: 0,
        synced_txg: ((time_ms / 1000) as u64).saturating_sub(1),
    }
}

pub fn event(time_ms: i64, kind: &str, vdev: u32) -> PoolEvent {
    PoolEvent {
        time_ms,
        kind: kind.into(),
        vdev,
        detail: String::new(),
    }
}

pub fn config(db: &std::path::Path, extra: &[&str]) -> Config {
    let mut args = vec![
        "aliquot-metrics".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--http-listen".into(),
        "127.0.0.1:0".into(),
        "--db".into(),
        db.display().to_string(),
    ];
    // Plaintext on loopback unless the test brings certificates.
    if !extra.contains(&"--tls-ca") {
        args.push("--insecure".into());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Config::try_parse_from(args).expect("config")
}

pub async fn start(db: &std::path::Path) -> Running {
    aliquot_metrics::start(&config(db, &[]))
        .await
        .expect("start metrics")
}

pub async fn client(r: &Running) -> MetricsClient<Channel> {
    MetricsClient::connect(format!("http://{}", r.grpc_addr))
        .await
        .expect("connect")
}

/// Minimal HTTP/1.1 GET: (status, content-type, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect http");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).expect("utf8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("http response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let ctype = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (status, ctype, body.to_string())
}
