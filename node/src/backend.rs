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
//! `[K₀ V₀ K₁ V₁ …]` per block, every KV head in order, in the cache's element type (`kv_dtype`:
//! f32, or f16 on the CPU), little-endian. So a sequence moves between a sharded and an
//! unsharded worker of the same model; caches of different element types have different block
//! sizes, and an import refuses blocks of another size.

mod cpu;
#[cfg(feature = "gpu")]
mod cuda;
mod step;
mod tensor_parallel;

pub use cpu::Cpu;
#[cfg(feature = "gpu")]
pub use cuda::{group as cuda_group, Cuda};
pub use step::{Backend, KvGeometry, Shape};
pub use tensor_parallel::TensorParallel;

use zerolayer_common::config::KvDtype;

use crate::error::{Result, WorkerError};
use crate::model::Model;

/// The backend a worker's config names for `model`: the CPU (whole or tensor parallel), or a
/// GPU. A GPU that this build or this machine cannot drive is an error saying which; a worker
/// never falls back to the CPU silently.
pub fn open(wc: &zerolayer_common::config::WorkerConfig, model: Model) -> Result<Box<dyn Backend>> {
    let budget = wc.kv_cache_mb << 20;
    match wc.gpu() {
        Ok(None) => cpu(model, wc.tensor_parallel, wc.threads, wc.block_size, wc.kv_dtype, budget),
        // GPU KV caches are f32 (the config refuses anything else on a GPU).
        Ok(Some(_)) if wc.kv_dtype != KvDtype::F32 => Err(WorkerError::Invalid(format!("device {}: kv_dtype {} runs on the CPU only", wc.device, wc.kv_dtype))),
        // The GPU kernels compute a Llama layer (Llama, Qwen2); Gemma 3's and Qwen3's extra
        // norms, GeGLU and sliding windows run on the CPU backend only so far.
        Ok(Some(_)) if !model.cfg.is_llama_layer() || model.cfg.q_dim() != model.cfg.dim => Err(WorkerError::Invalid(format!(
            "device {}: the {} architecture runs on the CPU backend only (the GPU kernels compute Llama and Qwen2 layers); use device = \"cpu\"",
            wc.device, model.cfg.arch
        ))),
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
    Err(no_cuda(ordinal))
}

#[cfg(not(feature = "gpu"))]
fn no_cuda(ordinal: usize) -> WorkerError {
    WorkerError::Invalid(format!(
        "device cuda:{ordinal}: this build has no CUDA backend (build with `--features cuda`, or `cuda13` for CUDA 13 libraries); use device = \"cpu\" here"
    ))
}

/// A new NCCL group id for a GPU group (the rank that makes it sends it to the others), on
/// device `ordinal`'s behalf (for the message when this build or machine has no NCCL).
pub fn gpu_group_id(ordinal: usize) -> Result<[u8; 128]> {
    #[cfg(feature = "gpu")]
    return zerolayer_kernels::cuda::group_id().map_err(|e| WorkerError::Invalid(format!("device cuda:{ordinal}: {e}")));
    #[cfg(not(feature = "gpu"))]
    Err(no_cuda(ordinal))
}

/// One rank (`plan.rank`) of a GPU group that spans nodes, on this node's GPU `ordinal`: it
/// joins the NCCL group `id` (blocking until every rank has) and holds `num_blocks` KV blocks.
/// (The CUDA backend's `rank`.)
pub fn gpu_rank(model: &Model, plan: &crate::model::shard::ShardPlan, ordinal: usize, id: &[u8; 128], block_size: usize, num_blocks: usize) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "gpu")]
    return Ok(Box::new(cuda::rank(model, plan, ordinal, id, block_size, num_blocks)?));
    #[cfg(not(feature = "gpu"))]
    {
        let _ = (model, plan, id, block_size, num_blocks);
        Err(no_cuda(ordinal))
    }
}

/// The backend for `model` on the CPU: the model itself when `tensor_parallel` is 1, else a
/// tensor-parallel group of that many ranks sharing `threads` kernel threads (0: all cores).
/// The KV budget is the worker's, across all ranks, for a cache of `dtype`.
pub fn cpu(model: Model, tensor_parallel: usize, threads: usize, block_size: usize, dtype: KvDtype, kv_budget_bytes: usize) -> Result<Box<dyn Backend>> {
    if tensor_parallel <= 1 {
        return Ok(Box::new(Cpu::new(model, block_size, dtype, kv_budget_bytes)?));
    }
    Ok(Box::new(TensorParallel::new(model, tensor_parallel, threads, block_size, dtype, kv_budget_bytes)?))
}
