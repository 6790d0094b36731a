//! `aliquotctl verify`: the allocator's consistency check on its store, like
//! `zdb -b`. The SQLite file is opened read-only (WAL readers see the last
//! synced txg, so this works on a stopped or a running pool); the pool is
//! rebuilt from it exactly as the allocator does at start, and the first
//! inconsistency (overlap, extent outside its vdev, per-vdev sums that do
//! not match) is named. With `--allocator` the running allocator is also
//! asked (GetPool) and must be the same pool with the same vdevs.

use std::path::PathBuf;

use aliquot_allocator::recovery::{self, VerifyReport};
use aliquot_allocator::sqlite_store::{self, Identity};
use aliquot_proto::v1::GetPoolRequest;

use crate::client;

#[derive(Clone, Debug, clap::Args)]
pub struct VerifyArgs {
    /// The allocator's --data-dir (the store is <data-dir>/pool.db), or
    /// `up`'s --data-dir (its allocator's store is <data-dir>/allocator/pool.db).
    #[arg(
        long,
        env = "ALIQUOT_DATA_DIR",
        default_value = "./aliquot-data/allocator"
    )]
    pub data_dir: PathBuf,
    /// The store file itself, instead of --data-dir.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// A PostgreSQL store (the allocators' --store postgres://…), instead
    /// of --data-dir; read in one read-only snapshot, the allocators may run.
    #[arg(long, env = "ALIQUOT_STORE", value_name = "URL", conflicts_with_all = ["db", "repair_vdev"])]
    pub store: Option<String>,
    /// With --store: the pool to verify (a database may hold several).
    #[arg(long, env = "ALIQUOT_POOL", default_value = "aliquot")]
    pub pool: String,
    /// Also cross-check a running allocator (same guid, vdevs, txgs).
    #[arg(long)]
    pub allocator: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Repair this vdev's row of a STOPPED pool's store so it opens again
    /// (its allocated sum recounted from its extents; with --capacity, its
    /// capacity and metaslab shift reset), then verify. Takes the data dir's
    /// lock: refused while an allocator runs.
    #[arg(long, value_name = "VDEV")]
    pub repair_vdev: Option<u32>,
    /// With --repair-vdev: the vdev's true capacity (e.g. 4GiB); it must
    /// hold every extent of the vdev.
    #[arg(long, value_parser = units::size_arg, requires = "repair_vdev")]
    pub capacity: Option<u64>,
    /// How to reach --allocator.
    #[command(flatten)]
    pub tls: aliquot_auth::ClientTlsArgs,
}

/// The store under `data_dir`: the allocator's data dir, or `up`'s (whose
/// allocator keeps its store in `<data-dir>/allocator`), whichever holds one.
fn store_path(data_dir: &std::path::Path) -> PathBuf {
    let direct = data_dir.join(sqlite_store::DB_FILE);
    let under_up = data_dir.join("allocator").join(sqlite_store::DB_FILE);
    if !direct.exists() && under_up.exists() {
        under_up
    } else {
        direct
    }
}

pub async fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let path = args
        .db
        .clone()
        .unwrap_or_else(|| store_path(&args.data_dir));
    if let Some(vdev) = args.repair_vdev {
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        let _lock = aliquot_allocator::lock::DataDirLock::acquire(dir)?;
        let changed = sqlite_store::repair_vdev(&path, vdev, args.capacity)
            .await
            .map_err(|e| anyhow::anyhow!("{}: repair refused: {e}", path.display()))?;
        eprintln!("repaired {}: {changed}", path.display());
    }
    let (id, persisted) = match &args.store {
        Some(url) => {
            let shown = aliquot_allocator::pg_store::redact(url);
            let p = aliquot_allocator::pg_store::read_only(url, &args.pool)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .ok_or_else(|| anyhow::anyhow!("{shown}: it holds no pool {:?}", args.pool))?;
            let id = Identity {
                guid: p.pool_guid,
                name: args.pool.clone(),
                synced_txg: p.synced_txg,
            };
            (id, p)
        }
        None => sqlite_store::read_only(&path)
            .await?
            .ok_or_else(|| anyhow::anyhow!("{}: no pool has been created in it", path.display()))?,
    };
    let path = match &args.store {
        Some(url) => PathBuf::from(aliquot_allocator::pg_store::redact(url)),
        None => path,
    };
    let report = recovery::verify(&persisted).map_err(|e| {
        anyhow::anyhow!(
            "{}: pool {:?} at txg {} is INCONSISTENT: {e}",
            path.display(),
            id.name,
            id.synced_txg
        )
    })?;
    let running = match &args.allocator {
        Some(url) => Some(cross_check(&args.tls.resolve()?, url, &id, &report).await?),
        None => None,
    };
    if args.json {
        println!("{}", json(&path, &id, &report, running));
    } else {
        print!("{}", table(&path, &id, &report, running));
    }
    Ok(())
}

/// The running allocator must be this pool, know every stored vdev as
/// stored, and be at or past the stored txg. Returns its synced txg.
async fn cross_check(
    tls: &aliquot_auth::ClientTls,
    url: &str,
    id: &Identity,
    r: &VerifyReport,
) -> anyhow::Result<u64> {
    let mut c = client::allocator(tls, url).await?;
    let s = c
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|e| client::status_msg("get pool", &e))?
        .into_inner();
    if s.guid != id.guid || s.name != id.name {
        anyhow::bail!(
            "{url} serves pool {:?} (guid {:#x}), but the store holds {:?} (guid {:#x})",
            s.name,
            s.guid,
            id.name,
            id.guid
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
        let Some(live) = s.vdevs.iter().find(|x| x.vdev == v.id) else {
            anyhow::bail!(
                "{url} does not know vdev {} of the store",
                crate::names::vdev_label(v.id, &v.name)
            );
        };
        if live.guid != v.guid || live.capacity < v.capacity {
            anyhow::bail!(
                "{url}: vdev {} is guid {:#x} with {} bytes, the store has guid {:#x} with {}",
                crate::names::vdev_label(v.id, &v.name),
                live.guid,
                live.capacity,
                v.guid,
                v.capacity
            );
        }
    }
    Ok(s.synced_txg)
}

fn table(path: &std::path::Path, id: &Identity, r: &VerifyReport, running: Option<u64>) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "pool {} guid {:#x} synced txg {} ({}): OK",
        id.name,
        id.guid,
        r.synced_txg,
        path.display()
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
            v.id,
            format!("{:#x}", v.guid),
            name,
            units::format_bytes_short(v.capacity),
            v.extents,
            units::format_bytes_short(v.allocated),
            units::format_bytes_short(1u64 << v.metaslab_shift),
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

fn json(
    path: &std::path::Path,
    id: &Identity,
    r: &VerifyReport,
    running: Option<u64>,
) -> serde_json::Value {
    serde_json::json!({
        "ok": true,
        "path": path.display().to_string(),
        "pool": id.name,
        "guid": id.guid,
        "synced_txg": r.synced_txg,
        "extents": r.extents,
        "allocated": r.allocated,
        "running_synced_txg": running,
        "vdevs": r.vdevs.iter().map(|v| serde_json::json!({
            "vdev": v.id,
            "guid": v.guid,
            "name": v.name,
            "endpoint": v.endpoint,
            "capacity": v.capacity,
            "metaslab_size": 1u64 << v.metaslab_shift,
            "extents": v.extents,
            "allocated": v.allocated,
            "removed": v.removed,
            "embedded_log_metaslab": v.embedded_log_metaslab,
        })).collect::<Vec<_>>(),
    })
}
