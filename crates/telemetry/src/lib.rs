//! Telemetry for every Aliquot binary, configured here and nowhere else:
//! `tracing` logs (human-readable by default, JSON on request, filtered by
//! `RUST_LOG`), and — when `OTEL_EXPORTER_OTLP_ENDPOINT` is set — spans
//! exported over OTLP/gRPC with `service.name` per service. W3C trace context
//! crosses every gRPC hop: clients inject it with [`TraceInjector`], servers
//! extract it in [`server_span`] (`Server::builder().trace_fn(server_span)`).
//! [`sink`] is a small OTLP/gRPC receiver, for tests and for the compose test
//! (the `aliquot-otlp-sink` binary) where Jaeger cannot be had. [`backoff`]
//! is the one retry policy (exponential, with jitter) of every binary.

use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::codegen::http;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

pub mod backoff;
pub mod rpc_metrics;
pub mod sink;

/// How log lines look on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The flags every binary shares; `#[command(flatten)]` it into a config.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TelemetryArgs {
    /// Log format on stderr. Spans go to OTEL_EXPORTER_OTLP_ENDPOINT when set.
    #[arg(long, env = "ALIQUOT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Flushes and shuts the exporter down when dropped (or by [`Guard::shutdown`]).
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl Guard {
    /// Flush spans; blocking, so run it off the async workers.
    pub async fn shutdown(mut self) {
        if let Some(p) = self.provider.take() {
            match tokio::task::spawn_blocking(move || p.shutdown()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("telemetry: flushing spans at exit failed: {e}"),
                Err(e) => eprintln!("telemetry: flushing spans at exit panicked: {e}"),
            }
        }
    }

    /// Export every finished span now (blocking, so off the async workers);
    /// the spans are at the collector when this returns.
    pub async fn flush(&self) {
        if let Some(p) = self.provider.clone() {
            let _ = tokio::task::spawn_blocking(move || p.force_flush()).await;
        }
    }

    pub fn provider(&self) -> Option<&SdkTracerProvider> {
        self.provider.as_ref()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            // Blocking is fine here: the process is ending.
            let _ = std::thread::spawn(move || p.shutdown()).join();
        }
    }
}

/// The OTLP endpoint from the standard variables, if tracing export is wanted
/// (`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off).
pub fn otlp_endpoint() -> Option<String> {
    let env = |k: &str| std::env::var(k).ok().filter(|s| !s.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"))
    {
        return None;
    }
    env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// A tracer provider exporting to `endpoint` as `service` (honours the other
/// `OTEL_*` variables the SDK reads). Must be called inside a Tokio runtime.
pub fn provider(service: &str, endpoint: &str) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint.to_string())
        .build()
        .map_err(|e| format!("otlp exporter for {endpoint}: {e}"))?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(name).build())
        .build())
}

/// A subscriber for `service` (logs, plus spans to `provider` if given), for
/// tests that want a scoped `Dispatch`.
///
/// The two outputs are filtered apart: `RUST_LOG` (default `info`) picks the
/// log lines, `ALIQUOT_TRACE_FILTER` (default `info`) the exported spans, so
/// quieting the logs (`RUST_LOG=warn`) does not blank the traces.
///
/// Spans reach the log layer only when asked for ([`LOG_SPANS_ENV`]`=1`, or
/// `RUST_LOG` at debug or trace anywhere): the layer formats every span it
/// sees into a string when the span opens, whether or not a line is ever
/// logged inside it, and per-request spans (each Write, each Allocate) made
/// that a large share of a busy agent's CPU. Log lines then carry no span
/// context at info; the exported spans are unchanged.
pub fn subscriber(
    service: &str,
    format: LogFormat,
    provider: Option<&SdkTracerProvider>,
) -> impl tracing::Subscriber + Send + Sync + 'static {
    let log_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let spans = log_spans_wanted(&log_filter);
    build(
        service,
        format,
        provider,
        std::io::stderr,
        log_filter,
        spans,
    )
}

/// `ALIQUOT_LOG_SPANS=1`: format spans into log lines even at info.
pub const LOG_SPANS_ENV: &str = "ALIQUOT_LOG_SPANS";

fn log_spans_wanted(log_filter: &EnvFilter) -> bool {
    let env = std::env::var(LOG_SPANS_ENV).is_ok_and(|v| v.trim() == "1");
    let verbose = log_filter
        .max_level_hint()
        .is_some_and(|l| l >= tracing_subscriber::filter::LevelFilter::DEBUG);
    env || verbose
}

fn build<W>(
    service: &str,
    format: LogFormat,
    provider: Option<&SdkTracerProvider>,
    writer: W,
    log_filter: EnvFilter,
    spans: bool,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::filter::{FilterExt, filter_fn};
    let log_filter = log_filter.and(filter_fn(move |m| spans || !m.is_span()));
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match format {
        // Colour only on a terminal: log files and `docker logs` get plain text.
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .with_filter(log_filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .with_filter(log_filter)
            .boxed(),
    };
    let otel = provider.map(|p| {
        let trace_filter = EnvFilter::try_from_env(TRACE_FILTER_ENV)
            .unwrap_or_else(|_| EnvFilter::new(DEFAULT_TRACE_FILTER));
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service.to_string()))
            .with_filter(trace_filter)
    });
    // No `Option` layer for "no exporter": a `None` layer is interested in
    // every callsite, so each span would be built in the registry for
    // nobody (half of a 4 KiB write's user-space CPU in the agent).
    let logs = Registry::default().with(fmt);
    match otel {
        Some(otel) => Box::new(logs.with(otel)) as Box<dyn tracing::Subscriber + Send + Sync>,
        None => Box::new(logs),
    }
}

