//! A worker on one GPU: its weights uploaded once (quantized formats kept quantized, as flat
//! blocks), its paged KV cache in device memory, and every step's forward run by the kernels of
//! `zerolayer_kernels::cuda` (compiled at run time with NVRTC for the device's architecture).
//! Only the batch's bookkeeping (token ids, positions, block tables) goes up each step, and only
//! the sampled rows' logits come back.
//!
//! The forward is [`crate::model::Model::forward_into`]'s, step for step, and each kernel
//! repeats the CPU kernel's operations in the same order, so a GPU worker is batch invariant
//! and meant to give the CPU worker's greedy tokens (checked on the GPU by `gpu-check`).

use zerolayer_common::config::KvDtype;
use zerolayer_kernels::cuda::{ActScratch, CudaSlice, DeviceMemory, DeviceWeight, Gpu, NcclGroup};

use super::step::{step_rows, Backend, KvGeometry, Shape, StepRows};
use super::tensor_parallel::TensorParallel;
use crate::model::shard::ShardPlan;
use crate::error::{Result, WorkerError};
use crate::model::{ForwardItem, KvCache, Model, ModelConfig};
use crate::sampler::{Pick, Picked};

struct Layer {
    attn_norm: CudaSlice<f32>,
    wqkv: DeviceWeight,
    bqkv: Option<CudaSlice<f32>>,
    wo: DeviceWeight,
    ffn_norm: CudaSlice<f32>,
    wgate_up: DeviceWeight,
    wdown: DeviceWeight,
}

/// Per-step device buffers, grown to the largest step and reused.
struct Scratch {
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    att: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    act: ActScratch,
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    blk: CudaSlice<i32>,
    slot: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    table_at: CudaSlice<i32>,
    last: CudaSlice<i32>,
    /// Each row's greedy token (device sampling).
    picked: CudaSlice<i32>,
    /// Top-k selection: the rows, their k and 1/temperature, and the candidates (`kmax` a row).
    topk: TopKScratch,
}

struct TopKScratch {
    rows: CudaSlice<i32>,
    k: CudaSlice<i32>,
    inv_t: CudaSlice<f32>,
    idx: CudaSlice<i32>,
    val: CudaSlice<f32>,
}

/// A model on one GPU (module docs).
pub struct Cuda {
    gpu: Gpu,
    /// The architecture, and what this GPU computes of it (the same unless it is one rank of a
    /// tensor-parallel group: then its heads and FFN columns).
    cfg: ModelConfig,
    shard_cfg: ModelConfig,
    /// The group it sums partials with, when it is a rank (rank 0 computes the logits).
    group: Option<NcclGroup>,
    rank: usize,
    embed: DeviceWeight,
    output: DeviceWeight,
    norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    half_split: bool,
    max_pos: usize,
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    geometry: KvGeometry,
    weight_bytes: usize,
    s: Scratch,
}

fn gpu_err(device: usize) -> impl Fn(zerolayer_kernels::cuda::GpuError) -> WorkerError {
    move |e| WorkerError::Invalid(format!("device cuda:{device}: {e}"))
}

/// How a GPU's KV cache is sized.
#[derive(Clone, Copy, Debug)]
pub enum KvSize {
    /// As many blocks as fit in this many bytes (a worker's `kv_cache_mb`).
    Budget(usize),
    /// This share of the device memory free once the weights are in.
    FreeShare(f64),
    /// Exactly this many blocks (the ranks of a group agree on one count).
    Blocks(usize),
}

impl Cuda {
    /// Uploads `model` to device `ordinal`, with a KV cache of `kv_budget_bytes`, or (0) of
    /// `free_share` of the device memory free once the weights are in.
    pub fn new(model: Model, ordinal: usize, block_size: usize, kv_budget_bytes: usize, free_share: f64) -> Result<Self> {
        let gpu = Gpu::open(ordinal).map_err(gpu_err(ordinal))?;
        let kv = if kv_budget_bytes > 0 { KvSize::Budget(kv_budget_bytes) } else { KvSize::FreeShare(free_share) };
        Self::upload(gpu, model, None, block_size, kv)
    }

