//! Comparison with measured OpenZFS pools (`scenarios/calibration/*.log`,
//! copied from the shared calibration folder): per-vdev used % at given
//! pool-fill points and the largest used-% spread, for a measured log and
//! for a simulated run, so the two can be set side by side; for the t5c
//! rewrite experiment also the device bytes each vdev wrote in each quarter
//! of a rewrite pass.

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
            // Rows written before a vdev was added (t5c's fill) are shorter:
            // they end before that vdev's columns (then `spread_pp`).
            let present = used.iter().filter(|&&i| i + 1 < f.len()).count().max(1);
            rows.push(FillRow {
                fill_pct: num(fill)?,
                used_pct: used[..present]
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

    /// The max spread within the project's target: ±max(5 points, 30 %)
    /// of the measured one (a spread of 1–2 points, as a CPU-bound pool's,
    /// is judged in points, not by its relative error).
    pub fn spread_within_target(&self) -> bool {
        (self.simulated_spread - self.measured_spread).abs()
            <= (0.30 * self.measured_spread).max(5.0)
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

/// Device MB (10⁶ bytes) each vdev wrote in each quarter of one rewrite
/// pass: `mb[quarter][vdev]`. Quarters are of the pass's data (measured:
/// the application's bytes, `app_MiB`; simulated: the data committed, which
/// trails it by up to a txg, a few % of a pass).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassQuarters {
    pub mb: Vec<Vec<f64>>,
}

impl PassQuarters {
    /// From a log's rows of `phase` (`rewrite1`, ...): each row's
    /// `vN_write_MBps` times the time since the previous row, added to the
    /// quarter the row's `app_MiB` ends in. None without such rows.
    pub fn from_log(text: &str, phase: &str) -> anyhow::Result<Option<PassQuarters>> {
        let mut lines = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty());
        let header: Vec<&str> = lines.next().context("no CSV header")?.split(',').collect();
        let col = |name: &str| {
            header
                .iter()
                .position(|h| *h == name)
                .with_context(|| format!("no {name} column"))
        };
        let (ph, t, app) = (col("phase")?, col("t_s")?, col("app_MiB")?);
        let rates: Vec<usize> = (0..)
            .map_while(|i| col(&format!("v{i}_write_MBps")).ok())
            .collect();
        let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
        let Some(first) = rows.iter().position(|r| r.get(ph) == Some(&phase)) else {
            return Ok(None);
        };
        if first == 0 {
            bail!("{phase} starts the log: no row before it");
        }
        let num = |r: &[&str], i: usize| -> anyhow::Result<f64> {
            r.get(i)
                .context("short row")?
                .parse::<f64>()
                .with_context(|| format!("column {}", header[i]))
        };
        let pass: Vec<&Vec<&str>> = rows[first..]
            .iter()
            .take_while(|r| r.get(ph) == Some(&phase))
            .collect();
        let a0 = num(&rows[first - 1], app)?;
        let a1 = num(pass.last().expect("one row at least"), app)?;
        let mut t_prev = num(&rows[first - 1], t)?;
        let mut mb = vec![vec![0.0; rates.len()]; 4];
        for r in pass {
            let t_now = num(r, t)?;
            let f = (num(r, app)? - a0) / (a1 - a0).max(1e-9);
            let q = ((f * 4.0 - 1e-9).max(0.0) as usize).min(3);
            for (v, &c) in rates.iter().enumerate() {
                mb[q][v] += num(r, c)? * (t_now - t_prev);
            }
            t_prev = t_now;
        }
        Ok(Some(PassQuarters { mb }))
    }

    /// From a simulated run: pass `pass` (0 = the first pass over the
    /// data) of `passes`, by data committed; each vdev's device bytes
    /// between the quarter boundaries.
    pub fn from_run(r: &RunResult, pass: u32, passes: u32) -> PassQuarters {
        let per_pass = r.bytes_planned / passes.max(1) as u64;
        let n = r.samples.last().map_or(0, |s| s.vdevs.len());
        let at = |c: u64| {
            let s = r
                .samples
                .iter()
                .find(|s| s.committed >= c)
                .or(r.samples.last());
            (0..n)
                .map(|v| s.and_then(|s| s.vdevs.get(v)).map_or(0, |x| x.bytes_done))
                .collect::<Vec<u64>>()
        };
        let start = per_pass * pass as u64;
        let mb = (0..4u64)
            .map(|q| {
                let a = at(start + per_pass * q / 4);
                let b = at(start + per_pass * (q + 1) / 4);
                a.iter()
                    .zip(&b)
                    .map(|(a, b)| b.saturating_sub(*a) as f64 / 1e6)
                    .collect()
            })
            .collect();
        PassQuarters { mb }
    }

    /// The last vdev's share of each quarter's device bytes, in %.
    pub fn new_share_pct(&self) -> Vec<f64> {
        self.mb
            .iter()
            .map(|q| {
                let total: f64 = q.iter().sum();
                100.0 * q.last().copied().unwrap_or(0.0) / total.max(1e-9)
            })
            .collect()
    }

    /// Measured beside simulated, one line per quarter.
    pub fn table(measured: &PassQuarters, simulated: &PassQuarters) -> String {
        let f = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        let (ms, ss) = (measured.new_share_pct(), simulated.new_share_pct());
        let mut out = String::from(
            "quarter  measured MB  simulated MB  last vdev's share measured · simulated\n",
        );
        for q in 0..4 {
            out += &format!(
                "  {}      {:<12} {:<13} {:.0} % · {:.0} %\n",
                q + 1,
                f(measured.mb.get(q).map_or(&[][..], |v| v)),
                f(simulated.mb.get(q).map_or(&[][..], |v| v)),
                ms.get(q).copied().unwrap_or(0.0),
                ss.get(q).copied().unwrap_or(0.0)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fill row before the add (one vdev: shorter), then a pass of four
    /// rows, one per quarter of its 400 MiB.
    const LOG: &str = "# made up\n\
phase,t_s,app_MiB,pool_fill_pct,v0_used_pct,v0_write_MBps,v1_used_pct,v1_write_MBps,spread_pp\n\
fill,10.0,400,90.0,90.0,50.0,90.0\n\
rewrite1,11.0,500,45.0,80.0,10.0,10.0,90.0,70.0\n\
rewrite1,12.0,600,45.0,70.0,20.0,20.0,80.0,50.0\n\
rewrite1,14.0,700,45.0,60.0,30.0,30.0,70.0,30.0\n\
rewrite1,15.0,800,45.0,50.0,40.0,40.0,60.0,10.0\n";

    #[test]
    fn pass_quarters_integrate_rates_and_short_rows_parse() {
        let q = PassQuarters::from_log(LOG, "rewrite1").unwrap().unwrap();
        // Rate × seconds since the previous row, per quarter.
        assert_eq!(
            q.mb,
            vec![
                vec![10.0, 90.0],
                vec![20.0, 80.0],
                vec![60.0, 140.0],
                vec![40.0, 60.0]
            ]
        );
        assert_eq!(q.new_share_pct(), vec![90.0, 80.0, 70.0, 60.0]);
        assert!(PassQuarters::from_log(LOG, "rewrite2").unwrap().is_none());
        let f = FillCurve::from_log(LOG).unwrap();
        assert_eq!(f.rows.len(), 1);
        assert_eq!(f.rows[0].used_pct, vec![90.0], "the fill row has one vdev");
    }
}
