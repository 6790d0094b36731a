//! The repository is read on its own: no comment or document may send the
//! reader to something it does not hold (a specification section, an issue
//! or work-session number, a sibling directory outside the checkout). What a
//! pointer meant is said in place, or cited as a repository document or an
//! OpenZFS `file.c:function@tag`. This walks every text file of the checkout
//! and fails on any such pointer, naming file and line.

use std::path::{Path, PathBuf};

/// Migrations already applied to deployed stores: sqlx keeps a checksum of
/// each file's whole text, comments included, and refuses to start on a
/// store whose applied migration changed. Their first-line comments keep
/// the numbers they were written with; every later migration is checked.
const APPLIED_MIGRATIONS: &[&str] = &[
    "migrations/allocator/0003_generation_history.sql",
    "migrations/allocator/0004_agent_bindings.sql",
    "migrations/allocator/0005_balancer.sql",
    "migrations/allocator/0006_spacemaps.sql",
    "migrations/allocator/0007_rewind.sql",
    "migrations/allocator/0008_owners.sql",
    "migrations/allocator/0009_state_digest.sql",
    "migrations/allocator/0010_owner_maps.sql",
    "migrations/allocator-postgres/0001_schema.sql",
    "migrations/allocator-postgres/0002_owner_maps.sql",
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration-tests sits in the repository root")
        .to_path_buf()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let entry = entry.unwrap();
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type().unwrap().is_dir() {
            // Build output, git's own files and Python caches are not sources.
            if name == "target" || name == ".git" || name == "__pycache__" || name == "node_modules"
            {
                continue;
            }
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// The pointers, matched case-insensitively: a word followed by a space and
/// a digit (an issue or a work session by number), the section sign after
/// "spec", and the sibling directory. The examples below are spelled in
/// pieces, so this file is checked like any other.
fn pointers_in(line: &str) -> Vec<&'static str> {
    let lower = line.to_lowercase();
    let mut found = Vec::new();
    for word in ["issue", "issues", "stop", "stops"] {
        let needle = format!("{word} ");
        let mut from = 0;
        while let Some(at) = lower[from..].find(&needle) {
            let start = from + at;
            let end = start + needle.len();
            let word_start = start == 0
                || !lower[..start]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
            let digit_next = lower[end..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit());
            if word_start && digit_next {
                found.push(word);
            }
            from = end;
        }
    }
    // A section sign before a digit is a section of a document not here,
    // however the line before introduced it.
    let section = '\u{a7}';
    if lower
        .match_indices(section)
        .any(|(at, _)| lower[at + section.len_utf8()..].starts_with(|c: char| c.is_ascii_digit()))
    {
        found.push("spec section");
    }
    if lower.contains(&format!("..{}shared", '/')) {
        found.push("sibling shared directory");
    }
    found
}

#[test]
fn the_matcher_finds_each_kind_of_pointer() {
    // So the walk below cannot pass by matching nothing.
    let issue = format!("see {} 25, item 3", "Issue");
    let stop = format!("({}p 42's note)", "sto");
    let spec = format!("(spec {}2.5)", '\u{a7}');
    let shared = format!("(..{}shared/calibration)", '/');
    assert_eq!(pointers_in(&issue), vec!["issue"]);
    assert_eq!(pointers_in(&stop), vec!["stop"]);
    assert_eq!(pointers_in(&spec), vec!["spec section"]);
    let bare = format!("eligibility ({}2.7, rule 3)", '\u{a7}');
    assert_eq!(pointers_in(&bare), vec!["spec section"]);
    assert_eq!(pointers_in(&shared), vec!["sibling shared directory"]);
    // Words that merely contain one, or a word without a number, are fine.
    assert!(pointers_in("SIGSTOP 1 second; nonstop 2; an issue to fix").is_empty());
}

#[test]
fn no_comment_or_document_points_outside_the_repository() {
    let root = repo_root();
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut scanned = 0usize;
    let mut hits = Vec::new();
    for path in files {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if APPLIED_MIGRATIONS.contains(&rel.as_str()) {
            continue;
        }
        // Binary files and data that is not text (logs of real runs are
        // text, and are checked too).
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        scanned += 1;
        for (n, line) in text.lines().enumerate() {
            for kind in pointers_in(line) {
                hits.push(format!("{rel}:{}: {kind}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        scanned > 200,
        "only {scanned} text files found under {}",
        root.display()
    );
    assert!(
        hits.is_empty(),
        "{} pointer(s) outside the repository; say the thing in place, or cite a repository \
         document or an OpenZFS file.c:function@tag:\n{}",
        hits.len(),
        hits.join("\n")
    );
}
