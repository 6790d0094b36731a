//! `aliquotctl balancer`: how balanced the pool is, in the terms of
//! `ceph balancer eval`. `eval` prints each class's balance score (computed
//! by the allocator, `metaslab::balance`), and per vdev its fill, VAR, the
//! bytes it would hold if every vdev were equally full (TARGET) and how far
//! it is from that (EXCESS: positive on over-full vdevs, the bytes a
//! rebalance would move off them).

use aliquot_proto::v1::{
    ClassStatus, GetPoolRequest, PlanRebalanceRequest, PoolStatus, RebalancePlan,
};
use serde::Serialize;
use tracing::Instrument;
use units::format_bytes_short as short;

use crate::client::AllocatorArgs;
use crate::names::vdev_label;

#[derive(Clone, Debug, clap::Args)]
pub struct BalancerArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(subcommand)]
    pub cmd: BalancerCmd,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum BalancerCmd {
    /// The balance score of each class (0 = every vdev equally full, < 1)
    /// and each vdev's VAR, target and excess.
    Eval {
        /// Print JSON (64-bit integers as strings).
        #[arg(long, env = "ALIQUOT_JSON")]
        json: bool,
    },
    /// Carry out rebalance plans for the blocks of the manifests (those
    /// `write` records in aliquot-data/manifests, or --manifest): each move copies a block to its new extent and commits
    /// it (the old extent is freed in the same txg), at most --rate, plan
    /// after plan until the score reaches --target-score. Interrupted (even
    /// by kill -9), run it again: it settles what was in flight first.
    Execute(crate::mover::ExecuteArgs),
    /// What the balancer is doing: the last plan and its progress, moves in
    /// flight and durable, vdevs being drained.
    Status {
        /// Print JSON (64-bit integers as strings).
        #[arg(long, env = "ALIQUOT_JSON")]
        json: bool,
    },
    /// Read every block of the manifests back and compare it with what was
    /// written; --exclusive also checks that they account for every
    /// allocated byte.
    Verify(crate::mover::VerifyManifestArgs),
    /// A bounded rebalance plan from the allocator: which committed extents
    /// to move off over-full vdevs, to which vdev, and the score after.
    /// Nothing moves: the client that owns the data carries a plan out.
    Plan {
        /// Fraction of the class's allocated bytes one plan may move.
        #[arg(long, env = "ALIQUOT_BALANCER_MAX_MISPLACED", default_value_t = 0.05)]
        max_misplaced: f64,
        /// Bytes one plan may move at most (default: no limit but the above).
        #[arg(long, env = "ALIQUOT_BALANCER_BUDGET", value_parser = units::size_arg)]
        budget: Option<u64>,
        /// The mover's rate, to predict how long the plan takes, e.g. 100MiB/s.
        #[arg(long, env = "ALIQUOT_BALANCER_RATE", value_parser = units::rate_arg)]
        rate: Option<f64>,
        /// Moves to list (all with --json).
        #[arg(long, env = "ALIQUOT_BALANCER_SHOW", default_value_t = 10)]
        show: usize,
        /// Plan moving everything off this vdev (name or id; it must be
        /// offline: `aliquotctl vdev drain` does both). Repeatable.
        #[arg(long, env = "ALIQUOT_BALANCER_DRAIN", value_delimiter = ',')]
        drain: Vec<String>,
        /// Print JSON (64-bit integers as strings).
        #[arg(long, env = "ALIQUOT_JSON")]
        json: bool,
    },
}

