//! Administrative commands: tunables (list / get / set) and vdev add /
//! online / offline / expand. Each is one RPC; the allocator validates, and its
//! message is passed on to the operator unchanged. Vdevs are named as
//! `status` shows them (name or id); a mistyped name gets a suggestion.

use aliquot_proto::v1::{
    GetPoolRequest, GetTunablesRequest, SetTunableRequest, SetVdevStateRequest, TunableList,
};

use crate::client::{self, AllocatorArgs};
use crate::names::{did_you_mean, resolve_vdev, split_assignment, vdev_label};
use crate::status::health_name;

#[derive(Clone, Debug, clap::Args)]
pub struct TunablesArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(subcommand)]
    pub cmd: Option<TunablesCmd>,
    /// Print JSON.
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum TunablesCmd {
    /// List every tunable with its value, default and meaning (the default).
    List,
    /// Print one tunable's value.
    Get { name: String },
    /// Change a tunable at run time (persisted): `set metaslab_perf_bias=0`
    /// or `set metaslab_perf_bias 0`.
    Set {
        /// NAME=VALUE, or NAME followed by VALUE.
        name: String,
        value: Option<String>,
    },
}

pub async fn tunables(args: TunablesArgs) -> anyhow::Result<()> {
    let mut c = args.conn.connect().await?;
    match args.cmd.unwrap_or(TunablesCmd::List) {
        TunablesCmd::List => {
            let list = c
                .get_tunables(GetTunablesRequest {})
                .await
                .map_err(|s| client::status_msg("get tunables", &s))?
                .into_inner();
            if args.json {
                let v: Vec<_> = list
                    .tunables
                    .iter()
                    .map(|t| {
                        serde_json::json!({"name": t.name, "value": t.value,
                            "default": t.default, "description": t.description})
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            let wn = list
                .tunables
                .iter()
                .map(|t| t.name.len())
                .max()
                .unwrap_or(4)
                .max(4);
            let wv = list
                .tunables
                .iter()
                .map(|t| t.value.len())
                .max()
                .unwrap_or(5)
                .max(5);
            let wd = list
                .tunables
                .iter()
                .map(|t| t.default.len())
                .max()
                .unwrap_or(7)
                .max(7);
            println!(
                "{:<wn$}  {:>wv$}  {:>wd$}  DESCRIPTION",
                "NAME", "VALUE", "DEFAULT"
            );
            for t in &list.tunables {
                let mark = if t.value != t.default { "*" } else { " " };
                println!(
                    "{:<wn$}  {:>wv$}  {:>wd$} {mark}{}",
                    t.name, t.value, t.default, t.description
                );
            }
        }
        TunablesCmd::Get { name } => {
            let list = c
                .get_tunables(GetTunablesRequest {})
                .await
                .map_err(|s| client::status_msg("get tunables", &s))?
                .into_inner();
            match list.tunables.iter().find(|t| t.name == name) {
                Some(t) => println!("{}", t.value),
                None => anyhow::bail!("{}", unknown_tunable(&name, &list)),
            }
        }
        TunablesCmd::Set { name, value } => {
            let (name, value) =
                split_assignment(&name, value.as_deref()).map_err(anyhow::Error::msg)?;
            let t = match c
                .set_tunable(SetTunableRequest {
                    name: name.clone(),
                    value: value.clone(),
                })
                .await
            {
                Ok(t) => t.into_inner(),
                Err(s) if s.code() == tonic::Code::NotFound => {
                    // Suggest from the allocator's own list: it is the truth.
                    let list = c
                        .get_tunables(GetTunablesRequest {})
                        .await
                        .map_err(|s| client::status_msg("get tunables", &s))?
                        .into_inner();
                    anyhow::bail!("{}", unknown_tunable(&name, &list));
                }
                Err(s) => {
                    return Err(client::status_msg(
                        &format!("set tunable {name}={value}"),
                        &s,
                    ));
                }
            };
            println!("{} = {} (default {})", t.name, t.value, t.default);
        }
    }
    Ok(())
}

fn unknown_tunable(name: &str, list: &TunableList) -> String {
    match did_you_mean(name, list.tunables.iter().map(|t| t.name.as_str())) {
        Some(n) => format!(
            "unknown tunable {name:?}; did you mean {n:?}? (`aliquotctl tunables` lists them)"
        ),
        None => format!("unknown tunable {name:?}; `aliquotctl tunables` lists them"),
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct VdevArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(subcommand)]
    pub cmd: VdevCmd,
}

#[derive(Clone, Debug, clap::Subcommand)]
pub enum VdevCmd {
    /// Admit a device waiting to join the pool (`status` lists pending
    /// devices): its agent registered it with a certificate no operator
    /// admitted, so it holds no space until this (like `zpool add`). NAME is
    /// the name its agent registered (or its certificate's name).
    Add {
        name: String,
        /// The device guid, when two pending devices share NAME.
        #[arg(long, value_parser = parse_guid)]
        guid: Option<u64>,
        /// How long to wait for NAME's agent to register first (it may
        /// still be starting), and then for it to report as a vdev.
        #[arg(long, default_value = "15s", value_parser = units::duration_arg)]
        wait: std::time::Duration,
    },
    /// Make a vdev allocatable again. VDEV is its name (file0) or id.
    Online { vdev: String },
    /// Stop allocating on a vdev (its data stays readable). VDEV is its
    /// name (file0) or id.
    Offline { vdev: String },
    /// Stop allocating on a vdev (offline, like `zpool set allocating=off`)
    /// and show the plan that moves everything off it (`balancer plan
    /// --drain VDEV`); VDEV is its name or id.
    Drain {
        vdev: String,
        /// Fraction of the class's allocated bytes one plan may move.
        #[arg(long, env = "ALIQUOT_BALANCER_MAX_MISPLACED", default_value_t = 0.05)]
        max_misplaced: f64,
    },
    /// Remove a vdev from the pool once it holds nothing (after `vdev
    /// drain` and `balancer execute --drain`); the pool forgets it for good.
    Remove {
        /// The vdev's name (file2) or id.
        vdev: String,
    },
    /// Grow a vdev to a larger capacity, e.g. after its device grew (like
    /// `zpool online -e`); agents' reports never grow a vdev.
    Expand {
        /// The vdev's name (file0) or id.
        vdev: String,
        /// The new capacity, e.g. 2GiB (never smaller than now).
        #[arg(value_parser = units::size_arg)]
        capacity: u64,
    },
}

fn parse_guid(s: &str) -> Result<u64, String> {
    let t = s.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse::<u64>(),
    }
    .map_err(|e| format!("{s:?} is not a device guid: {e}"))
}

/// `vdev add`: wait for NAME to be pending, admit it, then wait for its
/// agent to register again and the vdev to take allocations.
async fn vdev_add(
    c: &mut client::Allocator,
    name: &str,
    guid: Option<u64>,
    wait: std::time::Duration,
) -> anyhow::Result<()> {
    use std::time::{Duration, Instant};
    let until = Instant::now() + wait;
    let get = |c: &mut client::Allocator| {
        let mut c = c.clone();
        async move {
            c.get_pool(GetPoolRequest {})
                .await
                .map_err(|s| client::status_msg("get pool", &s))
                .map(|r| r.into_inner())
        }
    };
    loop {
        let pool = get(c).await?;
        let pending = pool.pending_vdevs.iter().any(|p| match guid {
            Some(g) => p.device_guid == g,
            None => p.name == name || p.agent == name,
        });
        if pending || Instant::now() >= until {
            break;
        }
        if pool.vdevs.iter().any(|v| v.name == name) && guid.is_none() {
            anyhow::bail!("{name} is a vdev of the pool already (`status` shows it)");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let v = c
        .admit_vdev(aliquot_proto::v1::AdmitVdevRequest {
            name: name.to_owned(),
            device_guid: guid.unwrap_or(0),
        })
        .await
        .map_err(|s| client::status_msg(&format!("vdev add {name}"), &s))?
        .into_inner();
    let label = vdev_label(v.vdev, &v.name);
    println!(
        "vdev {label} added: {} ({} metaslabs of {}), durable",
        units::format_bytes(v.capacity),
        v.metaslab_count,
        units::format_bytes(v.metaslab_size)
    );
    // Its agent registers again within its backoff (at most 5 s) and
    // then takes allocations.
    let until = Instant::now() + wait;
    loop {
        let pool = get(c).await?;
        let now = pool.vdevs.iter().find(|x| x.vdev == v.vdev);
        if let Some(x) = now
            && x.health == aliquot_proto::v1::VdevHealth::Healthy as i32
        {
            println!("vdev {label} is {}", health_name(x.health, x.online));
            return Ok(());
        }
        if Instant::now() >= until {
            println!(
                "vdev {label} waits for its agent to register again (it takes allocations once it does)"
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub async fn vdev(args: VdevArgs) -> anyhow::Result<()> {
    let mut c = args.conn.connect().await?;
    if let VdevCmd::Add { name, guid, wait } = &args.cmd {
        return vdev_add(&mut c, name, *guid, *wait).await;
    }
    let pool = c
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|s| client::status_msg("get pool", &s))?
        .into_inner();
    let spec = match &args.cmd {
        VdevCmd::Add { name, .. } => name.clone(),
        VdevCmd::Online { vdev }
        | VdevCmd::Offline { vdev }
        | VdevCmd::Expand { vdev, .. }
        | VdevCmd::Remove { vdev }
        | VdevCmd::Drain { vdev, .. } => vdev.clone(),
    };
    let (vdev, name) = resolve_vdev(&pool, &spec).map_err(anyhow::Error::msg)?;
    let label = vdev_label(vdev, &name);
    let online = match args.cmd {
        VdevCmd::Online { .. } => true,
        VdevCmd::Offline { .. } | VdevCmd::Add { .. } => false,
        VdevCmd::Drain { max_misplaced, .. } => {
            c.set_vdev_state(SetVdevStateRequest {
                vdev,
                online: false,
                drain: true,
            })
            .await
            .map_err(|s| client::status_msg(&format!("vdev drain {label}"), &s))?;
            let p = c
                .plan_rebalance(aliquot_proto::v1::PlanRebalanceRequest {
                    max_misplaced,
                    drain: vec![vdev],
                    ..Default::default()
                })
                .await
                .map_err(|s| client::status_msg(&format!("plan the drain of {label}"), &s))?
                .into_inner();
            println!(
                "vdev {label} is offline: no new allocations; {} allocated on it",
                units::format_bytes(
                    pool.vdevs
                        .iter()
                        .find(|v| v.vdev == vdev)
                        .map_or(0, |v| v.alloc)
                )
            );
            print!("{}", crate::balancer::render_plan(&pool, &p, 5));
            println!(
                "(each plan moves at most --max-misplaced of the pool; `balancer execute --drain \
                 {name}` carries the plans out for the blocks of the manifests `write` recorded, `vdev remove {name}` ends the drain \
                 once it is empty; `vdev online {name}` stops draining)"
            );
            return Ok(());
        }
        VdevCmd::Remove { .. } => {
            let r = c
                .remove_vdev(aliquot_proto::v1::RemoveVdevRequest { vdev })
                .await
                .map_err(|s| client::status_msg(&format!("vdev remove {label}"), &s))?
                .into_inner();
            if r.evacuating {
                println!(
                    "vdev {} is being removed: the allocator moves its {} ({} blocks) to the \
                     other vdevs; `aliquotctl status` shows the progress, and its agent may be \
                     stopped once it says done",
                    vdev_label(r.vdev, &r.name),
                    units::format_bytes(r.bytes),
                    r.extents
                );
            } else {
                println!(
                    "vdev {} removed from the pool (durable in txg {}); stop its agent",
                    vdev_label(r.vdev, &r.name),
                    r.txg
                );
            }
            return Ok(());
        }
        VdevCmd::Expand { capacity, .. } => {
            let v = c
                .expand_vdev(aliquot_proto::v1::ExpandVdevRequest { vdev, capacity })
                .await
                .map_err(|s| client::status_msg(&format!("vdev expand {label}"), &s))?
                .into_inner();
            println!(
                "vdev {} is {} ({} metaslabs of {})",
                vdev_label(v.vdev, &v.name),
                units::format_bytes(v.capacity),
                v.metaslab_count,
                units::format_bytes(v.metaslab_size)
            );
            return Ok(());
        }
    };
    let what = if online { "online" } else { "offline" };
    // Setting the state it is in changes nothing: say so (as `zpool
    // offline` of an offline device would).
    let already = pool
        .vdevs
        .iter()
        .find(|v| v.vdev == vdev)
        .is_some_and(|v| v.online == online);
    let v = c
        .set_vdev_state(SetVdevStateRequest {
            vdev,
            online,
            drain: false,
        })
        .await
        .map_err(|s| client::status_msg(&format!("vdev {what} {label}"), &s))?
        .into_inner();
    println!(
        "vdev {} is {}{}",
        vdev_label(v.vdev, &v.name),
        if already { "already " } else { "" },
        health_name(v.health, v.online)
    );
    Ok(())
}
