//! `aliquot-sim`: parse the command line, run it, map failures to exit codes
//! (2 bad usage or scenario, 1 a run failed).

use clap::Parser;

fn main() {
    let cli = aliquot_sim::cli::Cli::parse();
    if let Err(e) = aliquot_sim::cli::execute(cli) {
        eprintln!("aliquot-sim: {e}");
        std::process::exit(e.exit_code());
    }
}
