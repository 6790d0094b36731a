use clap::Parser;

fn main() -> std::process::ExitCode {
    let config = aliquot_allocator::Config::parse();
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = config.worker_threads {
        b.worker_threads(n.into());
    }
    let rt = match b.enable_all().build() {
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
