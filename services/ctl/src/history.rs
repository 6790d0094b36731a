//! `aliquotctl history` and the demo's chart: the metrics service's own
//! client (`aliquot_metrics::cli`), wired here.

#[derive(Debug, Clone, clap::Args)]
pub struct Args {}

pub async fn run(_args: Args) -> anyhow::Result<()> {
    Err(
        crate::UsageError("history needs the metrics service's client, not built in yet".into())
            .into(),
    )
}

pub async fn chart(_url: &str, _pool: &str, _path: &std::path::Path) -> anyhow::Result<()> {
    anyhow::bail!("the metrics client is not built in yet")
}
