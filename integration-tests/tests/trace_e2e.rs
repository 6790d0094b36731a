//! Traces across real processes: the metrics service, the allocator, two
//! file agents and one `aliquotctl write` all export to an in-process OTLP
//! receiver (`telemetry::sink`). One write must come out as ONE trace whose
//! spans link ctl → allocator and ctl → agent through the W3C traceparent
//! each gRPC hop carries; txg sync and metrics ingest spans arrive too; and a
//! service flushes its spans when it is stopped with SIGTERM.

// `args![..]` builds a Vec of Strings; `Proc::start` borrows it as a slice.
#![allow(clippy::useless_vec)]

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use aliquot_proto::v1::allocator_client::AllocatorClient;
use aliquot_proto::v1::metrics_client::MetricsClient;
use aliquot_proto::v1::vdev_agent_client::VdevAgentClient;
use aliquot_proto::v1::{GetPoolRequest, GetStatsRequest, SummaryRequest};
use integration_tests::{Proc, args, bin};
use telemetry::sink::{SpanRecord, TraceSink};

const CTL: &str = "aliquotctl";
const ALLOCATOR: &str = "aliquot-allocator";
const AGENT: &str = "aliquot-agent";
const METRICS: &str = "aliquot-metrics";

fn otel_env(endpoint: &str, delay_ms: u64) -> Vec<(String, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint.into()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), delay_ms.to_string()),
        ("RUST_LOG".into(), "info".into()),
    ]
}

/// Metrics, allocator and `n` file agents, all exporting spans to `endpoint`.
struct Pool {
    metrics: Proc,
    allocator: Proc,
    agents: Vec<Proc>,
}

async fn start_pool(dir: &Path, endpoint: &str, n: usize) -> Pool {
    let env = otel_env(endpoint, 200);
    let metrics = Proc::start(
        "metrics",
        &bin(METRICS),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--db",
            dir.join("metrics.db").display()
        ],
        &env,
        &["grpc", "http"],
        dir,
    )
    .expect("start metrics");
    let allocator = Proc::start(
        "allocator",
        &bin(ALLOCATOR),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.join("allocator").display(),
            "--metrics",
            metrics.url("grpc"),
            "--zfs-txg-timeout",
            "200ms",
            "--snapshot-interval",
            "200ms"
        ],
        &env,
        &["grpc"],
        dir,
    )
    .expect("start allocator");
    let mut agents = Vec::new();
    for i in 0..n {
        let name = format!("agent{i}");
        agents.push(
            Proc::start(
                &name,
                &bin(AGENT),
                &args![
                    "--listen",
                    "127.0.0.1:0",
                    "--allocator",
                    allocator.url("grpc"),
                    "--name",
                    name,
                    "--backend",
                    "file",
                    "--path",
                    dir.join(format!("{name}.img")).display(),
                    "--capacity",
                    "256MiB"
                ],
                &env,
                &["grpc"],
                dir,
            )
            .expect("start agent"),
        );
    }
    // Every agent registered and reporting before the client writes.
    let url = allocator.url("grpc");
    let mut client = AllocatorClient::connect(url).await.expect("allocator");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pool = client
            .get_pool(GetPoolRequest {})
            .await
            .expect("GetPool")
            .into_inner();
        if pool.vdevs.len() >= n {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {n} agents registered; allocator log:\n{}",
            pool.vdevs.len(),
            allocator.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Pool {
        metrics,
        allocator,
        agents,
    }
}

fn by_id(spans: &[SpanRecord]) -> HashMap<&str, &SpanRecord> {
    spans.iter().map(|s| (s.span_id.as_str(), s)).collect()
}

/// `s`, its parent, its parent's parent, … as far as the spans reach.
fn ancestors<'a>(s: &'a SpanRecord, ids: &HashMap<&str, &'a SpanRecord>) -> Vec<&'a SpanRecord> {
    let mut out = vec![s];
    let mut cur = s;
    while let Some(p) = ids.get(cur.parent_span_id.as_str()) {
        if out.len() > 64 {
            break;
        }
        out.push(p);
        cur = p;
    }
    out
}

