//! CPU time of a process from /proc, for the benches that charge CPU to
//! each process of a pool (load-independent, unlike wall time on a shared
//! machine).

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
