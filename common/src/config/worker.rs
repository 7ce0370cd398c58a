//! One worker's settings (`[[nodes.workers]]`): its device, its KV cache and its scheduling
//! limits, each with its default and the reason for it.

use serde::{Deserialize, Serialize};

/// One worker (one device).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct WorkerConfig {
    /// The worker's id, unique within its node.
    pub id: String,
    /// The id of the model it loads (`[model]`'s when absent).
    pub model: Option<String>,
    /// `cpu`, or `cuda:N` (GPU N, in a build with the `cuda` feature on a machine with a CUDA
    /// driver; otherwise the node refuses to start, saying which is missing).
    pub device: String,
    /// Kernel threads (0: all cores), shared among tensor-parallel ranks.
    pub threads: usize,
    /// Ranks the model is sharded over (Megatron style: attention heads and the FFN's width
    /// split, an all-reduce after each attention output and FFN down projection). At most the
    /// model's KV heads. On the CPU the ranks are threads of this process; with `cuda:N` they
    /// are GPUs N..N+tensor_parallel, summing through NCCL.
    pub tensor_parallel: usize,
    /// A group that spans nodes: the node of each rank, in rank order (`tensor_parallel` of
    /// them, this node first). Ranks on other nodes are hosted there over the cluster's QUIC
    /// link (see `coordinator::cluster::rank`); empty (the default): every rank is here. On
    /// `cuda:N` a node's ranks take its GPUs N, N+1, … in rank order, and sum through NCCL.
    pub rank_nodes: Vec<String>,
    /// KV cache memory budget (all ranks together). On a GPU, 0 takes `gpu_kv_share` of the
    /// device memory free once the weights are in.
    pub kv_cache_mb: usize,
    /// On a GPU with `kv_cache_mb = 0`: the share of free device memory the KV cache takes.
    pub gpu_kv_share: f64,
    /// The disk tier under the KV cache, in MiB (0, the default: none). Blocks that RAM evicts
    /// are written to it in the background (bounded: a full writer queue drops them), and a
    /// later prompt whose prefix they hold reads them back instead of recomputing it. `cache_control`
    /// pins carry down to disk, where nothing overwrites them until they expire.
    pub kv_disk_mb: usize,
    /// Where the disk tier's file lives (`<node>-<worker>.kv`; required with `kv_disk_mb`). A
    /// restart with the same directory and the same model reloads it, so a restarted node
    /// keeps its prefixes; another model, KV element type or size starts it afresh.
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Tokens per KV block. Small blocks waste few slots (a sequence's last block is on
    /// average half empty: ~1% of slots at 4 tokens against ~5% at 16 for short chats, measured)
    /// and share prefixes at a finer grain; the attention kernel gathers keys across blocks, so
    /// they cost no speed (BENCHMARKS.md).
    pub block_size: usize,
    /// The KV cache's element type: `f32` (the default: exact, logits match the reference
    /// implementation's) or `f16` (llama.cpp's default: half the KV memory, so twice the
    /// cached tokens per MB, and half the bytes attention reads per step; K and V are rounded
    /// to 11 significant bits, which moves logits and can change greedy answers). CPU workers
    /// only; every worker of a config needs the same one (a moved sequence continues with the
    /// same tokens only on a cache of the same element type).
    pub kv_dtype: KvDtype,
    /// Most tokens computed in one engine step (chunked prefill budget).
    pub max_batch_tokens: usize,
    /// Most sequences in the running batch.
    pub max_running: usize,
    /// Most sequences waiting for admission; more are refused (529 upstream).
    pub max_waiting: usize,
    /// Stall-free batching: a step that carries decodes may take this many times what its
    /// decodes alone would take, and prefill chunks get what fits in the difference (the step
    /// time is learnt from the worker's own steps). 0 turns it off: every step gives prefill
    /// the whole `max_batch_tokens`, and a long prompt freezes every stream for its chunks.
    pub step_stretch: f64,
    /// ...but a step may always take this long, so cheap decode steps still leave prefill
    /// chunks large enough to be efficient.
    pub min_step_ms: f64,
    /// Prefill tokens every step may take whatever the decode load, so prompts keep moving.
    pub min_prefill_chunk: usize,
    /// Output tokens of KV a sequence must find room for, beyond its prompt, to be admitted
    /// (all of its `max_tokens` once it has been preempted), so admission does not overcommit
    /// the cache into preemption loops.
    pub reserve_output_tokens: usize,
    /// The share of the KV cache that `cache_control` pins may hold at once: a pinned prefix
    /// stays cached for its TTL (refreshed on each hit) whatever LRU pressure other traffic
    /// brings; the rest of the cache is LRU's alone. 0 turns pinning off.
    pub pinned_kv_share: f64,
    /// Speculative decoding: `ngram` (the default) drafts a decoding sequence's next tokens from
    /// its own prompt and output (prompt lookup) and verifies the draft in the step's batch,
    /// keeping the longest prefix the sampler agrees with; the output is exactly what plain
    /// decoding gives, greedy or seeded, since each verified row is computed as a decode would
    /// compute it (batch invariance) and drawn with the same `(seed, step)`. `off` decodes one
    /// token per step.
    pub speculative: Speculative,
    /// Most tokens a draft proposes (the step computes a draft of k tokens as k + 1 rows).
    pub max_draft: usize,
}

/// The most `max_draft` may say: a longer draft costs a step more rows than prompt lookup's
/// acceptance repays.
pub const MAX_DRAFT: usize = 16;

/// How a worker speculates (`speculative`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Speculative {
    /// Prompt lookup: n-gram drafts from the sequence's own tokens.
    #[default]
    Ngram,
    Off,
}

/// The element type of a worker's KV cache (`kv_dtype`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F32,
    F16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        })
    }
}

impl WorkerConfig {
    /// The GPU it names: `Ok(Some(n))` for `cuda:n`, `Ok(None)` for the CPU, `Err` for
    /// anything else.
    pub fn gpu(&self) -> Result<Option<usize>, ()> {
        match self.device.as_str() {
            "cpu" => Ok(None),
            d => d.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Some).ok_or(()),
        }
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            id: "cpu0".into(),
            model: None,
            device: "cpu".into(),
            threads: 0,
            tensor_parallel: 1,
            rank_nodes: Vec::new(),
            kv_cache_mb: 1024,
            gpu_kv_share: 0.9,
            kv_disk_mb: 0,
            kv_disk_dir: None,
            block_size: 4,
            kv_dtype: KvDtype::F32,
            max_batch_tokens: 512,
            max_running: 32,
            max_waiting: 256,
            step_stretch: 3.0,
            min_step_ms: 40.0,
            min_prefill_chunk: 32,
            reserve_output_tokens: 128,
            pinned_kv_share: 0.5,
            speculative: Speculative::Ngram,
            max_draft: 8,
        }
    }
}
