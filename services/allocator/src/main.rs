//! `aliquot-allocator` binary: parse, init telemetry, run the library; or,
//! as `aliquot-allocator verify ...`, check a store and print JSON (what
//! `aliquotctl verify` runs); or, as `aliquot-allocator migrate-store ...`,
//! move a stopped pool from SQLite into PostgreSQL. Exit 2 for bad
//! configuration, 1 for failures.

use clap::Parser;

fn main() -> std::process::ExitCode {
    // Before any thread (as every Aliquot binary): large buffers stay in
    // malloc's arenas.
    aliquot_process::tune_allocator();
    // Started by `aliquotctl up`: stop when it goes.
    aliquot_process::watch_parent();
    if std::env::args_os().nth(1).is_some_and(|a| a == "verify") {
        return verify();
    }
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "migrate-store")
    {
        return migrate_store();
    }
    let config = aliquot_allocator::Config::parse();
    let rt = match aliquot_process::runtime(config.worker_threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aliquot-allocator: cannot start the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    rt.block_on(serve(config))
}

async fn serve(config: aliquot_allocator::Config) -> std::process::ExitCode {
    let guard = telemetry::init("aliquot-allocator", &config.telemetry);
    let result = aliquot_allocator::run(config).await;
    guard.shutdown().await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aliquot-allocator: {e:#}");
            if e.downcast_ref::<aliquot_allocator::ConfigError>().is_some() {
                std::process::ExitCode::from(2)
            } else {
                std::process::ExitCode::from(1)
            }
        }
    }
}

/// `aliquot-allocator verify ARGS`: the store check, its report as JSON on
/// stdout; exit 1 (the reason on stderr) when the store is inconsistent or
/// cannot be read.
fn verify() -> std::process::ExitCode {
    let args = aliquot_allocator::verify_cmd::VerifyArgs::parse_from(
        std::iter::once(std::ffi::OsString::from("aliquot-allocator verify"))
            .chain(std::env::args_os().skip(2)),
    );
    tool("verify", aliquot_allocator::verify_cmd::run(args))
}

/// `aliquot-allocator migrate-store ARGS`: progress on stderr, the summary
/// on stdout; exit 1 (the reason on stderr) when refused or failed.
fn migrate_store() -> std::process::ExitCode {
    let cmd = aliquot_allocator::migrate_cmd::MigrateCmd::parse_from(
        std::iter::once(std::ffi::OsString::from("aliquot-allocator migrate-store"))
            .chain(std::env::args_os().skip(2)),
    );
    tool(
        "migrate-store",
        aliquot_allocator::migrate_cmd::run(cmd.args),
    )
}

/// Run a store tool `name` on a runtime of its own: what it returns on
/// stdout, or exit 1 with the reason on stderr.
fn tool<T: std::fmt::Display>(
    name: &str,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> std::process::ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aliquot-allocator {name}: cannot start the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(work) {
        Ok(out) => {
            println!("{out}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("aliquot-allocator {name}: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
