//! Security across real services on loopback, all over mutual TLS: an
//! allocator and an agent in-process, the agent registered with its agent
//! certificate, a client writing with the allocator's tokens; refusals for
//! plaintext, wrong roles and token-less writes.

use std::time::Duration;

use aliquot_agent::{Agent, BackendKind};
use aliquot_auth::{PoolCa, Role, TlsFiles};
use aliquot_proto::v1 as pb;
use pb::agent_registry_client::AgentRegistryClient;
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;

async fn tls_channel(url: &str, files: &TlsFiles, server: Role) -> Channel {
    Channel::from_shared(url.to_owned())
        .unwrap()
        .tls_config(files.client_config(server).unwrap())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn pool_over_mutual_tls_with_write_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let ca = PoolCa::init(&certs, "tank").unwrap();
    for (role, name) in [
        (Role::Allocator, "allocator"),
        (Role::Agent, "file0"),
        (Role::Agent, "file1"),
        (Role::Client, "alice"),
    ] {
        ca.issue(role, name, &[]).unwrap();
    }
    let files = |role, name| TlsFiles::in_dir(&certs, role, name);
    let set_tls = |args: &mut aliquot_auth::TlsArgs, f: TlsFiles| {
        args.tls_ca = Some(f.ca);
        args.tls_cert = Some(f.cert);
        args.tls_key = Some(f.key);
    };

    let mut ac = aliquot_allocator::Config::with_listen("127.0.0.1:0".parse().unwrap());
    ac.data_dir = dir.path().join("allocator");
    ac.token_key = Some(certs.clone());
    set_tls(&mut ac.tls, files(Role::Allocator, "allocator"));
    let store = std::sync::Arc::new(aliquot_allocator::MemStore::new());
    let allocator = aliquot_allocator::start(ac, store).await.unwrap();
    let alloc_url = format!("https://127.0.0.1:{}", allocator.addr.port());

    let mut gc = aliquot_agent::Config::new(BackendKind::Sim);
    gc.capacity = Some(1 << 30);
    gc.allocator = alloc_url.clone();
    gc.token_key = Some(certs.clone());
    set_tls(&mut gc.tls, files(Role::Agent, "file0"));
    let agent = Agent::open(&gc).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = {
        let agent = agent.clone();
        tokio::spawn(async move {
            aliquot_agent::serve(agent, &gc, listener, async {
                let _ = stopped.await;
            })
            .await
        })
    };

    let alice = files(Role::Client, "alice");
    let ch = tls_channel(&alloc_url, &alice, Role::Allocator).await;
    let mut alloc = AllocatorClient::new(ch.clone());
    // The agent registered over TLS with its agent certificate.
    let mut up = false;
    for _ in 0..100 {
        if alloc
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner()
            .vdevs
            .len()
            == 1
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "the agent did not register over TLS");

    // Allocate, write with the token, commit.
    let reply = alloc
        .allocate(pb::AllocateRequest {
            size: 64 << 10,
            class: pb::AllocationClass::Data as i32,
            copies: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let e = reply.extents[0];
    let mut writer =
        VdevAgentClient::new(tls_channel(&reply.endpoints[0], &alice, Role::Agent).await);
    let no_token = writer
        .write(pb::WriteRequest {
            offset: e.offset,
            data: vec![1; e.size as usize].into(),
            token: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(no_token.code(), Code::Unauthenticated, "{no_token:?}");
    writer
        .write(pb::WriteRequest {
            offset: e.offset,
            data: vec![1; e.size as usize].into(),
            token: reply.tokens[0].clone(),
        })
        .await
        .unwrap();
    alloc
        .commit(pb::CommitRequest {
            allocation_ids: vec![reply.allocation_id],
            generation: reply.generation,
            ..Default::default()
        })
        .await
        .unwrap();

    // A client certificate cannot register a vdev or set tunables.
    let e = AgentRegistryClient::new(ch)
        .register(pb::RegisterRequest {
            endpoint: "https://127.0.0.1:1".into(),
            device_guid: 42,
            name: "evil".into(),
            capacity: 64 << 30,
            ashift: 12,
            children: 1,
            backend: "sim".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role agent"), "{e:?}");
    let e = alloc
        .set_tunable(pb::SetTunableRequest {
            name: "zfs_txg_timeout".into(),
            value: "3600".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // Another agent certificate cannot take over file0's device (here: a
    // new endpoint for its guid); file0's certificate cannot report another vdev.
    let guid = agent.info().guid;
    let mut file1 = AgentRegistryClient::new(
        tls_channel(&alloc_url, &files(Role::Agent, "file1"), Role::Allocator).await,
    );
    let e = file1
        .register(pb::RegisterRequest {
            endpoint: "https://127.0.0.1:1".into(),
            device_guid: guid,
            name: "file0".into(),
            capacity: 8 << 30,
            ashift: 12,
            children: 1,
            backend: "sim".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut file0 = AgentRegistryClient::new(
        tls_channel(&alloc_url, &files(Role::Agent, "file0"), Role::Allocator).await,
    );
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::AgentReport {
        vdev: e_vdev(&reply) + 1,
        capacity: 64 << 30,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut acks = file0
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let e = acks.message().await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    drop(tx);

    // Plaintext to the allocator gets nothing.
    let plain = async {
        AllocatorClient::connect(format!("http://127.0.0.1:{}", allocator.addr.port()))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?
            .get_pool(pb::GetPoolRequest {})
            .await
    };
    assert!(plain.await.is_err(), "plaintext served");

    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
    allocator.shutdown().await.unwrap();
}

fn e_vdev(reply: &pb::AllocateReply) -> u32 {
    reply.extents[0].vdev
}
