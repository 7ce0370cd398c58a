//! Chained block hashes for automatic prefix caching.
//!
//! A full block of `block_size` tokens is named by `chain_hash(parent, tokens)`, where `parent`
//! is the previous block's hash (0 for the first block). Equal hashes therefore mean an equal
//! whole prefix, not just an equal block. The function is fixed (FNV-style mixing with a
//! splitmix finalizer) so that every node of a cluster computes the same names: coordinators use
//! them for cache-aware placement, workers for reuse.
//!
//! **Scopes.** A chain starts from a *root*, not from 0, when its request runs in a cache scope
//! (a tenant's own prefixes, or those it shares, narrowed by a `cache_salt`): the root is
//! [`scope_root`], a BLAKE3 keyed hash of the scope under the cluster's secret, so the same
//! tokens are named differently in every scope, and no client can compute a name. Names are
//! not trusted alone: a worker reuses a cached block only when its stored parent and tokens
//! equal the request's (the block pool compares them), so even a collision cannot make a
//! request read KV computed for other tokens.

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

/// A block's name in a worker's prefix index when only its disk tier holds it. Block hashes are
/// odd ([`chain_hash`] sets the low bit), so the even number below names the same block one
/// tier down: a worker's one gossiped set says which of its blocks are in RAM (`h`) and which
/// on disk (`disk_name(h)`), and placement prices each.
pub fn disk_name(hash: u64) -> u64 {
    hash & !1
}

/// Hashes of every *full* block of `tokens`, in order, in the unscoped namespace (root 0).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_hashes_from(0, tokens, block_size)
}

/// Hashes of every *full* block of `tokens`, in order, the chain starting at `root` (a
/// [`scope_root`], or 0 for the unscoped namespace).
pub fn block_hashes_from(root: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = root;
    for chunk in tokens.chunks_exact(block_size) {
        parent = chain_hash(parent, chunk);
        out.push(parent);
    }
    out
}

/// The root of scope `scope`'s chains under the cluster's `secret`: the first 8 bytes of
/// BLAKE3's keyed hash of the scope's name, never 0 (0 is the unscoped root).
pub fn scope_root(secret: &[u8; 32], scope: &str) -> u64 {
    let mut h = blake3::Hasher::new_keyed(secret);
    h.update(b"zerolayer cache scope\0");
    h.update(scope.as_bytes());
    let bytes = h.finalize();
    u64::from_le_bytes(bytes.as_bytes()[..8].try_into().unwrap()) | 1
}

/// The cluster's secret for [`scope_root`], derived from material every node holds and no
/// client sees (the cluster CA's certificate), for one purpose.
pub fn cluster_secret(material: &[u8]) -> [u8; 32] {
    blake3::derive_key("zerolayer 2026-12 prefix cache scope roots", material)
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
    fn scopes_name_the_same_tokens_apart() {
        let tokens: Vec<u32> = (0..16).collect();
        let secret = cluster_secret(b"ca");
        let (a, b) = (scope_root(&secret, "key:alice"), scope_root(&secret, "key:bob"));
        assert!(a != b && a != 0 && b != 0);
        assert_eq!(a, scope_root(&secret, "key:alice"), "every node computes the same root");
        assert_ne!(a, scope_root(&cluster_secret(b"another ca"), "key:alice"), "the secret enters the root");
        let (ha, hb) = (block_hashes_from(a, &tokens, 4), block_hashes_from(b, &tokens, 4));
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y), "no block name is shared across scopes");
        assert_eq!(block_hashes_from(0, &tokens, 4), block_hashes(&tokens, 4));
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
