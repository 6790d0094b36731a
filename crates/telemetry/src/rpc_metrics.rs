//! gRPC server metrics for every service: request counts by method and
//! status code and latency histograms ([`RpcMetrics`], fed by one tower
//! layer, [`RpcMetricsLayer`]), and a small HTTP listener serving them as a
//! Prometheus/OpenMetrics `/metrics` ([`serve`]). The metrics service adds
//! them to its pool gauges; the allocator and the agents serve their own.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::codegen::http;

/// Content type of OpenMetrics text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the Prometheus text format 0.0.4 (what promtool, older
/// scrapers and `curl` get).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scrape's `Accept` header prefers OpenMetrics to the 0.0.4
/// text format (Prometheus sends `application/openmetrics-text;...,
/// text/plain;version=0.0.4;q=0.5,...`): by the highest q of each; no
/// header, `*/*`, or a tie that does not name OpenMetrics first gets text.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let Some(accept) = accept else { return false };
    let (mut om, mut text) = (0.0f32, 0.0f32);
    // Media ranges as `mime` parses them; one it cannot parse is skipped.
    for range in accept
        .split(',')
        .filter_map(|r| r.trim().parse::<mime::Mime>().ok())
    {
        let q = range
            .get_param("q")
            .and_then(|q| q.as_str().parse::<f32>().ok())
            .unwrap_or(1.0);
        match range.essence_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" => text = text.max(q),
            _ => {}
        }
    }
    om > 0.0 && om >= text
}

/// prometheus-client's OpenMetrics text as the 0.0.4 text format: a
/// counter's HELP and TYPE name its `_total` sample (OpenMetrics names the
/// family without it, which promtool rejects), `_created` samples, UNIT
/// lines, exemplars and `# EOF` go, `unknown` is `untyped`, and HELP keeps
/// only the escapes 0.0.4 has (`\\` and `\n`).
pub fn to_text_004(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut counters: HashSet<&str> = HashSet::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, kind)) = rest.split_once(' ')
            && kind == "counter"
        {
            counters.insert(name);
        }
    }
    let total = |name: &str| {
        if counters.contains(name) && !name.ends_with("_total") {
            format!("{name}_total")
        } else {
            name.to_string()
        }
    };
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!(
                "# HELP {} {}\n",
                total(name),
                help.replace("\\\"", "\"")
            ));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind {
                "counter" | "gauge" | "histogram" | "summary" => kind,
                _ => "untyped",
            };
            out.push_str(&format!("# TYPE {} {kind}\n", total(name)));
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if line[..name_end].ends_with("_created") {
            continue;
        }
        // An exemplar follows " # " after the value.
        let sample = line.split(" # ").next().unwrap_or(line);
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// The scrape body and content type for this `Accept` header, from the
/// OpenMetrics text `om`.
pub fn negotiate(accept: Option<&str>, om: String) -> (&'static str, String) {
    if wants_openmetrics(accept) {
        (CONTENT_TYPE, om)
    } else {
        (TEXT_CONTENT_TYPE, to_text_004(&om))
    }
}

type Labels = Vec<(String, String)>;
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Most distinct method labels kept; further unknown paths count as "other"
/// (a peer choosing paths must not grow this without bound).
const MAX_METHODS: usize = 64;

/// gRPC server counts and latencies by method and status code.
pub struct RpcMetrics {
    requests: Family<Labels, Counter>,
    latency: Family<Labels, Histogram>,
    /// Per message of a streaming call (AllocateStream: per allocation,
    /// commit, abort), which the per-call figures above count once.
    stream_messages: Family<Labels, Counter>,
    stream_latency: Family<Labels, Histogram>,
    /// The allocator's per-vdev space counters (see [`RpcMetrics::vdev_space`]).
    vdev_space: VdevSpace,
    /// The allocator's txg persists (see [`RpcMetrics::txg_persist`]).
    txg_persist: TxgPersist,
    methods: Mutex<HashSet<String>>,
}

/// Whether the store refuses a txg now (gauge 0/1), and how many persist
/// attempts it refused since the allocator started. Only the allocator
/// fills them; they are served once it has said anything.
#[derive(Default)]
struct TxgPersist {
    used: std::sync::atomic::AtomicBool,
    failing: Gauge,
    failures: Counter,
}

