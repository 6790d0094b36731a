//! A simulated device in real time, for demos of mixed devices on one
//! machine: every device I/O takes `latency + bytes / bandwidth`, and I/Os are
//! served one after another as by a single disk head, however many workers
//! issue them. Data lives in memory, sparsely: only written chunks cost
//! memory, so a 4 GiB sim device costs what was written to it.

use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::Device;

const CHUNK: u64 = 64 << 10;

pub struct SimDevice {
    capacity: u64,
    bandwidth: Option<f64>,
    latency: Duration,
    /// When the (single) head is free again.
    head_free_at: Mutex<Instant>,
    chunks: Mutex<BTreeMap<u64, Box<[u8]>>>,
}

impl SimDevice {
    pub fn new(capacity: u64, bandwidth: Option<f64>, latency: Duration) -> SimDevice {
        SimDevice {
            capacity,
            bandwidth,
            latency,
            head_free_at: Mutex::new(Instant::now()),
            chunks: Mutex::new(BTreeMap::new()),
        }
    }

    /// Book the head for one I/O of `bytes`; returns when it completes.
    fn schedule(&self, bytes: usize) -> Instant {
        let transfer = match self.bandwidth {
            Some(bw) => Duration::from_secs_f64(bytes as f64 / bw),
            None => Duration::ZERO,
        };
        let mut free = self.head_free_at.lock().unwrap_or_else(|p| p.into_inner());
        let start = (*free).max(Instant::now());
        *free = start + self.latency + transfer;
        *free
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "I/O beyond the end of the simulated device",
            )),
        }
    }

    /// Bytes of memory held by written chunks.
    pub fn resident_bytes(&self) -> u64 {
        self.chunks.lock().unwrap_or_else(|p| p.into_inner()).len() as u64 * CHUNK
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

impl Device for SimDevice {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check(offset, data.len())?;
        let done = self.schedule(data.len());
        {
            let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
            let mut pos = 0usize;
            while pos < data.len() {
                let at = offset + pos as u64;
                let (idx, within) = (at / CHUNK, (at % CHUNK) as usize);
                let n = (CHUNK as usize - within).min(data.len() - pos);
                let chunk = chunks
                    .entry(idx)
                    .or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
                chunk[within..within + n].copy_from_slice(&data[pos..pos + n]);
                pos += n;
            }
        }
        sleep_until(done);
        Ok(())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len())?;
        let done = self.schedule(buf.len());
        {
            let chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
            let mut pos = 0usize;
            while pos < buf.len() {
                let at = offset + pos as u64;
                let (idx, within) = (at / CHUNK, (at % CHUNK) as usize);
                let n = (CHUNK as usize - within).min(buf.len() - pos);
                match chunks.get(&idx) {
                    Some(c) => buf[pos..pos + n].copy_from_slice(&c[within..within + n]),
                    None => buf[pos..pos + n].fill(0),
                }
                pos += n;
            }
        }
        sleep_until(done);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        // A cache flush costs one latency on the head, like a real disk's.
        sleep_until(self.schedule(0));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_round_trip_across_chunks() {
        let d = SimDevice::new(4 << 30, None, Duration::ZERO);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let off = CHUNK - 4096;
        d.write_at(off, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        d.read_at(off, &mut back).unwrap();
        assert_eq!(back, data);
        // 200 000 bytes from 4 KiB before a chunk boundary touch 4 chunks.
        assert_eq!(d.resident_bytes(), 4 * CHUNK);
        let mut unwritten = vec![1u8; 8192];
        d.read_at(1 << 30, &mut unwritten).unwrap();
        assert!(unwritten.iter().all(|&b| b == 0));
        assert!(d.write_at((4 << 30) - 4096, &[0u8; 8192]).is_err());
    }

    #[test]
    fn head_serialises_ios() {
        let d = SimDevice::new(1 << 30, Some(100.0 * 1048576.0), Duration::from_millis(5));
        let t0 = Instant::now();
        let a = d.schedule(1 << 20); // 5 ms + 10 ms
        let b = d.schedule(1 << 20);
        assert!(b >= a + Duration::from_millis(15));
        assert!(a >= t0 + Duration::from_millis(15));
    }
}
