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

use integration_tests::data_request as data;

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
    // The operator admits file0's device ahead (`--admit-agent file0`).
    ac.admit_agents = vec![("file0".into(), None)];
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
    agent_knows_its_registration(&agent).await;

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
    // The agent registered over mutual TLS with its own certificate, so it
    // holds its vdev's MAC key: the token is a MAC, and one
    // widened, or made under another key, is refused as forged.
    let token = &reply.tokens[0];
    assert_eq!(
        (token.len(), token[0]),
        (
            aliquot_auth::mac_token::MAC_TOKEN_LEN,
            aliquot_auth::mac_token::MAC_WRITE_VERSION
        ),
        "a MAC token"
    );
    let mut widened = token.clone();
    widened[36] ^= 0x80; // the size's low byte
    let stranger = aliquot_auth::TokenSigner::generate()
        .vdev_key(1, agent.info().guid, reply.generation)
        .sign(&aliquot_auth::WriteGrant {
            pool_guid: u64::from_be_bytes(token[1..9].try_into().unwrap()),
            generation: reply.generation,
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
            allocation_id: reply.allocation_id,
            expires_ms: u64::MAX / 2,
        });
    for (what, t) in [("widened", widened), ("another key's", stranger)] {
        let err = writer
            .write(pb::WriteRequest {
                offset: e.offset,
                data: vec![2; e.size as usize].into(),
                token: t,
            })
            .await
            .expect_err(what);
        assert_eq!(
            (err.code(), reason(&err).as_str()),
            (Code::PermissionDenied, "WRITE_TOKEN_FORGED"),
            "{what}: {err:?}"
        );
    }
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

/// The ErrorInfo reason of a refusal.
fn reason(s: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    s.get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default()
}

async fn try_channel(url: &str, files: &TlsFiles, server: Role) -> Result<Channel, String> {
    Channel::from_shared(url.to_owned())
        .unwrap()
        .tls_config(files.client_config(server).unwrap())
        .unwrap()
        .connect()
        .await
        .map_err(|e| e.to_string())
}

async fn start_allocator(
    dir: &std::path::Path,
    certs: &std::path::Path,
    metrics: Option<String>,
) -> (
    aliquot_allocator::Running,
    std::sync::Arc<aliquot_allocator::SqliteStore>,
) {
    start_allocator_with(dir, certs, metrics, |_| {}).await
}

async fn start_allocator_with(
    dir: &std::path::Path,
    certs: &std::path::Path,
    metrics: Option<String>,
    tweak: impl FnOnce(&mut aliquot_allocator::Config),
) -> (
    aliquot_allocator::Running,
    std::sync::Arc<aliquot_allocator::SqliteStore>,
) {
    let mut ac = aliquot_allocator::Config::with_listen("127.0.0.1:0".parse().unwrap());
    // The operator admits these agents' devices ahead (`--admit-agent`).
    ac.admit_agents = ["file0", "file1", "d0"]
        .map(|n| (n.to_string(), None))
        .to_vec();
    tweak(&mut ac);
    ac.data_dir = dir.join("allocator");
    ac.token_key = Some(certs.to_owned());
    ac.metrics = metrics;
    ac.snapshot_interval = Duration::from_millis(100);
    ac.claim_window = Duration::ZERO;
    ac.tls =
        aliquot_auth::TlsArgs::with_files(TlsFiles::in_dir(certs, Role::Allocator, "allocator"));
    std::fs::create_dir_all(&ac.data_dir).unwrap();
    // A real SQLite store: agent bindings must outlive a restart.
    let store = std::sync::Arc::new(
        aliquot_allocator::SqliteStore::open(&ac.data_dir.join("pool.db"), &ac.pool, None)
            .await
            .unwrap(),
    );
    let running = aliquot_allocator::start(ac, store.clone()).await.unwrap();
    (running, store)
}

