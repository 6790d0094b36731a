//! Device counters and latency: cumulative byte/I/O/error counts, the queue
//! depth now, and p50/p99 request latency over the last interval (an
//! hdrhistogram rotated once a report interval).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use hdrhistogram::Histogram;

pub struct Stats {
    pub writes: AtomicU64,
    pub device_writes: AtomicU64,
    pub reads: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    pub write_errors: AtomicU64,
    pub read_errors: AtomicU64,
    /// I/O requests queued or in flight at the device.
    pub queue_ios: AtomicU64,
    pub queue_bytes: AtomicU64,
    /// Unary Writes the fast path took off the wire (not reported: tests
    /// and benches read it to know which path served them).
    pub fast_writes: AtomicU64,
    /// A device write or flush met ENOSPC; cleared once the file system
    /// has room again (`Agent::out_of_space`).
    pub storage_full: std::sync::atomic::AtomicBool,
    latency: Mutex<Intervals>,
}

struct Intervals {
    current: Histogram<u64>,
    last: Histogram<u64>,
    errors_at_rotation: u64,
    errors_in_last: u64,
}

/// A point-in-time copy, for GetStats and the report stream.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub writes: u64,
    pub device_writes: u64,
    pub reads: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub write_errors: u64,
    pub read_errors: u64,
    pub queue_ios: u64,
    pub queue_bytes: u64,
    pub latency_p50_us: u64,
    pub latency_p99_us: u64,
    /// Errors seen during the last interval (the device is degraded).
    pub recent_errors: u64,
}

fn histogram() -> Histogram<u64> {
    // 1 µs .. 1 h at 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds")
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            writes: AtomicU64::new(0),
            fast_writes: AtomicU64::new(0),
            device_writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            storage_full: std::sync::atomic::AtomicBool::new(false),
            read_errors: AtomicU64::new(0),
            queue_ios: AtomicU64::new(0),
            queue_bytes: AtomicU64::new(0),
            latency: Mutex::new(Intervals {
                current: histogram(),
                last: histogram(),
                errors_at_rotation: 0,
                errors_in_last: 0,
            }),
        }
    }
}

impl Stats {
    pub fn record_latency(&self, d: Duration) {
        let us = (d.as_micros() as u64).max(1);
        self.lock().current.saturating_record(us);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Intervals> {
        self.latency.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Close the current interval.
    pub fn rotate(&self) {
        let errors = self.write_errors.load(Relaxed) + self.read_errors.load(Relaxed);
        let mut i = self.lock();
        let Intervals {
            current,
            last,
            errors_at_rotation,
            errors_in_last,
        } = &mut *i;
        std::mem::swap(current, last);
        current.reset();
        *errors_in_last = errors - *errors_at_rotation;
        *errors_at_rotation = errors;
    }

    pub fn snapshot(&self) -> Snapshot {
        let (p50, p99, recent) = {
            let i = self.lock();
            // Before the first full interval, report what there is so far.
            let h = if i.last.is_empty() {
                &i.current
            } else {
                &i.last
            };
            let errors = self.write_errors.load(Relaxed) + self.read_errors.load(Relaxed);
            let recent = i.errors_in_last.max(errors - i.errors_at_rotation);
            if h.is_empty() {
                (0, 0, recent)
            } else {
                (h.value_at_quantile(0.5), h.value_at_quantile(0.99), recent)
            }
        };
        Snapshot {
            writes: self.writes.load(Relaxed),
            device_writes: self.device_writes.load(Relaxed),
            reads: self.reads.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            write_errors: self.write_errors.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            queue_ios: self.queue_ios.load(Relaxed),
            queue_bytes: self.queue_bytes.load(Relaxed),
            latency_p50_us: p50,
            latency_p99_us: p99,
            recent_errors: recent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_the_last_interval() {
        let s = Stats::default();
        for _ in 0..99 {
            s.record_latency(Duration::from_micros(100));
        }
        s.record_latency(Duration::from_millis(50));
        let a = s.snapshot();
        assert!((99..=101).contains(&a.latency_p50_us), "{a:?}");
        s.rotate();
        s.record_latency(Duration::from_secs(1)); // in the new, current interval
        let b = s.snapshot();
        assert!((99..=101).contains(&b.latency_p50_us), "{b:?}");
        s.rotate();
        let c = s.snapshot();
        assert!(c.latency_p50_us >= 999_000, "{c:?}");
    }
}