fn describe(spans: &[SpanRecord]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{} {} {} [{}] trace={} id={} parent={}",
                s.service,
                s.kind,
                s.name,
                s.attributes
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                &s.trace_id[..8],
                s.span_id,
                s.parent_span_id
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn has_attr(s: &SpanRecord, key: &str) -> bool {
    s.attr(key).is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_block_is_one_trace_across_ctl_allocator_and_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = TraceSink::new();
    let endpoint = sink.spawn_local().await.expect("receiver");
    let mut pool = start_pool(dir.path(), &endpoint, 2).await;

    // One client operation: 4 blocks of 64 KiB.
    let out = Command::new(bin(CTL))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "write",
            "--allocator",
            pool.allocator.url("grpc"),
            "--total",
            "256KiB",
            "--block-size",
            "64KiB",
            "--concurrency",
            "1",
            "--api",
            "unary"
        ])
        .envs(otel_env(&endpoint, 200))
        .output()
        .expect("run aliquotctl write");
    assert!(
        out.status.success(),
        "aliquotctl write failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // ctl exited, so its spans were flushed at exit; the services export
    // every 200 ms. Wait for the pieces the assertions need.
    let arrived = sink
        .wait_until(Duration::from_secs(20), |spans| {
            // ctl's root and its 4 blocks, and in the blocks' traces their
            // Allocate, Commit and Write server spans.
            if !spans
                .iter()
                .any(|s| s.service == CTL && s.name == "aliquotctl.write")
            {
                return false;
            }
            let blocks: std::collections::BTreeSet<&str> = spans
                .iter()
                .filter(|s| s.service == CTL && s.name == "aliquotctl.block")
                .map(|s| s.trace_id.as_str())
                .collect();
            let in_trace = |svc: &str, name: &str| {
                spans
                    .iter()
                    .filter(|s| {
                        blocks.contains(s.trace_id.as_str()) && s.service == svc && s.name == name
                    })
                    .count()
            };
            let alloc = in_trace(ALLOCATOR, "/aliquot.v1.Allocator/Allocate") >= 4
                && in_trace(ALLOCATOR, "/aliquot.v1.Allocator/Commit") >= 4;
            let agent = in_trace(AGENT, "/aliquot.v1.VdevAgent/Write") >= 4;
            let txg = spans.iter().any(|s| {
                s.service == ALLOCATOR && s.name.contains("txg") && s.name.contains("sync")
            });
            let ingest = spans
                .iter()
                .any(|s| s.service == METRICS && s.kind == "server" && s.name.contains("Record"));
            alloc && agent && txg && ingest
        })
        .await;
    let spans = sink.spans();
    assert!(
        arrived,
        "not every expected span arrived within 20 s; got:\n{}",
        describe(&spans)
    );

    // One root for the command, and one trace per block, linked to it by
    // the block span's write_trace attribute.
    let roots: Vec<&SpanRecord> = spans
        .iter()
        .filter(|s| s.service == CTL && s.name == "aliquotctl.write")
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "one aliquotctl.write root per write command:\n{}",
        describe(&spans)
    );
    let root = roots[0];
    assert!(
        root.parent_span_id.is_empty(),
        "aliquotctl.write is a root span"
    );
    let blocks: Vec<&SpanRecord> = spans
        .iter()
        .filter(|s| s.service == CTL && s.name == "aliquotctl.block")
        .collect();
    assert_eq!(blocks.len(), 4, "a span per block:\n{}", describe(&spans));
    let block_traces: std::collections::BTreeSet<&str> =
        blocks.iter().map(|b| b.trace_id.as_str()).collect();
    assert_eq!(block_traces.len(), 4, "each block is its own trace");
    assert!(!block_traces.contains(root.trace_id.as_str()));
    for b in &blocks {
        assert!(
            b.parent_span_id.is_empty(),
            "a block span is a trace's root"
        );
        assert_eq!(
            b.attr("write_trace"),
            Some(root.trace_id.as_str()),
            "block {:?} leads back to its command",
            b.attributes
        );
    }

    let mut trace = Vec::new();
    for b in &blocks {
        let t = sink.trace(&b.trace_id);
        let ids = by_id(&t);
        // Each block's trace: its allocator and agent server spans, parented
        // (through ctl's client spans) on the block span.
        for svc_name in [
            (ALLOCATOR, "/aliquot.v1.Allocator/Allocate"),
            (ALLOCATOR, "/aliquot.v1.Allocator/Commit"),
            (AGENT, "/aliquot.v1.VdevAgent/Write"),
        ] {
            let s = t
                .iter()
                .find(|s| (s.service.as_str(), s.name.as_str()) == svc_name)
                .unwrap_or_else(|| panic!("no {svc_name:?} in a block's trace:\n{}", describe(&t)));
            let parent = ids
                .get(s.parent_span_id.as_str())
                .unwrap_or_else(|| panic!("{} has no parent in the trace", s.name));
            assert_eq!(parent.service, CTL, "{}'s parent is ctl's", s.name);
            assert!(
                ancestors(parent, &ids)
                    .iter()
                    .any(|a| a.span_id == b.span_id),
                "{} does not descend from its aliquotctl.block",
                s.name
            );
        }
        trace.extend(t);
    }
    let mut census: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for s in &trace {
        *census
            .entry((s.service.clone(), s.name.clone()))
            .or_default() += 1;
    }
    eprintln!("the 4 blocks' traces, {} spans: {census:?}", trace.len());

    // The spans worth looking at carry their facts.
    let allocate = trace
        .iter()
        .find(|s| s.service == ALLOCATOR && (s.name == "allocate" || s.name == "stream.allocate"))
        .unwrap_or_else(|| panic!("no allocate handler span:\n{}", describe(&trace)));
    for key in ["class", "size", "copies", "vdevs"] {
        assert!(
            has_attr(allocate, key),
            "allocate span lacks {key}: {:?}",
            allocate.attributes
        );
    }
    let agent_write = trace
        .iter()
        .find(|s| s.service == AGENT && s.kind == "internal" && s.name == "write")
        .unwrap_or_else(|| panic!("no agent write handler span:\n{}", describe(&trace)));
    assert!(
        has_attr(agent_write, "bytes") || has_attr(agent_write, "len"),
        "agent write span lacks its byte count: {:?}",
        agent_write.attributes
    );
    assert!(
        has_attr(agent_write, "aggregated_ios"),
        "agent write span lacks aggregated_ios: {:?}",
        agent_write.attributes
    );
    assert!(
        trace
            .iter()
            .any(|s| s.service == ALLOCATOR && s.name.to_lowercase().contains("commit")),
        "no Commit span in the write's trace:\n{}",
        describe(&trace)
    );

    // Background work has its own traces: txg sync and metrics ingest.
    let txg = spans
        .iter()
        .find(|s| s.service == ALLOCATOR && s.name.contains("txg") && s.name.contains("sync"))
        .expect("txg sync span");
    assert!(
        has_attr(txg, "txg"),
        "txg sync span lacks txg: {:?}",
        txg.attributes
    );
    let ingest = spans
        .iter()
        .find(|s| s.service == METRICS && s.kind == "server" && s.name.contains("Record"))
        .expect("metrics ingest span");
    // The ingest RPC was made by the allocator's snapshot push: linked across.
    let push_ids = by_id(&spans);
    let pusher = push_ids
        .get(ingest.parent_span_id.as_str())
        .unwrap_or_else(|| panic!("ingest span has no parent among:\n{}", describe(&spans)));
    assert_eq!(
        pusher.service, ALLOCATOR,
        "the snapshot push is the allocator's"
    );

    for a in &mut pool.agents {
        a.kill();
    }
    pool.allocator.kill();
    pool.metrics.kill();
}

