//! `aliquot-allocator migrate-store`: move a stopped pool from its SQLite
//! file into PostgreSQL (what `aliquotctl migrate-store` runs), so the pool
//! can be served by allocators sharing that database (high availability).
//! The source is read with the store's own loaders while holding its data
//! dir's lock (so no allocator serves it meanwhile), checked as `verify`
//! checks it, and written into the destination in one transaction
//! (`SqlStore::import`); the copy is then read back and compared. Last, the
//! SQLite file is renamed to `pool.db.moved`, so no allocator serves the pool
//! from both stores.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aliquot_process::migrate_args::{self, MigrateArgs};

use crate::pg_store::{self, PgStore};
use crate::recovery;
use crate::sqlite_store::{self, SqliteStore};

/// What the SQLite file is renamed to once its pool is in PostgreSQL.
pub const MOVED_SUFFIX: &str = ".moved";

/// The destination session's statement bound: writing a large pool's
/// chunks is one statement per vdev.
const IMPORT_BOUND: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "aliquot-allocator migrate-store",
    about = "Move a stopped pool from its SQLite store into PostgreSQL",
    long_about = migrate_args::LONG_ABOUT
)]
pub struct MigrateCmd {
    /// Declared once for this and `aliquotctl migrate-store`, which runs it.
    #[command(flatten)]
    pub args: MigrateArgs,
}

/// The SQLite file `from` names.
fn source_path(from: &str) -> PathBuf {
    let p = Path::new(from.strip_prefix("sqlite://").unwrap_or(from));
    if p.is_dir() {
        crate::verify_cmd::store_path(p)
    } else {
        p.to_path_buf()
    }
}

/// Move the pool; the summary line on success. Progress goes to stderr.
pub async fn run(args: MigrateArgs) -> anyhow::Result<String> {
    let path = source_path(&args.from);
    let src_shown = path.display().to_string();
    let dst_shown = pg_store::redact(&args.to);
    if !pg_store::is_postgres_url(&args.to) {
        anyhow::bail!("--to {dst_shown}: expected a postgres:// URL");
    }
    if !path.is_file() {
        anyhow::bail!("--from {src_shown}: no SQLite store there");
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let _lock = crate::lock::DataDirLock::acquire(dir)
        .map_err(|e| anyhow::anyhow!("refusing to move {src_shown}: {e}"))?;
    let id = sqlite_store::preflight(&path)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{src_shown} holds no pool: nothing to move"))?;
    let t0 = Instant::now();
    eprintln!(
        "reading pool {:?} (guid {:#x}, txg {}) from {src_shown}",
        id.name, id.guid, id.synced_txg
    );
    let src = SqliteStore::open(&path, &id.name, Some(id.guid)).await?;
    let img = src.export().await;
    src.close().await;
    let img = img
        .map_err(|e| anyhow::anyhow!("{src_shown}: {e}"))?
        .ok_or_else(|| anyhow::anyhow!("{src_shown} holds no pool: nothing to move"))?;
    let p = &img.persisted;
    let report = recovery::verify(p).map_err(|e| {
        anyhow::anyhow!(
            "refusing to move {src_shown}: pool {:?} at txg {} is INCONSISTENT: {e} \
             (nothing was written)",
            id.name,
            p.synced_txg
        )
    })?;
    eprintln!(
        "read and verified in {:.1} s: {} vdevs, {} extents ({} bytes), {} owner runs, \
         {} mapping entries, generation {}",
        t0.elapsed().as_secs_f64(),
        p.vdevs.len(),
        report.extents,
        report.allocated,
        p.owner_runs.len(),
        p.mappings.len(),
        img.generation
    );
    let t1 = Instant::now();
    let dst =
        PgStore::open_with_lease(&args.to, &id.name, None, "migrate-store", IMPORT_BOUND).await?;
    eprintln!("writing into {dst_shown}");
    let r = dst
        .import(&img, &mut |step: String| eprintln!("  {step}"))
        .await;
    dst.close().await;
    r.map_err(|e| anyhow::anyhow!("{e}"))?;
    eprintln!("written in {:.1} s", t1.elapsed().as_secs_f64());
    // Read back as the next allocator will, and compare what it serves.
    let back = pg_store::read_only(&args.to, &id.name)
        .await
        .map_err(|e| anyhow::anyhow!("reading the copy back: {e}"))?
        .ok_or_else(|| anyhow::anyhow!("the copy in {dst_shown} is not there"))?;
    recovery::verify(&back)
        .map_err(|e| anyhow::anyhow!("the copy in {dst_shown} is INCONSISTENT: {e}"))?;
    let same = back.pool_guid == p.pool_guid
        && back.synced_txg == p.synced_txg
        && back.state_digest == p.state_digest
        && back.vdevs == p.vdevs
        && back.vdev_states == p.vdev_states
        && back.allocated == p.allocated
        && back.owner_identities == p.owner_identities
        && back.owner_runs == p.owner_runs
        && back.mappings == p.mappings;
    if !same {
        anyhow::bail!(
            "the copy in {dst_shown} differs from {src_shown}: do not start allocators on it; \
             {src_shown} was left in place"
        );
    }
    let moved = retire_source(&path)?;
    Ok(format!(
        "moved pool {:?} (guid {:#x}, txg {}, {} extents, {} bytes) from {src_shown} to \
         {dst_shown}; the SQLite file is now {}: start the allocators with --store URL --pool {}",
        id.name,
        p.pool_guid,
        p.synced_txg,
        report.extents,
        report.allocated,
        moved.display(),
        id.name
    ))
}

/// Rename the SQLite file (and its WAL files, which SQLite names after it)
/// so no allocator serves the pool from it again; the new name.
fn retire_source(path: &Path) -> anyhow::Result<PathBuf> {
    let mut moved = path.as_os_str().to_owned();
    moved.push(MOVED_SUFFIX);
    let moved = PathBuf::from(moved);
    for suffix in ["", "-wal", "-shm"] {
        let mut from = path.as_os_str().to_owned();
        from.push(suffix);
        let mut to = moved.as_os_str().to_owned();
        to.push(suffix);
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!(
                "the pool is in PostgreSQL now, but {} could not be renamed ({e}): remove it \
                 before any allocator starts on it",
                Path::new(&from).display()
            ),
        }
    }
    Ok(moved)
}
