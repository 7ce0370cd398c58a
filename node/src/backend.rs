//! What the engine runs a model on: the forward pass over a ragged batch, the paged KV cache it
//! reads and writes, and the logits it returns, behind one interface. The scheduler, block
//! pool, sampler and stop matcher above it do not know which backend they drive.
//!
//! - [`Cpu`]: the model and its cache in host memory, on this process's kernel threads.
//! - [`TensorParallel`]: one worker spread over a group of ranks (Megatron-style shards, one
//!   thread per rank, summing through a collective), here on CPU threads: the sharding logic
//!   that GPU groups use, run and tested where CI runs.
//!
//! A backend's KV blocks travel (migration, drain) in one layout whatever it is:
//! `[K₀ V₀ K₁ V₁ …]` per block, every KV head in order, f32 little-endian. So a sequence moves
//! between a sharded and an unsharded worker of the same model.

#[cfg(feature = "gpu")]
mod cuda;
mod tensor_parallel;

#[cfg(feature = "gpu")]
pub use cuda::{group as cuda_group, Cuda};
pub use tensor_parallel::TensorParallel;

use crate::error::{Result, WorkerError};
use crate::model::{ForwardItem, KvCache, Model, ModelConfig};

/// The shape of a backend's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Bytes of one block across every layer, K and V (what a KV transfer moves per block).
    pub block_bytes: usize,
    /// Bytes of the whole cache.
    pub bytes: usize,
}

/// A device (or group of devices) that runs forward steps for one engine.
pub trait Backend: Send {
    /// The model's architecture.
    fn config(&self) -> &ModelConfig;
    /// Bytes of weights it holds (all ranks together).
    fn weight_bytes(&self) -> usize;
    fn kv(&self) -> KvGeometry;
    /// Runs one step: writes K/V for every token through the block tables, and writes the logits
    /// of the last token of every item with `want_logits` into `logits` (rows × vocabulary),
    /// returning the number of rows.
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize>;
    /// Appends block `b` in the common layout (module docs) to `out`.
    fn read_block(&self, b: u32, out: &mut Vec<u8>);
    /// Overwrites block `b` with bytes in the common layout.
    fn write_block(&mut self, b: u32, bytes: &[u8]);
    /// A line for logs and status: what runs this worker.
    fn describe(&self) -> String;
    /// A device's own memory (used, total) in bytes, where the backend has one (a GPU).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The model and its KV cache in host memory.
pub struct Cpu {
    model: Model,
    cache: KvCache,
}

impl Cpu {
    /// `model` with a cache of as many `block_size`-token blocks as fit in `kv_budget_bytes`.
    pub fn new(model: Model, block_size: usize, kv_budget_bytes: usize) -> Result<Self> {
        let cache = KvCache::with_budget(model.shard_cfg(), block_size, kv_budget_bytes)?;
        Ok(Cpu { model, cache })
    }