/// The allocator lists a vdev once it has recorded the registration; the
/// agent accepts writes only once the reply (vdev, pool, generation) has
/// reached it, a moment later (on a loaded machine the test's first write
/// could land in between and get UNAVAILABLE "not registered yet").
async fn agent_knows_its_registration(agent: &Agent) {
    for _ in 0..200 {
        if agent.vdev().is_some() && agent.gate().generation() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the agent never learned its registration");
}

/// Allocation ids bound to the client, Free/Claim/admin calls by role,
/// RenewLease reissuing tokens, an agent certificate that can neither grow
/// nor move its vdev (and stays bound to its device across a restart), a
/// certificate from another CA, and the metrics service taking snapshots
/// from the allocator only.
#[tokio::test]
async fn identities_own_their_allocations_devices_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let ca = PoolCa::init(&certs, "tank").unwrap();
    for (role, name) in [
        (Role::Allocator, "allocator"),
        (Role::Metrics, "metrics"),
        (Role::Agent, "file0"),
        (Role::Agent, "file1"),
        (Role::Client, "alice"),
        (Role::Client, "bob"),
        (Role::Admin, "op"),
    ] {
        ca.issue(role, name, &[]).unwrap();
    }
    let files = |role, name| TlsFiles::in_dir(&certs, role, name);

    // Metrics over mutual TLS (the HTTP port stays plaintext on loopback).
    let mcfg = {
        use clap::Parser;
        let m = files(Role::Metrics, "metrics");
        aliquot_metrics::Config::try_parse_from([
            "aliquot-metrics".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--db".into(),
            dir.path().join("metrics.db").display().to_string(),
            "--tls-ca".into(),
            m.ca.display().to_string(),
            "--tls-cert".into(),
            m.cert.display().to_string(),
            "--tls-key".into(),
            m.key.display().to_string(),
        ])
        .unwrap()
    };
    let metrics = aliquot_metrics::start(&mcfg).await.unwrap();
    let metrics_url = format!("https://127.0.0.1:{}", metrics.grpc_addr.port());

    let (allocator, store) = start_allocator(dir.path(), &certs, Some(metrics_url.clone())).await;
    let alloc_url = format!("https://127.0.0.1:{}", allocator.addr.port());

    let mut gc = aliquot_agent::Config::new(BackendKind::Sim);
    gc.capacity = Some(1 << 30);
    gc.allocator = alloc_url.clone();
    gc.token_key = Some(certs.clone());
    gc.tls = aliquot_auth::TlsArgs::with_files(files(Role::Agent, "file0"));
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

    let alice_files = files(Role::Client, "alice");
    let mut alice =
        AllocatorClient::new(tls_channel(&alloc_url, &alice_files, Role::Allocator).await);
    let mut bob = AllocatorClient::new(
        tls_channel(&alloc_url, &files(Role::Client, "bob"), Role::Allocator).await,
    );
    let vdev = loop {
        let st = alice
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        if let Some(v) = st.vdevs.first()
            && st
                .classes
                .iter()
                .flat_map(|c| &c.groups)
                .any(|g| g.capacity > 0)
        {
            break v.clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    agent_knows_its_registration(&agent).await;

    // A client certificate cannot Report (any vdev).
    let mut reg_alice =
        AgentRegistryClient::new(tls_channel(&alloc_url, &alice_files, Role::Allocator).await);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::AgentReport {
        vdev: vdev.vdev,
        capacity: 64 << 30,
        ..Default::default()
    })
    .await
    .unwrap();
    let e = match reg_alice
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
    {
        Err(e) => e,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role agent"), "{e:?}");
    drop(tx);

    // A certificate from another CA: refused at the handshake.
    let other = dir.path().join("other-ca");
    PoolCa::init(&other, "evil")
        .unwrap()
        .issue(Role::Admin, "op", &[])
        .unwrap();
    let mallory = TlsFiles::in_dir(&other, Role::Admin, "op");
    let refused = match try_channel(&alloc_url, &mallory, Role::Allocator).await {
        Err(_) => true,
        Ok(ch) => AllocatorClient::new(ch)
            .get_pool(pb::GetPoolRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a certificate from another CA was served");

    // Alice allocates; Bob can neither commit, abort nor renew it.
    let a = alice
        .allocate(pb::AllocateRequest {
            size: 64 << 10,
            class: pb::AllocationClass::Data as i32,
            copies: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let ids = vec![a.allocation_id];
    let e = bob
        .commit(pb::CommitRequest {
            allocation_ids: ids.clone(),
            generation: a.generation,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::PermissionDenied, "NOT_OWNER"),
        "{e:?}"
    );
    let e = bob
        .abort(pb::AbortRequest {
            allocation_ids: ids.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::PermissionDenied, "NOT_OWNER"),
        "{e:?}"
    );
    let e = bob
        .renew_lease(pb::RenewLeaseRequest {
            allocation_ids: ids.clone(),
            lease_ms: 60_000,
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::PermissionDenied, "NOT_OWNER"),
        "{e:?}"
    );

    // Alice renews: new tokens with the new expiry, which the agent takes.
    let r = alice
        .renew_lease(pb::RenewLeaseRequest {
            allocation_ids: ids.clone(),
            lease_ms: 60_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.tokens.len(), a.extents.len());
    assert_ne!(r.tokens[0], a.tokens[0], "renewed token is the old one");
    assert!(r.lease_deadline_ms > a.lease_deadline_ms);
    let ext = a.extents[0];
    let mut writer =
        VdevAgentClient::new(tls_channel(&a.endpoints[0], &alice_files, Role::Agent).await);
    writer
        .write(pb::WriteRequest {
            offset: ext.offset,
            data: vec![7; ext.size as usize].into(),
            token: r.tokens[0].clone(),
        })
        .await
        .unwrap();
    alice
        .commit(pb::CommitRequest {
            allocation_ids: ids.clone(),
            generation: a.generation,
            ..Default::default()
        })
        .await
        .unwrap();

    // Roles: an agent may not free, a client may not take a vdev offline.
    let mut as_agent = AllocatorClient::new(
        tls_channel(&alloc_url, &files(Role::Agent, "file0"), Role::Allocator).await,
    );
    let e = as_agent
        .free(pb::FreeRequest { extents: vec![ext] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role client or admin"), "{e:?}");
    let e = alice
        .set_vdev_state(pb::SetVdevStateRequest {
            vdev: vdev.vdev,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role admin"), "{e:?}");

    // An expired allocation of alice's: bob is told NOT_OWNER, not its
    // state; alice is told it expired.
    let short = alice
        .allocate(pb::AllocateRequest {
            lease_ms: 200,
            ..data(4096)
        })
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let e = bob
        .abort(pb::AbortRequest {
            allocation_ids: vec![short.allocation_id],
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::PermissionDenied, "NOT_OWNER"),
        "{e:?}"
    );
    // It had expired: its owner is told so.
    let e = alice
        .commit(pb::CommitRequest {
            allocation_ids: vec![short.allocation_id],
            generation: short.generation,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "LEASE_EXPIRED", "{e:?}");

    // file0's certificate re-registering its own device: it cannot grow it
    // (refused, naming `vdev expand`) nor move it while it is live.
    let mut file0 = AgentRegistryClient::new(
        tls_channel(&alloc_url, &files(Role::Agent, "file0"), Role::Allocator).await,
    );
    let own = |endpoint: &str, capacity: u64| pb::RegisterRequest {
        endpoint: endpoint.into(),
        device_guid: agent.info().guid,
        name: vdev.name.clone(),
        capacity,
        ashift: 12,
        children: 1,
        backend: "sim".into(),
        ..Default::default()
    };
    let e = file0
        .register(own(&vdev.endpoint, 8 << 30))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("vdev expand"), "{e:?}");
    // What the agent registered (its device less the 1 MiB label) again.
    file0
        .register(own(&vdev.endpoint, (1 << 30) - (1 << 20)))
        .await
        .unwrap();
    let st = alice
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    let size: u64 = st
        .classes
        .iter()
        .flat_map(|c| &c.groups)
        .filter(|g| g.vdev == vdev.vdev)
        .map(|g| g.capacity)
        .max()
        .unwrap();
    assert!(
        size <= 1 << 30,
        "an agent certificate grew its vdev to {size}"
    );
    let e = file0
        .register(own("https://127.0.0.1:1", 1 << 30))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // Metrics: the allocator's snapshots arrive over mutual TLS; a client may
    // read them but not record any.
    let mut m_alice = pb::metrics_client::MetricsClient::new(
        tls_channel(&metrics_url, &alice_files, Role::Metrics).await,
    );
    let mut pushed = false;
    for _ in 0..100 {
        let h = m_alice
            .history(pb::HistoryRequest {
                pool: "aliquot".into(),
                max_points: 10,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        if !h.series.is_empty() {
            pushed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        pushed,
        "no snapshot from the allocator reached metrics over TLS"
    );
    let e = m_alice
        .record_batch(pb::SnapshotBatch {
            snapshots: vec![pb::PoolSnapshot {
                pool: "aliquot".into(),
                time_ms: 1,
                ..Default::default()
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs role allocator"), "{e:?}");

    // A refused first Register binds nothing: file1's certificate, refused
    // for a bad ashift on device 0xb1, may then register device 0xb2.
    {
        let mut file1 = AgentRegistryClient::new(
            tls_channel(&alloc_url, &files(Role::Agent, "file1"), Role::Allocator).await,
        );
        let new_device = |guid: u64, ashift: u32| pb::RegisterRequest {
            endpoint: format!("https://127.0.0.1:9/{guid}"),
            device_guid: guid,
            name: format!("dev{guid}"),
            capacity: 1 << 30,
            ashift,
            children: 1,
            backend: "sim".into(),
            ..Default::default()
        };
        let e = file1.register(new_device(0xb1, 99)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        file1
            .register(new_device(0xb2, 12))
            .await
            .expect("a refused Register did not bind the certificate");
    }

    // Bindings are in the store: after a restart, before file0's agent is
    // back, file1's certificate still cannot register file0's device.
    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
    allocator.shutdown().await.unwrap();
    store.close().await;
    let (allocator, store) = start_allocator(dir.path(), &certs, None).await;
    let alloc_url = format!("https://127.0.0.1:{}", allocator.addr.port());
    let mut file1 = AgentRegistryClient::new(
        tls_channel(&alloc_url, &files(Role::Agent, "file1"), Role::Allocator).await,
    );
    let e = file1
        .register(own("https://127.0.0.1:2", 1 << 30))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::PermissionDenied, "NOT_OWNER"),
        "{e:?}"
    );
    allocator.shutdown().await.unwrap();
    store.close().await;
    metrics.shutdown().await.unwrap();
}

/// `aliquotctl up` is mutual TLS by default: `status` with the certificates
/// `up` wrote works, plaintext is refused, health checks work over TLS.
#[test]
fn up_is_tls_by_default_and_status_works() {
    use integration_tests::{Proc, args, bin, ctl, ok_stdout};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let up = Proc::start(
        "up",
        &bin("aliquotctl"),
        &args![
            "up",
            "--ephemeral",
            "--no-metrics",
            "--data-dir",
            data.display(),
            "--agents",
            "64MiB"
        ],
        // Explicitly not plaintext (the harness defaults to --insecure).
        &[(
            integration_tests::INSECURE_ENV.to_string(),
            "false".to_string(),
        )],
        &["grpc"],
        dir.path(),
    )
    .unwrap();
    let addr = up.addr("grpc").to_string();
    let certs = data.join("certs");
    assert!(certs.join("ca.pem").exists() && certs.join("admin-operator.pem").exists());
    let out = ok_stdout(
        &ctl(&args![
            "status",
            "--allocator",
            addr,
            "--certs-dir",
            certs.display()
        ]),
        "status over TLS",
    );
    assert!(out.contains("file0") && out.contains("ONLINE"), "{out}");
    let o = ctl(&args!["status", "--allocator", addr, "--insecure"]);
    assert!(!o.status.success(), "plaintext status was served");
    ok_stdout(
        &ctl(&args!["health", addr, "--certs-dir", certs.display()]),
        "health over TLS",
    );
    // Without certificates (another directory) the client says what to do.
    let o = ctl(&args![
        "status",
        "--allocator",
        addr,
        "--certs-dir",
        dir.path().join("none").display()
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("aliquotctl up"),
        "{err}"
    );
    // Another pool's certificates: said as such, naming the CA tried.
    let other = dir.path().join("other");
    let ca = PoolCa::init(&other, "other").unwrap();
    ca.ensure_issued(Role::Admin, aliquot_auth::client::OPERATOR, &[])
        .unwrap();
    let o = ctl(&args![
        "status",
        "--allocator",
        addr,
        "--certs-dir",
        other.display()
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains(&format!(
                "the server's certificate is not signed by {}",
                other.join("ca.pem").display()
            ))
            && err.contains("another pool? give --certs-dir"),
        "{err}"
    );
}

/// A client holds at most --max-leased-per-client bytes
/// in flight, and no allocation outlives --max-lease-lifetime by renewing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_bounded_per_client_and_in_lifetime() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let ca = PoolCa::init(&certs, "tank").unwrap();
    for (role, name) in [
        (Role::Allocator, "allocator"),
        (Role::Agent, "d0"),
        (Role::Client, "alice"),
        (Role::Client, "bob"),
    ] {
        ca.issue(role, name, &[]).unwrap();
    }
    let files = |role, name| TlsFiles::in_dir(&certs, role, name);
    let (allocator, store) = start_allocator_with(dir.path(), &certs, None, |c| {
        c.max_leased_per_client = 8 << 20;
        c.max_lease_lifetime = Duration::from_secs(2);
    })
    .await;
    let url = format!("https://127.0.0.1:{}", allocator.addr.port());
    AgentRegistryClient::new(tls_channel(&url, &files(Role::Agent, "d0"), Role::Allocator).await)
        .register(pb::RegisterRequest {
            endpoint: "https://127.0.0.1:9/d0".into(),
            device_guid: 0xd0,
            name: "d0".into(),
            capacity: 1 << 30,
            ashift: 12,
            children: 1,
            backend: "sim".into(),
            ..Default::default()
        })
        .await
        .expect("register");
    let mut alice = AllocatorClient::new(
        tls_channel(&url, &files(Role::Client, "alice"), Role::Allocator).await,
    );
    let mut bob =
        AllocatorClient::new(tls_channel(&url, &files(Role::Client, "bob"), Role::Allocator).await);
    let started = std::time::Instant::now();
    let a1 = alice.allocate(data(4 << 20)).await.unwrap().into_inner();
    let a2 = alice.allocate(data(4 << 20)).await.unwrap().into_inner();
    let e = alice.allocate(data(1 << 20)).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e).as_str()),
        (Code::ResourceExhausted, "LEASE_QUOTA"),
        "{e:?}"
    );
    // The quota is per client: bob is not held back by alice.
    bob.allocate(data(4 << 20)).await.expect("bob's own quota");
    // What alice commits no longer counts.
    alice
        .commit(pb::CommitRequest {
            allocation_ids: vec![a1.allocation_id],
            generation: a1.generation,
            ..Default::default()
        })
        .await
        .unwrap();
    alice
        .allocate(data(4 << 20))
        .await
        .expect("room again after a commit");

    // Renewing a2 with a 60 s lease ends it at its 2 s lifetime, and once
    // that has passed a renewal is refused.
    let r = alice
        .renew_lease(pb::RenewLeaseRequest {
            allocation_ids: vec![a2.allocation_id],
            lease_ms: 60_000,
        })
        .await
        .unwrap()
        .into_inner();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let left = r.lease_deadline_ms.saturating_sub(now_ms);
    assert!(
        left <= 2_000,
        "a renewal past the lifetime: {left} ms left after {:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(2_100).saturating_sub(started.elapsed())).await;
    let e = alice
        .renew_lease(pb::RenewLeaseRequest {
            allocation_ids: vec![a2.allocation_id],
            lease_ms: 60_000,
        })
        .await
        .unwrap_err();
    assert!(
        ["LEASE_LIFETIME", "LEASE_EXPIRED"].contains(&reason(&e).as_str()),
        "{e:?}"
    );
    allocator.shutdown().await.unwrap();
    store.close().await;
}
