//! Across real processes: an agent that slept (SIGSTOP)
//! through an allocator restart still honours the old generation's write
//! tokens until it has registered again. So nothing of the new generation
//! may be placed on its vdev before the agent has reported in it; and once
//! it has, a write with a token of the old generation is refused.

use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args, data_request as data, signal};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

async fn channel(url: &str) -> Channel {
    Channel::from_shared(url.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_takes_nothing_until_it_knows_the_new_generation() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = FilePool::start_with_write_tokens(
        dir.path(),
        "genack",
        &args![
            "--report-interval",
            "200ms",
            // No claim window: the first Allocate after the restart is
            // served at once, the case in which a stale agent could be
            // written through.
            "--claim-window",
            "0s",
        ],
    );
    let alloc_url = pool.url.clone();
    pool.add_file_agent("d0", &dir.path().join("d0.img"), "256MiB", &[]);
    let FilePool {
        mut alloc, agents, ..
    } = pool;
    let agent = &agents[0];
    let mut agent_c = VdevAgentClient::new(channel(&agent.url("grpc")).await);
    let mut c = AllocatorClient::new(channel(&alloc_url).await);

    // Generation 1: an allocation whose write is still to come.
    let deadline = Instant::now() + Duration::from_secs(20);
    let a = loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "never allocatable: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let g1 = a.generation;
    assert!(!a.tokens.is_empty(), "the allocator signs tokens");

    // The agent sleeps through a crash and restart of the allocator.
    signal(agent, "-STOP");
    alloc.kill9();
    alloc.restart().expect("restart allocator");
    let mut c = AllocatorClient::new(channel(&alloc_url).await);
    let st = c
        .get_pool(pb::GetPoolRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.generation, g1 + 1);

    // While the agent still believes in generation 1, the allocator places
    // nothing on its vdev (the only one): generation 1's uncommitted
    // extent is free again in generation 2, and a late write with its token
    // would land on whatever went there.
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        match c.allocate(data(MIB)).await {
            Ok(r) => panic!(
                "allocated {:?} on a vdev whose agent has not heard of generation {}",
                r.into_inner().extents,
                g1 + 1
            ),
            // UNAVAILABLE (no vdev allocatable) while the agent sleeps; the
            // point is that nothing is placed.
            Err(e) => assert_ne!(e.code(), Code::Ok, "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The agent wakes, registers again, reports: now it is allocatable.
    signal(agent, "-CONT");
    let deadline = Instant::now() + Duration::from_secs(20);
    let b = loop {
        match c.allocate(data(MIB)).await {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert!(Instant::now() < deadline, "agent never rejoined: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(b.generation, g1 + 1);
    let (ea, eb) = (a.extents[0], b.extents[0]);

    // Generation 2's client writes its block; generation 1's late write
    // with its old token is refused, wherever it falls.
    let mine = vec![0xb2u8; eb.size as usize];
    agent_c
        .write(pb::WriteRequest {
            offset: eb.offset,
            data: mine.clone().into(),
            token: b.tokens[0].clone(),
        })
        .await
        .expect("generation 2's write");
    let e = agent_c
        .write(pb::WriteRequest {
            offset: ea.offset,
            data: vec![0xa1u8; ea.size as usize].into(),
            token: a.tokens[0].clone(),
        })
        .await
        .expect_err("a token of generation 1 after the agent rejoined generation 2");
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    assert!(e.message().contains("older than generation"), "{e}");
    c.commit(pb::CommitRequest {
        allocation_ids: vec![b.allocation_id],
        wait_synced: true,
        generation: b.generation,
    })
    .await
    .unwrap();
    let token = c
        .read_tokens(pb::ReadTokensRequest { extents: vec![eb] })
        .await
        .unwrap()
        .into_inner()
        .tokens
        .remove(0);
    let back = agent_c
        .read(pb::ReadRequest {
            offset: eb.offset,
            size: eb.size,
            token,
        })
        .await
        .unwrap()
        .into_inner()
        .data;
    assert!(back == mine, "generation 2's block intact");
}
