//! SVG line charts of a pool's history (plotters, SVG backend): one coloured
//! line per vdev with a legend, vdev events as vertical lines, axes labelled
//! with their units. Takes plain series, so the HTTP server and
//! `aliquotctl history --svg` draw the very same chart (a crate of its own:
//! the CLI links no server). Also the time range both take ([`parse_time`]).

use aliquot_proto::v1::HistoryReply;
use plotters::prelude::*;

/// How the y values read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YUnit {
    /// A fraction 0..=1 shown as a percentage.
    Fraction,
    Bytes,
    BytesPerSec,
}

/// One line: `(unix ms, value)` points, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(i64, f64)>,
}

/// A vertical line at an event (vdev add, offline, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct Marker {
    pub time_ms: i64,
    pub kind: String,
    pub label: String,
}

/// Everything a chart needs.
#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub y_desc: String,
    pub unit: YUnit,
    pub series: Vec<Series>,
    pub markers: Vec<Marker>,
    /// The time range shown; `None` fits the data.
    pub x_range: Option<(i64, i64)>,
    pub width: u32,
    pub height: u32,
}

/// The three charts the service serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChartKind {
    Balance,
    Throughput,
    Queues,
}

impl ChartKind {
    pub const ALL: [ChartKind; 3] = [ChartKind::Balance, ChartKind::Throughput, ChartKind::Queues];

    pub fn name(self) -> &'static str {
        match self {
            ChartKind::Balance => "balance",
            ChartKind::Throughput => "throughput",
            ChartKind::Queues => "queues",
        }
    }

    /// This chart of `pool` from a History reply.
    pub fn chart(self, pool: &str, reply: &HistoryReply, x_range: Option<(i64, i64)>) -> Chart {
        let (title, y_desc, unit): (String, &str, YUnit) = match self {
            ChartKind::Balance => (
                format!("{pool}: used fraction per vdev"),
                "used (% of capacity)",
                YUnit::Fraction,
            ),
            ChartKind::Throughput => (
                format!("{pool}: write throughput per vdev"),
                "write (bytes/s)",
                YUnit::BytesPerSec,
            ),
            ChartKind::Queues => (
                format!("{pool}: queue depth per vdev (placed, not yet committed)"),
                "queue depth (bytes)",
                YUnit::Bytes,
            ),
        };
        let series = reply
            .series
            .iter()
            .map(|s| Series {
                label: if s.name.is_empty() {
                    format!("vdev{}", s.vdev)
                } else {
                    format!("{} ({})", s.name, s.vdev)
                },
                points: s
                    .points
                    .iter()
                    .map(|p| {
                        let y = match self {
                            ChartKind::Balance => p.used_fraction,
                            ChartKind::Throughput => p.write_bytes_per_sec,
                            ChartKind::Queues => p.queue_depth as f64,
                        };
                        (p.time_ms, y)
                    })
                    .collect(),
            })
            .collect();
        let markers = reply
            .events
            .iter()
            .map(|e| Marker {
                time_ms: e.time_ms,
                kind: e.kind.clone(),
                label: format!(
                    "{} {}",
                    e.kind.trim_start_matches("vdev_"),
                    vdev_name(reply, e.vdev)
                ),
            })
            .collect();
        Chart {
            title,
            y_desc: y_desc.to_string(),
            unit,
            series,
            markers,
            x_range,
            width: 1100,
            height: 420,
        }
    }
}

impl std::str::FromStr for ChartKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "balance" => Ok(Self::Balance),
            "throughput" => Ok(Self::Throughput),
            "queues" => Ok(Self::Queues),
            _ => Err(format!("unknown chart {s:?} (balance, throughput, queues)")),
        }
    }
}

/// `2026-12-02 10:04:05`-style UTC parts from unix ms (outside the
/// calendar's range: the epoch).
fn civil(ms: i64) -> (i32, u8, u8, u8, u8, u8) {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    (
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
    )
}

/// `file2 (2)` for vdev 2 of the reply's series, or `vdev 2` when unnamed.
pub fn vdev_name(reply: &HistoryReply, vdev: u32) -> String {
    match reply
        .series
        .iter()
        .find(|s| s.vdev == vdev && !s.name.is_empty())
    {
        Some(s) => format!("{} ({vdev})", s.name),
        None => format!("vdev {vdev}"),
    }
}