    /// `model` with exactly `num_blocks` blocks (a tensor-parallel rank sizes its cache by the
    /// group's, so every rank has the same blocks).
    pub fn with_blocks(model: Model, block_size: usize, num_blocks: usize) -> Self {
        let cache = KvCache::new(model.shard_cfg(), block_size, num_blocks);
        Cpu { model, cache }
    }
}

impl Backend for Cpu {
    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    fn kv(&self) -> KvGeometry {
        KvGeometry { block_size: self.cache.layout.block_size, num_blocks: self.cache.num_blocks, block_bytes: self.cache.block_bytes(), bytes: self.cache.bytes() }
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        self.model.forward_into(&mut self.cache, items, logits)
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) {
        self.cache.read_block(b, out)
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) {
        self.cache.write_block(b, bytes)
    }
    fn describe(&self) -> String {
        format!("cpu, {} kernel threads", self.model.threads())
    }
}

/// The backend a worker's config names for `model`: the CPU (whole or tensor parallel), or a
/// GPU. A GPU that this build or this machine cannot drive is an error saying which; a worker
/// never falls back to the CPU silently.
pub fn open(wc: &zerolayer_common::config::WorkerConfig, model: Model) -> Result<Box<dyn Backend>> {
    let budget = wc.kv_cache_mb << 20;
    match wc.gpu() {
        Ok(None) => cpu(model, wc.tensor_parallel, wc.threads, wc.block_size, budget),
        Ok(Some(n)) => gpu(model, n, wc.tensor_parallel, wc.block_size, budget, wc.gpu_kv_share),
        Err(()) => Err(WorkerError::Invalid(format!("unknown device {:?}", wc.device))),
    }
}

#[cfg(feature = "gpu")]
fn gpu(model: Model, ordinal: usize, tensor_parallel: usize, block_size: usize, budget: usize, free_share: f64) -> Result<Box<dyn Backend>> {
    if tensor_parallel <= 1 {
        return Ok(Box::new(Cuda::new(model, ordinal, block_size, budget, free_share)?));
    }
    Ok(Box::new(cuda_group(model, ordinal..ordinal + tensor_parallel, block_size, budget, free_share)?))
}

#[cfg(not(feature = "gpu"))]
fn gpu(_: Model, ordinal: usize, _: usize, _: usize, _: usize, _: f64) -> Result<Box<dyn Backend>> {
    Err(WorkerError::Invalid(format!(
        "device cuda:{ordinal}: this build has no CUDA backend (build with `--features cuda`, or `cuda13` for CUDA 13 libraries); use device = \"cpu\" here"
    )))
}

/// The backend for `model` on the CPU: the model itself when `tensor_parallel` is 1, else a
/// tensor-parallel group of that many ranks sharing `threads` kernel threads (0: all cores).
/// The KV budget is the worker's, across all ranks.
pub fn cpu(model: Model, tensor_parallel: usize, threads: usize, block_size: usize, kv_budget_bytes: usize) -> Result<Box<dyn Backend>> {
    if tensor_parallel <= 1 {
        return Ok(Box::new(Cpu::new(model, block_size, kv_budget_bytes)?));
    }
    Ok(Box::new(TensorParallel::new(model, tensor_parallel, threads, block_size, kv_budget_bytes)?))
}

#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
/// Host-side bookkeeping of one step, checked before anything reaches the device (a kernel
/// indexes what it is given; nothing out of range may reach it).
#[derive(Default, Debug, PartialEq)]
pub(crate) struct StepRows {
    pub tokens: Vec<i32>,
    pub pos: Vec<i32>,
    pub blk: Vec<i32>,
    pub slot: Vec<i32>,
    pub tables: Vec<i32>,
    pub table_at: Vec<i32>,
    pub last: Vec<i32>,
    pub max_ctx: usize,
}

#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
/// Flattens `items` into per-row arrays, refusing what the CPU forward refuses (too long, a
/// short block table, a token outside the vocabulary) and any block outside the cache.
pub(crate) fn step_rows(items: &[ForwardItem<'_>], max_pos: usize, block_size: usize, num_blocks: usize, vocab: usize) -> Result<StepRows> {
    let mut r = StepRows::default();
    for it in items {
        let end = it.start_pos + it.tokens.len();
        if end > max_pos {
            return Err(WorkerError::TooLong { needed: end, limit: max_pos });
        }
        let used = end.div_ceil(block_size);
        if it.block_table.len() < used {
            return Err(WorkerError::Invalid(format!("block table covers {} tokens, need {end}", it.block_table.len() * block_size)));
        }
        if let Some(b) = it.block_table[..used].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(WorkerError::Invalid(format!("block {b} is outside the cache's {num_blocks}")));
        }
        let at = r.tables.len() as i32;
        r.tables.extend(it.block_table[..used].iter().map(|&b| b as i32));
        for (j, &tok) in it.tokens.iter().enumerate() {
            if tok as usize >= vocab {
                return Err(WorkerError::Invalid(format!("token id {tok} out of vocabulary")));
            }
            let p = it.start_pos + j;
            r.tokens.push(tok as i32);
            r.pos.push(p as i32);
            r.blk.push(it.block_table[p / block_size] as i32);
            r.slot.push((p % block_size) as i32);
            r.table_at.push(at);
        }
        r.max_ctx = r.max_ctx.max(end);
        if it.want_logits && !it.tokens.is_empty() {
            r.last.push(r.tokens.len() as i32 - 1);
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_rows_flatten_and_refuse_what_the_device_must_not_index() {
        let t1 = [3u32, 9];
        let t2 = [5u32];
        let items = [
            ForwardItem { tokens: &[1, 2, 3], start_pos: 0, block_table: &t1, want_logits: true },
            ForwardItem { tokens: &[7], start_pos: 4, block_table: &t2, want_logits: false },
        ];
        // Block size 4: the second item's position 4 is in its table's second block, which it lacks.
        assert!(step_rows(&items, 64, 4, 16, 100).unwrap_err().to_string().contains("block table covers"));
        let t2 = [5u32, 6];
        let items = [
            ForwardItem { tokens: &[1, 2, 3], start_pos: 0, block_table: &t1, want_logits: true },
            ForwardItem { tokens: &[7], start_pos: 4, block_table: &t2, want_logits: false },
        ];
        let r = step_rows(&items, 64, 4, 16, 100).unwrap();
        assert_eq!(r.tokens, [1, 2, 3, 7]);
        assert_eq!(r.pos, [0, 1, 2, 4]);
        assert_eq!((r.blk, r.slot), (vec![3, 3, 3, 6], vec![0, 1, 2, 0]));
        assert_eq!((r.tables, r.table_at), (vec![3, 5, 6], vec![0, 0, 0, 1]));
        assert_eq!((r.last, r.max_ctx), (vec![2], 5));
        assert!(step_rows(&items, 64, 4, 6, 100).unwrap_err().to_string().contains("outside the cache"));
        assert!(step_rows(&items, 64, 4, 16, 5).unwrap_err().to_string().contains("out of vocabulary"));
        assert!(matches!(step_rows(&items, 4, 4, 16, 100), Err(WorkerError::TooLong { .. })));
    }
}