pub async fn run(args: BalancerArgs) -> anyhow::Result<()> {
    match &args.cmd {
        BalancerCmd::Execute(e) => {
            let r = crate::mover::execute(&args.conn, e).await?;
            if e.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", crate::mover::render_execute(&r));
            }
            if !r.left.is_empty() {
                anyhow::bail!(
                    "the drain did not empty {}",
                    r.left
                        .iter()
                        .map(|l| vdev_label(l.vdev, &l.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            return Ok(());
        }
        BalancerCmd::Verify(v) => {
            // The command's trace holds every Read it makes.
            let r = crate::mover::verify(&args.conn, v)
                .instrument(tracing::info_span!("aliquotctl.balancer.verify"))
                .await?;
            if v.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!(
                    "{} manifests, {} blocks, {} copies, {} of data: all intact{}{}",
                    r.manifests,
                    r.blocks,
                    r.copies,
                    short(r.bytes),
                    if v.exclusive {
                        "; every vdev holds exactly its copies"
                    } else {
                        ""
                    },
                    if r.pending > 0 {
                        format!(
                            " ({} moves pending: `balancer execute` settles them)",
                            r.pending
                        )
                    } else {
                        String::new()
                    }
                );
            }
            return Ok(());
        }
        BalancerCmd::Status { json } => {
            let mut c = args.conn.connect().await?;
            let st = c
                .balancer_status(aliquot_proto::v1::BalancerStatusRequest::default())
                .await
                .map_err(|s| crate::client::status_msg("balancer status", &s))?
                .into_inner();
            if *json {
                println!("{}", serde_json::to_string_pretty(&status_json(&st))?);
            } else {
                print!("{}", render_status(&st));
            }
            return Ok(());
        }
        _ => {}
    }
    let mut c = args.conn.connect().await?;
    if let BalancerCmd::Plan {
        max_misplaced,
        budget,
        rate,
        show,
        json,
        drain,
    } = args.cmd
    {
        let st = c
            .get_pool(GetPoolRequest {})
            .await
            .map_err(|s| crate::client::status_msg("get pool", &s))?
            .into_inner();
        let drain = drain
            .iter()
            .map(|d| crate::names::resolve_vdev(&st, d).map(|(id, _)| id))
            .collect::<Result<Vec<_>, _>>()
            .map_err(anyhow::Error::msg)?;
        let p = c
            .plan_rebalance(PlanRebalanceRequest {
                max_misplaced,
                byte_budget: budget.unwrap_or(0),
                bytes_per_sec: rate.map_or(0, |r| r as u64),
                drain,
            })
            .await
            .map_err(|s| crate::client::status_msg("plan rebalance", &s))?
            .into_inner();
        if json {
            println!("{}", serde_json::to_string_pretty(&plan_json(&p))?);
        } else {
            print!("{}", render_plan(&st, &p, show));
        }
        return Ok(());
    }
    let st = c
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|s| crate::client::status_msg("get pool", &s))?
        .into_inner();
    match args.cmd {
        BalancerCmd::Plan { .. }
        | BalancerCmd::Execute(_)
        | BalancerCmd::Status { .. }
        | BalancerCmd::Verify(_) => unreachable!("handled above"),
        BalancerCmd::Eval { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&eval_json(&st))?);
            } else {
                print!("{}", render_eval(&st));
            }
        }
    }
    Ok(())
}

/// `balancer status` as text.
pub fn render_status(st: &aliquot_proto::v1::BalancerStatusReply) -> String {
    let mut out = format!("score {:.4} ({})\n", st.score, verdict(st.score));
    if st.plan_id == 0 {
        out.push_str("no plan made since the allocator started\n");
    } else {
        let pct = if st.plan_bytes == 0 {
            100.0
        } else {
            st.plan_done_bytes as f64 * 100.0 / st.plan_bytes as f64
        };
        out.push_str(&format!(
            "plan {} of generation {}: {}/{} moves, {}/{} ({pct:.0} %), score {:.4} → {:.4} \
             predicted\n",
            st.plan_id & 0xffff_ffff,
            st.plan_id >> 32,
            st.plan_done_moves,
            st.plan_moves,
            short(st.plan_done_bytes),
            short(st.plan_bytes),
            st.plan_score_before,
            st.plan_score_after
        ));
    }
    out.push_str(&format!(
        "in flight: {} moves ({}); durable moves ever: {} ({})\n",
        st.in_flight,
        short(st.in_flight_bytes),
        st.durable_moves,
        short(st.durable_bytes)
    ));
    for d in &st.draining {
        out.push_str(&format!(
            "draining {}: {} left\n",
            vdev_label(d.vdev, &d.name),
            short(d.alloc)
        ));
    }
    out
}

fn status_json(st: &aliquot_proto::v1::BalancerStatusReply) -> serde_json::Value {
    serde_json::json!({
        "score": st.score,
        "plan_id": st.plan_id.to_string(),
        "plan_moves": st.plan_moves.to_string(),
        "plan_bytes": st.plan_bytes.to_string(),
        "plan_done_moves": st.plan_done_moves.to_string(),
        "plan_done_bytes": st.plan_done_bytes.to_string(),
        "plan_score_before": st.plan_score_before,
        "plan_score_after": st.plan_score_after,
        "in_flight": st.in_flight,
        "in_flight_bytes": st.in_flight_bytes.to_string(),
        "durable_moves": st.durable_moves.to_string(),
        "durable_bytes": st.durable_bytes.to_string(),
        "draining": st.draining.iter().map(|d| serde_json::json!({
            "vdev": d.vdev, "name": d.name, "alloc": d.alloc.to_string(),
        })).collect::<Vec<_>>(),
        "generation": st.generation.to_string(),
    })
}