/// Per-vdev counters of space given out and given back, as node_exporter's
/// `zfs_*` counters are (so `rate()` works): bytes and extents committed
/// (each copy of a block is an extent) and freed. Only the allocator fills
/// them; an endpoint that never does exports none.
#[derive(Default)]
struct VdevSpace {
    used: std::sync::atomic::AtomicBool,
    alloc_bytes: Family<Labels, Counter>,
    allocs: Family<Labels, Counter>,
    free_bytes: Family<Labels, Counter>,
    frees: Family<Labels, Counter>,
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~105 s, x4 per bucket.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-4, 4.0, 11,
    ))
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            stream_messages: Family::default(),
            stream_latency: Family::new_with_constructor(latency_histogram),
            vdev_space: VdevSpace::default(),
            txg_persist: TxgPersist::default(),
            methods: Mutex::new(HashSet::new()),
        }
    }
}

impl RpcMetrics {
    /// Add these metrics to `reg` (to serve beside others).
    pub fn register(&self, reg: &mut Registry) {
        reg.register(
            "aliquot_grpc_server_requests",
            "gRPC calls served, by method and status code",
            self.requests.clone(),
        );
        reg.register(
            "aliquot_grpc_server_duration_seconds",
            "Time from request headers to response headers, by method",
            self.latency.clone(),
        );
        reg.register(
            "aliquot_grpc_server_stream_messages",
            "Messages answered on streaming calls, by method, operation (allocate, commit, abort, \
             renew) and status code",
            self.stream_messages.clone(),
        );
        reg.register(
            "aliquot_grpc_server_stream_message_duration_seconds",
            "Time from a stream message's arrival to its answer, by method and operation \
             (throttle waits included)",
            self.stream_latency.clone(),
        );
        let t = &self.txg_persist;
        if t.used.load(std::sync::atomic::Ordering::Relaxed) {
            reg.register(
                "aliquot_txg_persist_failing",
                "1 while the store refuses a txg (nothing waiting on it or a later txg is \
                 answered until it persists), else 0",
                t.failing.clone(),
            );
            reg.register(
                "aliquot_txg_persist_failures",
                "Txg persist attempts the store refused since the allocator started",
                t.failures.clone(),
            );
        }
        let v = &self.vdev_space;
        if v.used.load(std::sync::atomic::Ordering::Relaxed) {
            reg.register(
                "aliquot_vdev_alloc_bytes",
                "Bytes of extents committed on the vdev since the allocator started",
                v.alloc_bytes.clone(),
            );
            reg.register(
                "aliquot_vdev_allocs",
                "Extents committed on the vdev (one per copy of a block) since the allocator \
                 started",
                v.allocs.clone(),
            );
            reg.register(
                "aliquot_vdev_free_bytes",
                "Bytes of extents freed on the vdev (Free, and a move's source) since the \
                 allocator started",
                v.free_bytes.clone(),
            );
            reg.register(
                "aliquot_vdev_frees",
                "Extents freed on the vdev since the allocator started",
                v.frees.clone(),
            );
        }
    }

    /// A txg persist ended: `ok`, or refused by the store (counted). The
    /// gauge says whether the last attempt failed.
    pub fn txg_persist(&self, ok: bool) {
        let t = &self.txg_persist;
        t.used.store(true, std::sync::atomic::Ordering::Relaxed);
        t.failing.set(i64::from(!ok));
        if !ok {
            t.failures.inc();
        }
    }

    /// Serve the txg persist metrics from now on (0 until a failure).
    pub fn txg_persist_known(&self) {
        self.txg_persist
            .used
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Extents of `bytes` in all committed (`freed` false) or freed on vdev
    /// `vdev` (named `name`), `count` of them.
    pub fn vdev_space(&self, vdev: u32, name: &str, bytes: u64, count: u64, freed: bool) {
        let v = &self.vdev_space;
        v.used.store(true, std::sync::atomic::Ordering::Relaxed);
        let id = vdev.to_string();
        let labels = l(&[("vdev", &id), ("name", name)]);
        let (b, n) = if freed {
            (&v.free_bytes, &v.frees)
        } else {
            (&v.alloc_bytes, &v.allocs)
        };
        b.get_or_create(&labels).inc_by(bytes);
        n.get_or_create(&labels).inc_by(count);
    }

    /// One message of streaming call `method` (a gRPC path) answered:
    /// operation `op` (a fixed name), gRPC status code number `code`.
    pub fn observe_stream(&self, method: &str, op: &'static str, code: i32, took: Duration) {
        let method = self.method_label(method);
        self.stream_messages
            .get_or_create(&l(&[
                ("method", &method),
                ("op", op),
                ("code", code_name(&code.to_string())),
            ]))
            .inc();
        self.stream_latency
            .get_or_create(&l(&[("method", &method), ("op", op)]))
            .observe(took.as_secs_f64());
    }

    fn method_label(&self, path: &str) -> String {
        let known = path.len() <= 128
            && path.starts_with('/')
            && path[1..].split('/').count() == 2
            && path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._".contains(&b));
        if !known {
            return "other".into();
        }
        let mut m = self.methods.lock().unwrap_or_else(|e| e.into_inner());
        if m.contains(path) || m.len() < MAX_METHODS {
            m.insert(path.to_owned());
            path.to_owned()
        } else {
            "other".into()
        }
    }

    fn observe(&self, path: &str, code: &str, took: Duration) {
        let method = self.method_label(path);
        self.requests
            .get_or_create(&l(&[("method", &method), ("code", code)]))
            .inc();
        self.latency
            .get_or_create(&l(&[("method", &method)]))
            .observe(took.as_secs_f64());
    }
}

/// gRPC status code names, by number.
fn code_name(v: &str) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    v.parse::<usize>()
        .ok()
        .and_then(|i| NAMES.get(i).copied())
        .unwrap_or("UNKNOWN")
}

