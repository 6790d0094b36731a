//! `aliquotctl migrate-store`: move a stopped pool from its SQLite store into
//! PostgreSQL, for allocators sharing that database (high availability).
//! The move is the allocator binary's (`aliquot-allocator migrate-store`,
//! which owns the stores: it refuses a running pool, an inconsistent source,
//! a destination already holding the pool, and writes in one transaction);
//! this runs it with the URL in its environment (never on a command line `ps`
//! shows, as its password may be in it), its progress and summary shown as
//! they come.

use std::process::Stdio;

use aliquot_process::migrate_args::{DATA_DIR_ENV, MigrateArgs, STORE_ENV};

pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    let bin = crate::binaries::find(crate::binaries::ALLOCATOR)?;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("migrate-store")
        .args(args.forward())
        .stdin(Stdio::null());
    // The flags given are the whole request: nothing from our environment.
    cmd.env_remove(DATA_DIR_ENV);
    cmd.env(STORE_ENV, &args.to);
    let status = cmd
        .status()
        .await
        .map_err(|e| anyhow::anyhow!("cannot run {} migrate-store: {e}", bin.display()))?;
    if !status.success() {
        // It said why on stderr.
        anyhow::bail!("the pool was not moved");
    }
    Ok(())
}
