//! Trace context across a real gRPC hop on loopback: a client call made with
//! `TraceInjector` inside a `client_span` is the parent of the server's
//! `server_span`, and the spans reach an OTLP receiver (`telemetry::sink`)
//! over OTLP/gRPC.

use std::time::Duration;

use opentelemetry::global;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use telemetry::sink::TraceSink;
use telemetry::{LogFormat, TraceInjector, client_span};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tracing::Instrument;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_and_server_spans_share_one_trace() {
    let sink = TraceSink::new();
    let endpoint = sink.spawn_local().await.expect("receiver");
    global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = telemetry::provider("telemetry-test", &endpoint).expect("provider");
    tracing::subscriber::set_global_default(telemetry::subscriber(
        "telemetry-test",
        LogFormat::Text,
        Some(&provider),
    ))
    .expect("global subscriber");

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .trace_fn(telemetry::server_span)
            .add_service(health_service)
            // Any gRPC service will do as the callee: a second sink.
            .add_service(TraceSink::new().service())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = TraceServiceClient::with_interceptor(channel.clone(), TraceInjector);
    let mut health = HealthClient::with_interceptor(channel, TraceInjector);
    async {
        client
            .export(ExportTraceServiceRequest::default())
            .instrument(client_span("TraceService/Export"))
            .await
            .expect("export");
        // Health probes are not traced (they would drown the rest).
        health
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health check");
    }
    .instrument(tracing::info_span!("test.root"))
    .await;

    let p = provider.clone();
    tokio::task::spawn_blocking(move || p.force_flush())
        .await
        .unwrap()
        .expect("flush");
    let done = sink
        .wait_until(Duration::from_secs(10), |s| s.len() >= 3)
        .await;
    let spans = sink.spans();
    assert!(done, "spans: {spans:#?}");
    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name} in {spans:#?}"))
    };
    let root = find("test.root");
    let client = find("TraceService/Export");
    let server = find("/opentelemetry.proto.collector.trace.v1.TraceService/Export");
    assert_eq!(root.service, "telemetry-test");
    assert!(root.parent_span_id.is_empty());
    assert_eq!(client.kind, "client");
    assert_eq!(server.kind, "server");
    assert_eq!(client.trace_id, root.trace_id);
    assert_eq!(
        server.trace_id, root.trace_id,
        "traceparent crossed the hop"
    );
    assert_eq!(client.parent_span_id, root.span_id);
    assert_eq!(server.parent_span_id, client.span_id);
    assert_eq!(server.attr("rpc.system"), Some("grpc"));
    assert!(server.to_json().contains("\"kind\":\"server\""));
    assert!(
        !spans
            .iter()
            .any(|s| s.name.contains("grpc.health.v1.Health/Check") && s.kind == "server"),
        "health probes are not traced: {spans:#?}"
    );

    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .unwrap()
        .expect("shutdown");
}
