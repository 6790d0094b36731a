//! `aliquotctl migrate-store`: move a stopped pool from its SQLite store into
//! PostgreSQL, for allocators sharing that database (high availability).
//! The move is the allocator binary's (`aliquot-allocator migrate-store`,
//! which owns the stores: it refuses a running pool, an inconsistent source,
//! a destination already holding the pool, and writes in one transaction);
//! this runs it with the URL in its environment (never on a command line `ps`
//! shows, as its password may be in it), its progress and summary shown as
//! they come.

use std::path::PathBuf;
use std::process::Stdio;

#[derive(Clone, Debug, clap::Args)]
pub struct MigrateArgs {
    /// The SQLite store: the allocator's --data-dir, `up`'s --data-dir
    /// (its allocator's store is <data-dir>/allocator/pool.db), or the
    /// pool.db file. Stop the allocator first.
    #[arg(
        long,
        env = "ALIQUOT_DATA_DIR",
        default_value = "./aliquot-data/allocator"
    )]
    pub from: PathBuf,
    /// The PostgreSQL store (postgres://user:password@host:port/database)
    /// the allocators will be given as --store; it must not hold the pool.
    #[arg(long, env = "ALIQUOT_STORE", value_name = "URL")]
    pub to: String,
}

pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    let bin = crate::binaries::find(crate::binaries::ALLOCATOR)?;
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("migrate-store")
        .arg("--from")
        .arg(&args.from)
        .stdin(Stdio::null());
    // The flags given are the whole request: nothing from our environment.
    cmd.env_remove("ALIQUOT_DATA_DIR");
    cmd.env("ALIQUOT_STORE", &args.to);
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
