//! `aliquotctl free`: give back every block a manifest lists (what a
//! `write` run left allocated), so a test pool can be emptied without
//! deleting its files. The manifest is renamed `NAME.freeing` first (so no
//! command reads it as live any more), its extents are freed (Free, 1024 at
//! a time), the txg holding the frees is synced, and the file is removed.
//! A run stopped part way leaves `NAME.freeing` and says so: its extents
//! are partly free and nothing else references them.

use std::path::PathBuf;

use aliquot_proto::v1::{Extent, FreeRequest, GetPoolRequest, SyncTxgRequest};
use serde::Serialize;
use units::format_bytes_short as short;

use crate::client::{self, AllocatorArgs};
use crate::mover::ManifestArgs;

#[derive(Clone, Debug, clap::Args)]
pub struct FreeArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    #[command(flatten)]
    pub manifests: ManifestArgs,
    /// Free every manifest of the default directory (without --manifest,
    /// this must be said).
    #[arg(long, env = "ALIQUOT_FREE_ALL", conflicts_with = "manifest")]
    pub all: bool,
    /// Print the report as JSON.
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
}

#[derive(Debug, Default, Serialize)]
pub struct FreeReport {
    pub manifests: Vec<String>,
    pub blocks: u64,
    pub extents: u64,
    #[serde(serialize_with = "crate::status::as_string")]
    pub bytes: u64,
    #[serde(serialize_with = "crate::status::as_string")]
    pub synced_txg: u64,
}

pub async fn free(args: &FreeArgs) -> anyhow::Result<FreeReport> {
    let alloc = args.conn.connect().await?;
    let guid = alloc
        .clone()
        .get_pool(GetPoolRequest {})
        .await
        .map_err(|s| client::status_msg("get pool", &s))?
        .into_inner()
        .guid;
    if args.manifests.manifest.is_empty() && !args.all {
        return Err(crate::UsageError(format!(
            "free what? --manifest FILE (or a directory), or --all for every manifest in {}",
            crate::manifest::default_dir(&args.conn.tls.certs_dir).display()
        ))
        .into());
    }
    let paths = args.manifests.paths(&args.conn);
    let ms = crate::manifest::load_all(&paths, guid)?;
    if ms.is_empty() {
        anyhow::bail!(
            "no manifest in {}: nothing to free",
            crate::manifest::describe(&paths)
        );
    }
    if let Some(m) = ms.iter().find(|m| !m.pending.is_empty()) {
        anyhow::bail!(
            "manifest {} has {} moves pending: `aliquotctl balancer execute --manifest {}` settles \
             them first (until then a block may be at either extent)",
            m.path().display(),
            m.pending.len(),
            m.path().display()
        );
    }
    let mut report = FreeReport::default();
    for m in ms {
        let path = m.path().to_path_buf();
        let freeing = PathBuf::from(format!("{}.freeing", path.display()));
        std::fs::rename(&path, &freeing)
            .map_err(|e| anyhow::anyhow!("rename {}: {e}", path.display()))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir).and_then(|d| d.sync_all())?;
        }
        let extents: Vec<Extent> = m
            .blocks
            .values()
            .flatten()
            .map(|c| Extent::from(c.at))
            .collect();
        for chunk in extents.chunks(1024) {
            alloc
                .clone()
                .free(FreeRequest {
                    extents: chunk.to_vec(),
                })
                .await
                .map_err(|s| {
                    client::status_msg(
                        &format!(
                            "free the blocks of {} (now {}; part may be free: run free --manifest \
                             on it again once the cause is fixed, or delete it)",
                            path.display(),
                            freeing.display()
                        ),
                        &s,
                    )
                })?;
        }
        let synced = alloc
            .clone()
            .sync_txg(SyncTxgRequest::default())
            .await
            .map_err(|s| client::status_msg("sync the frees' txg", &s))?
            .into_inner()
            .synced_txg;
        std::fs::remove_file(&freeing)
            .map_err(|e| anyhow::anyhow!("remove {}: {e}", freeing.display()))?;
        report.manifests.push(path.display().to_string());
        report.blocks += m.blocks.len() as u64;
        report.extents += extents.len() as u64;
        report.bytes += extents.iter().map(|e| e.size).sum::<u64>();
        report.synced_txg = synced;
    }
    Ok(report)
}

pub async fn run(args: FreeArgs) -> anyhow::Result<()> {
    let r = free(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "freed {} blocks ({} extents, {}) of {} manifests; durable in txg {}, the space is \
             reusable after 2 more synced txgs; removed: {}",
            r.blocks,
            r.extents,
            short(r.bytes),
            r.manifests.len(),
            r.synced_txg,
            r.manifests.join(", ")
        );
    }
    Ok(())
}
