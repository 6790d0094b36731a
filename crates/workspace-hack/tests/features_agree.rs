//! Every dependency `cargo build -p aliquot-sim` compiles has a feature set
//! the workspace build also compiles it with, so `cargo run -p aliquot-sim`
//! after `cargo build` recompiles nothing. Fails when a package starts
//! turning on a feature of a shared dependency that this crate's lists miss.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// `cargo tree` of the given selection: one "name version|features" line
/// per distinct unit (a package built for the host and the target with
/// different features is two lines), workspace members left out.
fn units(select: &[&str]) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        .args(["--no-dedupe", "-f", "{p}|{f}"])
        .args(select)
        .current_dir(root)
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {select:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.contains(" (/"))
        .map(|l| l.trim_end_matches(" (*)").to_string())
        .collect()
}

#[test]
fn the_simulator_alone_resolves_the_workspace_features() {
    let workspace = units(&["--workspace"]);
    let sim = units(&["-p", "aliquot-sim"]);
    assert!(sim.len() > 10, "too few units: {sim:?}");
    let differ: Vec<&String> = sim.difference(&workspace).collect();
    assert!(
        differ.is_empty(),
        "built with other features under -p aliquot-sim than in the workspace \
         (add them to crates/workspace-hack/Cargo.toml): {differ:#?}"
    );
}
