//! What `aliquotctl up` sets up, the other commands find, with real
//! processes: `history` reaches the running pool's metrics service over TLS
//! given its address as printed (any scheme), `verify --data-dir` takes
//! `up`'s data dir, after `vdev remove` the removed vdev's agent stops and
//! `up` says so while the rest of the pool runs on, and `up` again on the
//! same data dir leaves the removed vdev out and starts the rest.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration_tests::{TermOnDrop, args, bin, ctl, ok_stdout};

/// A running `aliquotctl up`: its banner (stdout up to the LISTEN line),
/// the allocator's address, and its stderr as it comes.
struct Up {
    banner: String,
    addr: String,
    errs: Arc<Mutex<String>>,
    _child: TermOnDrop,
}

/// `aliquotctl up` on `data`: three 256 MiB file vdevs, ephemeral ports,
/// fast snapshots and txgs; returns once it printed its LISTEN line.
fn up(data: &Path) -> Up {
    let mut up = Command::new(bin("aliquotctl"))
        .args(args![
            "up",
            "--data-dir",
            data.display(),
            "--ephemeral",
            "--agents",
            "256MiB,256MiB,256MiB",
            "--snapshot-interval",
            "200ms",
            "--zfs-txg-timeout",
            "300ms"
        ])
        .env_remove("ALIQUOT_ALLOCATOR")
        .env_remove("ALIQUOT_INSECURE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("aliquotctl up");
    let errs = Arc::new(Mutex::new(String::new()));
    {
        let errs = errs.clone();
        let stderr = up.stderr.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut e = errs.lock().unwrap();
                e.push_str(&l);
                e.push('\n');
            }
        });
    }
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let child = TermOnDrop(up);
    let mut banner = String::new();
    let addr = loop {
        let Some(Ok(l)) = lines.next() else {
            panic!("up ended before LISTEN:\n{banner}{}", errs.lock().unwrap());
        };
        banner.push_str(&l);
        banner.push('\n');
        if let Some(a) = l.strip_prefix("LISTEN grpc ") {
            break a.to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    Up {
        banner,
        addr,
        errs,
        _child: child,
    }
}

#[test]
fn history_verify_and_removal_follow_up() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let Up {
        banner,
        addr,
        errs,
        _child: first,
    } = up(&data);
    // "  metrics    https://127.0.0.1:PORT   charts ...": given as http://,
    // as a user copying the address might.
    let metrics = banner
        .lines()
        .find_map(|l| l.trim().strip_prefix("metrics"))
        .and_then(|l| l.split_whitespace().next())
        .expect("metrics line")
        .replace("https://", "http://");
    let certs = data.join("certs");
    let conn = |a: &mut Vec<String>| {
        a.extend(args![
            "--allocator",
            format!("https://{addr}"),
            "--certs-dir",
            certs.display()
        ]);
    };

    let mut w = args!["write", "--total", "64MiB", "--no-progress"];
    conn(&mut w);
    ok_stdout(&ctl(&w), "write");

    // history: the snapshots of this pool, over TLS.
    let deadline = Instant::now() + Duration::from_secs(20);
    let table = loop {
        let o = ctl(&args![
            "history",
            "--metrics",
            metrics,
            "--certs-dir",
            certs.display()
        ]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && out.contains("file2") {
            break out;
        }
        assert!(
            Instant::now() < deadline,
            "history: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(table.contains("file0"), "{table}");
    // Events name their vdev, not just its id.
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("event ") && l.contains("file2 (2)")),
        "{table}"
    );

    // verify with up's own data dir.
    let o = ctl(&args!["verify", "--data-dir", data.display()]);
    ok_stdout(&o, "verify --data-dir <up's data dir>");

    // Remove file2 (drained first: offline, its blocks moved by the mover
    // from the manifest the write recorded), then its agent stops.
    let mut a = args!["vdev", "drain", "file2"];
    conn(&mut a);
    ok_stdout(&ctl(&a), "vdev drain");
    let mut a = args!["balancer", "execute", "--drain", "file2"];
    conn(&mut a);
    ok_stdout(&ctl(&a), "balancer execute --drain");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut a = args!["vdev", "remove", "file2"];
        conn(&mut a);
        let o = ctl(&a);
        if o.status.success() {
            break;
        }
        // Deferred frees: empty once two more txgs synced.
        assert!(
            Instant::now() < deadline,
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !errs
        .lock()
        .unwrap()
        .contains("file2 stopped: its vdev was removed from the pool")
    {
        assert!(
            Instant::now() < deadline,
            "up did not report file2 stopping: {}",
            errs.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(data.join("logs/file2.log")).unwrap();
    assert!(log.contains("removed from the pool"), "{log}");
    // The rest of the pool serves on.
    let mut a = args!["status"];
    conn(&mut a);
    let st = ok_stdout(&ctl(&a), "status after remove");
    assert!(
        st.contains("health ONLINE") && !st.contains("file2"),
        "{st}"
    );

    // The README's flow goes on: stop the pool, `up` again on the same data
    // dir. The store says file2 was removed: up leaves it out, says so, and
    // starts the rest.
    drop(first);
    let again = up(&data);
    assert!(
        again
            .banner
            .lines()
            .any(|l| l.trim_start().starts_with("skipped") && l.contains("file2")),
        "{}",
        again.banner
    );
    assert!(
        !again.banner.contains("agent      file2"),
        "{}",
        again.banner
    );
    let mut a = args!["status", "--json"];
    a.extend(args![
        "--allocator",
        format!("https://{}", again.addr),
        "--certs-dir",
        certs.display()
    ]);
    let st: serde_json::Value =
        serde_json::from_str(&ok_stdout(&ctl(&a), "status after up again")).unwrap();
    let vdevs: Vec<(String, String)> = st["vdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap_or_default().to_string(),
                v["health"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(
        vdevs,
        vec![
            ("file0".to_string(), "healthy".to_string()),
            ("file1".to_string(), "healthy".to_string())
        ],
        "{st}\n{}",
        again.errs.lock().unwrap()
    );
}

/// The README's "add a vdev to the running pool": a certificate from the
/// pool CA (`certs issue`) and `serve agent` with its nine flags, run from
/// the directory holding `aliquot-data` as the README does; the vdev joins
/// the pool healthy.
#[test]
fn a_vdev_added_by_hand_as_the_readme_says_joins_the_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("aliquot-data");
    let pool = up(&data);
    let url = format!("https://{}", pool.addr);
    let run = |a: &[&str]| {
        Command::new(bin("aliquotctl"))
            .args(a)
            .current_dir(tmp.path())
            .env_remove("ALIQUOT_ALLOCATOR")
            .env_remove("ALIQUOT_INSECURE")
            .output()
            .expect("run aliquotctl")
    };
    ok_stdout(
        &run(&[
            "certs",
            "issue",
            "--dir",
            "aliquot-data/certs",
            "--role",
            "agent",
            "file3",
        ]),
        "certs issue --role agent file3",
    );
    let log = std::fs::File::create(tmp.path().join("file3.log")).unwrap();
    let agent = Command::new(bin("aliquotctl"))
        .args([
            "serve",
            "agent",
            "--allocator",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--name",
            "file3",
            "--backend",
            "file",
            "--path",
            "aliquot-data/vdevs/file3.img",
            "--capacity",
            "256MiB",
            "--tls-ca",
            "aliquot-data/certs/ca.pem",
            "--tls-cert",
            "aliquot-data/certs/agent-file3.pem",
            "--tls-key",
            "aliquot-data/certs/agent-file3.key",
            "--token-key",
            "aliquot-data/certs",
        ])
        .current_dir(tmp.path())
        .env_remove("ALIQUOT_INSECURE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("serve agent");
    let _agent = TermOnDrop(agent);
    // Its device waits as pending until the operator adds it.
    let added = ok_stdout(
        &run(&["vdev", "add", "file3", "--allocator", &url, "--wait", "60s"]),
        "vdev add file3",
    );
    assert!(
        added.contains("file3") && added.contains("added"),
        "{added}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = run(&["status", "--json", "--allocator", &url]);
        let st: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
        let joined = st["vdevs"].as_array().is_some_and(|v| {
            v.iter()
                .any(|v| v["name"] == "file3" && v["health"] == "healthy")
        });
        if joined {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "file3 did not join: {st}\n{}\nagent log:\n{}",
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(tmp.path().join("file3.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}