    /// Uploads `model` (whole, or one rank's shard summing through `group`) to `gpu`.
    pub fn upload(gpu: Gpu, model: Model, group: Option<NcclGroup>, block_size: usize, kv: KvSize) -> Result<Self> {
        let ordinal = gpu.ordinal;
        let e = gpu_err(ordinal);
        let cfg = model.cfg.clone();
        let shard_cfg = model.shard_cfg().clone();
        let rank = model.rank();
        let parts = model.parts();
        let mut weight_bytes = 0;
        let mut up = |w: &zerolayer_kernels::quant::Weight| -> Result<DeviceWeight> {
            let d = gpu.weight(w).map_err(&e)?;
            weight_bytes += d.bytes();
            Ok(d)
        };
        let embed = up(parts.embed)?;
        let output = up(parts.output)?;
        let mut layers = Vec::with_capacity(parts.layers.len());
        for l in &parts.layers {
            layers.push(Layer {
                attn_norm: gpu.upload(l.attn_norm).map_err(&e)?,
                wqkv: up(l.wqkv)?,
                bqkv: l.bqkv.map(|b| gpu.upload(b)).transpose().map_err(&e)?,
                wo: up(l.wo)?,
                ffn_norm: gpu.upload(l.ffn_norm).map_err(&e)?,
                wgate_up: up(l.wgate_up)?,
                wdown: up(l.wdown)?,
            });
        }
        let (cos, sin) = parts.rope.cos_sin();
        let (cos, sin) = (gpu.upload(cos).map_err(&e)?, gpu.upload(sin).map_err(&e)?);
        let max_pos = parts.rope.max_pos();
        let half_split = parts.rope.style == zerolayer_kernels::ops::RopeStyle::HalfSplit;
        let norm = gpu.upload(parts.norm).map_err(&e)?;
        drop(model);
        let per_block = shard_cfg.kv_bytes_per_token(KvDtype::F32) * block_size;
        let num_blocks = match kv {
            KvSize::Blocks(n) => n,
            KvSize::Budget(b) => b / per_block,
            KvSize::FreeShare(share) => (gpu.memory().map_err(&e)?.free as f64 * share.clamp(0.0, 0.95)) as usize / per_block,
        };
        if num_blocks == 0 {
            return Err(WorkerError::Invalid(format!("device cuda:{ordinal}: the KV cache would hold no block ({per_block} B each)")));
        }
        let layer_elems = num_blocks * block_size * shard_cfg.kv_dim();
        let mut k = Vec::with_capacity(cfg.n_layers);
        let mut v = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            k.push(gpu.zeros::<f32>(layer_elems).map_err(&e)?);
            v.push(gpu.zeros::<f32>(layer_elems).map_err(&e)?);
        }
        let s = Scratch {
            x: gpu.zeros(1).map_err(&e)?,
            h: gpu.zeros(1).map_err(&e)?,
            qkv: gpu.zeros(1).map_err(&e)?,
            att: gpu.zeros(1).map_err(&e)?,
            proj: gpu.zeros(1).map_err(&e)?,
            gu: gpu.zeros(1).map_err(&e)?,
            ff: gpu.zeros(1).map_err(&e)?,
            logits: gpu.zeros(1).map_err(&e)?,
            scores: gpu.zeros(1).map_err(&e)?,
            act: gpu.act_scratch().map_err(&e)?,
            tokens: gpu.zeros(1).map_err(&e)?,
            pos: gpu.zeros(1).map_err(&e)?,
            blk: gpu.zeros(1).map_err(&e)?,
            slot: gpu.zeros(1).map_err(&e)?,
            tables: gpu.zeros(1).map_err(&e)?,
            table_at: gpu.zeros(1).map_err(&e)?,
            last: gpu.zeros(1).map_err(&e)?,
            picked: gpu.zeros(1).map_err(&e)?,
            topk: TopKScratch { rows: gpu.zeros(1).map_err(&e)?, k: gpu.zeros(1).map_err(&e)?, inv_t: gpu.zeros(1).map_err(&e)?, idx: gpu.zeros(1).map_err(&e)?, val: gpu.zeros(1).map_err(&e)? },
        };
        let geometry = KvGeometry { block_size, num_blocks, dtype: KvDtype::F32, block_bytes: per_block, bytes: per_block * num_blocks };
        Ok(Cuda { gpu, cfg, shard_cfg, group, rank, embed, output, norm, layers, cos, sin, half_split, max_pos, k, v, geometry, weight_bytes, s })
    }

    /// The device's memory now.
    pub fn device_memory(&self) -> Option<DeviceMemory> {
        self.gpu.memory().ok()
    }

    /// One step on the device: the CPU forward's sequence of operations (see
    /// `Model::forward_into`). The logits come back to `logits` for each item's last `logits` tokens; each row's
    /// argmax to `tokens` when given.
    fn run(&mut self, rows: &StepRows, logits: &mut Vec<f32>, picks: &[Pick], picked: &mut Picked) -> std::result::Result<usize, zerolayer_kernels::cuda::GpuError> {
        let (g, s, c) = (&self.gpu, &mut self.s, &self.shard_cfg);
        g.bind()?;
        let t = rows.tokens.len();
        let (d, qd, kvd, hd, f) = (c.dim, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_dim);
        let width = qd + 2 * kvd;
        for (buf, host) in [(&mut s.tokens, &rows.tokens), (&mut s.pos, &rows.pos), (&mut s.blk, &rows.blk), (&mut s.slot, &rows.slot), (&mut s.tables, &rows.tables), (&mut s.table_at, &rows.table_at), (&mut s.last, &rows.last)] {
            g.ensure(buf, host.len())?;
            if !host.is_empty() {
                g.write_at(host, buf, 0)?;
            }
        }
        g.ensure(&mut s.x, t * d)?;
        g.ensure(&mut s.h, t * d)?;
        g.ensure(&mut s.qkv, t * width)?;
        g.ensure(&mut s.att, t * qd)?;
        g.ensure(&mut s.proj, t * d)?;
        g.ensure(&mut s.gu, t * 2 * f)?;
        g.ensure(&mut s.ff, t * f)?;
        g.embed(&self.embed, &s.tokens, t, &mut s.x)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let bs = self.geometry.block_size;
        for (l, layer) in self.layers.iter().enumerate() {
            g.rms_norm(&s.x, None, t, &layer.attn_norm, c.rms_eps, d, &mut s.h)?;
            g.matmul(&layer.wqkv, &s.h, t, &mut s.act, &mut s.qkv)?;
            g.qkv_rope_store(
                &mut s.qkv,
                t,
                width,
                layer.bqkv.as_ref(),
                (c.n_heads, c.n_kv_heads, hd),
                &s.pos,
                (&self.cos, &self.sin, self.half_split),
                (&s.blk, &s.slot, bs),
                (&mut self.k[l], &mut self.v[l]),
            )?;
            g.attention(&s.qkv, t, width, (&self.k[l], &self.v[l]), (&s.tables, &s.table_at, &s.pos), (c.n_heads, c.n_kv_heads, hd), bs, scale, &mut s.scores, rows.max_ctx, &mut s.att)?;
            g.matmul(&layer.wo, &s.att, t, &mut s.act, &mut s.proj)?;
            if let Some(group) = self.group.as_mut() {
                group.all_reduce_sum(g, &mut s.proj, t * d)?;
            }
            g.add_assign(&mut s.x, &s.proj, t * d)?;
            g.rms_norm(&s.x, None, t, &layer.ffn_norm, c.rms_eps, d, &mut s.h)?;
            g.matmul(&layer.wgate_up, &s.h, t, &mut s.act, &mut s.gu)?;
            g.silu_mul(&s.gu, f, t, &mut s.ff)?;
            g.matmul(&layer.wdown, &s.ff, t, &mut s.act, &mut s.proj)?;
            if let Some(group) = self.group.as_mut() {
                group.all_reduce_sum(g, &mut s.proj, t * d)?;
            }
            g.add_assign(&mut s.x, &s.proj, t * d)?;
        }
        // Every rank holds the same final activations; rank 0 alone computes the logits.
        let n_last = if self.rank == 0 { rows.last.len() } else { 0 };
        if n_last > 0 {
            let vocab = c.vocab_size;
            g.rms_norm(&s.x, Some(&s.last), n_last, &self.norm, c.rms_eps, d, &mut s.h)?;
            g.ensure(&mut s.logits, n_last * vocab)?;
            g.matmul(&self.output, &s.h, n_last, &mut s.act, &mut s.logits)?;
            // Greedy rows' tokens and top-k rows' candidates come from the device; the logits
            // come back only if a row is sampled on the host (or the caller asked for them).
            if picks.contains(&Pick::Greedy) {
                g.ensure(&mut s.picked, n_last)?;
                g.argmax(&s.logits, n_last, vocab, &mut s.picked)?;
                picked.tokens = g.download(&s.picked, n_last)?.into_iter().map(|t| t as u32).collect();
            }
            select_top_k(g, &s.logits, vocab, picks, &mut s.topk, picked)?;
            if picks.is_empty() || picks.contains(&Pick::Host) {
                *logits = g.download(&s.logits, n_last * vocab)?;
            } else {
                logits.clear();
            }
        }
        Ok(n_last)
    }
}

