//! Comparison with measured OpenZFS pools (`scenarios/calibration/*.log`,
//! copied from the shared calibration folder): per-vdev used % at given
//! pool-fill points and the largest used-% spread, for a measured log and
//! for a simulated run, so the two can be set side by side.

use anyhow::{Context, bail};

use crate::engine::RunResult;

/// One row of a measured log: pool fill % and each vdev's used %.
#[derive(Clone, Debug, PartialEq)]
pub struct FillRow {
    pub fill_pct: f64,
    pub used_pct: Vec<f64>,
}

/// A fill curve: rows in fill order, from a log or a simulated run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FillCurve {
    pub rows: Vec<FillRow>,
}

impl FillCurve {
    /// Parse a measured log: `#` lines, then a CSV with `pool_fill_pct` and
    /// `vN_used_pct` columns. Only rows of the `fill` phase are kept (the
    /// t5c logs go on with rewrite passes).
    pub fn from_log(text: &str) -> anyhow::Result<FillCurve> {
        let mut lines = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty());
        let header: Vec<&str> = lines.next().context("no CSV header")?.split(',').collect();
        let col = |name: &str| header.iter().position(|h| *h == name);
        let fill = col("pool_fill_pct").context("no pool_fill_pct column")?;
        let phase = col("phase");
        let used: Vec<usize> = (0..)
            .map_while(|i| col(&format!("v{i}_used_pct")))
            .collect();
        if used.is_empty() {
            bail!("no v0_used_pct column");
        }
        let mut rows = Vec::new();
        for (n, line) in lines.enumerate() {
            let f: Vec<&str> = line.split(',').collect();
            if phase.is_some_and(|p| f.get(p) != Some(&"fill")) {
                continue;
            }
            let num = |i: usize| -> anyhow::Result<f64> {
                f.get(i)
                    .with_context(|| format!("row {}: short", n + 2))?
                    .parse()
                    .with_context(|| format!("row {}: column {}", n + 2, header[i]))
            };
            rows.push(FillRow {
                fill_pct: num(fill)?,
                used_pct: used
                    .iter()
                    .map(|&i| num(i))
                    .collect::<anyhow::Result<_>>()?,
            });
        }
        Ok(FillCurve { rows })
    }

    /// A simulated run's curve: pool fill is allocated over capacity of the
    /// vdevs present at each sample (log devices excluded by the caller's
    /// scenario: the calibration pools have none).
    pub fn from_run(r: &RunResult) -> FillCurve {
        let rows = r
            .samples
            .iter()
            .map(|s| {
                let alloc: u64 = s.vdevs.iter().map(|v| v.alloc).sum();
                let cap: u64 = s.vdevs.iter().map(|v| v.capacity).sum();
                FillRow {
                    fill_pct: 100.0 * alloc as f64 / cap.max(1) as f64,
                    used_pct: s.vdevs.iter().map(|v| 100.0 * v.used_fraction()).collect(),
                }
            })
            .collect();
        FillCurve { rows }
    }

    /// Used % per vdev at the first row whose pool fill reaches `pct` (the
    /// last row if none does).
    pub fn used_at(&self, pct: f64) -> Option<&[f64]> {
        self.rows
            .iter()
            .find(|r| r.fill_pct >= pct)
            .or(self.rows.last())
            .map(|r| r.used_pct.as_slice())
    }

    /// Largest max − min used % over the rows, in points.
    pub fn max_spread(&self) -> f64 {
        self.rows
            .iter()
            .filter(|r| r.used_pct.len() > 1)
            .map(|r| {
                let hi = r.used_pct.iter().cloned().fold(f64::MIN, f64::max);
                let lo = r.used_pct.iter().cloned().fold(f64::MAX, f64::min);
                hi - lo
            })
            .fold(0.0, f64::max)
    }
}

/// The fill points the calibration compares at.
pub const FILL_POINTS: [f64; 4] = [25.0, 50.0, 75.0, 90.0];

/// Measured vs simulated at [`FILL_POINTS`]: the worst per-vdev difference
/// in points at each, and both max spreads.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub measured: Vec<Vec<f64>>,
    pub simulated: Vec<Vec<f64>>,
    pub worst_diff: Vec<f64>,
    pub measured_spread: f64,
    pub simulated_spread: f64,
}

impl Comparison {
    pub fn new(measured: &FillCurve, simulated: &FillCurve) -> Comparison {
        let mut c = Comparison {
            measured: Vec::new(),
            simulated: Vec::new(),
            worst_diff: Vec::new(),
            measured_spread: measured.max_spread(),
            simulated_spread: simulated.max_spread(),
        };
        for p in FILL_POINTS {
            let m = measured.used_at(p).unwrap_or(&[]).to_vec();
            let s = simulated.used_at(p).unwrap_or(&[]).to_vec();
            let d = m
                .iter()
                .zip(&s)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            c.measured.push(m);
            c.simulated.push(s);
            c.worst_diff.push(d);
        }
        c
    }

    /// Simulated max spread off the measured one, as a fraction of it.
    pub fn spread_error(&self) -> f64 {
        (self.simulated_spread - self.measured_spread).abs() / self.measured_spread.max(1e-9)
    }

    /// A plain-text table, one line per fill point.
    pub fn table(&self) -> String {
        let f = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        let mut out = String::from("fill   measured        simulated       worst diff\n");
        for (i, p) in FILL_POINTS.iter().enumerate() {
            out += &format!(
                "{p:>3.0} %  {:<15} {:<15} {:.1} pt\n",
                f(&self.measured[i]),
                f(&self.simulated[i]),
                self.worst_diff[i]
            );
        }
        out += &format!(
            "max spread: measured {:.1} pt, simulated {:.1} pt ({:+.0} %)\n",
            self.measured_spread,
            self.simulated_spread,
            100.0 * (self.simulated_spread - self.measured_spread) / self.measured_spread.max(1e-9)
        );
        out
    }
}
