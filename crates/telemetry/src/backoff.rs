//! The one retry policy of every Aliquot binary: exponential backoff with
//! jitter. Each failed attempt doubles the nominal delay up to a cap; the
//! delay slept is drawn from the upper half of it ("equal jitter"), so that
//! agents, allocators and clients that failed together (an allocator
//! restart, a takeover) do not all retry in the same instant, while no
//! retry comes sooner than half its nominal delay.

use std::time::Duration;

/// Retry delays: `min`, doubling per attempt up to `max`, each jittered.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    nominal: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        let max = max.max(min);
        Backoff {
            min,
            max,
            nominal: min,
        }
    }

    /// The delay to sleep before the next attempt (in [nominal/2, nominal]),
    /// and the nominal delay doubles for the one after.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.nominal;
        self.nominal = (self.nominal * 2).min(self.max);
        d / 2 + d.mul_f64(fastrand::f64() / 2.0)
    }

    /// Back to `min`, after a success.
    pub fn reset(&mut self) {
        self.nominal = self.min;
    }

    /// A new cap (the next delays stay at or below it).
    pub fn set_max(&mut self, max: Duration) {
        self.max = max.max(self.min);
        self.nominal = self.nominal.min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_with_jitter_in_the_upper_half() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(800));
        for nominal in [100, 200, 400, 800, 800, 800] {
            let d = b.next_delay();
            assert!(
                d >= ms(nominal / 2) && d <= ms(nominal),
                "{d:?} for {nominal}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= ms(100));
        b.set_max(ms(150));
        for _ in 0..5 {
            assert!(b.next_delay() <= ms(150));
        }
    }

    #[test]
    fn delays_are_spread() {
        let delays: std::collections::HashSet<Duration> = (0..32)
            .map(|_| Backoff::new(Duration::from_secs(1), Duration::from_secs(1)).next_delay())
            .collect();
        assert!(delays.len() > 16, "{delays:?}");
    }
}
