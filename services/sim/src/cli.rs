//! The `aliquot-sim` command line: `run`, `compare`, `check`, `list`, `tunables` and `rebalance`.
//! Exit codes: 0 ok, 1 a run failed, 2 bad usage or a bad scenario.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use clap::{Parser, Subcommand};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::scenario::{self, Scenario, ScenarioError};

#[derive(Debug, Parser)]
#[command(
    name = "aliquot-sim",
    version,
    about = "Simulate a pool of mixed devices filling under crates/metaslab, in virtual time",
    long_about = "Simulate a pool of mixed devices filling under crates/metaslab, in virtual time.\n\n\
        A scenario (TOML) names the vdevs, the write load, events (vdev adds, load start/stop), \
        tunables and the throttle policies to compare; `run` simulates every policy × block size × \
        variant and writes summary.json, timeseries.csv and SVG charts. See services/sim/README.md \
        for the scenario keys."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run every policy (× block size × variant) of a scenario and write the results.
    Run {
        /// The scenario file.
        scenario: PathBuf,
        /// Output directory (created): summary.json, timeseries.csv, *.svg.
        #[arg(long, env = "ALIQUOT_SIM_OUT")]
        out: PathBuf,
        /// Runs simulated at once (default: the number of CPUs).
        #[arg(long, env = "ALIQUOT_SIM_JOBS")]
        jobs: Option<usize>,
        /// Only the runs whose label (e.g. `unified`, `legacy-16K`) contains this.
        #[arg(long, env = "ALIQUOT_SIM_ONLY")]
        only: Option<String>,
        /// No progress bars.
        #[arg(long, short, env = "ALIQUOT_SIM_QUIET")]
        quiet: bool,
        /// Run the experiment N times smaller and faster (capacities, amounts
        /// and times divided by N; bandwidths kept) for a quick look.
        #[arg(long, env = "ALIQUOT_SIM_SCALE", default_value_t = 1)]
        scale: u64,
    },
    /// Run one policy of a scenario and set it beside a measured OpenZFS log
    /// (scenarios/calibration/*.log): used % at 25/50/75/90 % pool fill, max
    /// spread, and a chart of both curves against pool fill.
    Compare {
        /// The scenario file (e.g. scenarios/calibration/t1c.toml).
        scenario: PathBuf,
        /// The measured log (e.g. scenarios/calibration/t1c-2.4.log).
        log: PathBuf,
        /// The run to compare (`unified` for 2.4 logs, `legacy` for 2.3).
        #[arg(long, env = "ALIQUOT_SIM_POLICY", default_value = "unified")]
        policy: String,
        /// Where the chart goes (SVG).
        #[arg(long, env = "ALIQUOT_SIM_CHART", default_value = "compare.svg")]
        chart: PathBuf,
    },
    /// Parse and validate a scenario (tunable names and values included) without running it.
    Check { scenario: PathBuf },
    /// List the scenarios in a directory (default: the shipped ones).
    List {
        #[arg(env = "ALIQUOT_SIM_SCENARIOS")]
        dir: Option<PathBuf>,
    },
    /// List the tunables a scenario's [tunables] table accepts.
    Tunables,
    /// What-if for the balancer: run the allocator's rebalance planner plan
    /// after plan on the given vdevs until the balance score reaches the
    /// target; print each plan's bytes and score, and the time at --rate.
    Rebalance {
        /// A vdev as CAPACITY:ALLOCATED (e.g. 10G:8G), once per vdev.
        #[arg(
            long = "vdev",
            required = true,
            env = "ALIQUOT_SIM_VDEVS",
            value_delimiter = ','
        )]
        vdevs: Vec<String>,
        /// Size of the modelled blocks (the planner moves whole blocks).
        #[arg(long, env = "ALIQUOT_SIM_BLOCK_SIZE", default_value = "16M", value_parser = units::size_arg)]
        block_size: u64,
        /// Mover budget in bytes/s (e.g. 100M).
        #[arg(long, env = "ALIQUOT_SIM_RATE", default_value = "100M", value_parser = units::rate_arg)]
        rate: f64,
        /// Fraction of allocated bytes one plan may move.
        #[arg(long, env = "ALIQUOT_SIM_MAX_MISPLACED", default_value_t = 0.05)]
        max_misplaced: f64,
        /// Bytes one plan may move (0: only --max-misplaced).
        #[arg(long, env = "ALIQUOT_SIM_BUDGET", default_value = "0", value_parser = units::size_arg)]
        budget: u64,
        /// Stop once the score is at or below this.
        #[arg(long, env = "ALIQUOT_SIM_TARGET_SCORE", default_value_t = 0.01)]
        target_score: f64,
        /// Stop after this many plans.
        #[arg(long, env = "ALIQUOT_SIM_MAX_PLANS", default_value_t = 1000)]
        max_plans: usize,
        /// Drain this vdev (index from 0, in --vdev order): move everything off it.
        #[arg(long, env = "ALIQUOT_SIM_DRAIN", value_delimiter = ',')]
        drain: Vec<usize>,
    },
}