/// A UTC timestamp: `2026-12-02 10:04:05`.
pub fn format_time(ms: i64) -> String {
    let (y, mo, d, h, mi, s) = civil(ms);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}")
}

/// An axis tick: time of day for short spans, date and time for long ones.
fn tick(ms: i64, span_ms: i64) -> String {
    let (_, mo, d, h, mi, s) = civil(ms);
    if span_ms > 86_400_000 {
        format!("{mo:02}-{d:02} {h:02}:{mi:02}")
    } else {
        format!("{h:02}:{mi:02}:{s:02}")
    }
}

fn format_y(unit: YUnit, y: f64) -> String {
    match unit {
        YUnit::Fraction => format!("{:.1}%", y * 100.0),
        YUnit::Bytes => units::format_bytes_short(y.max(0.0) as u64),
        YUnit::BytesPerSec => format!("{}/s", units::format_bytes_short(y.max(0.0) as u64)),
    }
}

/// The y axis's top and its ticks: sizes at multiples of a power of two
/// (16M, 32M, 48M: binary units at binary positions, not 95.4M), fractions
/// at 1, 2 or 5 × a power of ten; 3 to 6 steps, the top rounded up to one.
/// Returns (step, steps to the top).
fn y_ticks(unit: YUnit, top: f64) -> (f64, usize) {
    let step = match unit {
        YUnit::Fraction => {
            let raw = top / 5.0;
            let p = 10f64.powf(raw.log10().floor());
            [1.0, 2.0, 5.0, 10.0]
                .iter()
                .map(|m| m * p)
                .find(|s| top / s <= 6.0)
                .unwrap_or(10.0 * p)
        }
        YUnit::Bytes | YUnit::BytesPerSec => {
            let raw = (top / 5.0).max(1.0);
            let mut s = 2f64.powf(raw.log2().floor());
            while top / s > 6.0 {
                s *= 2.0;
            }
            s
        }
    };
    (step, (top / step).ceil().max(1.0) as usize)
}

fn marker_color(kind: &str) -> RGBColor {
    match kind {
        "vdev_add" => RGBColor(0, 140, 60),
        "vdev_offline" | "vdev_unavailable" => RGBColor(200, 30, 30),
        _ => RGBColor(230, 140, 0),
    }
}

/// Render `chart` as a standalone SVG document.
pub fn render_svg(chart: &Chart) -> Result<String, String> {
    let mut buf = String::new();
    draw(chart, &mut buf).map_err(|e| format!("drawing chart {:?}: {e}", chart.title))?;
    Ok(buf)
}

