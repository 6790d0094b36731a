//! What the benches share: CPU time of a process from /proc (they charge
//! CPU to each process of a pool: load-independent, unlike wall time on a
//! shared machine) and the median of their rounds.

use std::time::Duration;

/// user + system CPU of process `pid` (or "self") so far: fields 14 and 15
/// of stat(5), in 10 ms ticks; zero if the process is gone.
pub fn process_cpu(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// The median of `v` (the mean of the middle two for an even count; NaN
/// when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