/// Which spans are exported (an `EnvFilter` directive string).
pub const TRACE_FILTER_ENV: &str = "ALIQUOT_TRACE_FILTER";
/// Spans at info and above: every RPC and the spans worth looking at, none of
/// h2's or hyper's internals (they are at debug/trace).
pub const DEFAULT_TRACE_FILTER: &str = "info";

/// Install the global subscriber for `service`. Call once, inside the Tokio
/// runtime, before serving; keep the guard until exit.
pub fn init(service: &str, args: &TelemetryArgs) -> Guard {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = otlp_endpoint().and_then(|ep| match provider(service, &ep) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("telemetry: {e}; spans will not be exported");
            None
        }
    });
    if let Some(p) = &provider {
        global::set_tracer_provider(p.clone());
    }
    let _ = subscriber(service, args.log_format, provider.as_ref()).try_init();
    Guard { provider }
}

/// `tonic::transport::Server::builder().trace_fn(telemetry::server_span)`:
/// one span per RPC, parented on the caller's W3C trace context.
///
/// Health probes (`/grpc.health.v1.Health/*`, every second or two from each
/// compose health check) get no span: they would bury the traces worth
/// looking at.
pub fn server_span<B>(req: &http::Request<B>) -> tracing::Span {
    let path = req.uri().path().to_string();
    if path.starts_with("/grpc.health.v1.Health/") {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %path,
        otel.kind = "server",
        rpc.system = "grpc",
    );
    let parent = global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(req.headers())));
    let _ = span.set_parent(parent);
    span
}

/// A client-kind span for one outgoing RPC, e.g.
/// `client.commit(req).instrument(telemetry::client_span("aliquot.v1.Allocator/Commit"))`:
/// the callee's server span becomes its child, so Jaeger draws the hop.
pub fn client_span(method: &str) -> tracing::Span {
    tracing::info_span!(
        "grpc.client",
        otel.name = %method,
        otel.kind = "client",
        rpc.system = "grpc",
    )
}

/// The current span's trace context as W3C `traceparent`/`tracestate`
/// entries, for a message that carries its own: an AllocateStream message
/// belongs to its block's trace, not to the stream's (empty when no span
/// is being exported).
pub fn context_map() -> std::collections::HashMap<String, String> {
    let cx = tracing::Span::current().context();
    let mut m = std::collections::HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut m));
    m
}

/// Make `span` a child of the trace context in `map` (from
/// [`context_map`]); an empty map leaves it under the current span.
pub fn adopt(span: &tracing::Span, map: &std::collections::HashMap<String, String>) {
    if map.is_empty() {
        return;
    }
    let parent = global::get_text_map_propagator(|p| p.extract(map));
    let _ = span.set_parent(parent);
}

/// Client side: `FooClient::with_interceptor(channel, TraceInjector)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TraceInjector;

impl tonic::service::Interceptor for TraceInjector {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let cx = tracing::Span::current().context();
        global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(req.metadata_mut()))
        });
        Ok(req)
    }
}

/// A client channel wrapped with the trace injector.
pub type TracedChannel =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, TraceInjector>;

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The trace id of `span` (32 hex digits), if it is being exported.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt as _;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Link `span` (the root of its own trace) to `to`: one trace per unit of
/// work (a written block) that still leads back to the command that did it.
pub fn link(span: &tracing::Span, to: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt as _;
    let sc = to.context().span().span_context().clone();
    if sc.is_valid() {
        span.add_link(sc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What the log layer prints for an info line inside a request span.
    fn logged(format: LogFormat, filter: &str, spans: bool) -> String {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = build(
            "t",
            format,
            None,
            move || w.clone(),
            EnvFilter::new(filter),
            spans,
        );
        tracing::subscriber::with_default(sub, || {
            let span = tracing::info_span!("write", offset = 4242u64);
            let _in = span.enter();
            tracing::info!("inside the request");
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn request_spans_stay_out_of_the_log_unless_asked() {
        for format in [LogFormat::Text, LogFormat::Json] {
            let quiet = logged(format, "info", false);
            assert!(quiet.contains("inside the request"), "{quiet}");
            assert!(!quiet.contains("4242"), "{quiet}");
            let asked = logged(format, "info", true);
            assert!(asked.contains("inside the request"), "{asked}");
            assert!(asked.contains("4242"), "{asked}");
        }
        // Nothing exports or logs spans: they are not even created (the
        // registry's per-span bookkeeping was half of a 4 KiB write's agent
        // CPU in user space).
        let sub = build(
            "t",
            LogFormat::Text,
            None,
            std::io::sink,
            EnvFilter::new("info"),
            false,
        );
        tracing::subscriber::with_default(sub, || {
            assert!(tracing::info_span!("write", offset = 1u64).is_disabled());
        });
        // Asking is RUST_LOG at debug or trace, or ALIQUOT_LOG_SPANS=1.
        assert!(!log_spans_wanted(&EnvFilter::new("info")) || std::env::var(LOG_SPANS_ENV).is_ok());
        assert!(log_spans_wanted(&EnvFilter::new("info,h2=debug")));
        assert!(log_spans_wanted(&EnvFilter::new("trace")));
    }
}
