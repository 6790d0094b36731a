//! `aliquotctl serve agent|allocator|metrics`: each service's own `Config`
//! and `run`, in this binary, so `up` and `demo` need nothing but
//! `cargo run -p aliquotctl`. Flags, env variables and behaviour are exactly
//! those of the service's own binary.

#[derive(Debug, clap::Subcommand)]
pub enum ServeCmd {
    /// One vdev: aliquot-agent.
    Agent(aliquot_agent::Config),
    /// The pool's allocator: aliquot-allocator.
    Allocator(aliquot_allocator::Config),
    /// Balance history, charts: aliquot-metrics.
    Metrics(aliquot_metrics::Config),
}

impl ServeCmd {
    pub fn service_name(&self) -> &'static str {
        match self {
            ServeCmd::Agent(_) => "aliquot-agent",
            ServeCmd::Allocator(_) => "aliquot-allocator",
            ServeCmd::Metrics(_) => "aliquot-metrics",
        }
    }

    pub fn telemetry(&self) -> &telemetry::TelemetryArgs {
        match self {
            ServeCmd::Agent(c) => &c.telemetry,
            ServeCmd::Allocator(c) => &c.telemetry,
            ServeCmd::Metrics(c) => &c.telemetry,
        }
    }
}

pub async fn run(cmd: ServeCmd) -> anyhow::Result<()> {
    crate::local::watch_parent();
    match cmd {
        ServeCmd::Agent(c) => aliquot_agent::run(c).await,
        ServeCmd::Allocator(c) => aliquot_allocator::run(c).await,
        ServeCmd::Metrics(c) => aliquot_metrics::run(c).await,
    }
}

/// A service's configuration error (exit code 2), as its own main decides.
pub fn is_usage_error(e: &anyhow::Error) -> bool {
    e.downcast_ref::<aliquot_agent::AgentError>()
        .is_some_and(|e| e.is_usage())
        || e.downcast_ref::<aliquot_allocator::ConfigError>().is_some()
        || aliquot_metrics::exit_code(e) == 2
        || e.downcast_ref::<crate::UsageError>().is_some()
}
