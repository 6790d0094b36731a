//! `aliquotctl verify`: the allocator's consistency check on its store, like
//! `zdb -b`. The check itself is the allocator binary's (`aliquot-allocator
//! verify`, which owns the store: opened read-only, so this works on a
//! stopped or a running pool; the pool rebuilt from it exactly as the
//! allocator does at start, the first inconsistency named); this reads its
//! JSON and prints it. With `--allocator` the running allocator is also
//! asked (GetPool) and must be the same pool with the same vdevs.

use std::process::Stdio;

use aliquot_process::verify_args::StoreArgs;
use aliquot_proto::v1::GetPoolRequest;

use crate::client;

/// What `aliquot-allocator verify` found in a consistent store.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct StoreReport {
    pub path: String,
    pub pool: String,
    pub guid: u64,
    pub synced_txg: u64,
    pub extents: u64,
    pub allocated: u64,
    pub vdevs: Vec<StoreVdev>,
}

#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct StoreVdev {
    pub vdev: u32,
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    pub capacity: u64,
    pub metaslab_size: u64,
    pub extents: u64,
    pub allocated: u64,
    pub removed: bool,
    pub embedded_log_metaslab: Option<u32>,
}

/// A store as `aliquot-allocator verify` read it.
pub enum Stored {
    Pool(StoreReport),
    /// It holds no pool yet (the store's path or redacted URL).
    Empty(String),
}

/// Run `aliquot-allocator verify ARGS` (with `store`, a PostgreSQL URL:
/// passed in its environment, never on a command line `ps` shows, as its
/// password may be in it); an error says why the store is inconsistent or
/// could not be read (the allocator's own words).
pub async fn store_report(args: &[String], store: Option<&str>) -> anyhow::Result<Stored> {
    let bin = crate::binaries::find(crate::binaries::ALLOCATOR)?;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("verify").args(args).stdin(Stdio::null());
    // The flags given are the whole request: nothing from our environment.
    for v in ["ALIQUOT_DATA_DIR", "ALIQUOT_STORE", "ALIQUOT_POOL"] {
        cmd.env_remove(v);
    }
    if let Some(url) = store {
        cmd.env("ALIQUOT_STORE", url);
    }
    let out = cmd
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("cannot run {} verify: {e}", bin.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let said = stderr.trim();
        let said = said
            .strip_prefix("aliquot-allocator verify: ")
            .unwrap_or(said);
        anyhow::bail!("{said}");
    }
    // What it says besides the report (a repair done) is for the operator.
    eprint!("{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| anyhow::anyhow!("{} verify printed no report ({e})", bin.display()))?;
    if v.get("empty").and_then(|e| e.as_bool()) == Some(true) {
        let path = v
            .get("path")
            .and_then(|p| p.as_str())
            .unwrap_or("the store");
        return Ok(Stored::Empty(path.to_string()));
    }
    Ok(Stored::Pool(serde_json::from_value(v)?))
}

#[derive(Clone, Debug, clap::Args)]
pub struct VerifyArgs {
    /// The store and repair: `aliquot-allocator verify`'s own arguments,
    /// forwarded to it.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Also cross-check a running allocator (same guid, vdevs, txgs).
    #[arg(long)]
    pub allocator: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// How to reach --allocator.
    #[command(flatten)]
    pub tls: aliquot_auth::ClientTlsArgs,
}

pub async fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let a = args.store.forward();
    let report = match store_report(&a, args.store.store.as_deref()).await? {
        Stored::Pool(r) => r,
        Stored::Empty(path) => match &args.store.store {
            Some(_) => anyhow::bail!("{path}: it holds no pool {:?}", args.store.pool),
            None => anyhow::bail!("{path}: no pool has been created in it"),
        },
    };
    let running = match &args.allocator {
        Some(url) => Some(cross_check(&args.tls.resolve()?, url, &report).await?),
        None => None,
    };
    if args.json {
        println!("{}", json(&report, running));
    } else {
        print!("{}", table(&report, running));
    }
    Ok(())
}

/// The running allocator must be this pool, know every stored vdev as
/// stored, and be at or past the stored txg. Returns its synced txg.
async fn cross_check(
    tls: &aliquot_auth::ClientTls,
    url: &str,
    r: &StoreReport,
) -> anyhow::Result<u64> {
    let mut c = client::allocator(tls, url).await?;
    let s = c
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|e| client::status_msg("get pool", &e))?
        .into_inner();
    if s.guid != r.guid || s.name != r.pool {
        anyhow::bail!(
            "{url} serves pool {:?} (guid {:#x}), but the store holds {:?} (guid {:#x})",
            s.name,
            s.guid,
            r.pool,
            r.guid
        );
    }
    if s.synced_txg < r.synced_txg {
        anyhow::bail!(
            "{url} reports synced txg {} behind the store's {}",
            s.synced_txg,
            r.synced_txg
        );
    }
    for v in r.vdevs.iter().filter(|v| !v.removed) {
        let Some(live) = s.vdevs.iter().find(|x| x.vdev == v.vdev) else {
            anyhow::bail!(
                "{url} does not know vdev {} of the store",
                crate::names::vdev_label(v.vdev, &v.name)
            );
        };
        if live.guid != v.guid || live.capacity < v.capacity {
            anyhow::bail!(
                "{url}: vdev {} is guid {:#x} with {} bytes, the store has guid {:#x} with {}",
                crate::names::vdev_label(v.vdev, &v.name),
                live.guid,
                live.capacity,
                v.guid,
                v.capacity
            );
        }
    }
    Ok(s.synced_txg)
}

fn table(r: &StoreReport, running: Option<u64>) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "pool {} guid {:#x} synced txg {} ({}): OK",
        r.pool, r.guid, r.synced_txg, r.path
    );
    let names: Vec<String> = r
        .vdevs
        .iter()
        .map(|v| {
            if v.removed {
                format!("{} (removed)", v.name)
            } else {
                v.name.clone()
            }
        })
        .collect();
    // The name column as wide as its longest entry (`file0 (removed)`).
    let nw = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(0)
        .max(10);
    let _ = writeln!(
        o,
        "{:>4}  {:<18}  {:<nw$}  {:>9}  {:>8}  {:>9}  {:>5}  {:>7}",
        "vdev", "guid", "name", "capacity", "extents", "alloc", "ms", "elog ms"
    );
    for (v, name) in r.vdevs.iter().zip(names) {
        let _ = writeln!(
            o,
            "{:>4}  {:<18}  {:<nw$}  {:>9}  {:>8}  {:>9}  {:>5}  {:>7}",
            v.vdev,
            format!("{:#x}", v.guid),
            name,
            units::format_bytes_short(v.capacity),
            v.extents,
            units::format_bytes_short(v.allocated),
            units::format_bytes_short(v.metaslab_size),
            v.embedded_log_metaslab
                .map_or("-".to_string(), |m| m.to_string()),
        );
    }
    let _ = writeln!(
        o,
        "{} extents, {} allocated; no overlaps, per-vdev sums match",
        r.extents,
        units::format_bytes(r.allocated)
    );
    if let Some(t) = running {
        let _ = writeln!(o, "running allocator agrees (synced txg {t})");
    }
    o
}

fn json(r: &StoreReport, running: Option<u64>) -> serde_json::Value {
    serde_json::json!({
        "ok": true,
        "path": r.path,
        "pool": r.pool,
        "guid": r.guid,
        "synced_txg": r.synced_txg,
        "extents": r.extents,
        "allocated": r.allocated,
        "running_synced_txg": running,
        "vdevs": r.vdevs,
    })
}
