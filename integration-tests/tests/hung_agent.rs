//! One hung agent must not stall the pool's writers.
//! Real processes: an allocator and three file agents on loopback, and
//! `aliquotctl write` with 32 blocks in flight. One agent is stopped with
//! SIGSTOP for 10 s mid-run and then continued; the write must complete,
//! every block must read back intact, and the longest time without any
//! block completing must stay near the client's `--timeout`, not the 10 s
//! the agent was stopped.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, args, bin, signal};
use pb::allocator_client::AllocatorClient;

const STOP: Duration = Duration::from_secs(10);
const TIMEOUT: Duration = Duration::from_secs(2);

async fn wait_allocatable(url: String, n: usize) {
    let mut c = AllocatorClient::connect(url).await.expect("connect");
    let start = Instant::now();
    loop {
        let s = c
            .get_pool(pb::GetPoolRequest {})
            .await
            .expect("get pool")
            .into_inner();
        let ready: usize = s
            .classes
            .iter()
            .map(|c| c.groups.iter().filter(|g| g.allocatable).count())
            .sum();
        if ready >= n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{n} vdevs never became allocatable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_agent_stalls_writes_at_most_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    // The allocator's own txg, report and claim timings: the stall bound
    // is asserted under the defaults a user runs.
    let mut pool = FilePool::start_with_default_timings(dir.path(), &[]);
    for _ in 0..3 {
        pool.add_agent("1GiB");
    }
    wait_allocatable(pool.url.clone(), 3).await;

    // Paced so the run lasts well beyond the stop (~20 s): the stall shows
    // as a gap in completions, not as lost throughput.
    let t0 = Instant::now();
    let child = Command::new(bin("aliquotctl"))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "write",
            "--allocator",
            pool.url,
            "--total",
            "640MiB",
            "--block-size",
            "1MiB",
            "--concurrency",
            32,
            "--rate",
            "32MiB/s",
            "--timeout",
            format!("{}s", TIMEOUT.as_secs()),
            "--verify",
            "--json",
            "--no-progress",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start aliquotctl write");

    tokio::time::sleep(Duration::from_secs(3)).await;
    let hung = &pool.agents[1];
    signal(hung, "-STOP");
    let stopped = Instant::now();
    tokio::time::sleep(STOP).await;
    signal(hung, "-CONT");
    let continued = t0.elapsed();

    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("aliquotctl write output");
    let total = t0.elapsed();
    assert!(
        out.status.success(),
        "write failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The stop must have overlapped the run, or the test proves nothing.
    assert!(
        total > continued,
        "the write ended before the agent was continued"
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json report");
    let max_stall = Duration::from_micros(r["max_stall_us"].as_u64().unwrap());
    let p99 = Duration::from_micros(r["write"]["p99_us"].as_u64().unwrap());
    let timeouts = r["timeouts"].as_u64().unwrap();
    println!(
        "hung agent: stopped {:?} from {:?} into the run; run {:.1} s; max stall {} ms; \
         write p99 {} ms; agent timeouts {timeouts}; retries {}; blocks {}; verified {}",
        STOP,
        stopped.duration_since(t0),
        total.as_secs_f64(),
        max_stall.as_millis(),
        p99.as_millis(),
        r["retries"],
        r["blocks"],
        r["verified_blocks"],
    );
    assert_eq!(r["blocks"], 640, "every block written");
    assert_eq!(r["verified_blocks"], 640, "every block read back intact");
    // The other vdevs go on: no gap longer than the deadline plus slack
    // (process scheduling on a shared machine, the retry's back-off).
    assert!(
        max_stall < TIMEOUT + Duration::from_secs(3),
        "writes stalled {max_stall:?} with a {TIMEOUT:?} deadline"
    );
}

/// A read-back is not a hang: `write --verify` on an idle pool of slow
/// (simulated, 16 MiB/s) devices keeps reads queued at each device for
/// many report intervals while no write arrives, and no vdev may be
/// marked stalled for it (no `vdev_stalled` event reaches the metrics
/// service, no warning in the allocator's log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_back_marks_no_vdev_stalled() {
    use pb::metrics_client::MetricsClient;
    let dir = tempfile::tempdir().unwrap();
    let met = integration_tests::metrics_service(dir.path());
    let mut pool = FilePool::start(
        dir.path(),
        &args![
            "--report-interval",
            "100ms",
            "--metrics",
            met.url("grpc"),
            "--snapshot-interval",
            "200ms"
        ],
    );
    for (i, name) in ["sim0", "sim1"].iter().enumerate() {
        pool.add_sim_agent(
            name,
            0x51_0000 + i as u64,
            &args!["--capacity", "256MiB", "--bandwidth", "16MiB/s"],
        );
    }
    wait_allocatable(pool.url.clone(), 2).await;
    let url = pool.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        integration_tests::ctl(&args![
            "write",
            "--allocator",
            url,
            "--total",
            "32MiB",
            "--block-size",
            "1MiB",
            "--concurrency",
            "16",
            "--verify",
            "--no-manifest",
            "--json",
            "--no-progress"
        ])
    })
    .await
    .unwrap();
    let text = integration_tests::ok_stdout(&out, "write --verify");
    let r: serde_json::Value = serde_json::from_str(&text).expect("json report");
    assert_eq!(r["verified_blocks"], 32, "{text}");
    // The read-back took many report intervals, or this proves nothing.
    let verify_secs = r["verify_secs"].as_f64().unwrap();
    assert!(verify_secs > 0.5, "verify took only {verify_secs} s");
    let ended = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // Every report of the read-back has been judged and its events sent:
    // wait for snapshots well past its end.
    let mut m = MetricsClient::new(integration_tests::lazy_channel(&met.url("grpc")));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = m
            .summary(pb::SummaryRequest {
                pool: "aliquot".into(),
            })
            .await
            .map(|r| r.into_inner());
        if let Ok(s) = &s
            && s.pools.first().is_some_and(|p| p.last_ms > ended + 1000)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no snapshot after the write: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let h = m
        .history(pb::HistoryRequest {
            pool: "aliquot".into(),
            max_points: 10,
            ..Default::default()
        })
        .await
        .expect("history")
        .into_inner();
    let stalled: Vec<&pb::PoolEvent> = h
        .events
        .iter()
        .filter(|e| e.kind == "vdev_stalled")
        .collect();
    assert!(
        stalled.is_empty(),
        "a read-back marked vdevs stalled: {stalled:?}"
    );
    let log = std::fs::read_to_string(&pool.alloc.log).unwrap();
    assert!(
        !log.contains("stalled:"),
        "allocator log:\n{}",
        pool.alloc.log_tail()
    );
    drop(pool);
    drop(met);
}
