//! The data `aliquotctl write` puts on the devices: a per-block pattern that
//! depends on the run's nonce, the block number and the position in the
//! block, so a read-back detects lost, stale (a previous run's) and misplaced
//! (another block's) data alike. Cheap: one multiply and xor per 8 bytes.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Word `j` (bytes 8j..8j+8, little-endian) of a block whose pattern base is `base`.
#[inline(always)]
fn word(base: u64, j: usize) -> [u8; 8] {
    (base ^ (j as u64).wrapping_mul(GOLDEN)).to_le_bytes()
}

fn base(nonce: u64, block: u64) -> u64 {
    splitmix64(nonce ^ block.wrapping_mul(GOLDEN))
}

/// Fill `buf` with block `block`'s pattern for run `nonce`.
pub fn fill(buf: &mut [u8], nonce: u64, block: u64) {
    let base = base(nonce, block);
    let j = buf.len() / 8;
    let mut chunks = buf.chunks_exact_mut(8);
    for (j, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(base, j));
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&word(base, j)[..n]);
}

/// A new buffer holding the block's pattern. Written once, never zeroed
/// first: at 1 MiB blocks a memset would double the generator's memory traffic.
pub fn make(len: usize, nonce: u64, block: u64) -> Vec<u8> {
    use std::mem::MaybeUninit;
    let base = base(nonce, block);
    let mut v: Vec<u8> = Vec::with_capacity(len);
    let spare = &mut v.spare_capacity_mut()[..len];
    let j = len / 8;
    let mut chunks = spare.chunks_exact_mut(8);
    for (j, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(base, j).map(MaybeUninit::new));
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&word(base, j).map(MaybeUninit::new)[..n]);
    // SAFETY: every one of the first `len` bytes was written just above.
    unsafe { v.set_len(len) };
    v
}

/// The first byte offset where `data` differs from the block's pattern.
pub fn first_mismatch(data: &[u8], nonce: u64, block: u64) -> Option<usize> {
    let base = base(nonce, block);
    let mut chunks = data.chunks_exact(8);
    for (j, c) in (&mut chunks).enumerate() {
        let w = word(base, j);
        if c != w {
            return Some(8 * j + c.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(0));
        }
    }
    let rest = chunks.remainder();
    let j = data.len() / 8;
    rest.iter()
        .zip(&word(base, j))
        .position(|(a, b)| a != b)
        .map(|i| 8 * j + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_runs_differ() {
        let a = make(4096, 1, 0);
        assert_eq!(first_mismatch(&a, 1, 0), None);
        assert_eq!(first_mismatch(&a, 1, 1), Some(0));
        assert_eq!(first_mismatch(&a, 2, 0), Some(0));
        // No two 8-byte words of a block repeat, so a shifted copy is caught.
        assert_ne!(a[..8], a[8..16]);
        let mut b = a.clone();
        b[4000] ^= 1;
        assert_eq!(first_mismatch(&b, 1, 0), Some(4000));
        // Odd lengths: the tail is the prefix of the next word.
        let c = make(13, 7, 3);
        assert_eq!(&c[..8], &make(16, 7, 3)[..8]);
        assert_eq!(first_mismatch(&c, 7, 3), None);
        let mut d = c.clone();
        d[11] ^= 0x80;
        assert_eq!(first_mismatch(&d, 7, 3), Some(11));
        // make and fill agree.
        let mut e = vec![0u8; 4099];
        fill(&mut e, 5, 9);
        assert_eq!(e, make(4099, 5, 9));
    }
}
