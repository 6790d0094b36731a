//! `aliquotctl history` and the demo's chart: the metrics service's own
//! client (`aliquot_metrics::cli`), wired here.

use std::path::Path;

pub use aliquot_metrics::cli::HistoryArgs as Args;

pub async fn run(args: Args) -> anyhow::Result<()> {
    aliquot_metrics::cli::history(args).await
}

/// Write pool `pool`'s balance chart (used fraction per vdev over time) from
/// the metrics service at `metrics_url` to `path`.
pub async fn chart(
    metrics_url: &str,
    tls: &aliquot_auth::ClientTls,
    pool: &str,
    path: &Path,
) -> anyhow::Result<()> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct P {
        #[command(flatten)]
        a: Args,
    }
    let mut a = P::try_parse_from(["history"])?.a;
    a.endpoint = metrics_url.to_string();
    a.pool = pool.to_string();
    a.svg = Some(path.to_path_buf());
    a.tls = aliquot_auth::ClientTlsArgs::from_tls(tls);
    aliquot_metrics::cli::history(a).await
}
