//! A pool that fills up says why and what to do, with
//! `aliquotctl up` and `aliquotctl write` as real processes: `up`'s banner
//! suggests a `--total` that fits its pool; a write past the slop reserve
//! fails with NO_SPACE naming the reserve and the usable bytes left, and
//! says how much it wrote, that it stays allocated, and how to free it;
//! `aliquotctl free` then gives the space back. `up --prometheus-listen`
//! prints a `/metrics` per child, each serving its gRPC counters.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{args, bin, ctl, json_u64, ok_stdout};

const MIB: u64 = 1 << 20;

#[test]
fn a_full_pool_names_its_slop_and_a_failed_write_says_how_to_free_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    // Two 256 MiB vdevs: 512 MiB, of which the slop reserve is 128 MiB
    // (min(128 MiB, half the pool) > 512 MiB / 32).
    let mut up = Command::new(bin("aliquotctl"))
        .args(args![
            "up",
            "--data-dir",
            data.display(),
            "--ephemeral",
            "--insecure",
            "--no-metrics",
            "--agents",
            "256MiB,256MiB",
            "--zfs-txg-timeout",
            "300ms",
            "--prometheus-listen",
            "127.0.0.1"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aliquotctl up");
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let _up = integration_tests::TermOnDrop(up);
    let mut banner = String::new();
    let url = loop {
        let l = lines.next().expect("up ended before LISTEN").unwrap();
        banner.push_str(&l);
        banner.push('\n');
        if let Some(a) = l.strip_prefix("LISTEN grpc ") {
            break format!("http://{a}");
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    // --prometheus-listen: a /metrics per child, each printed.
    let prom: Vec<String> = banner
        .lines()
        .filter_map(|l| l.trim().strip_prefix("prometheus "))
        .map(|l| l.split_whitespace().last().unwrap_or_default().to_string())
        .collect();
    assert_eq!(prom.len(), 3, "allocator and two agents: {banner}");
    assert!(banner.contains("prometheus allocator") && banner.contains("prometheus file1"));
    // 384 MiB usable: the largest power of two at most half of it.
    assert!(
        banner.contains("--total 128MiB --verify") && !banner.contains("1GiB"),
        "{banner}"
    );

    let conn = args![
        "--allocator",
        url,
        "--insecure",
        "--certs-dir",
        data.join("certs").display()
    ];
    let mut w = args![
        "write",
        "--total",
        "512MiB",
        "--block-size",
        "1MiB",
        "--concurrency",
        "8",
        "--no-progress"
    ];
    w.extend(conn.iter().cloned());
    let o = ctl(&w);
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!("{err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the pool is full for data")
            && err.contains("128.00 MiB of the free space is the slop reserve")
            && err.contains("is usable"),
        "{err}"
    );
    assert!(
        err.contains("the run stopped after") && err.contains("stay allocated"),
        "{err}"
    );
    let manifest = err
        .split("aliquotctl free --manifest ")
        .nth(1)
        .and_then(|s| s.split('`').next())
        .unwrap_or_else(|| panic!("no free hint: {err}"))
        .to_string();
    assert!(
        manifest.starts_with(&data.join("manifests").display().to_string()),
        "{manifest}"
    );

    let status = |conn: &[String]| {
        let mut a = args!["status", "--json"];
        a.extend(conn.iter().cloned());
        let v: serde_json::Value =
            serde_json::from_str(&ok_stdout(&ctl(&a), "status")).expect("status json");
        v["vdevs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| json_u64(&v["alloc"]).unwrap_or(0))
            .sum::<u64>()
    };
    for url in &prom {
        let o = Command::new("curl")
            .args(["-sS", "--max-time", "10", url])
            .output()
            .expect("curl");
        let body = String::from_utf8_lossy(&o.stdout);
        assert!(
            body.contains("aliquot_grpc_server_requests_total{"),
            "{url}: {body}"
        );
    }
    let used = status(&conn);
    assert!(used >= 300 * MIB, "the write filled the pool: {used}");

    let mut f = args!["free", "--manifest", manifest];
    f.extend(conn.iter().cloned());
    let out = ok_stdout(&ctl(&f), "free");
    assert!(out.starts_with("freed "), "{out}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&conn) != 0 {
        assert!(Instant::now() < deadline, "space not given back");
        std::thread::sleep(Duration::from_millis(200));
    }
}
