//! Devices over real gRPC: round trips on both backends, the label (guid and
//! data across restarts, foreign files refused), and request validation.

mod common;

use std::os::unix::fs::FileExt;

use aliquot_agent::label::LABEL_SIZE;
use aliquot_agent::{Agent, AgentError};
use common::{file_config, pattern, sim_config, start};
use tonic::Code;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_round_trip_survives_restart_with_the_same_guid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vdev0.img");
    let cfg = file_config(&path, 64 * MIB);

    let mut a = start(cfg.clone()).await;
    let s = a.stats().await;
    assert_eq!(s.backend, "file");
    assert_eq!(
        s.capacity,
        64 * MIB - LABEL_SIZE,
        "capacity excludes the label"
    );
    assert_eq!(s.ashift, 12);
    assert_eq!(s.name, "vdev0");
    let guid = s.device_guid;
    assert_ne!(guid, 0);

    let blocks = [
        (0u64, pattern(4096, 1)),
        (40960, pattern(128 << 10, 2)),
        (s.capacity - MIB, pattern(MIB as usize, 3)),
    ];
    for (off, data) in &blocks {
        assert_eq!(a.write(*off, data.clone()).await.unwrap(), 1);
    }
    for (off, data) in &blocks {
        assert_eq!(&a.read(*off, data.len() as u64).await.unwrap(), data);
    }
    // Unwritten space reads as zeros.
    assert!(a.read(8192, 8192).await.unwrap().iter().all(|&b| b == 0));
    a.stop().await;

    // The data area starts after the label, on the real file.
    let f = std::fs::File::open(&path).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 64 * MIB);
    let mut raw = vec![0u8; 128 << 10];
    f.read_exact_at(&mut raw, LABEL_SIZE + 40960).unwrap();
    assert_eq!(raw, blocks[1].1);
    drop(f);

    // Restart on the same file: same guid, same data (no --capacity needed).
    let mut again = cfg.clone();
    again.capacity = None;
    let mut b = start(again).await;
    let s2 = b.stats().await;
    assert_eq!(s2.device_guid, guid, "guid survives a restart");
    assert_eq!(s2.capacity, s.capacity);
    for (off, data) in &blocks {
        assert_eq!(&b.read(*off, data.len() as u64).await.unwrap(), data);
    }
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_round_trip_is_sparse_and_per_process() {
    let mut a = start(sim_config(4 << 30)).await;
    let s = a.stats().await;
    assert_eq!(s.backend, "sim");
    assert_eq!(s.capacity, (4 << 30) - LABEL_SIZE);
    let hi = s.capacity - 3 * 4096;
    let data = pattern(3 * 4096, 9);
    a.write(hi, data.clone()).await.unwrap();
    a.write(0, pattern(4096, 10)).await.unwrap();
    assert_eq!(a.read(hi, data.len() as u64).await.unwrap(), data);
    assert_eq!(a.read(0, 4096).await.unwrap(), pattern(4096, 10));
    assert!(
        a.read(1 << 30, 65536)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    let s = a.stats().await;
    assert_eq!(s.bytes_written, 4 * 4096);
    assert_eq!(s.bytes_read, 3 * 4096 + 4096 + 65536);
    a.stop().await;

    // A sim guid may be pinned so a restarted demo agent rejoins as itself.
    let mut cfg = sim_config(64 * MIB);
    cfg.guid = Some(77);
    let mut b = start(cfg).await;
    assert_eq!(b.stats().await.device_guid, 77);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_files_are_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let mut text = b"these are someone's notes, not a vdev\n".repeat(300);
    text.truncate(10_000);
    std::fs::write(&path, &text).unwrap();

    let err = Agent::open(&file_config(&path, 64 * MIB))
        .err()
        .expect("a foreign file is refused");
    assert!(matches!(err, AgentError::Label(_)), "{err:?}");
    assert!(err.is_usage());
    let msg = err.to_string();
    assert!(
        msg.contains("refusing") && msg.contains("notes.txt"),
        "{msg}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), text, "file untouched");

    // Zeroed boot blocks followed by someone else's label (as ZFS lays its
    // vdev labels out) are not blank either.
    let zfs_like = dir.path().join("zfs-like.img");
    let mut img = vec![0u8; 2 << 20];
    img[(16 << 10) + 2..(16 << 10) + 9].copy_from_slice(b"version");
    std::fs::write(&zfs_like, &img).unwrap();
    let err = Agent::open(&file_config(&zfs_like, 2 * MIB))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("byte 16386"), "{err}");
    assert_eq!(std::fs::read(&zfs_like).unwrap(), img, "file untouched");

    // A file of zeros (say, from truncate) is a new device; it keeps its size.
    let zeros = dir.path().join("zeros.img");
    std::fs::File::create(&zeros)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let mut cfg = file_config(&zeros, 0);
    cfg.capacity = None;
    let agent = Agent::open(&cfg).expect("zeroed file is labelled");
    assert_eq!(agent.info().capacity, 3 * MIB);
    agent.shutdown().await;
    drop(agent);

    // An existing empty file is a new device.
    let empty = dir.path().join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let agent = Agent::open(&file_config(&empty, 8 * MIB)).expect("empty file is labelled");
    // A second agent on the same device is refused while the first holds it.
    let err = Agent::open(&file_config(&empty, 8 * MIB))
        .err()
        .expect("locked");
    assert!(err.to_string().contains("in use"), "{err}");
    agent.shutdown().await;
    drop(agent);

    // The label pins ashift and size.
    let mut cfg = file_config(&empty, 8 * MIB);
    cfg.ashift = 9;
    let err = Agent::open(&cfg).err().expect("ashift mismatch");
    assert!(err.to_string().contains("--ashift 12"), "{err}");
    let err = Agent::open(&file_config(&empty, 16 * MIB))
        .err()
        .expect("size mismatch");
    assert!(err.to_string().contains("--capacity"), "{err}");

    // A new file needs a size.
    let mut cfg = file_config(&dir.path().join("new.img"), 0);
    cfg.capacity = None;
    let err = Agent::open(&cfg).err().expect("no capacity");
    assert!(err.to_string().contains("--capacity"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_argument_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = start(file_config(&dir.path().join("v.img"), 8 * MIB)).await;
    let cap = a.stats().await.capacity;
    assert_eq!(cap, 7 * MIB);
    let original = pattern(64 << 10, 5);
    a.write(0, original.clone()).await.unwrap();
    let tail = pattern(8192, 6);
    a.write(cap - 8192, tail.clone()).await.unwrap();
    let before = a.stats().await;

    let cases: Vec<(&str, u64, usize, &str)> = vec![
        (
            "unaligned offset",
            512,
            4096,
            "offset 512 is not a multiple",
        ),
        ("unaligned size", 0, 4097, "size 4097 is not a multiple"),
        ("empty", 0, 0, "empty write"),
        ("past the end", cap, 4096, "outside the device"),
        ("straddles the end", cap - 4096, 8192, "outside the device"),
        (
            "overflowing offset",
            u64::MAX - 4095,
            4096,
            "outside the device",
        ),
        ("too large", 0, (16 << 20) + 4096, "16 MiB"),
    ];
    for (what, off, len, needle) in cases {
        let st = a.write(off, vec![0xEE; len]).await.expect_err(what);
        assert_eq!(st.code(), Code::InvalidArgument, "{what}: {st:?}");
        assert!(st.message().contains(needle), "{what}: {}", st.message());
    }
    for (what, off, len) in [
        ("read unaligned", 100u64, 4096u64),
        ("read past the end", cap, 4096),
        ("read too large", 0, 32 << 20),
        ("read empty", 0, 0),
    ] {
        let st = a.read(off, len).await.expect_err(what);
        assert_eq!(st.code(), Code::InvalidArgument, "{what}: {st:?}");
    }

    assert_eq!(a.read(0, original.len() as u64).await.unwrap(), original);
    assert_eq!(a.read(cap - 8192, 8192).await.unwrap(), tail);
    let after = a.stats().await;
    assert_eq!(
        after.writes, before.writes,
        "refused writes never reach the queue"
    );
    assert_eq!(after.bytes_written, before.bytes_written);
    assert_eq!(after.write_errors, 0);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let a = start(sim_config(64 * MIB)).await;
    let url = format!("http://{}", a.addr);
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    let st = health
        .check(HealthCheckRequest {
            service: "aliquot.v1.VdevAgent".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.status(), ServingStatus::Serving);

    let mut refl = ServerReflectionClient::new(channel.clone());
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = refl
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let reply = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply {reply:?}");
    };
    let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    // Exactly what an agent serves: no Allocator or Metrics to call in vain.
    let want = [
        "aliquot.v1.VdevAgent",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    assert_eq!(names, want);
    // The batch write is described too (grpcurl can call it).
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "aliquot.v1.VdevAgent.WriteBatch".into(),
        )),
    };
    let mut stream = refl
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let reply = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = reply.message_response else {
        panic!("WriteBatch not found by reflection: {reply:?}");
    };
    assert!(
        files
            .file_descriptor_proto
            .iter()
            .any(|f| f.windows(10).any(|w| w == b"WriteBatch")),
        "no descriptor names WriteBatch"
    );

    // v1alpha (grpcio-reflection, older grpcurl) lists the same.
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest as Req;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as Client;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as M;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as R;
        let mut refl = Client::new(channel.clone());
        let req = Req {
            host: String::new(),
            message_request: Some(M::ListServices(String::new())),
        };
        let mut stream = refl
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let reply = stream.message().await.unwrap().unwrap();
        let Some(R::ListServicesResponse(list)) = reply.message_response else {
            panic!("unexpected v1alpha reflection reply {reply:?}");
        };
        let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        names.sort();
        assert_eq!(names, want);
    }
    drop((health, refl, stream, channel));
    a.stop().await;
}
