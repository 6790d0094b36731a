//! `aliquotctl free` stopped part way is resumed by running it again, and
//! frees nothing twice, with real processes: a pool filled by a write
//! (which fails with NO_SPACE and records its manifest), a `free` of that
//! manifest killed (a crash point: abort, as kill -9) right after a chunk's
//! Free synced and before it was journaled, then the freed space written
//! again by another run, whose blocks take exactly the extents of that
//! chunk (the only free space). The same `free` run again finishes the
//! manifest, and the other run's blocks all read back intact and are all
//! that stays allocated: a blind second Free of that chunk would have freed
//! them.

use std::time::{Duration, Instant};

use integration_tests::{FilePool, args, bin};

fn allocated(p: &FilePool) -> u64 {
    p.alloc_by_name().values().sum()
}

/// The blocks' bytes (each copy's extent) of a manifest.
fn extent_bytes(path: &std::path::Path) -> (u64, Vec<(u32, u64, u64)>) {
    let m = aliquotctl::manifest::Manifest::load(path).expect("manifest");
    let ext: Vec<_> = m
        .extents()
        .iter()
        .map(|(_, c)| (c.at.vdev, c.at.offset, c.at.size))
        .collect();
    (ext.iter().map(|e| e.2).sum(), ext)
}

#[test]
fn a_free_killed_after_a_chunk_synced_resumes_without_freeing_it_twice() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = FilePool::start(dir.path(), &[]);
    p.add_agent("64MiB");
    let a = dir.path().join("a.jsonl");
    let b = dir.path().join("b.jsonl");

    // Fill the pool: the run fails with NO_SPACE and lists what it wrote.
    let fill = p.run(&args![
        "write",
        "--total",
        "256MiB",
        "--block-size",
        "64KiB",
        "--concurrency",
        "1",
        "--no-progress",
        "--manifest",
        a.display()
    ]);
    let err = String::from_utf8_lossy(&fill.stderr);
    assert!(
        !fill.status.success(),
        "a 64 MiB write fit in 16 MiB: {err}"
    );
    assert!(err.contains(&a.display().to_string()), "{err}");
    let (a_bytes, a_ext) = extent_bytes(&a);
    assert!(a_ext.len() > 256, "{} blocks", a_ext.len());

    // Free it 256 extents a chunk; abort once the first chunk's Free synced.
    let crashed = std::process::Command::new(bin("aliquotctl"))
        .args(args![
            "free",
            "--manifest",
            a.display(),
            "--chunk",
            "256",
            "--allocator",
            p.url,
            "--insecure",
            "--certs-dir",
            p.data_dir().join("certs").display()
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .env("ALIQUOT_FAILPOINT", "free-after-synced:1")
        .output()
        .expect("run aliquotctl free");
    assert!(!crashed.status.success(), "the crash point did not fire");
    let freeing = dir.path().join("a.jsonl.freeing");
    assert!(
        freeing.exists() && !a.exists(),
        "the run left no .freeing file"
    );
    let m = aliquotctl::manifest::Manifest::load(&freeing).unwrap();
    assert_eq!((m.freed, m.free_sent), (0, 256), "journaled progress");
    let chunk1: std::collections::BTreeSet<_> = a_ext[..256].iter().copied().collect();

    // Another run takes the freed space, 64 blocks of the same size: the
    // chunk is the first metaslab (16 MiB, written in block order), wholly
    // free again, which weighs as much as the next unused one and comes
    // first. Freed space is given out two synced txgs later (200 ms each).
    std::thread::sleep(Duration::from_secs(1));
    p.alloc.kill9();
    p.alloc.restart().expect("restart the allocator");
    let deadline = Instant::now() + Duration::from_secs(30);
    while p.status()["vdevs"][0]["health"] != "healthy" {
        assert!(Instant::now() < deadline, "{}", p.status());
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _ = std::fs::remove_file(&b);
        let o = p.run(&args![
            "write",
            "--total",
            "4MiB",
            "--block-size",
            "64KiB",
            "--concurrency",
            "1",
            "--no-progress",
            "--manifest",
            b.display()
        ]);
        if o.status.success() {
            break;
        }
        // A run that failed part way keeps what it wrote: free it again.
        if b.exists() {
            p.ok(&args!["free", "--manifest", b.display()]);
        }
        assert!(
            Instant::now() < deadline,
            "the freed space was never given out again: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (b_bytes, b_ext) = extent_bytes(&b);
    let reused = b_ext.iter().filter(|e| chunk1.contains(e)).count();
    assert!(
        reused > 0,
        "no block of the second run took an extent of the unjournaled chunk: the test proves \
         nothing ({:?} vs {:?})",
        b_ext.first(),
        chunk1.first()
    );

    // The same free again: resumes, skips what is someone else's now.
    let out = p.ok(&args!["free", "--manifest", a.display(), "--chunk", "256"]);
    assert!(out.contains("resumed"), "{out}");
    assert!(
        !freeing.exists(),
        "the resumed run left {}",
        freeing.display()
    );
    let ok = p.ok(&args!["balancer", "verify", "--manifest", b.display()]);
    assert!(ok.contains("all intact"), "{ok}");
    // Everything of the first run is free; the second run's blocks stay.
    let deadline = Instant::now() + Duration::from_secs(20);
    while allocated(&p) != b_bytes {
        assert!(
            Instant::now() < deadline,
            "allocated {} bytes, the second run holds {b_bytes} (the first held {a_bytes})",
            allocated(&p)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "{} blocks of the second run on extents of the chunk a crash left unjournaled; \
         none freed by the resumed free",
        reused
    );
}
