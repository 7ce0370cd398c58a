//! The CPU backend: a model (whole, or one tensor-parallel shard) and its KV cache in host memory.

use zerolayer_common::config::KvDtype;

use super::step::{Backend, KvGeometry, Shape};
use crate::error::{Result, WorkerError};
use crate::model::{ForwardItem, KvCache, Model};

/// The model and its KV cache in host memory.
pub struct Cpu {
    model: Model,
    cache: KvCache,
}

impl Cpu {
    /// `model` with a cache of as many `block_size`-token blocks of `dtype` as fit in
    /// `kv_budget_bytes`.
    pub fn new(model: Model, block_size: usize, dtype: KvDtype, kv_budget_bytes: usize) -> Result<Self> {
        let cache = KvCache::with_budget(model.shard_cfg(), block_size, dtype, kv_budget_bytes)?;
        Ok(Cpu { model, cache })
    }

    /// `model` with exactly `num_blocks` blocks (a tensor-parallel rank sizes its cache by the
    /// group's, so every rank has the same blocks).
    pub fn with_blocks(model: Model, block_size: usize, dtype: KvDtype, num_blocks: usize) -> Self {
        let cache = KvCache::new(model.shard_cfg(), block_size, dtype, num_blocks);
        Cpu { model, cache }
    }
}

impl Backend for Cpu {
    fn shape(&self) -> Shape<'_> {
        let c = &self.cache;
        let kv = KvGeometry { block_size: c.layout.block_size, num_blocks: c.num_blocks, dtype: c.dtype, block_bytes: c.block_bytes(), bytes: c.bytes() };
        Shape { config: &self.model.cfg, weight_bytes: self.model.weight_bytes(), kv }
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        self.model.forward_into(&mut self.cache, items, logits)
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> Result<()> {
        check_block(b, self.cache.num_blocks)?;
        self.cache.read_block(b, out);
        Ok(())
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> Result<()> {
        check_block(b, self.cache.num_blocks)?;
        if bytes.len() != self.cache.block_bytes() {
            return Err(WorkerError::Invalid(format!("KV block of {} bytes, not {}", bytes.len(), self.cache.block_bytes())));
        }
        self.cache.write_block(b, bytes);
        Ok(())
    }
    fn describe(&self) -> String {
        format!("cpu, {} kernel threads, KV cache in {}", self.model.threads(), self.cache.dtype)
    }
}

/// Refuses a block outside a cache of `num_blocks`.
pub(crate) fn check_block(b: u32, num_blocks: usize) -> Result<()> {
    if b as usize >= num_blocks {
        return Err(WorkerError::Invalid(format!("KV block {b} is outside the cache ({num_blocks} blocks)")));
    }
    Ok(())
}
