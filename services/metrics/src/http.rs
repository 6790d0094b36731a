//! The chart server (axum): `/` lists pools with their charts and refreshes
//! itself; `/pools/{pool}/{balance,throughput,queues}.svg` draw one chart,
//! over `?since=&until=` (unix ms, `now`, or relative like `-1h`);
//! `/metrics` is the Prometheus scrape target ([`crate::exposition`]).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use aliquot_proto::v1::HistoryRequest;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;

use crate::charts::ChartKind;
use crate::error::MetricsError;
use crate::exposition::{self, RpcMetrics};
use crate::service::now_ms;
use crate::store::Store;

/// Above this spread "rebalanced in" no longer describes the pool.
const REBALANCED_SPREAD: f64 = 0.10;

/// Points per vdev a served chart asks for (about one per 2 pixels).
const CHART_POINTS: u32 = 500;

pub fn router(store: Arc<Store>, rpc: Arc<RpcMetrics>) -> Router {
    let metrics = Router::new()
        .route("/metrics", get(prometheus))
        .with_state((store.clone(), rpc));
    Router::new()
        .route("/", get(index))
        .route("/pools/{pool}/{chart}", get(chart))
        .with_state(store)
        .merge(metrics)
}

/// Prometheus scrape target: OpenMetrics when the scraper's `Accept`
/// prefers it (Prometheus does), else the 0.0.4 text format (promtool,
/// curl, older scrapers).
async fn prometheus(
    State((store, rpc)): State<(Arc<Store>, Arc<RpcMetrics>)>,
    headers: axum::http::HeaderMap,
) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let (ct, body) = telemetry::rpc_metrics::negotiate(accept, exposition::render(&store, &rpc));
    ([(header::CONTENT_TYPE, ct)], body).into_response()
}

use crate::charts::parse_time;

fn range(q: &HashMap<String, String>) -> Result<(Option<i64>, Option<i64>), String> {
    let now = now_ms();
    let get = |k: &str| -> Result<Option<i64>, String> {
        match q.get(k).map(|s| s.trim()).filter(|s| !s.is_empty()) {
            Some(v) => parse_time(v, now).map(Some),
            None => Ok(None),
        }
    };
    Ok((get("since")?, get("until")?))
}

fn error_response(e: MetricsError) -> Response {
    let code = match e {
        MetricsError::InvalidArgument { .. } => StatusCode::BAD_REQUEST,
        MetricsError::NoPool { .. } | MetricsError::NoVdev { .. } => StatusCode::NOT_FOUND,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (code, format!("{e}\n")).into_response()
}

#[tracing::instrument(skip_all, fields(pool = %pool, chart = %file))]
async fn chart(
    State(store): State<Arc<Store>>,
    Path((pool, file)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(kind) = file
        .strip_suffix(".svg")
        .and_then(|k| k.parse::<ChartKind>().ok())
    else {
        return (
            StatusCode::NOT_FOUND,
            "charts: balance.svg, throughput.svg, queues.svg\n",
        )
            .into_response();
    };
    let (since, until) = match range(&q) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e + "\n").into_response(),
    };
    let req = HistoryRequest {
        pool: pool.clone(),
        vdevs: vec![],
        since_ms: since,
        until_ms: until,
        max_points: CHART_POINTS,
    };
    let reply = match store.history(&req).await {
        Ok(r) => r,
        Err(e) => return error_response(e),
    };
    let x_range = match (since, until) {
        (Some(s), Some(u)) => Some((s, u)),
        (Some(s), None) => Some((s, now_ms())),
        _ => None,
    };
    match crate::charts::render_svg(&kind.chart(&pool, &reply, x_range)) {
        Ok(svg) => (
            [
                (header::CONTENT_TYPE, "image/svg+xml"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            svg,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e + "\n").into_response(),
    }
}

/// Everything but RFC 3986's unreserved characters.
const COMPONENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encode one URL path segment or query value.
pub fn encode_component(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, COMPONENT).to_string()
}

#[tracing::instrument(skip_all)]
async fn index(
    State(store): State<Arc<Store>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(e) = range(&q) {
        return (StatusCode::BAD_REQUEST, e + "\n").into_response();
    }
    let summaries = match store.summary("", now_ms()).await {
        Ok(s) => s,
        Err(e) => return error_response(e),
    };
    let mut qs = String::new();
    for k in ["since", "until"] {
        if let Some(v) = q.get(k).filter(|v| !v.is_empty()) {
            qs.push(if qs.is_empty() { '?' } else { '&' });
            let _ = write!(qs, "{k}={}", encode_component(v));
        }
    }
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"5\">\
         <title>Aliquot balance history</title><style>\
         body{font-family:sans-serif;margin:16px;color:#222}h2{margin:18px 0 4px}\
         table{border-collapse:collapse;margin:6px 0}td,th{padding:2px 10px;text-align:left}\
         th{color:#666;font-weight:normal}img{display:block;margin:6px 0;border:1px solid #ddd}\
         nav a{margin-right:10px}</style></head><body><h1>Aliquot balance history</h1>\
         <nav>range: <a href=\"/?since=-5m\">5 min</a><a href=\"/?since=-1h\">1 h</a>\
         <a href=\"/?since=-1d\">1 day</a><a href=\"/?since=-7d\">7 days</a><a href=\"/\">all</a></nav>",
    );
    if summaries.is_empty() {
        html.push_str("<p>No pool has reported yet.</p>");
    }
    for s in &summaries {
        // Text and the alt attribute: `&`, `<`, `>` and `"` escaped.
        let name = html_escape::encode_double_quoted_attribute(&s.pool);
        let seg = encode_component(&s.pool);
        let dur = |ms: Option<i64>| {
            ms.map(|m| format!("{:.1} s", m as f64 / 1000.0))
                .unwrap_or_else(|| "—".into())
        };
        let _ = write!(
            html,
            "<h2>pool {name}</h2><table><tr><th>vdevs</th><th>spread now</th><th>worst spread</th>\
             <th>since last vdev add</th><th>rebalanced in</th><th>written</th><th>samples</th>\
             <th>dropped snapshots</th><th>last sample (UTC)</th></tr><tr><td>{}</td><td>{:.2} %</td>\
             <td>{:.2} %</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr></table>",
            s.vdevs,
            s.current_spread * 100.0,
            s.worst_spread * 100.0,
            dur(s.since_last_vdev_add_ms),
            if s.last_vdev_add_ms.is_some() && s.rebalance_ms.is_none() {
                "not yet".to_string()
            } else if s.current_spread > REBALANCED_SPREAD {
                // Balanced once, unbalanced now: a time beside a wide spread
                // would read as the present.
                format!("not now (once: {})", dur(s.rebalance_ms))
            } else {
                dur(s.rebalance_ms)
            },
            units::format_bytes(s.total_written_bytes),
            s.samples,
            s.dropped_snapshots,
            crate::charts::format_time(s.last_ms),
        );
        for k in ChartKind::ALL {
            let _ = write!(
                html,
                "<img src=\"/pools/{seg}/{}.svg{qs}\" alt=\"{name} {}\" width=\"1100\" height=\"420\">",
                k.name(),
                k.name()
            );
        }
    }
    html.push_str("</body></html>");
    Html(html).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(encode_component("a b/c"), "a%20b%2Fc");
    }
}
