//! Sampling the pool over time.

use super::*;

impl<P: SimPool> Sim<'_, P> {
    pub(super) fn sample_until(&mut self, t: u64) {
        while self.next_sample <= t {
            let at = self.next_sample;
            self.take_sample(at);
            self.next_sample = at + self.sample_interval;
        }
    }

    pub(super) fn take_sample(&mut self, t: u64) {
        let view = self.pool.view();
        let vdevs = view
            .vdevs
            .iter()
            .map(|v| VdevSample {
                alloc: self
                    .synced_alloc
                    .get(v.id as usize)
                    .copied()
                    .unwrap_or(v.alloc),
                capacity: v.capacity,
                bytes_done: self
                    .devices
                    .get(v.id as usize)
                    .map(|d| d.bytes_done())
                    .unwrap_or(0),
                queue_depth: v.queue_depth,
                fragmentation: v.fragmentation,
                aliquot: v.aliquot,
                queue_target: v.queue_target,
            })
            .collect();
        if self.samples.last().is_some_and(|s| s.t == t) {
            self.samples.pop();
        }
        self.samples.push(Sample {
            t,
            vdevs,
            committed: self.committed,
            log_ops: std::mem::take(&mut self.log_ops_acc),
            log_latency_sum: std::mem::take(&mut self.log_lat_acc),
            log_latency_max: std::mem::take(&mut self.log_max_acc),
        });
        if self.samples.len() >= MAX_SAMPLES {
            decimate(&mut self.samples);
            self.sample_interval *= 2;
        }
    }
}

/// Halve the samples, keeping the first and merging each pair into its later
/// member (cumulative counters stay exact; interval counters add up).
fn decimate(samples: &mut Vec<Sample>) {
    let old = std::mem::take(samples);
    let mut it = old.into_iter();
    if let Some(first) = it.next() {
        samples.push(first);
    }
    while let Some(a) = it.next() {
        match it.next() {
            Some(mut b) => {
                b.log_ops += a.log_ops;
                b.log_latency_sum += a.log_latency_sum;
                b.log_latency_max = b.log_latency_max.max(a.log_latency_max);
                samples.push(b);
            }
            None => samples.push(a),
        }
    }
}
