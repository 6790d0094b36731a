//! DESIGN.md's list of differences from OpenZFS stays honest: every entry
//! names the test that pins the crate's side of it (`Test: `path::name``),
//! and every named test exists as a test function in that file. A
//! difference cannot be listed without a test, and a test that is renamed
//! or deleted fails here until the document follows.

use std::path::{Path, PathBuf};

const SECTION: &str = "## Where the crate differs from OpenZFS, and why";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The differences section's bullets, each as one string.
fn differences() -> Vec<String> {
    let text = std::fs::read_to_string(crate_dir().join("DESIGN.md")).unwrap();
    let start = text
        .find(SECTION)
        .expect("DESIGN.md has the differences section");
    let body = &text[start + SECTION.len()..];
    let end = body.find("\n## ").unwrap_or(body.len());
    let mut bullets: Vec<String> = Vec::new();
    for line in body[..end].lines() {
        if let Some(rest) = line.strip_prefix("* ") {
            bullets.push(rest.to_string());
        } else if let Some(last) = bullets.last_mut()
            && line.starts_with("  ")
        {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    bullets
}

/// `Test: `path::name`` of a bullet: the path is the crate's own
/// (`tests/…`, `src/…`) or, for another package's test, the repository's.
fn named_test(bullet: &str) -> Option<(String, String)> {
    let at = bullet.find("Test: `")? + "Test: `".len();
    let spec = &bullet[at..at + bullet[at..].find('`')?];
    let (path, name) = spec.rsplit_once("::")?;
    Some((path.to_string(), name.to_string()))
}

/// Whether `file` defines a test function `name`: `fn name(` after a test
/// attribute (`#[test]`, `#[tokio::test…]`), other attributes between.
fn has_test(file: &Path, name: &str) -> bool {
    let Ok(text) = std::fs::read_to_string(file) else {
        return false;
    };
    let lines: Vec<&str> = text.lines().collect();
    lines.iter().enumerate().any(|(i, l)| {
        let l = l.trim_start();
        let defines = l.starts_with(&format!("fn {name}("))
            || l.starts_with(&format!("async fn {name}("))
            || l.starts_with(&format!("pub fn {name}("));
        defines
            && lines[..i]
                .iter()
                .rev()
                .map(|p| p.trim())
                .take_while(|p| p.starts_with("#[") || p.starts_with("///"))
                .any(|p| p.starts_with("#[test]") || p.starts_with("#[tokio::test"))
    })
}

#[test]
fn every_difference_names_a_test_that_exists() {
    let bullets = differences();
    assert!(
        bullets.len() >= 15,
        "only {} differences found: is the section still there?",
        bullets.len()
    );
    let repo = crate_dir().join("../..");
    let mut problems = Vec::new();
    for b in &bullets {
        let title: String = b.chars().take(60).collect();
        match named_test(b) {
            None => problems.push(format!("names no test: {title}")),
            Some((path, name)) => {
                let file = if path.starts_with("tests/") || path.starts_with("src/") {
                    crate_dir().join(&path)
                } else {
                    repo.join(&path)
                };
                if !has_test(&file, &name) {
                    problems.push(format!("{path}::{name} is not a test ({title})"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checker_tells_a_test_from_a_helper() {
    // So the check above cannot pass by accepting any name.
    let this = crate_dir().join("tests/design_doc.rs");
    assert!(has_test(&this, "the_checker_tells_a_test_from_a_helper"));
    assert!(!has_test(&this, "named_test"), "a helper is not a test");
    assert!(!has_test(&this, "no_such_test"));
    assert_eq!(
        named_test("x. Test: `tests/a.rs::b_c`."),
        Some(("tests/a.rs".into(), "b_c".into()))
    );
    assert_eq!(named_test("no test named"), None);
}