/// Failure of a command, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error("{0:#}")]
    Run(anyhow::Error),
}

impl CliError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Scenario(_) => 2,
            CliError::Run(_) => 1,
        }
    }
}

pub fn default_scenario_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

pub fn execute(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Run {
            scenario,
            out,
            jobs,
            only,
            quiet,
            scale,
        } => {
            let sc = Scenario::from_file(&scenario)?.scaled_down(scale);
            let mut runs = sc.runs();
            if let Some(f) = &only {
                runs.retain(|r| r.label.contains(f.as_str()));
                if runs.is_empty() {
                    return Err(ScenarioError::Invalid {
                        key: "--only".into(),
                        reason: format!("no run label contains {f:?}"),
                    }
                    .into());
                }
            }
            for r in &runs {
                crate::build_pool(&sc, r)?;
            }
            let jobs = jobs
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                .max(1);
            let results = run_many(&sc, &runs, jobs, quiet).map_err(CliError::Run)?;
            let summary = crate::write_outputs(&out, &sc, &results).map_err(CliError::Run)?;
            let mut o = std::io::stdout().lock();
            for r in &summary.runs {
                let _ = writeln!(
                    o,
                    "{:<24} {:>9.1} s  {:>12}  spread max {:>5.1}% final {:>5.1}%  ({})",
                    r.label,
                    r.total_time_s,
                    units::format_rate(r.mean_throughput_bytes_per_s),
                    r.max_spread * 100.0,
                    r.final_spread * 100.0,
                    r.stop_reason
                );
                if let Some(l) = &r.log {
                    let _ = writeln!(
                        o,
                        "{:<24} sync writes {:.0}/s, latency mean {:.1} us p99 {:.1} us, txg-wait fallbacks {}, metaslab loads {}",
                        "",
                        l.sync_writes_per_s,
                        l.latency_mean_us,
                        l.latency_p99_us,
                        l.txg_wait_fallbacks,
                        l.metaslab_loads
                    );
                }
            }
            let _ = writeln!(o, "wrote {}", out.display());
            Ok(())
        }
        Command::Compare {
            scenario,
            log,
            policy,
            chart,
        } => {
            let sc = Scenario::from_file(&scenario)?;
            let Some(spec) = sc.runs().into_iter().find(|r| r.label == policy) else {
                return Err(ScenarioError::Invalid {
                    key: "--policy".into(),
                    reason: format!("{} has no run {policy:?}", sc.name),
                }
                .into());
            };
            crate::build_pool(&sc, &spec)?;
            let text = std::fs::read_to_string(&log).map_err(|source| ScenarioError::Read {
                path: log.display().to_string(),
                source,
            })?;
            let measured = crate::calibration::FillCurve::from_log(&text)
                .map_err(|e| CliError::Run(e.context(format!("{}", log.display()))))?;
            let r = run_many(&sc, std::slice::from_ref(&spec), 1, false)
                .map_err(CliError::Run)?
                .remove(0);
            let simulated = crate::calibration::FillCurve::from_run(&r);
            let c = crate::calibration::Comparison::new(&measured, &simulated);
            let title = format!(
                "{} {policy}: simulated (lines) vs {} (dots)",
                sc.name,
                log.file_name().unwrap_or_default().to_string_lossy()
            );
            crate::chart::compare_chart(&chart, &title, &r.vdev_names, &measured, &simulated)
                .map_err(CliError::Run)?;
            // Built whole, then written once: a reader that closes early
            // (`| head`) ends the output, not the process with a panic.
            let mut out = c.table();
            let secs = r.end_time as f64 / 1e9;
            out += &format!(
                "run: {:.1} s, {:.0} MiB/s",
                secs,
                r.bytes_committed as f64 / secs.max(1e-9) / 1048576.0
            );
            out += &match r.cpu_utilisation() {
                // Past 90 % busy the CPUs, not the devices, set the pace.
                Some(u) if u >= 0.9 => format!("; CPUs {:.0} % busy: CPU-bound\n", 100.0 * u),
                Some(u) => format!("; CPUs {:.0} % busy: device-bound\n", 100.0 * u),
                None => "; no [cpu]: device-bound\n".to_string(),
            };
            // A rewrite experiment (t5c): the first rewrite pass by quarters.
            if let Some(m) = crate::calibration::PassQuarters::from_log(&text, "rewrite1")
                .map_err(|e| CliError::Run(e.context(format!("{}", log.display()))))?
            {
                let passes = sc.load.as_ref().map_or(1, |l| l.passes);
                let s = crate::calibration::PassQuarters::from_run(&r, 1, passes);
                out += "first rewrite pass (rewrite1):\n";
                out += &crate::calibration::PassQuarters::table(&m, &s);
            }
            out += &format!("({}) wrote {}\n", r.stop_reason, chart.display());
            let _ = std::io::stdout().lock().write_all(out.as_bytes());
            Ok(())
        }
        Command::Check { scenario } => {
            let sc = Scenario::from_file(&scenario)?;
            for r in sc.runs() {
                crate::build_pool(&sc, &r)?;
            }
            let labels: Vec<String> = sc.runs().into_iter().map(|r| r.label).collect();
            println!(
                "{}: ok, {} run(s): {}",
                sc.name,
                labels.len(),
                labels.join(", ")
            );
            Ok(())
        }
        Command::List { dir } => {
            let dir = dir.unwrap_or_else(default_scenario_dir);
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map_err(|source| ScenarioError::Read {
                    path: dir.display().to_string(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .collect();
            files.sort();
            for f in files {
                match Scenario::from_file(&f) {
                    Ok(sc) => println!(
                        "{:<40} {} run(s)  {}",
                        f.file_name().unwrap().to_string_lossy(),
                        sc.runs().len(),
                        sc.description.lines().next().unwrap_or("")
                    ),
                    Err(e) => println!(
                        "{:<40} INVALID: {e}",
                        f.file_name().unwrap().to_string_lossy()
                    ),
                }
            }
            Ok(())
        }
        Command::Rebalance {
            vdevs,
            block_size,
            rate,
            max_misplaced,
            budget,
            target_score,
            max_plans,
            drain,
        } => {
            let bad = |m: String| {
                CliError::Scenario(ScenarioError::Invalid {
                    key: "--vdev".into(),
                    reason: m,
                })
            };
            let mut parsed = Vec::new();
            for v in &vdevs {
                let (c, a) = v
                    .split_once(':')
                    .ok_or_else(|| bad(format!("{v:?}: want CAPACITY:ALLOCATED")))?;
                let size = |s: &str| units::parse_size(s).map_err(|e| bad(format!("{v:?}: {e}")));
                parsed.push(crate::rebalance::WhatIfVdev {
                    capacity: size(c)?,
                    alloc: size(a)?,
                });
            }
            let limits = metaslab::move_plan::PlanLimits {
                max_misplaced,
                byte_budget: budget,
            };
            let r = crate::rebalance::simulate(
                &parsed,
                &drain,
                block_size,
                limits,
                rate,
                target_score,
                max_plans,
            )
            .map_err(|e| bad(e.to_string()))?;
            crate::rebalance::print(&r, rate);
            Ok(())
        }
        Command::Tunables => {
            for (name, what) in scenario::SIM_TUNABLES {
                println!("{name:<48} (simulator) {what}");
            }
            for (info, value) in metaslab::Tunables::default().list() {
                println!("{:<48} {value:<12} {}", info.name, info.description);
            }
            Ok(())
        }
    }
}

/// Simulate `runs` on up to `jobs` threads; results in `runs` order.
pub fn run_many(
    sc: &Scenario,
    runs: &[crate::RunSpec],
    jobs: usize,
    quiet: bool,
) -> anyhow::Result<Vec<crate::RunResult>> {
    let multi = MultiProgress::new();
    if quiet {
        multi.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style =
        ProgressStyle::with_template("{prefix:>24} [{bar:40}] {percent:>3}% {elapsed_precise}")
            .expect("valid template")
            .progress_chars("=> ");
    let bars: Vec<ProgressBar> = runs
        .iter()
        .map(|r| {
            let b = multi.add(ProgressBar::new(1000));
            b.set_style(style.clone());
            b.set_prefix(r.label.clone());
            b
        })
        .collect();
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Option<anyhow::Result<crate::RunResult>>>> =
        Mutex::new((0..runs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.min(runs.len()) {
            s.spawn(|| {
                loop {
                    let i = {
                        let mut n = next.lock().unwrap();
                        if *n >= runs.len() {
                            return;
                        }
                        *n += 1;
                        *n - 1
                    };
                    let bar = &bars[i];
                    let r = crate::run_one(sc, &runs[i], &mut |f| {
                        bar.set_position((f * 1000.0) as u64)
                    })
                    .map_err(|e| e.context(format!("run {}", runs[i].label)));
                    bar.finish();
                    results.lock().unwrap()[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every run ran"))
        .collect()
}
