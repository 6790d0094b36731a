//! The chart server over real HTTP: the SVGs parse as XML, hold one series
//! per vdev with a legend entry each, mark vdev events; the index page lists
//! pools with their charts; bad requests get 4xx.

mod common;

use std::collections::BTreeSet;

use aliquot_metrics::charts::{ChartKind, render_svg};
use aliquot_proto::v1::SnapshotBatch;
use common::*;

/// (polylines with at least 3 points → their stroke colours, all text).
fn parse_svg(svg: &str) -> (Vec<String>, String) {
    let doc = roxmltree::Document::parse(svg).expect("SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let mut lines = Vec::new();
    let mut text = String::new();
    for n in doc.descendants() {
        match n.tag_name().name() {
            "polyline" => {
                let pts = n
                    .attribute("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .count();
                if pts >= 3 {
                    lines.push(n.attribute("stroke").unwrap_or("").to_string());
                }
            }
            "text" => {
                text.push_str(&n.text().unwrap_or("").replace('\n', " "));
                text.push('\n');
            }
            _ => {}
        }
    }
    (lines, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charts_have_one_series_per_vdev() {
    let dir = tempfile::tempdir().unwrap();
    let svc = start(&dir.path().join("m.db")).await;
    let mut c = client(&svc).await;
    let mut snaps = Vec::new();
    for s in 0..120 {
        let x = s as f64 / 120.0;
        let mut used = vec![0.2 + 0.1 * x, 0.21 + 0.1 * x];
        if s >= 40 {
            used.push(0.25 * x);
        }
        let mut sn = snap("tank", T0 + s * 1000, &used);
        if s == 40 {
            sn.events.push(event(T0 + 40_000, "vdev_add", 2));
        }
        if s == 90 {
            sn.events.push(event(T0 + 90_000, "vdev_offline", 1));
        }
        snaps.push(sn);
    }
    c.record_batch(SnapshotBatch { snapshots: snaps })
        .await
        .unwrap();

    for kind in ChartKind::ALL {
        let (status, ctype, body) =
            http_get(svc.http_addr, &format!("/pools/tank/{}.svg", kind.name())).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(ctype, "image/svg+xml");
        let (lines, text) = parse_svg(&body);
        assert_eq!(lines.len(), 3, "{kind:?}: one line per vdev");
        assert_eq!(
            lines.iter().collect::<BTreeSet<_>>().len(),
            3,
            "distinct colours"
        );
        for v in 0..3 {
            assert!(
                text.contains(&format!("disk{v} ({v})")),
                "legend for vdev {v}"
            );
        }
        assert!(
            text.contains("add disk2 (2)") && text.contains("offline disk1 (1)"),
            "event markers name their vdev: {text}"
        );
        assert!(text.contains("time (UTC)"));
        let unit = match kind {
            ChartKind::Balance => "used (% of capacity)",
            ChartKind::Throughput => "write (bytes/s)",
            ChartKind::Queues => "queue depth (bytes)",
        };
        assert!(text.contains(unit), "{kind:?} y axis");
    }

    // A window: absolute ms and relative times both parse.
    let (status, _, body) = http_get(
        svc.http_addr,
        &format!(
            "/pools/tank/balance.svg?since={}&until={}",
            T0 + 50_000,
            T0 + 100_000
        ),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(parse_svg(&body).0.len(), 3);
    let (status, _, body) = http_get(svc.http_addr, "/pools/tank/balance.svg?since=-1h").await;
    assert_eq!(status, 200);
    assert!(
        parse_svg(&body).1.contains("no samples"),
        "T0 is not within the last hour"
    );

    // A pool name with HTML's special characters: escaped in the page's
    // text and attributes, percent-encoded in its links.
    c.record_batch(SnapshotBatch {
        snapshots: vec![snap("a<b&\"c>", T0, &[0.5])],
    })
    .await
    .unwrap();

    // The page: auto-refresh, the pool and its three charts.
    let (status, ctype, page) = http_get(svc.http_addr, "/?since=-7d").await;
    assert!(
        page.contains("pool a&lt;b&amp;&quot;c&gt;</h2>")
            && page.contains("alt=\"a&lt;b&amp;&quot;c&gt; balance\"")
            && page.contains("/pools/a%3Cb%26%22c%3E/balance.svg")
            && !page.contains("a<b"),
        "{page}"
    );
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/html"));
    assert!(page.contains("http-equiv=\"refresh\""));
    assert!(page.contains("pool tank"));
    for k in ["balance", "throughput", "queues"] {
        assert!(
            page.contains(&format!("/pools/tank/{k}.svg?since=-7d")),
            "{k}"
        );
    }

    // Errors.
    assert_eq!(
        http_get(svc.http_addr, "/pools/nope/balance.svg").await.0,
        404
    );
    assert_eq!(http_get(svc.http_addr, "/pools/tank/pie.svg").await.0, 404);
    assert_eq!(
        http_get(svc.http_addr, "/pools/tank/balance.svg?since=soon")
            .await
            .0,
        400
    );
    let (status, _, _) = http_get(
        svc.http_addr,
        &format!("/pools/tank/balance.svg?since={}&until={}", T0 + 10, T0),
    )
    .await;
    assert_eq!(status, 400);

    drop(c);
    svc.shutdown().await.unwrap();
}

#[test]
fn plain_series_render_without_a_service() {
    use aliquot_metrics::charts::{Chart, Marker, Series, YUnit};
    let chart = Chart {
        title: "t <&> \"quoted\"".into(),
        y_desc: "used (% of capacity)".into(),
        unit: YUnit::Fraction,
        series: (0..12)
            .map(|v| Series {
                label: format!("v{v}"),
                points: (0..50)
                    .map(|i| (T0 + i * 1000, 0.01 * (v + i) as f64))
                    .collect(),
            })
            .collect(),
        markers: vec![Marker {
            time_ms: T0 + 10_000,
            kind: "vdev_add".into(),
            label: "add 11".into(),
        }],
        x_range: None,
        width: 800,
        height: 300,
    };
    let (lines, text) = parse_svg(&render_svg(&chart).unwrap());
    assert_eq!(lines.len(), 12);
    assert_eq!(lines.iter().collect::<BTreeSet<_>>().len(), 12);
    assert!(text.contains("t <&> \"quoted\""));
    // No data at all still draws a valid, labelled chart.
    let empty = Chart {
        series: vec![],
        markers: vec![],
        ..chart
    };
    assert!(
        parse_svg(&render_svg(&empty).unwrap())
            .1
            .contains("no samples")
    );
}
