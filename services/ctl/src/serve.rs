//! `aliquotctl serve agent|allocator|metrics ARGS`: replaces this process
//! with the service's own binary and ARGS (exec: same pid, stdin, stdout
//! and signals), found as [`crate::binaries::find`] says. Flags, env
//! variables, exit codes and behaviour are exactly the binary's own; its
//! `--help` lists them.

use std::ffi::OsString;

use crate::binaries;

#[derive(Debug, clap::Subcommand)]
pub enum ServeCmd {
    /// One vdev: runs aliquot-agent with these arguments.
    #[command(disable_help_flag = true)]
    Agent(Passthrough),
    /// The pool's allocator: runs aliquot-allocator with these arguments.
    #[command(disable_help_flag = true)]
    Allocator(Passthrough),
    /// Balance history, charts: runs aliquot-metrics with these arguments.
    #[command(disable_help_flag = true)]
    Metrics(Passthrough),
}

#[derive(Debug, clap::Args)]
pub struct Passthrough {
    /// The service's own flags (`--help` shows them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    pub args: Vec<OsString>,
}

impl ServeCmd {
    /// The binary this runs.
    pub fn binary(&self) -> &'static str {
        match self {
            ServeCmd::Agent(_) => binaries::AGENT,
            ServeCmd::Allocator(_) => binaries::ALLOCATOR,
            ServeCmd::Metrics(_) => binaries::METRICS,
        }
    }

    fn args(&self) -> &[OsString] {
        match self {
            ServeCmd::Agent(p) | ServeCmd::Allocator(p) | ServeCmd::Metrics(p) => &p.args,
        }
    }
}

/// Exec the service; returns only if that failed. `json_logs`: aliquotctl's
/// own `--log-format json` was given, and the service logs JSON too.
pub fn exec(cmd: &ServeCmd, json_logs: bool) -> anyhow::Error {
    use std::os::unix::process::CommandExt;
    let bin = match binaries::find(cmd.binary()) {
        Ok(b) => b,
        Err(e) => return e.into(),
    };
    let mut c = std::process::Command::new(&bin);
    c.args(cmd.args());
    if json_logs {
        c.env("ALIQUOT_LOG_FORMAT", "json");
    }
    let e = c.exec();
    anyhow::anyhow!("cannot run {}: {e}", bin.display())
}
