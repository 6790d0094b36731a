//! The README's balancer flow ends where it should, with
//! real processes: `aliquotctl write` records a manifest per run in the
//! pool's data dir by default; `balancer verify --exclusive` tells bytes
//! another manifest lists and bytes no manifest lists from lost ones;
//! `balancer execute --drain` finds every manifest by itself, empties a
//! vdev written only with manifests (which `vdev remove` then takes), and
//! on a vdev holding blocks written with `--no-manifest` fails naming those
//! bytes and what would move them; `aliquotctl free` gives back what the
//! manifests hold.

use std::time::{Duration, Instant};

use integration_tests::{FilePool, args};

const MIB: u64 = 1 << 20;

fn manifests(p: &FilePool) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(p.manifest_dir())
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Wait (≤ 20 s) until the vdevs' allocated bytes are `want` (frees are
/// deferred two txgs).
fn wait_alloc(p: &FilePool, want: &[(&str, u64)]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = p.alloc_by_name();
        if want.iter().all(|(n, b)| got.get(*n) == Some(b)) {
            return;
        }
        assert!(Instant::now() < deadline, "want {want:?}, have {got:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn writes_are_listed_by_default_and_drain_verify_free_use_every_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &args!["--lease", "2s"]);
    // Large enough that the rest of the pool holds a whole drained vdev
    // (a drain needs room for all of it first: spa_vdev_remove_top_check).
    for _ in 0..3 {
        p.add_agent("512MiB");
    }
    let w = |extra: &[&str]| {
        let mut a = args![
            "write",
            "--block-size",
            "1MiB",
            "--concurrency",
            "8",
            "--no-progress"
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        p.ok(&a)
    };

    // 8 MiB written without a manifest, on file0 only (the others offline).
    p.ok(&args!["vdev", "offline", "file1"]);
    p.ok(&args!["vdev", "offline", "file2"]);
    let out = w(&["--total", "8MiB", "--no-manifest"]);
    assert!(out.contains("manifest: none"), "{out}");
    p.ok(&args!["vdev", "online", "file1"]);
    p.ok(&args!["vdev", "online", "file2"]);
    wait_alloc(&p, &[("file0", 8 * MIB), ("file1", 0), ("file2", 0)]);
    assert!(manifests(&p).is_empty(), "--no-manifest records none");

    // Two runs with the defaults: a manifest each, in the data dir.
    let out = w(&["--total", "24MiB"]);
    assert!(
        out.contains(&format!("manifest: {}", p.manifest_dir().display())),
        "{out}"
    );
    w(&["--total", "24MiB"]);
    let ms = manifests(&p);
    assert_eq!(ms.len(), 2, "{ms:?}");

    // One manifest: the other's bytes are named as another manifest's, the
    // --no-manifest bytes as in none; nothing is called lost.
    let one = p.run(&args![
        "balancer",
        "verify",
        "--exclusive",
        "--manifest",
        ms[0].display()
    ]);
    let err = String::from_utf8_lossy(&one.stderr);
    assert!(!one.status.success(), "{err}");
    assert!(err.contains("other manifest(s)"), "{err}");
    assert!(
        err.contains(&format!("{} bytes (8.00M) in no manifest", 8 * MIB)),
        "{err}"
    );
    assert!(!err.contains("LOST"), "{err}");
    // Every manifest (the default directory): only the 8 MiB in none.
    let all = p.run(&args!["balancer", "verify", "--exclusive"]);
    let err = String::from_utf8_lossy(&all.stderr);
    assert!(!all.status.success(), "{err}");
    assert!(
        err.contains("file0 (0) holds") && err.contains("8388608 bytes (8.00M) in no manifest"),
        "{err}"
    );
    assert!(
        !err.contains("file1") && !err.contains("file2") && !err.contains("other manifest"),
        "{err}"
    );
    let ok = p.ok(&args!["balancer", "verify"]);
    assert!(
        ok.starts_with("2 manifests, 48 blocks, 48 copies, 48.0M of data: all intact"),
        "{ok}"
    );

    // file1 holds only blocks of the manifests: the drain empties it, and
    // the vdev is removed.
    p.ok(&args!["vdev", "drain", "file1"]);
    let out = p.ok(&args!["balancer", "execute", "--drain", "file1"]);
    assert!(
        out.contains("stopped: file1 (1) is empty: `aliquotctl vdev remove file1`"),
        "{out}"
    );
    wait_alloc(&p, &[("file1", 0)]);
    let out = p.ok(&args!["vdev", "remove", "file1"]);
    assert!(out.contains("removed from the pool"), "{out}");

    // file0 also holds the 8 MiB no manifest lists: the drain moves the
    // rest, then fails naming exactly those bytes and what would move them.
    p.ok(&args!["vdev", "drain", "file0"]);
    let d = p.run(&args!["balancer", "execute", "--drain", "file0"]);
    let (out, err) = (
        String::from_utf8_lossy(&d.stdout),
        String::from_utf8_lossy(&d.stderr),
    );
    assert_eq!(d.status.code(), Some(1), "{out}\n{err}");
    assert!(
        out.contains("vdev file0 (0) still holds 8.00M (8388608 bytes)")
            && out.contains("8.00M (8388608 bytes) is in no manifest of")
            && out.contains("aliquotctl free --manifest"),
        "{out}"
    );
    assert!(err.contains("the drain did not empty file0 (0)"), "{err}");
    wait_alloc(&p, &[("file0", 8 * MIB), ("file2", 48 * MIB)]);

    // free: refused without saying what; --all frees every manifest's
    // blocks and removes the files; the unlisted 8 MiB stays.
    let none = p.run(&args!["free"]);
    assert_eq!(
        none.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
    let out = p.ok(&args!["free", "--all"]);
    assert!(
        out.starts_with("freed 48 blocks (48 extents, 48.0M) of 2 manifests"),
        "{out}"
    );
    assert!(manifests(&p).is_empty(), "{:?}", manifests(&p));
    wait_alloc(&p, &[("file0", 8 * MIB), ("file2", 0)]);
}