/// A score an operator can read at a glance.
pub fn verdict(score: f64) -> &'static str {
    if score < 0.01 {
        "balanced"
    } else if score < 0.05 {
        "nearly balanced"
    } else if score < 0.15 {
        "unbalanced"
    } else {
        "badly unbalanced"
    }
}

/// Classes worth evaluating: with space and more than one vdev (the
/// embedded log class mirrors normal's vdevs).
fn classes(st: &PoolStatus) -> impl Iterator<Item = &ClassStatus> {
    st.classes
        .iter()
        .filter(|c| c.space > 0 && c.groups.len() > 1 && c.name != "embedded_log")
}

#[derive(Debug, Serialize)]
pub struct VdevEval {
    pub vdev: u32,
    pub name: String,
    #[serde(serialize_with = "crate::status::as_string")]
    pub capacity: u64,
    #[serde(serialize_with = "crate::status::as_string")]
    pub alloc: u64,
    pub used: f64,
    pub var: Option<f64>,
    #[serde(serialize_with = "crate::status::as_string")]
    pub target: u64,
    /// alloc − target, bytes (negative: room to take more).
    #[serde(serialize_with = "crate::status::as_string")]
    pub excess: i64,
}

#[derive(Debug, Serialize)]
pub struct ClassEval {
    pub class: String,
    pub score: f64,
    pub verdict: &'static str,
    pub used: f64,
    /// Σ of positive excess: the fewest bytes a rebalance must move.
    #[serde(serialize_with = "crate::status::as_string")]
    pub misplaced: u64,
    pub vdevs: Vec<VdevEval>,
}

pub fn eval(st: &PoolStatus) -> Vec<ClassEval> {
    classes(st)
        .map(|c| {
            let cap: u128 = c.groups.iter().map(|g| u128::from(g.capacity)).sum();
            let alloc: u128 = c.groups.iter().map(|g| u128::from(g.alloc)).sum();
            let cu = if cap == 0 {
                0.0
            } else {
                alloc as f64 / cap as f64
            };
            let vdevs: Vec<VdevEval> = c
                .groups
                .iter()
                .map(|g| {
                    let used = if g.capacity == 0 {
                        0.0
                    } else {
                        g.alloc as f64 / g.capacity as f64
                    };
                    let target = (g.capacity as f64 * cu) as u64;
                    VdevEval {
                        vdev: g.vdev,
                        name: st
                            .vdevs
                            .iter()
                            .find(|v| v.vdev == g.vdev)
                            .map(|v| v.name.clone())
                            .unwrap_or_default(),
                        capacity: g.capacity,
                        alloc: g.alloc,
                        used,
                        var: (g.capacity > 0 && cu > 0.0).then(|| used / cu),
                        target,
                        excess: g.alloc as i64 - target as i64,
                    }
                })
                .collect();
            ClassEval {
                class: c.name.clone(),
                score: c.balance_score,
                verdict: verdict(c.balance_score),
                used: cu,
                misplaced: vdevs.iter().map(|v| v.excess.max(0) as u64).sum(),
                vdevs,
            }
        })
        .collect()
}

fn plan_json(p: &RebalancePlan) -> serde_json::Value {
    serde_json::json!({
        "bytes": p.bytes.to_string(),
        "limit_bytes": p.limit_bytes.to_string(),
        "lower_bound_bytes": p.lower_bound_bytes.to_string(),
        "score_before": p.score_before,
        "score_after": p.score_after,
        "predicted_ms": p.predicted_ms.to_string(),
        "generation": p.generation.to_string(),
        "moves": p.moves.iter().map(|m| {
            let e = m.extent.unwrap_or_default();
            serde_json::json!({
                "vdev": e.vdev,
                "offset": e.offset.to_string(),
                "size": e.size.to_string(),
                "to_vdev": m.to_vdev,
            })
        }).collect::<Vec<_>>(),
    })
}