/// A service stopped with SIGTERM exports what it has not sent yet: with a
/// 10-minute batch delay, the only way a span can arrive is the flush at
/// shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_flushes_pending_spans() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = TraceSink::new();
    let endpoint = sink.spawn_local().await.expect("receiver");
    let env = otel_env(&endpoint, 600_000);
    let mut metrics = Proc::start(
        "metrics",
        &bin(METRICS),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--db",
            dir.path().join("metrics.db").display()
        ],
        &env,
        &["grpc", "http"],
        dir.path(),
    )
    .expect("start metrics");
    let mut allocator = Proc::start(
        "allocator",
        &bin(ALLOCATOR),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().join("allocator").display()
        ],
        &env,
        &["grpc"],
        dir.path(),
    )
    .expect("start allocator");

    let mut agent = Proc::start(
        "agent",
        &bin(AGENT),
        &args![
            "--listen",
            "127.0.0.1:0",
            "--allocator",
            allocator.url("grpc"),
            "--name",
            "agent0",
            "--backend",
            "sim",
            "--capacity",
            "256MiB"
        ],
        &env,
        &["grpc"],
        dir.path(),
    )
    .expect("start agent");

    let mut client = AllocatorClient::connect(allocator.url("grpc"))
        .await
        .expect("allocator");
    client.get_pool(GetPoolRequest {}).await.expect("GetPool");
    let mut ac = VdevAgentClient::connect(agent.url("grpc"))
        .await
        .expect("agent");
    ac.get_stats(GetStatsRequest {}).await.expect("GetStats");
    let mut mc = MetricsClient::connect(metrics.url("grpc"))
        .await
        .expect("metrics");
    // Any answer will do (an empty database may say NotFound): the RPC is
    // what makes the span.
    let _ = mc
        .summary(SummaryRequest {
            pool: String::new(),
        })
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !sink.spans().iter().any(|s| s.name.ends_with("/GetPool")),
        "spans arrived before shutdown: the batch delay was not honoured"
    );

    agent.kill();
    allocator.kill();
    metrics.kill();
    let arrived = sink
        .wait_until(Duration::from_secs(10), |spans| {
            spans
                .iter()
                .any(|s| s.service == ALLOCATOR && s.name == "/aliquot.v1.Allocator/GetPool")
                && spans
                    .iter()
                    .any(|s| s.service == METRICS && s.name == "/aliquot.v1.Metrics/Summary")
                && spans
                    .iter()
                    .any(|s| s.service == AGENT && s.name == "/aliquot.v1.VdevAgent/GetStats")
        })
        .await;
    assert!(
        arrived,
        "spans not flushed at SIGTERM; got:\n{}\nagent log:\n{}\nallocator log:\n{}\nmetrics log:\n{}",
        describe(&sink.spans()),
        agent.log_tail(),
        allocator.log_tail(),
        metrics.log_tail()
    );
}

