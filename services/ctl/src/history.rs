//! `aliquotctl history` and the demo's chart: query a metrics service's
//! History and print a compact per-vdev table, or write the chart as an SVG
//! file (drawn by `aliquot_charts`, as the metrics service's own pages are).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use aliquot_charts::{ChartKind, format_time};
use aliquot_proto::v1::metrics_client::MetricsClient;
use aliquot_proto::v1::{HistoryReply, HistoryRequest};

#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The metrics service's gRPC endpoint.
    #[arg(
        long = "metrics",
        visible_alias = "endpoint",
        env = "ALIQUOT_METRICS",
        default_value = "http://127.0.0.1:7100"
    )]
    pub endpoint: String,
    /// Pool name.
    #[arg(long, env = "ALIQUOT_POOL", default_value = "aliquot")]
    pub pool: String,
    /// Only these vdev ids (comma-separated); default all.
    #[arg(long, value_delimiter = ',')]
    pub vdevs: Vec<u32>,
    /// Start: unix ms, `now`, or relative like `-1h`; default the first sample.
    #[arg(long, allow_hyphen_values = true)]
    pub since: Option<String>,
    /// End: unix ms, `now`, or relative like `-5m`; default the last sample.
    #[arg(long, allow_hyphen_values = true)]
    pub until: Option<String>,
    /// Points per vdev (the series are averaged into this many time buckets).
    #[arg(long, default_value_t = 300)]
    pub max_points: u32,
    /// Write the chart to this SVG file instead of printing the table.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Which chart `--svg` writes: balance, throughput or queues.
    #[arg(long, default_value = "balance")]
    pub chart: ChartKind,
    #[command(flatten)]
    pub tls: aliquot_auth::ClientTlsArgs,
}

/// Run the query and print (or write) the result.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let now = now_ms();
    let since = args
        .since
        .as_deref()
        .map(|s| aliquot_charts::parse_time(s, now))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let until = args
        .until
        .as_deref()
        .map(|s| aliquot_charts::parse_time(s, now))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    // The scheme follows the TLS mode (as the allocator's URL does for
    // `status`): the default http://127.0.0.1:7100 reaches a TLS `up` too.
    let tls = args.tls.resolve()?;
    let url = tls.url(&args.endpoint);
    let channel = tls
        .endpoint(&url, aliquot_auth::Role::Metrics)?
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach metrics at {url}: {e}"))?;
    let mut client = MetricsClient::with_interceptor(channel, telemetry::TraceInjector);
    let reply = client
        .history(HistoryRequest {
            pool: args.pool.clone(),
            vdevs: args.vdevs.clone(),
            since_ms: since,
            until_ms: until,
            max_points: args.max_points,
        })
        .await
        .map_err(|s| anyhow::anyhow!("history of pool {}: {}", args.pool, s.message()))?
        .into_inner();
    if let Some(path) = &args.svg {
        let x_range = since.map(|s| (s, until.unwrap_or(now)));
        let svg = aliquot_charts::render_svg(&args.chart.chart(&args.pool, &reply, x_range))
            .map_err(anyhow::Error::msg)?;
        std::fs::write(path, svg)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        println!("{}", path.display());
    } else {
        print!("{}", format_table(&args.pool, &reply));
    }
    Ok(())
}

/// One row per vdev: its latest point, the range of used fraction over the
/// period, average write rate and queue depth; then the events.
pub fn format_table(pool: &str, reply: &HistoryReply) -> String {
    let mut out = String::new();
    let first = reply
        .series
        .iter()
        .filter_map(|s| s.points.first())
        .map(|p| p.time_ms)
        .min();
    let last = reply
        .series
        .iter()
        .filter_map(|s| s.points.last())
        .map(|p| p.time_ms)
        .max();
    match (first, last) {
        (Some(f), Some(l)) => {
            let _ = writeln!(
                out,
                "pool {pool}: {} .. {} UTC",
                format_time(f),
                format_time(l)
            );
        }
        _ => {
            let _ = writeln!(out, "pool {pool}: no samples in range");
        }
    }
    let _ = writeln!(
        out,
        "{:>4}  {:<14} {:>6}  {:>7}  {:>15}  {:>19}  {:>11}  {:>10}  {:>8}",
        "VDEV",
        "NAME",
        "POINTS",
        "USED",
        "USED MIN..MAX",
        "ALLOC / CAPACITY",
        "WRITE AVG",
        "QUEUE AVG",
        "P99"
    );
    let mut used_now = Vec::new();
    for s in &reply.series {
        let n = s.points.len();
        let Some(p) = s.points.last() else {
            let _ = writeln!(out, "{:>4}  {:<14} {:>6}", s.vdev, s.name, 0);
            continue;
        };
        used_now.push(p.used_fraction);
        let (lo, hi) = s.points.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
            (lo.min(p.used_fraction), hi.max(p.used_fraction))
        });
        let w = s.points.iter().map(|p| p.write_bytes_per_sec).sum::<f64>() / n as f64;
        let q = s.points.iter().map(|p| p.queue_depth as f64).sum::<f64>() / n as f64;
        let _ = writeln!(
            out,
            "{:>4}  {:<14} {:>6}  {:>6.2}%  {:>6.2}..{:>6.2}%  {:>19}  {:>11}  {:>10}  {:>8}",
            s.vdev,
            s.name,
            n,
            p.used_fraction * 100.0,
            lo * 100.0,
            hi * 100.0,
            format!(
                "{} / {}",
                units::format_bytes_short(p.allocated),
                units::format_bytes_short(p.capacity)
            ),
            format!("{}/s", units::format_bytes_short(w as u64)),
            units::format_bytes_short(q as u64),
            // An idle vdev has no latency to show, not 0 µs.
            if p.latency_p99_us == 0 {
                "-".to_string()
            } else {
                format!("{}us", p.latency_p99_us)
            },
        );
    }
    if used_now.len() >= 2 {
        let lo = used_now.iter().copied().fold(f64::MAX, f64::min);
        let hi = used_now.iter().copied().fold(f64::MIN, f64::max);
        let _ = writeln!(
            out,
            "spread of used fraction (latest): {:.2}%",
            (hi - lo) * 100.0
        );
    }
    for e in &reply.events {
        let _ = writeln!(
            out,
            "event {} {} {}{}",
            format_time(e.time_ms),
            e.kind,
            aliquot_charts::vdev_name(reply, e.vdev),
            if e.detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", e.detail)
            }
        );
    }
    out
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
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
    run(a).await
}
