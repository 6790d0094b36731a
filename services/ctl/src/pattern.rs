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

/// Fill `buf` with block `block`'s pattern for run `nonce`.
pub fn fill(buf: &mut [u8], nonce: u64, block: u64) {
    let base = splitmix64(nonce ^ block.wrapping_mul(GOLDEN));
    let j = buf.len() / 8;
    let mut chunks = buf.chunks_exact_mut(8);
    for (j, c) in (&mut chunks).enumerate() {
        let w = base ^ (j as u64).wrapping_mul(GOLDEN);
        c.copy_from_slice(&w.to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let w = (base ^ (j as u64).wrapping_mul(GOLDEN)).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&w[..n]);
}

pub fn make(len: usize, nonce: u64, block: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, nonce, block);
    v
}

/// The first byte offset where `data` differs from the block's pattern.
pub fn first_mismatch(data: &[u8], nonce: u64, block: u64) -> Option<usize> {
    let want = make(data.len(), nonce, block);
    data.iter().zip(&want).position(|(a, b)| a != b)
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
    }
}