/// The pipelined API: the AllocateStream RPC is opened inside the command's
/// root span, so the allocator's stream span (and what it does for each
/// request) lands in the same trace as the agents' writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_stream_carries_the_trace_context() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = TraceSink::new();
    let endpoint = sink.spawn_local().await.expect("receiver");
    let mut pool = start_pool(dir.path(), &endpoint, 1).await;
    let out = Command::new(bin(CTL))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "write",
            "--allocator",
            pool.allocator.url("grpc"),
            "--total",
            "192KiB",
            "--block-size",
            "64KiB",
            "--concurrency",
            "2",
            "--api",
            "stream"
        ])
        .envs(otel_env(&endpoint, 200))
        .output()
        .expect("run aliquotctl write");
    assert!(
        out.status.success(),
        "aliquotctl write --api stream failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The stream's server span ends when the stream does, before ctl exits;
    // the allocator exports it within 200 ms.
    let arrived = sink
        .wait_until(Duration::from_secs(20), |spans| {
            spans
                .iter()
                .any(|s| s.service == ALLOCATOR && s.name == "/aliquot.v1.Allocator/AllocateStream")
                && spans
                    .iter()
                    .filter(|s| s.service == AGENT && s.name == "/aliquot.v1.VdevAgent/Write")
                    .count()
                    >= 3
        })
        .await;
    let spans = sink.spans();
    assert!(arrived, "spans missing:\n{}", describe(&spans));
    let root = spans
        .iter()
        .find(|s| s.service == CTL && s.name == "aliquotctl.write")
        .expect("root span");
    let trace = sink.trace(&root.trace_id);
    let ids = by_id(&trace);
    let stream = trace
        .iter()
        .find(|s| s.service == ALLOCATOR && s.name == "/aliquot.v1.Allocator/AllocateStream")
        .unwrap_or_else(|| {
            panic!(
                "AllocateStream is not in the write's trace:\n{}",
                describe(&spans)
            )
        });
    let parent = ids
        .get(stream.parent_span_id.as_str())
        .expect("stream span's parent in the trace");
    assert_eq!(parent.service, CTL);
    assert!(
        ancestors(parent, &ids)
            .iter()
            .any(|a| a.span_id == root.span_id)
    );
    // The stream is the command's; each block's Write is in that block's
    // own trace, whose root leads back to the command.
    let block_traces: std::collections::BTreeSet<&str> = spans
        .iter()
        .filter(|s| {
            s.service == CTL
                && s.name == "aliquotctl.block"
                && s.attr("write_trace") == Some(root.trace_id.as_str())
        })
        .map(|s| s.trace_id.as_str())
        .collect();
    assert_eq!(block_traces.len(), 3, "a trace per block");
    // Each block's trace holds its own Allocate and Commit stream messages,
    // under its aliquotctl.block root.
    for t in &block_traces {
        for op in ["aliquot.stream.allocate", "aliquot.stream.commit"] {
            assert!(
                spans
                    .iter()
                    .any(|s| s.service == CTL && s.name == op && s.trace_id == *t),
                "block trace {t} has no {op}:\n{}",
                describe(&spans)
            );
        }
    }
    let writes = spans
        .iter()
        .filter(|s| {
            s.service == AGENT
                && s.name == "/aliquot.v1.VdevAgent/Write"
                && block_traces.contains(s.trace_id.as_str())
        })
        .count();
    assert_eq!(writes, 3, "every block's Write in its block's trace");
    // The allocator's span for each message joins the block's trace too
    // (the message carries its block's trace context), under the ctl's
    // span for that message; the command's trace keeps only the stream.
    let ids_all = by_id(&spans);
    for op in ["stream.allocate", "stream.commit"] {
        let server: Vec<&SpanRecord> = spans
            .iter()
            .filter(|s| s.service == ALLOCATOR && s.name == op)
            .collect();
        assert_eq!(server.len(), 3, "one {op} per block:\n{}", describe(&spans));
        for s in &server {
            assert!(
                block_traces.contains(s.trace_id.as_str()),
                "the allocator's {op} is not in a block's trace:\n{}",
                describe(&spans)
            );
            let parent = ids_all
                .get(s.parent_span_id.as_str())
                .expect("its parent was exported");
            assert_eq!(parent.service, CTL);
            assert_eq!(parent.name, format!("aliquot.{op}"));
        }
    }
    assert!(
        !trace
            .iter()
            .any(|s| s.service == ALLOCATOR && s.name.starts_with("stream.")),
        "per-message spans left in the command's trace:\n{}",
        describe(&trace)
    );

    for a in &mut pool.agents {
        a.kill();
    }
    pool.allocator.kill();
    pool.metrics.kill();
}

