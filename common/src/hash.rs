//! Chained block hashes for automatic prefix caching.
//!
//! A full block of `block_size` tokens is named by `chain_hash(parent, tokens)`, where `parent`
//! is the previous block's hash (0 for the first block). Equal hashes therefore mean an equal
//! whole prefix, not just an equal block. The function is fixed (FNV-style mixing with a
//! splitmix finalizer) so that every node of a cluster computes the same names: coordinators use
//! them for cache-aware placement, workers for reuse.

const SEED: u64 = 0x5a65_726f_4c61_7972; // "ZeroLayr"

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash of a full block of `tokens` following a block whose hash is `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent ^ SEED);
    for &t in tokens {
        h = mix(h ^ (t as u64).wrapping_add(0x9e37_79b9_7f4a_7c15));
    }
    // Never 0: 0 is the parent of the first block.
    mix(h ^ tokens.len() as u64) | 1
}

/// Hashes of every *full* block of `tokens`, in order.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = 0;
    for chunk in tokens.chunks_exact(block_size) {
        parent = chain_hash(parent, chunk);
        out.push(parent);
    }
    out
}

/// A checksum of KV bytes in transit (64-bit, over little-endian words with the same mixing as
/// the block hash): a corrupted or truncated block is refused before it enters a cache.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = mix(SEED ^ bytes.len() as u64);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = mix(h ^ u64::from_le_bytes(w.try_into().unwrap()));
    }
    let mut tail = [0u8; 8];
    tail[..words.remainder().len()].copy_from_slice(words.remainder());
    mix(h ^ u64::from_le_bytes(tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_name_whole_prefixes() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[3] = 999; // differs in the first block only
        let ha = block_hashes(&a, 16);
        let hb = block_hashes(&b, 16);
        assert_eq!(ha.len(), 3);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y), "a change propagates to every later block");
        assert_eq!(block_hashes(&a[..40], 16), ha[..2].to_vec(), "partial blocks are not hashed");
        // Fixed across runs, builds and machines (every node of a cluster must compute the same
        // names): literal values, so a change to the function or its seed fails here.
        assert_eq!(chain_hash(0, &[1, 2, 3]), 0x1a87_f776_e6b4_44e1);
        assert_eq!(chain_hash(0x1a87_f776_e6b4_44e1, &[4, 5, 6, 7]), 0xaaa9_6862_e76b_f5e3);
    }

    #[test]
    fn checksums_see_every_byte() {
        let bytes: Vec<u8> = (0..1003u32).map(|i| (i * 7) as u8).collect();
        let c = checksum(&bytes);
        for i in [0, 7, 8, 500, 1002] {
            let mut b = bytes.clone();
            b[i] ^= 1;
            assert_ne!(checksum(&b), c, "byte {i}");
        }
        assert_ne!(checksum(&bytes[..1002]), c, "a truncation");
    }
}
