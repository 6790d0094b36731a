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
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::codegen::http;

/// Content type of OpenMetrics text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
    methods: Mutex<HashSet<String>>,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(|| {
                // 100 µs .. ~105 s, x4 per bucket.
                Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                    1e-4, 4.0, 11,
                ))
            }),
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
        get(move || {
            let rpc = rpc.clone();
            async move { ([(http::header::CONTENT_TYPE, CONTENT_TYPE)], rpc.render()) }
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
    }
}
