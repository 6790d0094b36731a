//! The arguments of the store check, declared once: `aliquot-allocator
//! verify` parses them, and `aliquotctl verify` (which links no server)
//! parses the same and forwards them to that binary ([`StoreArgs::forward`]).

use std::path::PathBuf;

/// Which store to check, and the repair to make first.
#[derive(Clone, Debug, clap::Args)]
pub struct StoreArgs {
    /// The allocator's --data-dir (the store is <data-dir>/pool.db), or
    /// `aliquotctl up`'s --data-dir (its allocator's store is
    /// <data-dir>/allocator/pool.db).
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
}

impl StoreArgs {
    /// The flags that ask `aliquot-allocator verify` for the same check,
    /// all but `--store`: its URL may hold a password, so it goes in the
    /// child's environment (`ALIQUOT_STORE`), never on a command line `ps`
    /// shows.
    pub fn forward(&self) -> Vec<String> {
        let mut a: Vec<String> = match (&self.store, &self.db) {
            (Some(_), _) => vec!["--pool".into(), self.pool.clone()],
            (None, Some(db)) => vec!["--db".into(), db.display().to_string()],
            (None, None) => vec!["--data-dir".into(), self.data_dir.display().to_string()],
        };
        if let Some(v) = self.repair_vdev {
            a.extend(["--repair-vdev".into(), v.to_string()]);
        }
        if let Some(c) = self.capacity {
            a.extend(["--capacity".into(), c.to_string()]);
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        store: StoreArgs,
    }

    fn parse(a: &[&str]) -> StoreArgs {
        Cmd::try_parse_from(std::iter::once("verify").chain(a.iter().copied()))
            .unwrap()
            .store
    }

    #[test]
    fn what_is_forwarded_parses_back_to_the_same_check() {
        for a in [
            &[
                "--db",
                "/x/pool.db",
                "--repair-vdev",
                "2",
                "--capacity",
                "4GiB",
            ][..],
            &["--data-dir", "/d"],
            &["--store", "postgres://u:secret@h/db", "--pool", "p"],
        ] {
            let first = parse(a);
            let fwd = first.forward();
            assert!(!fwd.iter().any(|f| f.contains("secret")), "{fwd:?}");
            let mut again = parse(&fwd.iter().map(String::as_str).collect::<Vec<_>>());
            again.store = first.store.clone();
            assert_eq!(format!("{again:?}"), format!("{first:?}"), "{a:?}");
        }
    }

    #[test]
    fn store_conflicts_with_a_file_and_a_repair() {
        let p =
            |a: &[&str]| Cmd::try_parse_from(std::iter::once("verify").chain(a.iter().copied()));
        assert!(p(&["--store", "postgres://h/db", "--db", "/x"]).is_err());
        assert!(p(&["--store", "postgres://h/db", "--repair-vdev", "1"]).is_err());
        assert!(p(&["--capacity", "1GiB"]).is_err());
    }
}
