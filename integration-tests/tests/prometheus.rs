//! `/metrics` on a real pool: `aliquot-metrics`, an allocator pushing a
//! snapshot every 200 ms, three sim agents and some committed writes. The
//! scrape is fetched and parsed by the Python `prometheus_client` OpenMetrics
//! parser (a real, independent parser: `$ALIQUOT_TEST_PYTHON`, default
//! `python3`, must import it), and its per-vdev figures must match what the
//! allocator's `GetPool` (what `status` prints) reports: the per-group
//! (metaslab-rounded) capacity and allocated of the normal class.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use aliquot_proto::v1 as pb;
use integration_tests::{FilePool, Proc, args, metrics_service};
use pb::allocator_client::AllocatorClient;
use pb::vdev_agent_client::VdevAgentClient;

/// Fetch the URL, check the content type, parse, print one JSON sample a line.
const PARSE: &str = r#"
import json, sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
# Prometheus's own Accept header: OpenMetrics preferred (else 0.0.4 text).
req = urllib.request.Request(sys.argv[1], headers={"Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
with urllib.request.urlopen(req, timeout=10) as r:
    ct = r.headers.get("Content-Type", "")
    assert ct.startswith("application/openmetrics-text"), ct
    text = r.read().decode()
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        print(json.dumps({"family": fam.name, "type": fam.type, "name": s.name,
                          "labels": s.labels, "value": s.value}))
"#;

#[derive(Debug)]
struct Sample {
    family: String,
    kind: String,
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

/// The parser's version, installed into the target dir by the test itself
/// when the interpreter lacks it (so `cargo test --workspace` needs no
/// separate step; `.ci/run` installs it up front all the same).
const PROMETHEUS_CLIENT: &str = "prometheus_client==0.26.0";

fn python_path(py: &str) -> Option<String> {
    let has = |path: Option<&str>| {
        let mut c = Command::new(py);
        c.args(["-c", "import prometheus_client"]);
        if let Some(p) = path {
            c.env("PYTHONPATH", p);
        }
        c.output().is_ok_and(|o| o.status.success())
    };
    if has(None) {
        return None;
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("pylib");
    let dir_s = dir.display().to_string();
    if !has(Some(&dir_s)) {
        let st = Command::new(py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                &dir_s,
                PROMETHEUS_CLIENT,
            ])
            .status()
            .unwrap_or_else(|e| panic!("cannot run {py} -m pip: {e}"));
        assert!(st.success(), "pip install {PROMETHEUS_CLIENT} failed");
    }
    Some(dir_s)
}

fn scrape(url: &str) -> Vec<Sample> {
    let py = integration_tests::python();
    let mut cmd = Command::new(&py);
    if let Some(p) = python_path(&py) {
        cmd.env("PYTHONPATH", p);
    }
    let out = cmd
        .args(["-c", PARSE, url])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    assert!(
        out.status.success(),
        "the prometheus_client parser refused the scrape (is it installed for {py}?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Sample {
                family: v["family"].as_str().unwrap().into(),
                kind: v["type"].as_str().unwrap().into(),
                name: v["name"].as_str().unwrap().into(),
                labels: serde_json::from_value(v["labels"].clone()).unwrap(),
                value: v["value"].as_f64().unwrap(),
            }
        })
        .collect()
}

fn get<'a>(s: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Option<&'a Sample> {
    s.iter().find(|x| {
        x.name == name
            && labels
                .iter()
                .all(|(k, v)| x.labels.get(*k).map(String::as_str) == Some(*v))
    })
}

fn start(dir: &Path) -> (Proc, Proc, Vec<Proc>) {
    let met = metrics_service(dir);
    let mut pool = FilePool::start_with_default_timings(
        dir,
        &args![
            "--metrics",
            met.url("grpc"),
            "--snapshot-interval",
            "200ms",
            "--prometheus-listen",
            "127.0.0.1:0",
        ],
    );
    for i in 0..3u64 {
        pool.add_sim_agent(
            &format!("sim{i}"),
            41 + i,
            &args!["--capacity", "4GiB", "--prometheus-listen", "127.0.0.1:0"],
        );
    }
    let FilePool { alloc, agents, .. } = pool;
    (met, alloc, agents)
}

/// The normal class's groups (one per top-level vdev here).
fn groups(p: &pb::PoolStatus) -> Vec<pb::GroupStatus> {
    p.classes
        .iter()
        .find(|c| c.name == "normal")
        .map(|c| c.groups.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_agree_with_get_pool() {
    let dir = tempfile::tempdir().unwrap();
    let (met, alloc, agents_procs) = start(dir.path());
    let mut c = AllocatorClient::connect(alloc.url("grpc")).await.unwrap();
    let t0 = Instant::now();
    loop {
        let s = c
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        let ready = s
            .classes
            .iter()
            .find(|c| c.name == "normal")
            .map_or(0, |c| c.groups.iter().filter(|g| g.allocatable).count());
        if ready >= 3 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "pool never allocatable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Some committed writes, so allocated is not zero everywhere.
    let mut agents: HashMap<String, VdevAgentClient<tonic::transport::Channel>> = HashMap::new();
    for _ in 0..24 {
        let a = c
            .allocate(pb::AllocateRequest {
                class: pb::AllocationClass::Data as i32,
                size: 1 << 20,
                copies: 1,
                lease_ms: 0,
                max_size: 0,
                affinity_key: None,
            })
            .await
            .unwrap()
            .into_inner();
        for (e, ep) in a.extents.iter().zip(&a.endpoints) {
            if !agents.contains_key(ep) {
                agents.insert(
                    ep.clone(),
                    VdevAgentClient::connect(ep.clone()).await.unwrap(),
                );
            }
            agents[ep]
                .clone()
                .write(pb::WriteRequest {
                    offset: e.offset,
                    data: vec![0xa5u8; e.size as usize].into(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        c.commit(pb::CommitRequest {
            allocation_ids: vec![a.allocation_id],
            wait_synced: true,
            generation: a.generation,
        })
        .await
        .unwrap();
    }

    // Writes are over: within a few snapshot intervals the scrape must show
    // exactly what GetPool shows.
    let url = format!("{}/metrics", met.url("http"));
    let t0 = Instant::now();
    let (pool, samples) = loop {
        let pool = c
            .get_pool(pb::GetPoolRequest {})
            .await
            .unwrap()
            .into_inner();
        let samples = scrape(&url);
        let agree = groups(&pool).iter().all(|v| {
            let id = v.vdev.to_string();
            let l = [("pool", pool.name.as_str()), ("vdev", id.as_str())];
            get(&samples, "aliquot_vdev_allocated_bytes", &l).map(|s| s.value)
                == Some(v.alloc as f64)
                && get(&samples, "aliquot_vdev_capacity_bytes", &l).map(|s| s.value)
                    == Some(v.capacity as f64)
        });
        if agree && !groups(&pool).is_empty() {
            break (pool, samples);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "scrape never agreed with GetPool:\n{pool:#?}\n{samples:#?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let gs = groups(&pool);
    assert_eq!(gs.len(), 3);
    let total_alloc: u64 = gs.iter().map(|v| v.alloc).sum();
    let total_cap: u64 = gs.iter().map(|v| v.capacity).sum();
    assert!(total_alloc >= 24 << 20, "writes not counted: {total_alloc}");
    let p = [("pool", pool.name.as_str())];

    // Derived figures, recomputed here from GetPool.
    let used: Vec<f64> = gs
        .iter()
        .map(|v| v.alloc as f64 / v.capacity as f64)
        .collect();
    let pool_used = total_alloc as f64 / total_cap as f64;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-9);
    let spread = used.iter().copied().fold(f64::MIN, f64::max)
        - used.iter().copied().fold(f64::MAX, f64::min);
    assert!(close(
        get(&samples, "aliquot_pool_used_ratio", &p).unwrap().value,
        pool_used
    ));
    // The balance score: the same function of the same figures.
    let want_score = metaslab::balance_score::score(
        &gs.iter()
            .map(|g| metaslab::balance_score::VdevFill {
                capacity: g.capacity,
                alloc: g.alloc,
            })
            .collect::<Vec<_>>(),
    );
    let got_score = get(&samples, "aliquot_pool_balance_score", &p)
        .unwrap()
        .value;
    assert!(
        (got_score - want_score).abs() < 1e-9,
        "{got_score} vs {want_score}"
    );
    assert!(close(
        get(&samples, "aliquot_pool_spread_ratio", &p)
            .unwrap()
            .value,
        spread
    ));
    for (g, u) in gs.iter().zip(&used) {
        let v = pool.vdevs.iter().find(|v| v.vdev == g.vdev).unwrap();
        let id = v.vdev.to_string();
        let l = [
            ("pool", pool.name.as_str()),
            ("vdev", id.as_str()),
            ("name", v.name.as_str()),
        ];
        let var = get(&samples, "aliquot_vdev_var_ratio", &l).unwrap().value;
        assert!(
            close(var, u / pool_used),
            "VAR of {}: {var} vs {}",
            v.name,
            u / pool_used
        );
        let online = get(
            &samples,
            "aliquot_vdev_health",
            &[l[0], l[1], ("state", "ONLINE")],
        )
        .unwrap();
        assert_eq!(online.value, 1.0, "{} not ONLINE", v.name);
    }
    let health = |st| {
        get(&samples, "aliquot_pool_health", &[p[0], ("state", st)])
            .unwrap()
            .value
    };
    assert_eq!(
        (health("ONLINE"), health("DEGRADED"), health("SUSPENDED")),
        (1.0, 0.0, 0.0)
    );
    let limit = get(
        &samples,
        "aliquot_class_limit_bytes",
        &[p[0], ("class", "normal")],
    )
    .unwrap();
    assert!(limit.value > 0.0, "class limit {limit:?}");
    assert_eq!(limit.kind, "gauge");
    // Txgs and the throttle's queue, as `status` shows them.
    let synced = get(&samples, "aliquot_pool_synced_txg", &p).unwrap().value;
    let open = get(&samples, "aliquot_pool_txg", &p).unwrap().value;
    assert!(
        synced >= 1.0 && synced < open,
        "synced {synced}, open {open}"
    );
    assert!(
        (pool.synced_txg as f64 - synced).abs() <= 5.0,
        "synced txg {synced} vs GetPool {}",
        pool.synced_txg
    );
    let waiting = get(
        &samples,
        "aliquot_class_waiting",
        &[p[0], ("class", "normal")],
    )
    .unwrap();
    assert_eq!(waiting.value, 0.0, "nothing waits once the writes are over");

    // The service's own RPC counters: the allocator has pushed batches.
    let pushes = samples
        .iter()
        .filter(|s| {
            s.family == "aliquot_grpc_server_requests"
                && s.labels
                    .get("method")
                    .is_some_and(|m| m.starts_with("/aliquot.v1.Metrics/"))
                && s.labels.get("code").map(String::as_str) == Some("OK")
        })
        .map(|s| s.value)
        .sum::<f64>();
    assert!(pushes >= 2.0, "RPC counter: {pushes}");
    let hist = samples
        .iter()
        .find(|s| s.name == "aliquot_grpc_server_duration_seconds_count")
        .expect("latency histogram");
    assert!(hist.value >= 1.0);

    // Every series the Grafana dashboard queries is one the scrape has.
    let dash = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/dashboards/aliquot.json"),
    )
    .unwrap();
    let dash: serde_json::Value = serde_json::from_str(&dash).unwrap();
    let mut queried = std::collections::BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            for (i, _) in expr.match_indices("aliquot_") {
                // Only where a name starts (not inside aliquot_vdev_aliquot_bytes).
                if expr[..i]
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    continue;
                }
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                queried.insert(name);
            }
        }
    }
    assert!(queried.len() >= 10, "{queried:?}");
    // Served by the allocator's own /metrics (AllocateStream's once it
    // carries traffic; this test writes unary): tests/promtool.rs checks
    // them after a streamed write and a free.
    let allocator_only = [
        "aliquot_grpc_server_stream_messages_total",
        "aliquot_grpc_server_stream_message_duration_seconds_bucket",
        "aliquot_vdev_alloc_bytes_total",
        "aliquot_vdev_free_bytes_total",
    ];
    for q in queried
        .iter()
        .filter(|q| !allocator_only.contains(&q.as_str()))
    {
        assert!(
            samples.iter().any(|s| &s.name == q || &s.family == q),
            "the dashboard queries {q}, which /metrics does not export"
        );
    }

    // The allocator and each agent serve their own RPC metrics.
    let count = |samples: &[Sample], method: &str| {
        samples
            .iter()
            .filter(|s| {
                s.name == "aliquot_grpc_server_requests_total"
                    && s.labels.get("method").map(String::as_str) == Some(method)
                    && s.labels.get("code").map(String::as_str) == Some("OK")
            })
            .map(|s| s.value)
            .sum::<f64>()
    };
    let a = scrape(&format!("http://{}/metrics", alloc.addr("prometheus")));
    assert_eq!(
        count(&a, "/aliquot.v1.Allocator/Allocate"),
        24.0,
        "allocator's own counts"
    );
    assert_eq!(count(&a, "/aliquot.v1.Allocator/Commit"), 24.0);
    assert!(count(&a, "/aliquot.v1.AgentRegistry/Register") >= 3.0);
    let writes: f64 = agents_procs
        .iter()
        .map(|ag| {
            let s = scrape(&format!("http://{}/metrics", ag.addr("prometheus")));
            assert!(
                s.iter().all(|x| !x
                    .labels
                    .get("method")
                    .is_some_and(|m| m.contains("Allocator"))),
                "an agent counts only its own calls"
            );
            count(&s, "/aliquot.v1.VdevAgent/Write")
        })
        .sum();
    assert_eq!(
        writes, 24.0,
        "every write counted by the agent that served it"
    );
}
