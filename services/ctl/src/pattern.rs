//! The data `aliquotctl write` puts on the devices: a per-block pattern that
//! depends on the run's nonce, the block number and the position in the
//! block, so a read-back detects lost, stale (a previous run's) and misplaced
//! (another block's) data alike. Cheap: one multiply and xor per 8 bytes,
//! generated straight into the destination (for writes, the RPC's encode
//! buffer), so each byte is stored once and never copied on the client.

use std::mem::MaybeUninit;

use prost::bytes::BufMut;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn base(nonce: u64, block: u64) -> u64 {
    splitmix64(nonce ^ block.wrapping_mul(GOLDEN))
}

/// Word `j` (bytes 8j..8j+8, little-endian) of a block whose base is `base`.
#[inline(always)]
fn word(base: u64, j: usize) -> u64 {
    base ^ (j as u64).wrapping_mul(GOLDEN)
}

/// Bytes `at .. at + out.len()` of the pattern into `out`.
fn write_at(out: &mut [MaybeUninit<u8>], base: u64, at: usize) {
    let head = ((8 - at % 8) % 8).min(out.len());
    let (h, out) = out.split_at_mut(head);
    for (d, s) in h
        .iter_mut()
        .zip(&word(base, at / 8).to_le_bytes()[at % 8..])
    {
        d.write(*s);
    }
    let first = (at + head) / 8;
    let words = out.len() / 8;
    let p = out.as_mut_ptr().cast::<u64>();
    for j in 0..words {
        // SAFETY: word j lies within `out` (j < out.len() / 8); unaligned
        // stores of initialised values into MaybeUninit memory are sound.
        unsafe { p.add(j).write_unaligned(word(base, first + j).to_le()) };
    }
    let tail = &mut out[8 * words..];
    for (d, s) in tail
        .iter_mut()
        .zip(&word(base, first + words).to_le_bytes())
    {
        d.write(*s);
    }
}

/// Append the first `len` bytes of the block's pattern to `dst`.
pub fn put(dst: &mut impl BufMut, len: usize, nonce: u64, block: u64) {
    let base = base(nonce, block);
    let mut at = 0;
    while at < len {
        let chunk = dst.chunk_mut();
        let n = chunk.len().min(len - at);
        // SAFETY: write_at initialises all of the first n bytes and reads
        // none; advance_mut then covers exactly those.
        unsafe {
            write_at(&mut chunk.as_uninit_slice_mut()[..n], base, at);
            dst.advance_mut(n);
        }
        at += n;
    }
}

/// Fill `buf` with block `block`'s pattern for run `nonce`.
pub fn fill(buf: &mut [u8], nonce: u64, block: u64) {
    let len = buf.len();
    put(&mut &mut buf[..], len, nonce, block);
}

pub fn make(len: usize, nonce: u64, block: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    put(&mut v, len, nonce, block);
    v
}

/// Block `block` of run `nonce`, `size` bytes long, as the client library
/// writes it: its pattern generated straight into each copy's request
/// (the whole extent, which may exceed the block by the sector rounding,
/// so reads compare whole).
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub nonce: u64,
    pub block: u64,
    pub size: u64,
}

impl aliquot_client::BlockData for Block {
    fn len(&self) -> u64 {
        self.size
    }
    fn put<B: BufMut>(&self, dst: &mut B, len: usize) {
        put(dst, len, self.nonce, self.block)
    }
}

/// The first byte offset where `data` differs from the block's pattern.
pub fn first_mismatch(data: &[u8], nonce: u64, block: u64) -> Option<usize> {
    let base = base(nonce, block);
    let mut chunks = data.chunks_exact(8);
    for (j, c) in (&mut chunks).enumerate() {
        let w = word(base, j).to_le_bytes();
        if c != w {
            return Some(8 * j + c.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(0));
        }
    }
    let j = data.len() / 8;
    chunks
        .remainder()
        .iter()
        .zip(&word(base, j).to_le_bytes())
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
    }

    #[test]
    fn chunked_generation_matches_fill() {
        // Across chunk boundaries, with and without a partial last word.
        for len in [1, 8, 4095, 4096, 4097, 12293, 1 << 20] {
            let mut want = vec![0u8; len];
            fill(&mut want, 5, 9);
            assert_eq!(make(len, 5, 9), want, "len {len}");
            assert_eq!(first_mismatch(&want, 5, 9), None);
        }
        // Each word is a function of its position: a prefix is the same pattern.
        assert_eq!(make(100, 3, 4)[..64], make(64, 3, 4)[..]);
        // A destination in pieces that end mid-word.
        let want = make(4099, 5, 9);
        for split in [0, 1, 3, 8, 13, 4098] {
            let (mut a, mut b) = (vec![0u8; split], vec![0u8; 4099 - split]);
            put(&mut (&mut a[..]).chain_mut(&mut b[..]), 4099, 5, 9);
            assert_eq!([a, b].concat(), want, "split at {split}");
        }
    }
}
