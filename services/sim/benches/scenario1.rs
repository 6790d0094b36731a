//! Speed target: scenario 1 at full scale (two SSDs of 128 and 256 GiB
//! filled with 128K blocks, ~3 M allocations) in under 10 s of wall time.
//! `cargo bench -p aliquot-sim --bench scenario1` prints the figures;
//! `ALIQUOT_SIM_BENCH_POLICY=legacy` times the other policy.

use std::path::Path;
use std::time::Instant;

use aliquot_sim::{Scenario, run_one};

fn main() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/1-ssd-128g-256g-full.toml");
    let sc = Scenario::from_file(&path).expect("scenario 1");
    let policy = std::env::var("ALIQUOT_SIM_BENCH_POLICY").unwrap_or_else(|_| "unified".into());
    let spec = sc
        .runs()
        .into_iter()
        .find(|r| r.label == policy)
        .expect("a run of that policy");
    let start = Instant::now();
    let r = run_one(&sc, &spec, &mut |_| {}).expect("run");
    let wall = start.elapsed().as_secs_f64();
    println!(
        "scenario 1 full scale [{}]: {} allocations, {} written, {:.1} s virtual, {:.2} s wall, {:.2} M allocations/s ({})",
        spec.label,
        r.allocations,
        units::format_bytes(r.bytes_committed),
        r.end_time as f64 / 1e9,
        wall,
        r.allocations as f64 / wall / 1e6,
        if wall < 10.0 {
            "under the 10 s target"
        } else {
            "OVER the 10 s target"
        }
    );
}
