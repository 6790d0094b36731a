//! `aliquot-agent` binary: parse, init telemetry, run the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    aliquot_agent::tune_allocator();
    // Started by `aliquotctl up`: stop when it goes.
    aliquot_process::watch_parent();
    let config = aliquot_agent::Config::parse();
    let rt = match aliquot_agent::runtime(config.worker_threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aliquot-agent: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async {
        let guard = telemetry::init("aliquot-agent", &config.telemetry);
        let result = aliquot_agent::run(config).await;
        let code = match &result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "aliquot-agent failed");
                eprintln!("aliquot-agent: {e:#}");
                let usage = e
                    .downcast_ref::<aliquot_agent::AgentError>()
                    .is_some_and(|e| e.is_usage());
                ExitCode::from(if usage { 2 } else { 1 })
            }
        };
        guard.shutdown().await;
        code
    })
}
