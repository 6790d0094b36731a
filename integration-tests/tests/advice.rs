//! TLS and addressing mistakes get one line naming the cause and the flag,
//! from `aliquotctl` as a user runs it: `--insecure`
//! against a TLS pool, certificates against a plaintext one, and agents
//! that advertise a host only their own network resolves (a compose stack
//! from the host) without `--agent-host`: no retry lines, exit 1, and the
//! same write with the flag works. The Python client says the same for a
//! plaintext client of a TLS pool and a missing client certificate.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use integration_tests::{FilePool, Proc, args, bin, ctl};

/// `aliquotctl up` (mutual TLS, one 256 MiB agent): its allocator URL.
fn tls_up(data: &std::path::Path) -> (std::process::Child, String) {
    let mut up = Command::new(bin("aliquotctl"))
        .args(args![
            "up",
            "--data-dir",
            data.display(),
            "--ephemeral",
            "--no-metrics",
            "--agents",
            "256MiB"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .env_remove("ALIQUOT_INSECURE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("aliquotctl up");
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("up ended before LISTEN").unwrap();
        if let Some(a) = l.strip_prefix("LISTEN grpc ") {
            break a.to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (up, addr)
}

fn stderr_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn tls_mismatches_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("tls");
    let (up, addr) = tls_up(&data);
    let _up = integration_tests::TermOnDrop(up);

    // Plaintext client, TLS pool.
    let o = ctl(&args![
        "status",
        "--allocator",
        format!("http://{addr}"),
        "--insecure"
    ]);
    let err = stderr_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("speaks TLS and this client plaintext (--insecure): drop --insecure"),
        "{err}"
    );

    // TLS client (the up pool's certificates), plaintext allocator.
    let plain = FilePool::start(&tmp.path().join("plain"), &[]);
    let o = ctl(&args![
        "status",
        "--allocator",
        plain.url.replace("http://", "https://"),
        "--certs-dir",
        data.join("certs").display()
    ]);
    let err = stderr_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("it speaks plaintext, not TLS") && err.contains("add --insecure"),
        "{err}"
    );
    // The Python client: plaintext against TLS, and TLS without a client
    // certificate (a channel of the caller's own, as an integrator makes).
    let py = integration_tests::python();
    let path = integration_tests::python_client_path(&py, Path::new(env!("CARGO_TARGET_TMPDIR")));
    let o = Command::new(&py)
        .args([
            "-c",
            PY,
            &addr,
            &data.join("certs/ca.pem").display().to_string(),
        ])
        .env("PYTHONPATH", &path)
        .output()
        .expect("python");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", stderr_of(&o));
    assert!(
        out.contains(
            "speaks TLS and this client plaintext (tls=None): give the pool's certificates"
        ),
        "{out}"
    );
    assert!(
        out.contains("it wants a client certificate issued by the pool CA"),
        "{out}"
    );
}

/// argv: allocator host:port, the pool CA. Prints each error's advice.
const PY: &str = r#"
import sys, grpc
from aliquot_client import Pool
from aliquot_client.pool import AliquotError
from aliquot.v1 import allocator_pb2, allocator_pb2_grpc
addr, ca = sys.argv[1], sys.argv[2]
try:
    Pool(addr, allocator_wait=1).get_pool()
except AliquotError as e:
    print("plaintext:", e.advice)
creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
ch = grpc.secure_channel(addr, creds, options=[("grpc.ssl_target_name_override", "allocator.aliquot")])
try:
    allocator_pb2_grpc.AllocatorStub(ch).GetPool(allocator_pb2.GetPoolRequest(), timeout=5)
except grpc.RpcError as e:
    print("no certificate:", AliquotError("get pool", e, target=addr, tls=True).advice)
"#;

#[test]
fn an_agent_host_that_does_not_resolve_asks_for_agent_host() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(tmp.path(), &[]);
    // As in compose: the agent listens on a port of this host but advertises
    // a name only its own network would resolve.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let agent = Proc::start(
        "agent1",
        &bin("aliquot-agent"),
        &args![
            "--listen",
            format!("127.0.0.1:{port}"),
            "--advertise",
            format!("http://agent1.invalid:{port}"),
            "--allocator",
            p.url,
            "--name",
            "agent1",
            "--backend",
            "sim",
            "--capacity",
            "1GiB"
        ],
        &[],
        &["grpc"],
        tmp.path(),
    )
    .expect("agent");
    p.agents.push(agent);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while p.status()["vdevs"].as_array().map_or(0, |v| v.len()) != 1 {
        assert!(std::time::Instant::now() < deadline, "agent not registered");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let w = args!["write", "--total", "8MiB", "--no-progress", "--no-manifest"];
    let o = p.run(&w);
    let err = stderr_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("advertises host \"agent1.invalid\", which does not resolve here")
            && err.contains("--agent-host 127.0.0.1"),
        "{err}"
    );
    assert!(!err.contains("writing the block again"), "{err}");
    assert!(err.lines().count() <= 2, "{err}");
    let mut w2 = w.clone();
    w2.extend(args!["--agent-host", "127.0.0.1"]);
    let out = p.ok(&w2);
    assert!(out.contains("8.0"), "{out}");
}
