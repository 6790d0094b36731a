//! `aliquot-otlp-sink`: an OTLP/gRPC trace receiver that prints every span it
//! is sent as one JSON line on stdout. It stands in for Jaeger where no
//! Jaeger image can be had (the compose test); with Jaeger, use Jaeger.

use std::io::Write;
use std::net::SocketAddr;

use clap::Parser;

/// Receive OTLP/gRPC traces and print each span as a JSON line on stdout.
#[derive(Parser, Debug)]
#[command(name = "aliquot-otlp-sink", version)]
struct Args {
    /// Where to serve OTLP/gRPC (the collector's usual port is 4317).
    #[arg(long, env = "ALIQUOT_LISTEN", default_value = "127.0.0.1:4317")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2.into() } else { 0.into() };
        }
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("aliquot-otlp-sink: cannot listen on {}: {e}", args.listen);
            return 1.into();
        }
    };
    let addr = listener.local_addr().expect("bound address");
    let sink = telemetry::sink::TraceSink::new().on_span(|s| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", s.to_json());
        let _ = out.flush();
    });
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(
            telemetry::sink::SERVICE_NAME,
            tonic_health::ServingStatus::Serving,
        )
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    println!("LISTEN grpc {addr}");
    let _ = std::io::stdout().flush();
    eprintln!("aliquot-otlp-sink: receiving OTLP/gRPC traces on {addr}");
    let served = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(sink.service())
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            shutdown_signal(),
        )
        .await;
    match served {
        Ok(()) => 0.into(),
        Err(e) => {
            eprintln!("aliquot-otlp-sink: {e}");
            1.into()
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
