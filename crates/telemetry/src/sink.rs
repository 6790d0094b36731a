//! A small OTLP/gRPC trace receiver: it keeps every span it is sent, in
//! memory, and can print each as a JSON line. The trace tests run it
//! in-process; the compose test runs it as the `aliquot-otlp-sink` container
//! in Jaeger's place (no Jaeger image can be pulled there). It is a test
//! and debugging aid, not a trace store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;

pub use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::SERVICE_NAME;

/// One received span, flattened: ids in lowercase hex, attribute values as
/// strings.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanRecord {
    /// `service.name` of the resource that sent it.
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// "internal", "server", "client", "producer", "consumer" or "unspecified".
    pub kind: &'static str,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub attributes: Vec<(String, String)>,
    /// Names of the span's events (tracing events inside the span).
    pub events: Vec<String>,
}

impl SpanRecord {
    /// The value of attribute `key`, if the span has it.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn duration(&self) -> Duration {
        Duration::from_nanos(self.end_unix_nano.saturating_sub(self.start_unix_nano))
    }

    /// One line of JSON (what `aliquot-otlp-sink` prints).
    pub fn to_json(&self) -> String {
        let attrs: serde_json::Map<String, serde_json::Value> = self
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        serde_json::json!({
            "service": self.service,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "kind": self.kind,
            "start_unix_nano": self.start_unix_nano,
            "end_unix_nano": self.end_unix_nano,
            "attributes": attrs,
            "events": self.events,
        })
        .to_string()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value_string(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::ArrayValue(a)) => {
            let items: Vec<String> = a
                .values
                .iter()
                .map(|v| value_string(&Some(v.clone())))
                .collect();
            format!("[{}]", items.join(","))
        }
        Some(any_value::Value::KvlistValue(kv)) => {
            let items: Vec<String> = kv
                .values
                .iter()
                .map(|kv| format!("{}={}", kv.key, value_string(&kv.value)))
                .collect();
            format!("{{{}}}", items.join(","))
        }
        Some(any_value::Value::BytesValue(b)) => hex(b),
        Some(any_value::Value::StringValueStrindex(i)) => format!("strindex:{i}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> Vec<(String, String)> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value_string(&kv.value)))
        .collect()
}

fn kind_name(kind: i32) -> &'static str {
    match SpanKind::try_from(kind).unwrap_or(SpanKind::Unspecified) {
        SpanKind::Unspecified => "unspecified",
        SpanKind::Internal => "internal",
        SpanKind::Server => "server",
        SpanKind::Client => "client",
        SpanKind::Producer => "producer",
        SpanKind::Consumer => "consumer",
    }
}

/// Flatten one export request into records.
pub fn records(req: &ExportTraceServiceRequest) -> Vec<SpanRecord> {
    let mut out = Vec::new();
    for rs in &req.resource_spans {
        let res = rs
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service = res
            .iter()
            .find(|(k, _)| k == "service.name")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        for ss in &rs.scope_spans {
            for s in &ss.spans {
                out.push(SpanRecord {
                    service: service.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name.clone(),
                    kind: kind_name(s.kind),
                    start_unix_nano: s.start_time_unix_nano,
                    end_unix_nano: s.end_time_unix_nano,
                    attributes: attributes(&s.attributes),
                    events: s.events.iter().map(|e| e.name.clone()).collect(),
                });
            }
        }
    }
    out
}

type OnSpan = Arc<dyn Fn(&SpanRecord) + Send + Sync>;

/// The receiver: clone it freely, every clone sees the same spans.
#[derive(Clone, Default)]
pub struct TraceSink {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    added: Arc<tokio::sync::Notify>,
    on_span: Option<OnSpan>,
}

impl TraceSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// Also call `f` for every span received (e.g. print it).
    pub fn on_span(mut self, f: impl Fn(&SpanRecord) + Send + Sync + 'static) -> Self {
        self.on_span = Some(Arc::new(f));
        self
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.spans.lock().expect("sink lock").clone()
    }

    /// Spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<SpanRecord> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }

    /// Spans grouped by trace id.
    pub fn traces(&self) -> HashMap<String, Vec<SpanRecord>> {
        let mut m: HashMap<String, Vec<SpanRecord>> = HashMap::new();
        for s in self.spans() {
            m.entry(s.trace_id.clone()).or_default().push(s);
        }
        m
    }

    /// Wait (≤ `timeout`) until `done(all spans)` holds; returns whether it did.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&[SpanRecord]) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.added.notified();
            if done(&self.spans()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return done(&self.spans());
            }
        }
    }

    pub fn clear(&self) {
        self.spans.lock().expect("sink lock").clear();
    }

    /// The tonic service to add to a server.
    pub fn service(&self) -> TraceServiceServer<TraceSink> {
        TraceServiceServer::new(self.clone())
    }

    /// Serve OTLP/gRPC on `listener` until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .add_service(self.service())
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                shutdown,
            )
            .await
    }

    /// Bind `127.0.0.1:0`, serve in the background, return the endpoint URL
    /// (for `OTEL_EXPORTER_OTLP_ENDPOINT`). Serves until the runtime ends.
    pub async fn spawn_local(&self) -> std::io::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let me = self.clone();
        tokio::spawn(async move {
            let _ = me.serve(listener, std::future::pending()).await;
        });
        Ok(url)
    }
}

#[tonic::async_trait]
impl TraceService for TraceSink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let recs = records(req.get_ref());
        if let Some(f) = &self.on_span {
            for r in &recs {
                f(r);
            }
        }
        self.spans.lock().expect("sink lock").extend(recs);
        self.added.notify_waiters();
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}