/// `write --verify`: the read-back is part of the command, so every agent
/// Read it makes is in the command's trace, under its `aliquotctl.verify`
/// span, not a root trace of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_are_in_the_commands_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = TraceSink::new();
    let endpoint = sink.spawn_local().await.expect("receiver");
    let mut pool = start_pool(dir.path(), &endpoint, 2).await;
    let out = Command::new(bin(CTL))
        .env(integration_tests::INSECURE_ENV, "1")
        .args(args![
            "write",
            "--allocator",
            pool.allocator.url("grpc"),
            "--total",
            "512KiB",
            "--block-size",
            "64KiB",
            "--concurrency",
            "4",
            "--verify",
            "--no-manifest",
            "--no-progress"
        ])
        .envs(otel_env(&endpoint, 200))
        .output()
        .expect("run aliquotctl write --verify");
    assert!(
        out.status.success(),
        "aliquotctl write --verify failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    const READS: usize = 8;
    let reads = |spans: &[SpanRecord]| {
        spans
            .iter()
            .filter(|s| s.service == AGENT && s.name == "/aliquot.v1.VdevAgent/Read")
            .count()
    };
    let arrived = sink
        .wait_until(Duration::from_secs(30), |spans| {
            reads(spans) >= READS
                && spans
                    .iter()
                    .any(|s| s.service == CTL && s.name == "aliquotctl.write")
        })
        .await;
    let spans = sink.spans();
    assert!(
        arrived,
        "the write's root and {READS} agent Read spans did not arrive within 30 s; got:\n{}",
        describe(&spans)
    );
    let root = spans
        .iter()
        .find(|s| s.service == CTL && s.name == "aliquotctl.write")
        .expect("root");
    let trace = sink.trace(&root.trace_id);
    let ids = by_id(&trace);
    let verify = trace
        .iter()
        .find(|s| s.service == CTL && s.name == "aliquotctl.verify")
        .unwrap_or_else(|| {
            panic!(
                "no aliquotctl.verify in the write's trace:\n{}",
                describe(&trace)
            )
        });
    let in_trace: Vec<&SpanRecord> = trace
        .iter()
        .filter(|s| s.service == AGENT && s.name == "/aliquot.v1.VdevAgent/Read")
        .collect();
    let orphans = spans
        .iter()
        .filter(|s| {
            s.service == AGENT
                && s.name == "/aliquot.v1.VdevAgent/Read"
                && s.trace_id != root.trace_id
        })
        .count();
    assert!(
        orphans == 0 && in_trace.len() >= READS,
        "{orphans} agent Reads outside the write's trace, {} in it:\n{}",
        in_trace.len(),
        describe(&spans)
    );
    for r in in_trace {
        assert!(
            ancestors(r, &ids)
                .iter()
                .any(|a| a.span_id == verify.span_id),
            "a Read does not descend from aliquotctl.verify:\n{}",
            describe(&trace)
        );
    }
    for a in &mut pool.agents {
        a.kill();
    }
    pool.allocator.kill();
    pool.metrics.kill();
}
