//! SVG charts of a scenario's runs (plotters): per run, used fraction and
//! write throughput per vdev over virtual time (and sync-write latency when
//! the scenario has intent-log traffic); across runs, the used-fraction
//! spread, and throughput by block size when the scenario lists several.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::report::{RunSummary, Summary};

const W: u32 = 960;
const H: u32 = 540;
const MIB: f64 = 1024.0 * 1024.0;

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

type Series = (String, Vec<(f64, f64)>);

fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    y_floor_max: f64,
) -> anyhow::Result<()> {
    let xmax = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let ymax = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .filter(|y| y.is_finite())
        .fold(y_floor_max, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Centred moving mean over `k` points (device throughput is lumpy at
/// sample resolution: whole I/Os complete in one interval or the next).
fn smooth(pts: &[(f64, f64)], k: usize) -> Vec<(f64, f64)> {
    let h = k / 2;
    (0..pts.len())
        .map(|i| {
            let a = i.saturating_sub(h);
            let b = (i + h + 1).min(pts.len());
            let m = pts[a..b].iter().map(|p| p.1).sum::<f64>() / (b - a) as f64;
            (pts[i].0, m)
        })
        .collect()
}

fn file_label(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Draw every chart; returns the files written.
pub fn draw_all(dir: &Path, s: &Summary) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for r in &s.runs {
        out.extend(draw_run(dir, &s.scenario, r)?);
    }
    if s.runs.len() > 1 {
        let series: Vec<Series> = s
            .runs
            .iter()
            .map(|r| {
                (
                    r.label.clone(),
                    r.samples
                        .iter()
                        .map(|p| (p.t_s, p.spread * 100.0))
                        .collect(),
                )
            })
            .collect();
        let p = dir.join("spread.svg");
        line_chart(
            &p,
            &format!("{}: spread of vdev used fractions", s.scenario),
            "virtual time (s)",
            "max − min used (percentage points)",
            &series,
            1.0,
        )?;
        out.push(p);
    }
    let mut sizes: Vec<u64> = s.runs.iter().map(|r| r.block_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() > 1 {
        let mut groups: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for r in &s.runs {
            let key = if r.variant.is_empty() {
                r.policy.to_string()
            } else {
                format!("{}-{}", r.policy, r.variant)
            };
            let x = sizes.iter().position(|&b| b == r.block_size).unwrap() as f64;
            let y = r.mean_throughput_bytes_per_s / MIB;
            match groups.iter_mut().find(|g| g.0 == key) {
                Some(g) => g.1.push((x, y)),
                None => groups.push((key, vec![(x, y)])),
            }
        }
        let p = dir.join("throughput-by-block-size.svg");
        block_size_chart(&p, &s.scenario, &sizes, &groups)?;
        out.push(p);
    }
    Ok(out)
}

fn block_size_chart(
    path: &Path,
    scenario: &str,
    sizes: &[u64],
    groups: &[Series],
) -> anyhow::Result<()> {
    let ymax = groups
        .iter()
        .flat_map(|g| g.1.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = sizes.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{scenario}: mean write throughput by block size"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..ymax)?;
    let labels: Vec<String> = sizes
        .iter()
        .map(|&b| crate::scenario::size_label(b))
        .collect();
    chart
        .configure_mesh()
        .x_desc("block size")
        .y_desc("throughput (MiB/s)")
        .x_labels(sizes.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for (i, (name, pts)) in groups.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 4, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn draw_run(dir: &Path, scenario: &str, r: &RunSummary) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let base = file_label(&r.label);
    let used: Vec<Series> = r
        .vdevs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let pts = r
                .samples
                .iter()
                .filter_map(|s| s.used_fraction[i].map(|u| (s.t_s, u * 100.0)))
                .collect();
            (v.name.clone(), pts)
        })
        .collect();
    let p = dir.join(format!("{base}-used.svg"));
    line_chart(
        &p,
        &format!("{scenario} [{}]: used fraction per vdev", r.label),
        "virtual time (s)",
        "used (% of vdev capacity)",
        &used,
        100.0,
    )?;
    out.push(p);

    let k = (r.samples.len() / 100).clamp(1, 9) | 1;
    let tput: Vec<Series> = r
        .vdevs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let pts: Vec<(f64, f64)> = r
                .samples
                .iter()
                .filter_map(|s| s.write_bytes_per_s[i].map(|b| (s.t_s, b / MIB)))
                .collect();
            (v.name.clone(), smooth(&pts, k))
        })
        .collect();
    let p = dir.join(format!("{base}-throughput.svg"));
    line_chart(
        &p,
        &format!(
            "{scenario} [{}]: device write throughput ({k}-sample mean)",
            r.label
        ),
        "virtual time (s)",
        "write throughput (MiB/s, asize)",
        &tput,
        1.0,
    )?;
    out.push(p);

    if r.log.is_some() {
        let lat: Vec<(f64, f64)> = r
            .samples
            .iter()
            .filter_map(|s| s.sync_latency_mean_us.map(|l| (s.t_s, l / 1e3)))
            .collect();
        let ops: Vec<(f64, f64)> = r
            .samples
            .iter()
            .skip(1)
            .map(|s| (s.t_s, s.sync_writes_per_s / 1e3))
            .collect();
        let p = dir.join(format!("{base}-sync-latency.svg"));
        line_chart(
            &p,
            &format!("{scenario} [{}]: sync-write latency", r.label),
            "virtual time (s)",
            "mean sync-write latency (ms)",
            &[("mean latency".to_string(), lat)],
            0.01,
        )?;
        out.push(p);
        let p = dir.join(format!("{base}-sync-ops.svg"));
        line_chart(
            &p,
            &format!("{scenario} [{}]: sync writes completed", r.label),
            "virtual time (s)",
            "sync writes (thousands per s)",
            &[("sync writes".to_string(), smooth(&ops, k))],
            0.01,
        )?;
        out.push(p);
    }
    Ok(out)
}

/// Measured beside simulated: used % per vdev against pool fill %, the
/// simulated run as lines and the measured log as dots of the same colour.
pub fn compare_chart(
    path: &Path,
    title: &str,
    names: &[String],
    measured: &crate::calibration::FillCurve,
    simulated: &crate::calibration::FillCurve,
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (W, H)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..100.0, 0.0..105.0)?;
    chart
        .configure_mesh()
        .x_desc("pool fill %")
        .y_desc("vdev used %")
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    let n = measured
        .rows
        .iter()
        .chain(&simulated.rows)
        .map(|r| r.used_pct.len())
        .max()
        .unwrap_or(0);
    for v in 0..n {
        let c = color(v);
        let name = names.get(v).cloned().unwrap_or_else(|| format!("v{v}"));
        let sim: Vec<(f64, f64)> = simulated
            .rows
            .iter()
            .filter_map(|r| r.used_pct.get(v).map(|u| (r.fill_pct, *u)))
            .collect();
        chart
            .draw_series(LineSeries::new(sim, c.stroke_width(2)))?
            .label(format!("{name} simulated"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        let real: Vec<(f64, f64)> = measured
            .rows
            .iter()
            .filter_map(|r| r.used_pct.get(v).map(|u| (r.fill_pct, *u)))
            .collect();
        chart
            .draw_series(real.into_iter().map(move |p| Circle::new(p, 3, c.filled())))?
            .label(format!("{name} measured (OpenZFS)"))
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
