//! The pool's mark on the device: which pool the device last served, in
//! which allocator generation, and the newest txg whose sync the allocator
//! had made durable in its store (OpenZFS keeps the same facts in the vdev
//! label's uberblock ring, `vdev_label.c:vdev_uberblock_sync_list@zfs-2.4.0`).
//! The allocator pushes them in every ReportAck; the agent writes them here
//! and sends them back at registration, so an allocator whose store came
//! back older than what a device saw (a lost WAL, a restored backup), or a
//! new pool created over devices of another, is caught before it places
//! anything on them.
//!
//! Two 4 KiB slots after the device label (byte 4096 and 8192 of the
//! 1 MiB label area), written alternately with a sequence number and a
//! checksum, so a torn write loses only the newer mark, never both. The
//! device label itself (identity, size) is never rewritten.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use crate::label::LABEL_BLOCK;

const MAGIC: &[u8; 8] = b"ALQTUBER";
const VERSION: u32 = 1;
/// Byte offsets of the two slots in the label area.
const SLOTS: [u64; 2] = [LABEL_BLOCK as u64, 2 * LABEL_BLOCK as u64];
/// magic, version, seq, pool guid, generation, txg, digest, checksum.
const ENCODED: usize = 8 + 4 + 8 * 5 + 8;

/// What a device's label says of its pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolMark {
    pub pool_guid: u64,
    pub generation: u64,
    /// The newest txg the allocator had synced when it told us.
    pub txg: u64,
    /// The store's state digest at that txg (0: not known).
    pub digest: u64,
}

fn encode(seq: u64, m: &PoolMark) -> Vec<u8> {
    let mut b = Vec::with_capacity(LABEL_BLOCK);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    for v in [seq, m.pool_guid, m.generation, m.txg, m.digest] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let sum = crate::label::fnv1a64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b.resize(LABEL_BLOCK, 0);
    b
}

/// A valid slot: (sequence, mark). Anything else (blank, torn, another
/// version) is no mark at all.
fn decode(b: &[u8]) -> Option<(u64, PoolMark)> {
    if b.len() < ENCODED || &b[..8] != MAGIC {
        return None;
    }
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    if u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) != VERSION {
        return None;
    }
    if crate::label::fnv1a64(&b[..52]) != u64_at(52) {
        return None;
    }
    Some((
        u64_at(12),
        PoolMark {
            pool_guid: u64_at(20),
            generation: u64_at(28),
            txg: u64_at(36),
            digest: u64_at(44),
        },
    ))
}

/// The device's marks: read at open, rewritten when the allocator's facts
/// change. A simulated device keeps them in memory.
#[derive(Debug)]
pub struct Uberblocks {
    file: Option<File>,
    /// (sequence of the newest slot, its mark).
    current: Mutex<(u64, Option<PoolMark>)>,
}

impl Uberblocks {
    /// Read both slots of `file` (the device, label first); the newest
    /// valid one wins.
    pub fn open(file: File) -> io::Result<Uberblocks> {
        let mut newest: (u64, Option<PoolMark>) = (0, None);
        for at in SLOTS {
            let mut b = vec![0u8; LABEL_BLOCK];
            match file.read_exact_at(&mut b, at) {
                Ok(()) => {}
                // A device too short for the slots has no mark yet.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => continue,
                Err(e) => return Err(e),
            }
            if let Some((seq, m)) = decode(&b)
                && (newest.1.is_none() || seq > newest.0)
            {
                newest = (seq, Some(m));
            }
        }
        Ok(Uberblocks {
            file: Some(file),
            current: Mutex::new(newest),
        })
    }

    pub fn in_memory() -> Uberblocks {
        Uberblocks {
            file: None,
            current: Mutex::new((0, None)),
        }
    }

    pub fn current(&self) -> Option<PoolMark> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    /// Make `m` the device's mark, durably (blocking: call off the async
    /// runtime). Returns false when it already was.
    pub fn record(&self, m: PoolMark) -> io::Result<bool> {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.1 == Some(m) {
            return Ok(false);
        }
        let seq = cur.0 + 1;
        if let Some(f) = &self.file {
            f.write_all_at(&encode(seq, &m), SLOTS[(seq % 2) as usize])?;
            f.sync_data()?;
        }
        *cur = (seq, Some(m));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> (tempfile::NamedTempFile, File) {
        let t = tempfile::NamedTempFile::new().unwrap();
        t.as_file().set_len(1 << 20).unwrap();
        let f = t.reopen().unwrap();
        (t, f)
    }

    #[test]
    fn marks_survive_reopen_and_a_torn_slot_keeps_the_older() {
        let (t, f) = device();
        let u = Uberblocks::open(f).unwrap();
        assert_eq!(u.current(), None);
        let m1 = PoolMark {
            pool_guid: 7,
            generation: 1,
            txg: 10,
            digest: 0xabc,
        };
        let m2 = PoolMark { txg: 11, ..m1 };
        assert!(u.record(m1).unwrap());
        assert!(!u.record(m1).unwrap(), "unchanged: not rewritten");
        assert!(u.record(m2).unwrap());
        assert_eq!(
            Uberblocks::open(t.reopen().unwrap()).unwrap().current(),
            Some(m2)
        );
        // Tear the newest slot (seq 2: slot 0): the older mark is found.
        t.as_file()
            .write_all_at(&[0xff; 16], SLOTS[0] + 20)
            .unwrap();
        assert_eq!(
            Uberblocks::open(t.reopen().unwrap()).unwrap().current(),
            Some(m1)
        );
    }
}
