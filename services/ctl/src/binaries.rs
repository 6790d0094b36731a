//! The service binaries `aliquotctl` runs (`up`, `demo`, `serve`, `verify`):
//! it links no server, it starts `aliquot-allocator`, `aliquot-agent` and
//! `aliquot-metrics`, found beside the running `aliquotctl` (a cargo build
//! or an install puts them together) or else on PATH.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// The allocator's binary (also the store's `verify`).
pub const ALLOCATOR: &str = "aliquot-allocator";
pub const AGENT: &str = "aliquot-agent";
pub const METRICS: &str = "aliquot-metrics";

/// A service binary that is neither beside `aliquotctl` nor on PATH.
#[derive(Debug, thiserror::Error)]
#[error(
    "{name} not found: looked beside aliquotctl ({beside}) and on PATH; build every binary \
     with `cargo build --release` at the workspace root (then run target/release/aliquotctl), \
     or put {name} on PATH"
)]
pub struct Missing {
    pub name: String,
    pub beside: String,
}

/// Path of service binary `name`: beside the running executable first (so
/// a build's aliquotctl runs that build's services), else the first on PATH.
pub fn find(name: &str) -> Result<PathBuf, Missing> {
    let dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf));
    let path = std::env::var_os("PATH").unwrap_or_default();
    lookup(name, dir.as_deref(), &path).ok_or_else(|| Missing {
        name: name.to_string(),
        beside: dir.map_or_else(|| "?".into(), |d| d.display().to_string()),
    })
}

fn lookup(name: &str, beside: Option<&Path>, path: &OsStr) -> Option<PathBuf> {
    beside
        .map(|d| d.join(name))
        .into_iter()
        .chain(std::env::split_paths(path).map(|d| d.join(name)))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn exe(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn beside_first_then_path_then_a_clear_refusal() {
        let beside = tempfile::tempdir().unwrap();
        let on_path = tempfile::tempdir().unwrap();
        let path = std::env::join_paths([on_path.path()]).unwrap();
        assert_eq!(lookup(AGENT, Some(beside.path()), &path), None);
        // Not executable: not a candidate.
        std::fs::write(beside.path().join(AGENT), "").unwrap();
        assert_eq!(lookup(AGENT, Some(beside.path()), &path), None);
        let p = exe(on_path.path(), AGENT);
        assert_eq!(lookup(AGENT, Some(beside.path()), &path), Some(p));
        let b = exe(beside.path(), AGENT);
        assert_eq!(lookup(AGENT, Some(beside.path()), &path), Some(b));

        let msg = find("aliquot-no-such-binary").unwrap_err().to_string();
        assert!(msg.contains("aliquot-no-such-binary not found"), "{msg}");
        assert!(msg.contains("cargo build --release"), "{msg}");
    }
}
