//! The leader's side of leadership: the lease this allocator
//! holds on the pool, checked before every call. The lease's local deadline
//! is measured from the moment a renewal was *sent* (by the monotonic
//! clock), so it ends no later than the database's: a leader paused past it
//! (SIGSTOP, a GC pause, a partition) refuses every call from the moment it
//! wakes, before it has talked to the database, and a txg it then tries to
//! persist is fenced by the store (`crate::pg_store`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::Error;

/// Room left between the local deadline and the database's, for the time a
/// renewal spent in flight before the database stamped it.
const MARGIN: Duration = Duration::from_millis(250);

pub struct Lease {
    generation: u64,
    /// This allocator's advertised URL.
    address: String,
    /// Standbys seen polling lately (refreshed at each renewal).
    standbys: Mutex<Vec<String>>,
    /// An operator asked this leader to hand the pool over.
    step_down: tokio::sync::Notify,
    duration: Duration,
    valid_until: Mutex<Instant>,
    deposed: AtomicBool,
    /// Who leads instead, once known (NOT_LEADER's metadata).
    leader: Mutex<String>,
    changed: tokio::sync::Notify,
}

impl Lease {
    /// A lease just taken by a compare-and-swap sent at `sent`.
    pub fn new(generation: u64, address: &str, duration: Duration, sent: Instant) -> Lease {
        Lease {
            generation,
            address: address.to_string(),
            standbys: Mutex::new(Vec::new()),
            step_down: tokio::sync::Notify::new(),
            duration,
            valid_until: Mutex::new(sent + duration.saturating_sub(MARGIN)),
            deposed: AtomicBool::new(false),
            leader: Mutex::new(String::new()),
            changed: tokio::sync::Notify::new(),
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn duration(&self) -> Duration {
        self.duration
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn standbys(&self) -> Vec<String> {
        self.standbys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set_standbys(&self, s: Vec<String>) {
        *self.standbys.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    /// Ask the leader's loop to hand the pool over (StepDown).
    pub fn request_step_down(&self) {
        self.step_down.notify_one();
    }

    /// Resolves when a step-down was asked for.
    pub async fn step_down_requested(&self) {
        self.step_down.notified().await
    }

    /// A renewal sent at `sent` succeeded.
    pub fn extend(&self, sent: Instant) {
        let mut v = self.valid_until.lock().unwrap_or_else(|p| p.into_inner());
        *v = (*v).max(sent + self.duration.saturating_sub(MARGIN));
    }

    /// Time left on the lease (zero once it ran out).
    pub fn left(&self) -> Duration {
        self.valid_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .saturating_duration_since(Instant::now())
    }

    /// Another allocator leads (or this one stepped down): for good.
    pub fn depose(&self, leader: &str, why: &str) {
        if !self.deposed.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                generation = self.generation,
                leader,
                why,
                "no longer the leader: serving nothing"
            );
        }
        if !leader.is_empty() {
            *self.leader.lock().unwrap_or_else(|p| p.into_inner()) = leader.to_string();
        }
        self.changed.notify_waiters();
    }

    pub fn is_deposed(&self) -> bool {
        self.deposed.load(Ordering::Acquire)
    }

    /// Resolves once deposed.
    pub async fn deposed(&self) {
        loop {
            let n = self.changed.notified();
            if self.is_deposed() {
                return;
            }
            n.await;
        }
    }

    /// Refuse every call unless this allocator leads under a live lease.
    pub fn check(&self) -> Result<(), Error> {
        let leader = || {
            self.leader
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
        };
        if self.is_deposed() {
            return Err(Error::NotLeader {
                why: format!("generation {} was replaced", self.generation),
                leader: leader(),
                generation: self.generation,
                lease_left_ms: 0,
            });
        }
        if self.left().is_zero() {
            return Err(Error::NotLeader {
                why: format!(
                    "generation {}'s lease ran out before it could be renewed",
                    self.generation
                ),
                leader: String::new(),
                generation: self.generation,
                lease_left_ms: 0,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_refuses_once_it_runs_out_or_is_deposed() {
        let l = Lease::new(
            3,
            "http://a:7000",
            Duration::from_millis(400),
            Instant::now(),
        );
        assert!(l.check().is_ok());
        std::thread::sleep(Duration::from_millis(200));
        assert!(l.check().is_err(), "past the lease less the margin");
        l.extend(Instant::now());
        assert!(l.check().is_ok());
        l.depose("https://b:7000", "test");
        match l.check() {
            Err(Error::NotLeader { leader, .. }) => assert_eq!(leader, "https://b:7000"),
            other => panic!("{other:?}"),
        }
        l.extend(Instant::now());
        assert!(l.check().is_err(), "deposed is for good");
    }
}
