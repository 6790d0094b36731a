//! What one taskq hand-off to an idle thread costs in CPU on this machine:
//! the `[cpu] dispatch` of `t6-A.toml` (README, "The throttle's extra hop").
//!
//! A taskq is a mutex, a condvar and a FIFO of tasks served by a thread
//! that sleeps on the condvar when the FIFO is empty (libzpool's taskq:
//! `taskq_dispatch_ent` appends and signals, the thread wakes and runs the
//! task). Two such queues hand one token back and forth, so every hand-off
//! wakes a sleeping thread, as 2.3's `zio_allocate_dispatch` wakes the idle
//! issue thread for each zio the throttle held. The CPU time the process
//! spends (user + system, both threads, from /proc/self/stat) over the
//! number of hand-offs is the CPU one hand-off costs; the wall time per
//! hand-off is shown beside it.
//!
//! Build and run (std only): `rustc -O handoff.rs -o /tmp/handoff && /tmp/handoff`

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Instant;

struct Taskq {
    q: Mutex<VecDeque<u64>>,
    cv: Condvar,
}

impl Taskq {
    fn new() -> Arc<Taskq> {
        Arc::new(Taskq {
            q: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
        })
    }
    fn dispatch(&self, t: u64) {
        self.q.lock().unwrap().push_back(t);
        self.cv.notify_one();
    }
    fn take(&self) -> u64 {
        let mut q = self.q.lock().unwrap();
        loop {
            if let Some(t) = q.pop_front() {
                return t;
            }
            q = self.cv.wait(q).unwrap();
        }
    }
}

/// User + system CPU of this process in seconds.
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name's closing parenthesis; utime and stime
    // are fields 14 and 15 of the whole line (clock ticks, 100 a second).
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

fn main() {
    let rounds: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().unwrap())
        .unwrap_or(200_000);
    let a = Taskq::new();
    let b = Taskq::new();
    let (a2, b2) = (a.clone(), b.clone());
    let worker = thread::spawn(move || {
        loop {
            let t = a2.take();
            b2.dispatch(t);
            if t == 0 {
                return;
            }
        }
    });
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    for i in (0..rounds).rev() {
        a.dispatch(i);
        let _ = b.take();
    }
    worker.join().unwrap();
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let hops = 2 * rounds;
    println!(
        "{hops} hand-offs: {:.2} us of CPU each, {:.2} us of wall time each ({:.2} CPUs busy)",
        cpu * 1e6 / hops as f64,
        wall * 1e6 / hops as f64,
        cpu / wall
    );
}
