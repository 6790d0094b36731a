//! No code: this crate exists for its dependencies' features (see its
//! Cargo.toml), so that `cargo run -p aliquot-sim` after a workspace build
//! reuses what the workspace build compiled.
