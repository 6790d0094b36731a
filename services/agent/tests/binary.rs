//! The real `aliquot-agent` binary: LISTEN line on stdout, clean exit on
//! SIGTERM, exit code 2 (and a clear message) for bad configuration.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_aliquot-agent");

fn run_fails(args: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("ALIQUOT_ALLOCATOR")
        .env("ALIQUOT_INSECURE", "1")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_configuration_exits_2_with_a_clear_message() {
    let (code, err) = run_fails(&["--backend", "sim"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--capacity"), "{err}");

    let (code, err) = run_fails(&["--backend", "sim", "--capacity", "1GiB", "--ashift", "20"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ashift"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let foreign = dir.path().join("foreign.img");
    std::fs::write(&foreign, vec![0x5a; 8192]).unwrap();
    let p = foreign.to_str().unwrap();
    let (code, err) = run_fails(&["--path", p, "--capacity", "16MiB"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("refusing"), "{err}");

    // Neither certificates nor --insecure: refused before the device is touched.
    let out = Command::new(BIN)
        .args(["--path", p, "--capacity", "16MiB"])
        .env_remove("ALIQUOT_INSECURE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--insecure") && err.contains("--tls-ca"),
        "{err}"
    );

    // Mutual TLS without --token-key: refused unless --unchecked-writes
    // (any client certificate could write anywhere), before the device.
    let certs = dir.path().join("certs");
    let ca = aliquot_auth::PoolCa::init(&certs, "p").unwrap();
    let issued = ca.issue(aliquot_auth::Role::Agent, "a0", &[]).unwrap();
    let fresh = dir.path().join("fresh.img");
    let tls = [
        "--path".to_string(),
        fresh.display().to_string(),
        "--capacity".into(),
        "16MiB".into(),
        "--tls-ca".into(),
        certs.join(aliquot_auth::ca::CA_CERT).display().to_string(),
        "--tls-cert".into(),
        issued.cert.display().to_string(),
        "--tls-key".into(),
        issued.key.display().to_string(),
    ];
    let out = Command::new(BIN)
        .args(&tls)
        .env_remove("ALIQUOT_INSECURE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--token-key") && err.contains("--unchecked-writes"),
        "{err}"
    );
    assert!(!fresh.exists(), "the device was not touched");

    // clap's own usage errors are 2 as well.
    let (code, _) = run_fails(&["--no-such-flag"]);
    assert_eq!(code, 2);
}

#[test]
fn prints_listen_serves_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.img");
    let mut child = Command::new(BIN)
        .args(["--path", path.to_str().unwrap(), "--capacity", "16MiB"])
        .args([
            "--allocator",
            "none",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("LISTEN grpc ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    assert_ne!(addr.port(), 0);

    // The client's runtime stops being polled below while its connection
    // stays open: shutdown must not wait for it beyond the grace period.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stats = rt.block_on(async {
        let mut c = aliquot_proto::v1::vdev_agent_client::VdevAgentClient::connect(format!(
            "http://{addr}"
        ))
        .await
        .unwrap();
        c.get_stats(aliquot_proto::v1::GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    assert_eq!(stats.capacity, 15 << 20);
    assert_eq!(stats.name, "v");

    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "agent did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}
