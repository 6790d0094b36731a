use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = aliquot_allocator::Config::parse();
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
