//! Real mutual TLS on loopback: a tonic server behind the role layer, and
//! clients with a pool certificate, with one from another CA, and in plaintext.

use std::time::Duration;

use aliquot_auth::layer::authorize;
use aliquot_auth::{Identity, PoolCa, Role, TlsFiles};
use tokio::net::TcpListener;
use tonic::Code;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

async fn serve(files: &TlsFiles) -> String {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .tls_config(files.server_config().unwrap())
        .unwrap()
        .layer(aliquot_auth::RoleLayer::enforce())
        .add_service(health)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(server);
    format!("127.0.0.1:{}", addr.port())
}

async fn check(channel: Channel) -> Result<(), tonic::Status> {
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .map(|_| ())
}

#[tokio::test]
async fn pool_certificates_only() {
    let dir = tempfile::tempdir().unwrap();
    let ca = PoolCa::init(dir.path(), "tank").unwrap();
    ca.issue(Role::Agent, "a0", &[]).unwrap();
    ca.issue(Role::Client, "c0", &[]).unwrap();
    let addr = serve(&TlsFiles::in_dir(dir.path(), Role::Agent, "a0")).await;

    // A pool client reaches the agent (health: any pool member).
    let client = TlsFiles::in_dir(dir.path(), Role::Client, "c0");
    let ch = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(client.client_config(Role::Agent).unwrap())
        .unwrap()
        .connect()
        .await
        .unwrap();
    check(ch).await.unwrap();

    // Expecting the allocator there: the agent's certificate does not say so.
    let wrong_role = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(client.client_config(Role::Allocator).unwrap())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    assert!(wrong_role.is_err(), "an agent passed for the allocator");

    // A certificate from another CA: the handshake fails.
    let other = tempfile::tempdir().unwrap();
    PoolCa::init(other.path(), "evil")
        .unwrap()
        .issue(Role::Admin, "mallory", &[])
        .unwrap();
    let mut foreign = TlsFiles::in_dir(other.path(), Role::Admin, "mallory");
    foreign.ca = dir.path().join("ca.pem"); // trusts the real pool's CA
    let r = match Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(foreign.client_config(Role::Agent).unwrap())
        .unwrap()
        .connect()
        .await
    {
        Ok(ch) => check(ch).await,
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(r.is_err(), "a foreign CA's certificate was accepted");

    // Plaintext to a TLS port: refused.
    let r = match Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
    {
        Ok(ch) => check(ch).await,
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(r.is_err(), "plaintext was served");
}

#[test]
fn roles_from_issued_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = PoolCa::init(dir.path(), "tank").unwrap();
    let der = |role, name| {
        let p = ca.issue(role, name, &[]).unwrap();
        let pem = std::fs::read_to_string(p.cert).unwrap();
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        decode_b64(&b64)
    };
    let client = der(Role::Client, "c1");
    let agent = der(Role::Agent, "vdev-3");
    assert_eq!(
        Identity::from_cert_der(&agent),
        Some(Identity {
            role: Role::Agent,
            name: "vdev-3".into()
        })
    );
    assert!(authorize("/aliquot.v1.Allocator/Allocate", Some(&client)).is_ok());
    let e = authorize("/aliquot.v1.AgentRegistry/Register", Some(&client)).unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("needs role agent"), "{}", e.message());
    let e = authorize("/aliquot.v1.Allocator/SetTunable", Some(&client)).unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("needs role admin"), "{}", e.message());
    assert!(authorize("/aliquot.v1.AgentRegistry/Report", Some(&agent)).is_ok());
    let e = authorize("/aliquot.v1.Allocator/Allocate", None).unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    // Files are never replaced; names stay plain.
    assert!(ca.issue(Role::Client, "c1", &[]).is_err());
    assert!(ca.issue(Role::Client, "../x", &[]).is_err());
    assert!(PoolCa::init(dir.path(), "tank").is_err());
}

fn decode_b64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= (val(c) as u32) << (18 - 6 * i);
        }
        for i in 0..chunk.len() - 1 {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}
