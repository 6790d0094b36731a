//! `aliquot-metrics`: parse, init telemetry, run.

use clap::Parser;

#[tokio::main]
async fn main() {
    // Started by `aliquotctl up`: stop when it goes.
    aliquot_process::watch_parent();
    let config = aliquot_metrics::Config::parse();
    let guard = telemetry::init("aliquot-metrics", &config.telemetry);
    let code = match aliquot_metrics::run(config).await {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "aliquot-metrics failed");
            eprintln!("aliquot-metrics: {e:#}");
            aliquot_metrics::exit_code(&e)
        }
    };
    guard.shutdown().await;
    std::process::exit(code);
}