/// The top-k candidates of every `TopK` row of `logits` (n rows × vocab), selected on the device
/// and brought back as `picked`'s candidates (nothing when no row is `TopK`).
fn select_top_k(g: &Gpu, logits: &CudaSlice<f32>, vocab: usize, picks: &[Pick], s: &mut TopKScratch, picked: &mut Picked) -> std::result::Result<(), zerolayer_kernels::cuda::GpuError> {
    let (mut rows, mut ks, mut inv_ts) = (Vec::new(), Vec::new(), Vec::new());
    for (r, p) in picks.iter().enumerate() {
        if let Pick::TopK { k, inv_t } = *p {
            rows.push(r as i32);
            ks.push(k as i32);
            inv_ts.push(inv_t);
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    let kmax = ks.iter().copied().max().unwrap_or(1) as usize;
    let n = rows.len();
    for (buf, host) in [(&mut s.rows, &rows), (&mut s.k, &ks)] {
        g.ensure(buf, n)?;
        g.write_at(host, buf, 0)?;
    }
    g.ensure(&mut s.inv_t, n)?;
    g.write_at(&inv_ts, &mut s.inv_t, 0)?;
    g.ensure(&mut s.idx, n * kmax)?;
    g.ensure(&mut s.val, n * kmax)?;
    g.top_k(logits, vocab, (&s.rows, &s.k, &s.inv_t), n, kmax, (&mut s.idx, &mut s.val))?;
    let (idx, val) = (g.download(&s.idx, n * kmax)?, g.download(&s.val, n * kmax)?);
    picked.ranges = vec![(0, 0); picks.len()];
    for (j, (&r, &k)) in rows.iter().zip(&ks).enumerate() {
        picked.ranges[r as usize] = (picked.candidates.len(), k as usize);
        picked.candidates.extend((0..k as usize).map(|i| (idx[j * kmax + i] as u32, val[j * kmax + i])));
    }
    Ok(())
}

/// A worker over the GPUs `devices`, one tensor-parallel rank each, summing through NCCL: every
/// rank joins the group and uploads its shard on a thread of its own (joining blocks until all
/// have), then rank 0 serves on the engine thread and the others on their threads. The KV cache
/// is `kv_budget_bytes` across the group, or (0) `free_share` of the free memory of the GPU
/// with the least.
pub fn group(model: Model, devices: std::ops::Range<usize>, block_size: usize, kv_budget_bytes: usize, free_share: f64) -> Result<TensorParallel> {
    let cfg = model.cfg.clone();
    let size = devices.len();
    let plans = ShardPlan::for_group(&cfg, size)?;
    let e0 = gpu_err(devices.start);
    let id = zerolayer_kernels::cuda::group_id().map_err(&e0)?;
    let mut shards = Vec::with_capacity(size);
    for plan in &plans {
        shards.push(model.shard(plan, 1)?);
    }
    drop(model);
    // Each rank's blocks: the group's budget over the whole model's per-block bytes, or the
    // smallest free-memory share a rank can give (decided after the weights are in, below).
    let blocks = if kv_budget_bytes > 0 { Some(KvCache::blocks_for(&cfg, block_size, KvDtype::F32, kv_budget_bytes)?) } else { None };
    let opened: Vec<Result<(Gpu, Option<NcclGroup>, Model)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = shards
            .into_iter()
            .zip(devices.clone())
            .enumerate()
            .map(|(rank, (shard, dev))| {
                let id = &id;
                sc.spawn(move || -> Result<(Gpu, Option<NcclGroup>, Model)> {
                    let e = gpu_err(dev);
                    let gpu = Gpu::open(dev).map_err(&e)?;
                    let group = NcclGroup::join(&gpu, rank, size, id).map_err(&e)?;
                    Ok((gpu, Some(group), shard))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(WorkerError::Invalid("a GPU rank panicked while joining its group".into())))).collect()
    });
    let mut ranks = Vec::with_capacity(size);
    for r in opened {
        ranks.push(r?);
    }
    let blocks = match blocks {
        Some(b) => b,
        None => {
            let mut least = usize::MAX;
            for ((gpu, _, shard), dev) in ranks.iter().zip(devices.clone()) {
                let free = gpu.memory().map_err(gpu_err(dev))?.free as f64 * free_share.clamp(0.0, 0.95);
                let weights: usize = shard.weight_bytes();
                let per_block = shard.shard_cfg().kv_bytes_per_token(KvDtype::F32) * block_size;
                least = least.min((free as usize).saturating_sub(weights) / per_block);
            }
            least
        }
    };
    let mut backends: Vec<Box<dyn Backend>> = Vec::with_capacity(size);
    for (gpu, group, shard) in ranks {
        backends.push(Box::new(Cuda::upload(gpu, shard, group, block_size, KvSize::Blocks(blocks))?));
    }
    TensorParallel::from_shards(cfg, &plans, backends)
}

/// One rank of a GPU group whose ranks are on several nodes (each node opens its own): opens GPU
/// `ordinal`, joins the NCCL group `id` names as `plan.rank` (blocking until every rank of the
/// group has joined, wherever it runs), and uploads `model`'s shard with exactly `num_blocks`
/// KV blocks (the ranks' configs agree on the count).
pub fn rank(model: &Model, plan: &ShardPlan, ordinal: usize, id: &[u8; 128], block_size: usize, num_blocks: usize) -> Result<Cuda> {
    let shard = model.shard(plan, 1)?;
    let e = gpu_err(ordinal);
    let gpu = Gpu::open(ordinal).map_err(&e)?;
    let group = NcclGroup::join(&gpu, plan.rank, plan.size, id).map_err(&e)?;
    Cuda::upload(gpu, shard, Some(group), block_size, KvSize::Blocks(num_blocks))
}

impl Backend for Cuda {
    fn shape(&self) -> Shape<'_> {
        Shape { config: &self.cfg, weight_bytes: self.weight_bytes, kv: self.geometry }
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        // No greedy rows: every row's logits come back.
        self.forward_pick(items, &[], logits, &mut Picked::default())
    }
    fn forward_pick(&mut self, items: &[ForwardItem<'_>], picks: &[Pick], logits: &mut Vec<f32>, picked: &mut Picked) -> Result<usize> {
        let rows = step_rows(items, self.max_pos, self.geometry.block_size, self.geometry.num_blocks, self.cfg.vocab_size)?;
        picked.clear();
        if rows.tokens.is_empty() {
            return Ok(0);
        }
        if !picks.is_empty() && picks.len() != rows.last.len() {
            return Err(WorkerError::Invalid(format!("{} picks for {} logits rows", picks.len(), rows.last.len())));
        }
        let ordinal = self.gpu.ordinal;
        self.run(&rows, logits, picks, picked).map_err(gpu_err(ordinal))
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> Result<()> {
        super::cpu::check_block(b, self.geometry.num_blocks)?;
        let be = self.geometry.block_size * self.shard_cfg.kv_dim();
        let mut bytes = Vec::with_capacity(self.geometry.block_bytes);
        for (k, v) in self.k.iter().zip(&self.v) {
            for part in [k, v] {
                let vals = self.gpu.read_at(part, b as usize * be, be).map_err(|e| WorkerError::Model(format!("reading KV block {b} from the device: {e}")))?;
                bytes.extend_from_slice(zerolayer_kernels::attention::kv_bytes(&vals));
            }
        }
        out.extend_from_slice(&bytes);
        Ok(())
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> Result<()> {
        super::cpu::check_block(b, self.geometry.num_blocks)?;
        if bytes.len() != self.geometry.block_bytes {
            return Err(WorkerError::Invalid(format!("KV block of {} bytes, not {}", bytes.len(), self.geometry.block_bytes)));
        }
        let be = self.geometry.block_size * self.shard_cfg.kv_dim();
        let vals: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        for ((k, v), kv) in self.k.iter_mut().zip(self.v.iter_mut()).zip(vals.chunks_exact(2 * be)) {
            let (kp, vp) = kv.split_at(be);
            for (part, src) in [(k, kp), (v, vp)] {
                self.gpu.write_at(src, part, b as usize * be).map_err(|e| WorkerError::Model(format!("writing KV block {b} to the device: {e}")))?;
            }
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("cuda:{} ({}, kernels for {})", self.gpu.ordinal, self.gpu.name, self.gpu.arch)
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.gpu.memory().ok().map(|m| (m.total - m.free, m.total))
    }
}
