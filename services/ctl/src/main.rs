//! `aliquotctl` binary: parse; `serve` execs the service's binary at once;
//! anything else inits telemetry and runs. Exit 2 for bad usage, 1 for
//! failures.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Before any thread: large RPC buffers stay in malloc's arenas instead of
    // a fresh mmap (256 page faults per MiB) each, for `write`.
    aliquot_process::tune_allocator();
    let cli = aliquotctl::Cli::parse();
    if let aliquotctl::Cmd::Serve(s) = &cli.command {
        // Nothing started yet that the service's process would inherit.
        let json = cli.telemetry.log_format == telemetry::LogFormat::Json;
        eprintln!("aliquotctl: {:#}", aliquotctl::serve::exec(s, json));
        return ExitCode::from(1);
    }
    let rt = match aliquot_process::runtime(None) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aliquotctl: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async {
        let guard = telemetry::init("aliquotctl", &cli.telemetry);
        let result = aliquotctl::run(cli).await;
        let code = match &result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("aliquotctl: {e:#}");
                ExitCode::from(if aliquotctl::is_usage_error(e) { 2 } else { 1 })
            }
        };
        guard.shutdown().await;
        code
    })
}
