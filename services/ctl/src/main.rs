//! `aliquotctl` binary: parse, init telemetry (as the embedded service for
//! `serve`), run; exit 2 for bad usage or configuration, 1 for failures.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Before any thread: large RPC buffers stay in malloc's arenas instead of
    // a fresh mmap (256 page faults per MiB) each; for `write` and `serve agent` alike.
    aliquot_agent::tune_allocator();
    let cli = aliquotctl::Cli::parse();
    let rt = match aliquot_agent::runtime(cli.worker_threads()) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aliquotctl: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async {
        let guard = telemetry::init(cli.service_name(), &cli.telemetry_args());
        let name = cli.service_name();
        let result = aliquotctl::run(cli).await;
        let code = match &result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{name}: {e:#}");
                ExitCode::from(if aliquotctl::serve::is_usage_error(e) {
                    2
                } else {
                    1
                })
            }
        };
        guard.shutdown().await;
        code
    })
}
