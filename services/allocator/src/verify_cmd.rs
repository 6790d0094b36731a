//! `aliquot-allocator verify`: the store check of `aliquotctl verify`, like
//! `zdb -b`, in the binary that owns the store (the CLI links no server; it
//! runs this and reads its JSON). The store is opened read-only (SQLite WAL
//! readers see the last synced txg, PostgreSQL is read in one snapshot), so
//! this works on a stopped or a running pool; the pool is rebuilt from it
//! exactly as the allocator does at start ([`recovery::verify`]) and the
//! first inconsistency is named. Prints one JSON object on stdout; a store
//! that holds no pool yet prints `{"empty": true, ...}`.

use std::path::{Path, PathBuf};

use aliquot_process::verify_args::StoreArgs;

use crate::recovery::{self, VerifyReport};
use crate::sqlite_store::{self, Identity};

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "aliquot-allocator verify",
    about = "Check the allocator's store (stopped or running pool), like zdb -b; prints JSON"
)]
pub struct VerifyArgs {
    /// Declared once for this and `aliquotctl verify`, which forwards them.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// The store under `data_dir`: the allocator's data dir, or `up`'s (whose
/// allocator keeps its store in `<data-dir>/allocator`), whichever holds one.
pub(crate) fn store_path(data_dir: &Path) -> PathBuf {
    let direct = data_dir.join(sqlite_store::DB_FILE);
    let under_up = data_dir.join("allocator").join(sqlite_store::DB_FILE);
    if !direct.exists() && under_up.exists() {
        under_up
    } else {
        direct
    }
}

/// Check the store; the report as JSON (repairs are said on stderr).
pub async fn run(args: VerifyArgs) -> anyhow::Result<serde_json::Value> {
    let args = args.store;
    let path = args
        .db
        .clone()
        .unwrap_or_else(|| store_path(&args.data_dir));
    if let Some(vdev) = args.repair_vdev {
        let dir = path.parent().unwrap_or(Path::new("."));
        let _lock = crate::lock::DataDirLock::acquire(dir)?;
        let changed = sqlite_store::repair_vdev(&path, vdev, args.capacity)
            .await
            .map_err(|e| anyhow::anyhow!("{}: repair refused: {e}", path.display()))?;
        eprintln!("repaired {}: {changed}", path.display());
    }
    let (shown, read) = match &args.store {
        Some(url) => {
            let shown = crate::pg_store::redact(url);
            let p = crate::pg_store::read_only(url, &args.pool)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let read = p.map(|p| {
                let id = Identity {
                    guid: p.pool_guid,
                    name: args.pool.clone(),
                    synced_txg: p.synced_txg,
                };
                (id, p)
            });
            (shown, read)
        }
        None => (
            path.display().to_string(),
            sqlite_store::read_only(&path).await?,
        ),
    };
    let Some((id, persisted)) = read else {
        return Ok(serde_json::json!({ "empty": true, "path": shown, "pool": args.pool }));
    };
    let report = recovery::verify(&persisted).map_err(|e| {
        anyhow::anyhow!(
            "{shown}: pool {:?} at txg {} is INCONSISTENT: {e}",
            id.name,
            id.synced_txg
        )
    })?;
    Ok(json(&shown, &id, &report))
}

fn json(path: &str, id: &Identity, r: &VerifyReport) -> serde_json::Value {
    serde_json::json!({
        "ok": true,
        "path": path,
        "pool": id.name,
        "guid": id.guid,
        "synced_txg": r.synced_txg,
        "extents": r.extents,
        "allocated": r.allocated,
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
