//! A sequence leaving its worker: what the worker exports, and how another worker imports KV
//! blocks into its prefix cache.
//!
//! A drain moves each sequence in two halves. The source exports it ([`Export`]: its tokens,
//! its sampler's seed, the chained hashes of its computed full blocks and their raw KV bytes)
//! and stops running it. The target imports the blocks it does not already cache
//! ([`KvImport`]): each is written into a free (or least recently used) block and registered in
//! the prefix index under its hash, exactly as if the target had computed it. The sequence
//! then continues on the target by exact replay (`Engine::add` of a `Job` with `resume` tokens): its whole computed
//! prefix is a cache hit, so only the last partial block (fewer than `block_size` tokens) is
//! recomputed, and batch invariance makes every later token the one the source would have
//! produced.
//!
//! Bytes are `[K₀ V₀ K₁ V₁ …]` per block, in the cache's element type (`kv_dtype`), little-endian:
//! [`crate::model::KvCache::read_block`]'s layout. Both sides must run the same model, block size
//! and element type; the import checks the block's size, which differs for each.

/// What a worker hands over for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    pub prompt: Vec<u32>,
    /// Tokens generated so far (the origin may have received fewer; it replays what it has).
    pub generated: Vec<u32>,
    /// The sampler's seed (one was drawn if the request had none).
    pub seed: u64,
    /// The root of its chain (its cache scope: the resumed job carries it too).
    pub cache_root: u64,
    /// Chained hashes of the computed full blocks, in order, from `cache_root`.
    pub block_hashes: Vec<u64>,
    /// `block_hashes.len() × block_bytes` bytes of KV.
    pub kv: Vec<u8>,
    pub block_bytes: usize,
    pub block_size: usize,
}

impl Export {
    /// The tokens its blocks hold: block `i` holds `block_tokens()[i × block_size ..][..block_size]`.
    pub fn block_tokens(&self) -> Vec<u32> {
        let n = self.block_hashes.len();
        self.prompt.iter().chain(&self.generated).copied().take(n * self.block_size).collect()
    }

    /// Block `i`'s bytes.
    pub fn block(&self, i: usize) -> &[u8] {
        &self.kv[i * self.block_bytes..(i + 1) * self.block_bytes]
    }

    /// Its blocks as an import into another worker of this process, without the bytes of the
    /// blocks `known` says the target caches already.
    pub fn to_import(&self, known: impl Fn(u64) -> bool) -> KvImport {
        let blocks = self.block_hashes.iter().enumerate().map(|(i, &h)| (h, (!known(h)).then(|| self.block(i).to_vec()))).collect();
        KvImport { block_size: self.block_size, block_bytes: self.block_bytes, cache_root: self.cache_root, tokens: self.block_tokens(), blocks }
    }
}

/// Cached blocks a worker reads for another that fetches them: the chain `tokens` spell from
/// `cache_root` as far as it is cached (`block_hashes`), and the bytes of blocks `from..` (the
/// asker caches the ones before).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedChain {
    pub cache_root: u64,
    /// The tokens of the found blocks (`block_hashes.len() × block_size`).
    pub tokens: Vec<u32>,
    pub block_hashes: Vec<u64>,
    pub from: usize,
    /// `(block_hashes.len() − from) × block_bytes` bytes of KV.
    pub kv: Vec<u8>,
    pub block_bytes: usize,
    pub block_size: usize,
}

impl CachedChain {
    /// Block `i`'s bytes (`i ≥ from`).
    pub fn block(&self, i: usize) -> &[u8] {
        let j = i - self.from;
        &self.kv[j * self.block_bytes..(j + 1) * self.block_bytes]
    }

    /// The chain as an import into a worker of this process (the blocks before `from` without
    /// bytes: the importer caches them).
    pub fn to_import(&self) -> KvImport {
        let blocks = self.block_hashes.iter().enumerate().map(|(i, &h)| (h, (i >= self.from).then(|| self.block(i).to_vec()))).collect();
        KvImport { block_size: self.block_size, block_bytes: self.block_bytes, cache_root: self.cache_root, tokens: self.tokens.clone(), blocks }
    }
}

/// Blocks for a worker's prefix cache, in chain order. A block without bytes is one the target
/// is believed to cache already. `tokens` are the tokens the blocks hold (block `i` holds
/// `tokens[i × block_size ..][..block_size]`), and the chain starts at `cache_root`: each
/// block is named by its hash, its parent and its tokens, as the target's own would be.
#[derive(Debug, Default)]
pub struct KvImport {
    pub block_size: usize,
    pub block_bytes: usize,
    pub cache_root: u64,
    pub tokens: Vec<u32>,
    pub blocks: Vec<(u64, Option<Vec<u8>>)>,
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// Blocks written from the bytes sent.
    pub imported: usize,
    /// Blocks the target cached already (sent or not).
    pub already_cached: usize,
    /// Blocks at the end of the chain that could not be placed (a block without bytes that was
    /// not cached, or no block free): the replay recomputes from the first of them.
    pub skipped: usize,
}

impl ImportReport {
    /// Blocks of the chain that are in the target's prefix cache now.
    pub fn usable(&self) -> usize {
        self.imported + self.already_cached
    }
}
