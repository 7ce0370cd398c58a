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

mod tensor_parallel;

pub use tensor_parallel::TensorParallel;

use crate::error::Result;
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

/// The backend for `model` on the CPU: the model itself when `tensor_parallel` is 1, else a
/// tensor-parallel group of that many ranks sharing `threads` kernel threads (0: all cores).
/// The KV budget is the worker's, across all ranks.
pub fn cpu(model: Model, tensor_parallel: usize, threads: usize, block_size: usize, kv_budget_bytes: usize) -> Result<Box<dyn Backend>> {
    if tensor_parallel <= 1 {
        return Ok(Box::new(Cpu::new(model, block_size, kv_budget_bytes)?));
    }
    Ok(Box::new(TensorParallel::new(model, tensor_parallel, threads, block_size, kv_budget_bytes)?))
}