pub fn render_plan(st: &PoolStatus, p: &RebalancePlan, show: usize) -> String {
    use std::fmt::Write as _;
    let name = |id: u32| {
        let n = st
            .vdevs
            .iter()
            .find(|v| v.vdev == id)
            .map_or("", |v| v.name.as_str());
        vdev_label(id, n)
    };
    let mut out = String::new();
    if p.moves.is_empty() {
        let _ = writeln!(
            out,
            "nothing to move: score {:.3} ({}); no move of a committed extent within {} lowers it",
            p.score_before,
            verdict(p.score_before),
            short(p.limit_bytes)
        );
        return out;
    }
    let _ = writeln!(
        out,
        "plan: {} moves, {} (bound {}; {} must move to balance), score {:.3} -> {:.3}{}",
        p.moves.len(),
        short(p.bytes),
        short(p.limit_bytes),
        short(p.lower_bound_bytes),
        p.score_before,
        p.score_after,
        if p.predicted_ms > 0 {
            format!(
                ", about {:.1} s at the given rate",
                p.predicted_ms as f64 / 1000.0
            )
        } else {
            String::new()
        }
    );
    let mut per: std::collections::BTreeMap<(u32, u32), (usize, u64)> = Default::default();
    for m in &p.moves {
        let e = m.extent.unwrap_or_default();
        let x = per.entry((e.vdev, m.to_vdev)).or_default();
        x.0 += 1;
        x.1 += e.size;
    }
    for ((from, to), (n, b)) in per {
        let _ = writeln!(
            out,
            "  {} -> {}: {n} extents, {}",
            name(from),
            name(to),
            short(b)
        );
    }
    for m in p.moves.iter().take(show) {
        let e = m.extent.unwrap_or_default();
        let _ = writeln!(
            out,
            "  move {}:{:#x}+{} -> {}",
            name(e.vdev),
            e.offset,
            short(e.size),
            name(m.to_vdev)
        );
    }
    if p.moves.len() > show {
        let _ = writeln!(
            out,
            "  ... {} more (--show N, or --json)",
            p.moves.len() - show
        );
    }
    out
}

fn eval_json(st: &PoolStatus) -> serde_json::Value {
    serde_json::json!({ "pool": st.name, "classes": eval(st) })
}

pub fn render_eval(st: &PoolStatus) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let evals = eval(st);
    if evals.is_empty() {
        let _ = writeln!(
            out,
            "pool {}: nothing to balance (no class has two vdevs with space)",
            st.name
        );
        return out;
    }
    for e in evals {
        let _ = writeln!(
            out,
            "pool {} class {}: score {:.3} ({}; 0 = every vdev equally full), {:.0}% used, {} misplaced",
            st.name,
            e.class,
            e.score,
            e.verdict,
            e.used * 100.0,
            short(e.misplaced)
        );
        let _ = writeln!(
            out,
            "{:<14} {:>7} {:>7} {:>5} {:>6} {:>7} {:>8}",
            "VDEV", "SIZE", "ALLOC", "CAP", "VAR", "TARGET", "EXCESS"
        );
        for v in &e.vdevs {
            let excess = if v.excess >= 0 {
                format!("+{}", short(v.excess as u64))
            } else {
                format!("-{}", short(v.excess.unsigned_abs()))
            };
            let _ = writeln!(
                out,
                "{:<14} {:>7} {:>7} {:>4}% {:>6} {:>7} {:>8}",
                vdev_label(v.vdev, &v.name),
                short(v.capacity),
                short(v.alloc),
                (v.used * 100.0).floor(),
                v.var.map_or("-".into(), |x| format!("{x:.2}")),
                short(v.target),
                excess
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_proto::v1::{GroupStatus, VdevStatus};

    const MIB: u64 = 1 << 20;

    #[test]
    fn eval_of_the_unbalanced_pool() {
        let g = |vdev, capacity, alloc| GroupStatus {
            vdev,
            capacity,
            alloc,
            ..Default::default()
        };
        let st = PoolStatus {
            name: "tank".into(),
            classes: vec![ClassStatus {
                name: "normal".into(),
                space: 7168 * MIB,
                balance_score: 0.091,
                groups: vec![
                    g(0, 1024 * MIB, 901 * MIB),
                    g(1, 2048 * MIB, 717 * MIB),
                    g(2, 4096 * MIB, 1679 * MIB),
                ],
                ..Default::default()
            }],
            vdevs: (0..3)
                .map(|i| VdevStatus {
                    vdev: i,
                    name: format!("file{i}"),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let e = &eval(&st)[0];
        assert_eq!(e.verdict, "unbalanced");
        // Class 3297/7168 used: file0's target is 471 MiB, 430 over.
        assert_eq!(
            e.vdevs[0].target,
            (1024.0 * MIB as f64 * 3297.0 / 7168.0) as u64
        );
        assert!(e.vdevs[0].excess > 429 * MIB as i64 && e.vdevs[0].excess < 431 * MIB as i64);
        assert_eq!(e.misplaced, e.vdevs[0].excess as u64);
        let t = render_eval(&st);
        assert!(
            t.starts_with("pool tank class normal: score 0.091 (unbalanced;"),
            "{t}"
        );
        assert!(t.contains("file0 (0)") && t.contains("+430M"), "{t}");
    }
}
