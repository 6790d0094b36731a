//! One error vocabulary: every reason the code emits or branches on is an
//! `ErrorReason` value declared in allocator.proto. Servers can only emit
//! declared reasons (`aliquot_proto::error::Refusal` takes the enum, and
//! only that module builds an ErrorInfo); this test reads the sources for
//! what the type system cannot see: reason names written as string
//! literals (Rust tests and clients, the Python client) and an ErrorInfo
//! built by hand anywhere else.

use std::path::{Path, PathBuf};

use aliquot_proto::v1::ErrorReason;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every file under `dir` ending in `ext`, but build output.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if p.is_dir() {
            if !(name == "target" || name.starts_with('.') || name == "__pycache__") {
                files(&p, ext, out);
            }
        } else if name.ends_with(ext) && !name.ends_with("_pb2.py") {
            out.push(p);
        }
    }
}

fn sources(ext: &str) -> Vec<(PathBuf, String)> {
    let mut v = Vec::new();
    for d in [
        "proto",
        "crates",
        "services",
        "integration-tests",
        "clients",
    ] {
        files(&root().join(d), ext, &mut v);
    }
    v.into_iter()
        .map(|p| {
            let s = std::fs::read_to_string(&p).unwrap();
            (p, s)
        })
        .collect()
}

/// The "UPPER_SNAKE" string literals of a line (two words at least).
fn upper_literals(line: &str) -> Vec<&str> {
    line.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.contains('_')
                && !s.starts_with('_')
                && !s.ends_with('_')
                && s.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

#[test]
fn every_reason_the_code_names_is_declared_in_the_proto() {
    let mut undeclared = Vec::new();
    let mut seen = 0;
    for (ext, files) in [(".rs", sources(".rs")), (".py", sources(".py"))] {
        for (path, text) in files {
            for (n, line) in text.lines().enumerate() {
                let lower = line.to_ascii_lowercase();
                let mut names: Vec<&str> = Vec::new();
                // A literal compared with, or given as, a reason.
                if lower.contains("reason") || lower.contains("refused(") {
                    names.extend(upper_literals(line));
                }
                // The Python client's `ErrorReason.NAME`.
                if ext == ".py" {
                    for part in line.split("ErrorReason.").skip(1) {
                        let name: String = part
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() && name.chars().all(|c| !c.is_ascii_lowercase()) {
                            seen += 1;
                            if ErrorReason::from_str_name(&name).is_none() {
                                undeclared.push(format!("{}:{}: {name}", path.display(), n + 1));
                            }
                        }
                    }
                }
                for name in names {
                    // ALIQUOT_* are environment variables, not reasons.
                    if name.starts_with("ALIQUOT_") {
                        continue;
                    }
                    seen += 1;
                    if ErrorReason::from_str_name(name).is_none() {
                        undeclared.push(format!("{}:{}: {name}", path.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(
        seen > 50,
        "the scan found only {seen} reason names: is it reading the tree?"
    );
    assert!(
        undeclared.is_empty(),
        "reasons not declared in ErrorReason (proto/aliquot/v1/allocator.proto):\n{}",
        undeclared.join("\n")
    );
}

#[test]
fn only_the_one_error_module_builds_an_error_info() {
    let one = root().join("proto/src/error.rs");
    let others: Vec<String> = sources(".rs")
        .into_iter()
        .filter(|(p, text)| {
            *p != one
                && !p.components().any(|c| c.as_os_str() == "tests")
                && (text.contains("with_error_info") || text.contains("ErrorInfo {"))
        })
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(
        others.is_empty(),
        "ErrorInfo built outside aliquot_proto::error (use Refusal): {others:?}"
    );
    // And no hand-kept list of reason names in the Python client.
    for (p, text) in sources(".py") {
        for (n, line) in text.lines().enumerate() {
            let t = line.trim();
            if let Some((name, value)) = t.split_once(" = ") {
                let value = value.trim_matches('"');
                assert!(
                    !(name == value && ErrorReason::from_str_name(name).is_some()),
                    "{}:{}: a reason declared by hand: {t}",
                    p.display(),
                    n + 1
                );
            }
        }
    }
}

/// Every server answers its errors through the one table: no service's code
/// (tests aside) builds a bare `tonic::Status`, which would reach clients
/// without a reason, its values or RetryInfo.
#[test]
fn every_service_refuses_through_the_one_table() {
    const BARE: &[&str] = &[
        "Status::new(",
        "Status::invalid_argument(",
        "Status::not_found(",
        "Status::unavailable(",
        "Status::failed_precondition(",
        "Status::internal(",
        "Status::permission_denied(",
        "Status::unauthenticated(",
        "Status::aborted(",
        "Status::resource_exhausted(",
        "Status::already_exists(",
        "Status::deadline_exceeded(",
        "Status::out_of_range(",
        "Status::unimplemented(",
        "Status::unknown(",
        "Status::data_loss(",
        "Status::cancelled(",
    ];
    let mut bare = Vec::new();
    let mut scanned = 0;
    for service in ["allocator", "agent", "metrics"] {
        let mut v = Vec::new();
        files(
            &root().join("services").join(service).join("src"),
            ".rs",
            &mut v,
        );
        for p in v {
            let text = std::fs::read_to_string(&p).unwrap();
            // A file's unit tests (its `#[cfg(test)]` module, last) may.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            scanned += 1;
            for (n, line) in code.lines().enumerate() {
                if BARE.iter().any(|b| line.contains(b)) {
                    bare.push(format!("{}:{}: {}", p.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        scanned > 30,
        "only {scanned} service files: is it reading the tree?"
    );
    assert!(
        bare.is_empty(),
        "a bare Status in a service (map the error through aliquot_proto::error::Refusal):\n{}",
        bare.join("\n")
    );
}
