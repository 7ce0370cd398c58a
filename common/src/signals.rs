//! What each worker publishes about itself, for placement, metrics and `zerolayer status`.

use serde::{Deserialize, Serialize};

/// A snapshot of a worker's load, cache and memory, published at least every 100 ms.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerSignals {
    pub kv_blocks_total: u32,
    /// Blocks not referenced by any sequence (includes cached, evictable blocks).
    pub kv_blocks_free: u32,
    /// Free blocks that still hold a cached prefix (evictable).
    pub kv_blocks_cached: u32,
    /// Blocks holding a `cache_control` pin (referenced or not; unreferenced pinned blocks are
    /// not free: nothing evicts them until the pin expires).
    #[serde(default)]
    pub kv_blocks_pinned: u32,
    /// 1 − live token slots ÷ slots in allocated blocks.
    pub kv_fragmentation_ratio: f32,
    pub block_size: u32,
    /// Weights plus the KV blocks held by sequences.
    pub memory_used_bytes: u64,
    /// Weights plus the whole KV pool (reserved at startup).
    pub memory_limit_bytes: u64,
    pub running: u32,
    pub waiting: u32,
    /// Prompt tokens of waiting and prefilling sequences not yet computed.
    pub waiting_prefill_tokens: u64,
    /// Blocks held by sequences that are decoding.
    pub active_decode_blocks: u32,
    /// Prefix-cache hit ratio over a recent window of admissions (tokens hit ÷ tokens queried).
    pub prefix_hit_ratio: f32,
    /// Cumulative prompt tokens found in the prefix cache, and queried.
    pub prefix_cache_hits_total: u64,
    pub prefix_cache_queries_total: u64,
    pub preemptions_total: u64,
    /// Preemptions of sequences already preempted before (preemption loops).
    #[serde(default)]
    pub repreemptions_total: u64,
    pub generated_tokens_total: u64,
    /// Speculative draft tokens verified, and of those kept (the acceptance rate is their
    /// ratio; each kept token is a decode step saved).
    #[serde(default)]
    pub draft_tokens_total: u64,
    #[serde(default)]
    pub draft_accepted_total: u64,
    /// Output tokens per second over the last second or so.
    pub tokens_per_second: f32,
    /// What one more prompt token adds to a step, in microseconds, and what 1,000 more
    /// attended (query, key) pairs add, as the worker's step-time model has measured them (0
    /// until it has): placement prices recomputing a prefix with them.
    #[serde(default)]
    pub prefill_us_per_token: f32,
    #[serde(default)]
    pub prefill_us_per_kilo_pair: f32,
    /// KV blocks written into this worker's prefix cache from elsewhere (a drain's moves and
    /// warm-up, prefix fetches), and blocks read out of it for other workers.
    #[serde(default)]
    pub kv_blocks_imported_total: u64,
    #[serde(default)]
    pub kv_blocks_served_total: u64,
    /// The worker's disk tier (all zeros without one).
    #[serde(default)]
    pub kv_disk: DiskSignals,
    /// Milliseconds since the worker started, at the time of this snapshot.
    pub at_ms: u64,
    /// The worker can run nothing (its backend is gone: a lost tensor-parallel rank); placement
    /// skips it.
    #[serde(default)]
    pub unavailable: bool,
}

/// What a worker's disk tier holds and has done: blocks that RAM evicted, kept on disk and read
/// back on a hit instead of being recomputed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskSignals {
    /// Blocks on disk now, and how many fit.
    pub blocks: u32,
    pub capacity_blocks: u32,
    /// Blocks written to disk, and spills dropped (the writer's queue full, or every slot
    /// pinned).
    pub written_total: u64,
    pub dropped_total: u64,
    /// Blocks read back into RAM for a prompt that hit them.
    pub restored_total: u64,
}

/// A change in a worker's prefix cache, by block hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEvent {
    Stored { hashes: Vec<u64> },
    Evicted { hashes: Vec<u64> },
}