/// A tower layer for a tonic server that feeds [`RpcMetrics`].
///
/// The code is read from the response headers: tonic sends a handler's error
/// as a trailers-only response, so it is there; a response without it is
/// counted OK. (A streaming call that fails mid-stream carries its status in
/// trailers and counts as OK; its latency is to the response headers.)
#[derive(Clone)]
pub struct RpcMetricsLayer(pub Arc<RpcMetrics>);

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcMetricsService {
            inner,
            m: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcMetricsService<S> {
    inner: S,
    m: Arc<RpcMetrics>,
}

impl<S, B, RB> tower::Service<http::Request<B>> for RpcMetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_owned();
        let m = self.m.clone();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            let code = match &r {
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .map_or("OK", code_name),
                Err(_) => "TRANSPORT_ERROR",
            };
            m.observe(&path, code, start.elapsed());
            r
        })
    }
}

impl RpcMetrics {
    /// These metrics alone, as OpenMetrics text.
    pub fn render(&self) -> String {
        let mut reg = Registry::default();
        self.register(&mut reg);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &reg);
        out
    }
}

/// Serve `GET /metrics` (the service's RPC metrics) on `addr` until the
/// process ends; returns the bound address (port 0 picks one).
/// `guard` wraps the bound listener (the services pass their connection
/// caps: `aliquot_auth::listen`).
pub async fn serve<L>(
    addr: SocketAddr,
    rpc: Arc<RpcMetrics>,
    guard: impl FnOnce(tokio::net::TcpListener) -> L,
) -> std::io::Result<SocketAddr>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let listener = guard(listener);
    let app = axum::Router::new().route(
        "/metrics",
        get(move |headers: http::HeaderMap| {
            let rpc = rpc.clone();
            async move {
                let accept = headers
                    .get(http::header::ACCEPT)
                    .and_then(|v| v.to_str().ok());
                let (ct, body) = negotiate(accept, rpc.render());
                ([(http::header::CONTENT_TYPE, ct)], body)
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the /metrics listener stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_bounded() {
        let m = RpcMetrics::default();
        assert_eq!(m.method_label("/a.B/C"), "/a.B/C");
        assert_eq!(m.method_label("/evil path\n"), "other");
        for i in 0..200 {
            m.method_label(&format!("/x.Y/M{i}"));
        }
        assert_eq!(m.methods.lock().unwrap().len(), MAX_METHODS);
        assert_eq!(m.method_label("/x.Y/M199"), "other");
    }

    #[test]
    fn renders_counts_and_codes() {
        let m = RpcMetrics::default();
        m.observe(
            "/aliquot.v1.Allocator/Allocate",
            "OK",
            Duration::from_millis(2),
        );
        m.observe(
            "/aliquot.v1.Allocator/Allocate",
            code_name("14"),
            Duration::from_millis(2),
        );
        let t = m.render();
        assert!(t.contains("aliquot_grpc_server_requests_total{method=\"/aliquot.v1.Allocator/Allocate\",code=\"UNAVAILABLE\"} 1"), "{t}");
        assert!(t.ends_with("# EOF\n"), "{t}");
        let p = to_text_004(&t);
        assert!(
            p.contains("# HELP aliquot_grpc_server_requests_total gRPC calls")
                && p.contains("# TYPE aliquot_grpc_server_requests_total counter")
                && p.contains("# TYPE aliquot_grpc_server_duration_seconds histogram")
                && !p.contains("# EOF"),
            "{p}"
        );
    }

    #[test]
    fn accept_negotiation() {
        // What Prometheus 2.x sends.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prom)));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.2,text/plain;q=0.9"
        )));
        // Case and spaces as RFC 9110 allows them; a range that does not
        // parse is skipped, not fatal.
        assert!(wants_openmetrics(Some(
            "Application/OpenMetrics-Text; version=1.0.0; q=0.9, text/plain; q=0.5"
        )));
        assert!(wants_openmetrics(Some(
            "garbage;;;=, application/openmetrics-text"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }
}