fn draw<'a>(chart: &Chart, buf: &'a mut String) -> Result<(), Box<dyn std::error::Error + 'a>> {
    let (mut x0, mut x1) = chart.x_range.unwrap_or_else(|| {
        let xs = chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0));
        let (lo, hi) = xs.fold((i64::MAX, i64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
        if lo > hi { (0, 60_000) } else { (lo, hi) }
    });
    if x1 <= x0 {
        x0 -= 30_000;
        x1 += 30_000;
    }
    let ymax = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|y| y.is_finite())
        .fold(0.0_f64, f64::max);
    let floor = match chart.unit {
        YUnit::Fraction => 0.01,
        _ => 1.0,
    };
    // The axis counts ticks (0..=n, plotters labels each integer); a value
    // is drawn at value / step and labelled step × tick.
    // Headroom above the highest point, but a fraction never past 100 %
    // (a used fraction cannot be more).
    let top = match chart.unit {
        YUnit::Fraction => (ymax * 1.1).min(1.0),
        _ => ymax * 1.1,
    };
    let (step, n) = y_ticks(chart.unit, top.max(floor));
    let y1 = n as f64;

    let root = SVGBackend::with_string(buf, (chart.width, chart.height)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut cc = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(84)
        .build_cartesian_2d(x0..x1, 0.0..y1)?;
    let span = x1 - x0;
    let unit = chart.unit;
    let xf = move |x: &i64| tick(*x, span);
    let yf = move |y: &f64| format_y(unit, *y * step);
    cc.configure_mesh()
        .x_desc("time (UTC)")
        .y_desc(chart.y_desc.as_str())
        .x_labels(7)
        .y_labels(n + 1)
        .x_label_formatter(&xf)
        .y_label_formatter(&yf)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;

    let shown = chart
        .markers
        .iter()
        .filter(|m| m.time_ms >= x0 && m.time_ms <= x1);
    for (i, m) in shown.enumerate() {
        let color = marker_color(&m.kind);
        // Stagger labels over three rows so close events stay readable.
        let label_y = y1 * (0.97 - 0.05 * (i % 3) as f64);
        cc.draw_series(LineSeries::new(
            [(m.time_ms, 0.0), (m.time_ms, y1)],
            color.stroke_width(1),
        ))?;
        cc.draw_series(std::iter::once(Text::new(
            m.label.clone(),
            (m.time_ms, label_y),
            ("sans-serif", 12).into_font().color(&color),
        )))?;
    }
    for (i, s) in chart.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        cc.draw_series(LineSeries::new(
            s.points
                .iter()
                .filter(|p| p.1.is_finite())
                .map(|&(x, y)| (x, y / step)),
            color.stroke_width(2),
        ))?
        .label(s.label.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    if chart.series.iter().all(|s| s.points.is_empty()) {
        cc.draw_series(std::iter::once(Text::new(
            "no samples in this range",
            (x0 + span / 3, y1 / 2.0),
            ("sans-serif", 16),
        )))?;
    }
    if !chart.series.is_empty() {
        cc.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// `since`/`until` as given on a URL or the command line: unix ms, `now`,
/// or `-<duration>` relative to `now_ms` (`-1h`, `-30m`, `-7d`).
pub fn parse_time(s: &str, now_ms: i64) -> Result<i64, String> {
    let t = s.trim();
    if t == "now" {
        return Ok(now_ms);
    }
    if let Some(rel) = t.strip_prefix('-')
        && rel.starts_with(|c: char| c.is_ascii_digit())
        && !rel.chars().all(|c| c.is_ascii_digit())
    {
        let d = units::parse_duration(rel).map_err(|e| format!("bad time {s:?}: {e}"))?;
        return Ok(now_ms - d.as_millis() as i64);
    }
    t.parse::<i64>()
        .map_err(|_| format!("bad time {s:?}: want unix ms, `now` or a relative time like -1h"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(parse_time("1234", 10_000), Ok(1234));
        assert_eq!(parse_time("now", 10_000), Ok(10_000));
        assert_eq!(parse_time("-1h", 7_200_000), Ok(3_600_000));
        assert_eq!(parse_time("-5", 100), Ok(-5));
        assert!(parse_time("yesterday", 0).is_err());
    }

    #[test]
    fn byte_ticks_are_binary() {
        let mib = (1u64 << 20) as f64;
        let (step, n) = y_ticks(YUnit::BytesPerSec, 95.4 * mib);
        assert_eq!((step, n), (16.0 * mib, 6));
        assert_eq!(format_y(YUnit::BytesPerSec, 2.0 * step), "32.0M/s");
        let (step, n) = y_ticks(YUnit::Fraction, 0.47);
        assert!((step - 0.1).abs() < 1e-9 && n == 5, "{step} {n}");
        // A full vdev's 98 %: the axis ends at 100 %, not 120 %.
        let (step, n) = y_ticks(YUnit::Fraction, (0.98f64 * 1.1).min(1.0));
        assert!((step * n as f64 - 1.0).abs() < 1e-9, "{step} {n}");
        // Drawn: the ticks are the labels.
        let chart = Chart {
            title: "t".into(),
            y_desc: "write".into(),
            unit: YUnit::BytesPerSec,
            series: vec![Series {
                label: "file0 (0)".into(),
                points: vec![(0, 10.0 * mib), (60_000, 86.7 * mib)],
            }],
            markers: vec![],
            x_range: None,
            width: 600,
            height: 300,
        };
        let svg = render_svg(&chart).unwrap();
        for t in ["16.0M/s", "48.0M/s", "96.0M/s"] {
            assert!(svg.contains(t), "{t} missing");
        }
        assert!(!svg.contains("95.4M/s"));
    }

    #[test]
    fn civil_dates() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(format_time(1_767_225_599_000), "2025-12-31 23:59:59");
    }
}
