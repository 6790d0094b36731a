//! The arguments of the store move, declared once: `aliquot-allocator
//! migrate-store` parses them, and `aliquotctl migrate-store` (which links
//! no server) parses the same and runs that binary with them
//! ([`MigrateArgs::forward`], [`STORE_ENV`]).

/// The variable that carries the destination URL to the child: its
/// password must never be on a command line `ps` shows.
pub const STORE_ENV: &str = "ALIQUOT_STORE";

/// The variable `--from` defaults from; a parent clears it for the child,
/// whose flags are then the whole request.
pub const DATA_DIR_ENV: &str = "ALIQUOT_DATA_DIR";

/// What `--help` says of the move, for both commands.
pub const LONG_ABOUT: &str = "Move a stopped pool from its SQLite store into PostgreSQL.\n\n\
    Stop the pool's allocator first (its data dir's lock is taken: a running \
    allocator is refused). The source must verify (as `aliquot-allocator verify`). \
    The destination may hold other pools, never one of this pool's name (refused). \
    Everything is written in one transaction: on any failure the destination holds \
    nothing of the pool. The copy is then read back and compared, and the SQLite \
    file is renamed to pool.db.moved so no allocator serves the pool from it again. \
    Then start the allocators with --store URL --pool NAME; the agents keep their \
    devices (same pool guid, txg and generation).";

/// The pool to move: where from, where to.
#[derive(Clone, Debug, clap::Args)]
pub struct MigrateArgs {
    /// The SQLite store: the allocator's --data-dir, `aliquotctl up`'s
    /// --data-dir (its allocator's store is <data-dir>/allocator/pool.db),
    /// the pool.db file itself, or sqlite://PATH. Stop the allocator first.
    #[arg(
        long,
        env = DATA_DIR_ENV,
        value_name = "PATH",
        default_value = "./aliquot-data/allocator"
    )]
    pub from: String,
    /// The PostgreSQL store (postgres://user:password@host:port/database),
    /// as the allocators' --store will be; it must not hold the pool.
    #[arg(long, env = STORE_ENV, value_name = "URL")]
    pub to: String,
}

impl MigrateArgs {
    /// The flags that ask `aliquot-allocator migrate-store` for the same
    /// move, all but `--to`: its URL may hold a password, so it goes in the
    /// child's environment ([`STORE_ENV`]).
    pub fn forward(&self) -> Vec<String> {
        vec!["--from".into(), self.from.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        args: MigrateArgs,
    }

    fn parse(a: &[&str]) -> Result<MigrateArgs, clap::Error> {
        Cmd::try_parse_from(std::iter::once("migrate-store").chain(a.iter().copied()))
            .map(|c| c.args)
    }

    #[test]
    fn what_is_forwarded_parses_back_to_the_same_move() {
        for from in [
            "/x/pool.db",
            "sqlite:///x/pool.db",
            "./d",
            "a dir/with spaces",
        ] {
            let url = "postgres://u:secret@h/db";
            let first = parse(&["--from", from, "--to", url]).unwrap();
            let fwd = first.forward();
            assert!(!fwd.iter().any(|f| f.contains("secret")), "{fwd:?}");
            let mut a: Vec<&str> = fwd.iter().map(String::as_str).collect();
            // The child is given the URL by STORE_ENV; as a flag here, so
            // the test does not depend on this process's environment.
            a.extend(["--to", url]);
            let again = parse(&a).unwrap();
            assert_eq!(format!("{again:?}"), format!("{first:?}"), "{from:?}");
        }
    }

    #[test]
    fn the_destination_is_required_and_the_source_defaults() {
        // Neither variable is set by the test harness; were one set in the
        // environment the test runs in, these would not be what a user gets.
        if std::env::var_os(STORE_ENV).is_some() || std::env::var_os(DATA_DIR_ENV).is_some() {
            return;
        }
        assert!(parse(&[]).is_err());
        let a = parse(&["--to", "postgres://h/db"]).unwrap();
        assert_eq!(a.from, "./aliquot-data/allocator");
    }
}
