//! Our Llama-family forward pass over a paged KV cache.
//!
//! One call runs one engine step: a *batch of sequences of different lengths* (decodes of one
//! token and prefill chunks of many) flattened into `T` token rows. Every projection runs as
//! one batched matmul over all rows; attention reads and writes K/V through each sequence's
//! block table. Logits are computed only for rows that are sampled.
//!
//! Weights load (`load`) from GGUF or from Hugging Face safetensors with `config.json`. The
//! architecture is read from metadata; nothing about a particular model is hard-coded. Llama
//! and its relatives, and Qwen2 (biases on Q, K and V; half-split RoPE), run here.
//!
//! A model may be one shard of a tensor-parallel group (`shard`): it then computes its ranks'
//! attention heads and FFN columns, and sums the attention output and FFN down projections with
//! the other ranks through a [`Collective`] (in rank order, so this stays batch invariant).
//!
//! Invariant (batch invariance): each row's arithmetic depends only on that row, its cached
//! K/V and the weights — never on the batch size, its position in the batch, or chunk
//! boundaries — because every kernel in `zerolayer-kernels` keeps a fixed per-row reduction order.

use std::sync::Arc;

use zerolayer_kernels::attention::AttnRow;
use zerolayer_kernels::collective::{Collective, Solo};
use zerolayer_kernels::ops::{add_assign, gelu_mul_to, rms_norm_row, silu_mul_to, RopeTable};
use zerolayer_kernels::pool::ThreadPool;
use zerolayer_kernels::quant::{matmul_rows, matmul_rows_state, matmul_rows_warming, matmul_warming, MatmulScratch, Warm, Weight, PANEL, QK};

mod config;
mod kv_cache;
mod load;
pub mod shard;

pub use config::{Activation, ModelConfig};
pub use kv_cache::KvCache;

use crate::error::{WorkerError, Result};

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V stacked: `q_dim + 2 * kv_dim` output rows.
    wqkv: Weight,
    /// Their biases, stacked the same way (Qwen2), added after the projection.
    bqkv: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and of K (`head_dim` each), applied before RoPE (Gemma 3,
    /// Qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    wo: Weight,
    /// RMSNorm of the attention output before its residual add (Gemma 3).
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up stacked: `2 * ffn_dim` output rows.
    wgate_up: Weight,
    wdown: Weight,
    /// RMSNorm of the FFN output before its residual add (Gemma 3).
    post_ffn_norm: Option<Vec<f32>>,
}

/// Moves the layers' weights (each below a huge page for small models) into one huge-page
/// arena, in the order a step reads them.
fn pack_layers(layers: &mut [Layer]) {
    Weight::pack(layers.iter_mut().flat_map(|l| [&mut l.wqkv, &mut l.wo, &mut l.wgate_up, &mut l.wdown]));
}

/// One sequence's share of a forward call.
pub struct ForwardItem<'a> {
    /// The tokens to compute, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Logits rows wanted, for the item's last `logits` tokens (0: none; 1: the last token, as
    /// a decode or a prompt's last chunk; more: a speculative draft's verification, a row per
    /// drafted position).
    pub logits: usize,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gu: Vec<f32>,
    mm: MatmulScratch,
    /// Buffers for the per-row bookkeeping, reused across calls (empty between them).
    rows: Vec<AttnRow<'static>>,
    last_rows: Vec<usize>,
    /// Byte offsets (the same in every layer's K and V arrays) of the KV runs this step's
    /// attention reads: one block of one KV head each.
    warm_runs: Vec<usize>,
    /// One row's post-norm of the last layer's output (`dim` values).
    row: Vec<f32>,
}

/// A loaded model, ready to run forward steps.
pub struct Model {
    /// The architecture (the whole model's, also in a shard).
    pub cfg: ModelConfig,
    /// What this model computes: `cfg` itself, or in a tensor-parallel shard its share of the
    /// query heads, KV heads and FFN width (what its KV cache is sized by).
    shard_cfg: ModelConfig,
    embed: Arc<Weight>,
    layers: Vec<Layer>,
    norm: Arc<Vec<f32>>,
    output: Arc<Weight>,
    rope: Arc<RopeTable>,
    /// The local (sliding-window) layers' RoPE, where their base differs (Gemma 3).
    rope_local: Option<Arc<RopeTable>>,
    pool: ThreadPool,
    /// The shard's group ([`Solo`] when unsharded).
    group: Box<dyn Collective>,
    /// Its rank in its group, and the group's size (0 of 1 when whole); rank 0 computes the
    /// logits.
    rank: usize,
    ranks: usize,
    scratch: Scratch,
    weight_bytes: usize,
}

/// A model's weights by reference, for device backends to upload.
pub struct ModelParts<'a> {
    pub embed: &'a Weight,
    pub output: &'a Weight,
    pub norm: &'a [f32],
    pub rope: &'a RopeTable,
    pub layers: Vec<LayerParts<'a>>,
}

/// One layer's weights by reference (Q/K/V stacked, gate/up stacked, as [`Model`] holds them).
pub struct LayerParts<'a> {
    pub attn_norm: &'a [f32],
    pub wqkv: &'a Weight,
    pub bqkv: Option<&'a [f32]>,
    pub wo: &'a Weight,
    pub ffn_norm: &'a [f32],
    pub wgate_up: &'a Weight,
    pub wdown: &'a Weight,
}

/// An emptied vector's allocation reused for another element type of the same size and
/// alignment (here: `AttnRow` with another lifetime). The standard library collects
/// `into_iter().map(..)` in place when layouts match, so no allocation happens.
pub(crate) fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    const { assert!(std::mem::size_of::<T>() == std::mem::size_of::<U>() && std::mem::align_of::<T>() == std::mem::align_of::<U>()) };
    v.clear();
    v.into_iter().map(|_| unreachable!("the vector is empty")).collect()
}

/// Whether batched steps warm the next layer's KV during a layer's projections: where it pays
/// on this CPU (`zerolayer_kernels::kv_warming_pays`; no value depends on it).
fn kv_warming() -> bool {
    zerolayer_kernels::kv_warming_pays()
}

impl Layer {
    /// The shares of the next layer's KV lines that the O, gate/up and down projections warm:
    /// in proportion to their panel blocks (their compute), so the loads spread evenly.
    fn warm_shares(&self) -> [(f32, f32); 3] {
        let blocks = |w: &Weight| (w.rows.div_ceil(PANEL) * (w.cols / QK)) as f32;
        let (o, gu, down) = (blocks(&self.wo), blocks(&self.wgate_up), blocks(&self.wdown));
        let all = (o + gu + down).max(1.0);
        [(0.0, o / all), (o / all, (o + gu) / all), ((o + gu) / all, 1.0)]
    }
}

/// Sizes a step buffer to `n` values without clearing it: every buffer sized this way is
/// written whole before it is read (the embedding, the projections, attention and the logits
/// each write every value of theirs), and zeroing the logits alone (rows × vocabulary, 3 MB at
/// 16 rows) cost a memset per step.
fn resize(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

impl Model {
    fn assemble(cfg: ModelConfig, embed: Weight, output: Option<Weight>, norm: Vec<f32>, mut layers: Vec<Layer>, rope_freqs: Option<&[f32]>, threads: usize) -> Result<Self> {
        pack_layers(&mut layers);
        let embed = Arc::new(embed);
        let output = match output {
            Some(o) => Arc::new(o),
            None => embed.clone(), // tied embeddings
        };
        if embed.cols != cfg.dim || output.cols != cfg.dim || output.rows != cfg.vocab_size {
            return Err(WorkerError::Model(format!(
                "embedding/output shapes {}x{} / {}x{} do not match dim {} vocab {}",
                embed.rows, embed.cols, output.rows, output.cols, cfg.dim, cfg.vocab_size
            )));
        }
        let weight_bytes = embed.bytes()
            + if Arc::ptr_eq(&embed, &output) { 0 } else { output.bytes() }
            + layers.iter().map(|l| l.wqkv.bytes() + l.wo.bytes() + l.wgate_up.bytes() + l.wdown.bytes()).sum::<usize>();
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let rope = Arc::new(RopeTable::scaled(cfg.head_dim, cfg.context_length, cfg.rope_base, cfg.rope_style, cfg.rope_pos_scale, rope_freqs));
        let rope_local = (cfg.sliding_window > 0 && (cfg.rope_base_local != cfg.rope_base || cfg.rope_pos_scale != 1.0))
            .then(|| Arc::new(RopeTable::new(cfg.head_dim, cfg.context_length, cfg.rope_base_local, cfg.rope_style)));
        Ok(Model {
            rope_local,
            shard_cfg: cfg.clone(),
            cfg,
            embed,
            layers,
            norm: Arc::new(norm),
            output,
            rope,
            pool: ThreadPool::new(threads),
            group: Box::new(Solo),
            rank: 0,
            ranks: 1,
            scratch: Scratch::default(),
            weight_bytes,
        })
    }

    /// Bytes of weights held in memory (a shard's own, plus the embedding and output head).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// What this model computes and caches: [`Model::cfg`], or a shard's share of it.
    pub fn shard_cfg(&self) -> &ModelConfig {
        &self.shard_cfg
    }

    /// The weights, for a device backend to upload.
    pub fn parts(&self) -> ModelParts<'_> {
        ModelParts {
            embed: &self.embed,
            output: &self.output,
            norm: &self.norm,
            rope: &self.rope,
            layers: self
                .layers
                .iter()
                .map(|l| LayerParts {
                    attn_norm: &l.attn_norm,
                    wqkv: &l.wqkv,
                    bqkv: l.bqkv.as_deref(),
                    wo: &l.wo,
                    ffn_norm: &l.ffn_norm,
                    wgate_up: &l.wgate_up,
                    wdown: &l.wdown,
                })
                .collect(),
        }
    }

    /// Kernel threads.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Runs one engine step. Writes K/V for every token through the block tables and returns
    /// the logits rows (`vocab_size` each) every item asks for (`ForwardItem::logits`), in
    /// item and position order. (Tests use this form; the engine uses [`Model::forward_into`].)
    pub fn forward(&mut self, cache: &mut KvCache, items: &[ForwardItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let mut flat = Vec::new();
        let rows = self.forward_into(cache, items, &mut flat)?;
        let v = self.cfg.vocab_size;
        Ok(flat[..rows * v].chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    /// As [`Model::forward`], writing the logits rows into `logits` (rows × `vocab_size`) and
    /// returning how many rows there are. `logits` is reused across steps, so a step allocates
    /// nothing once the buffers have grown to the largest batch.
    pub fn forward_into(&mut self, cache: &mut KvCache, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        // The shard's widths (the whole model's when unsharded); `dim` and the vocabulary are whole.
        let cfg = &self.shard_cfg;
        let (d, qd, kvd) = (cfg.dim, cfg.q_dim(), cfg.kv_dim());
        let qkv_w = qd + 2 * kvd;
        let t_total: usize = items.iter().map(|it| it.tokens.len()).sum();
        if t_total == 0 {
            return Ok(0);
        }
        // Row bookkeeping: each row's position and block table (in a buffer kept across calls).
        let mut rows: Vec<AttnRow<'_>> = recycle(std::mem::take(&mut self.scratch.rows));
        for it in items {
            check_item(it, self.rope.max_pos(), cache)?;
            for (j, _) in it.tokens.iter().enumerate() {
                rows.push(AttnRow { table: it.block_table, pos: it.start_pos + j });
            }
        }
        let s = &mut self.scratch;
        // The KV attention reads, by runs: with several sequences in the step, each layer's
        // projections bring the next layer's into the caches as they compute (`Warm`).
        let run_bytes = warm_runs(&mut s.warm_runs, items, cache);
        resize(&mut s.x, t_total * d);
        embed(&self.embed, items, &mut s.x, d)?;
        if cfg.embed_scale != 1.0 {
            s.x.iter_mut().for_each(|v| *v *= cfg.embed_scale);
        }
        resize(&mut s.qkv, t_total * qkv_w);
        resize(&mut s.att, t_total * qd);
        resize(&mut s.proj, t_total * d);
        resize(&mut s.gu, t_total * 2 * cfg.ffn_dim);
        let scale = cfg.attn_scale;
        let (eps, f) = (cfg.rms_eps, cfg.ffn_dim);
        let n_layers = self.layers.len();
        for (li, layer) in self.layers.iter().enumerate() {
            // Layer 0's KV warms during its own QKV projection; every later layer's during the
            // previous layer's O, gate/up and down projections, split between them.
            let (here, next) = (cache.bases(li), cache.bases((li + 1).min(n_layers - 1)));
            let warm = |bases, share| (!s.warm_runs.is_empty()).then_some(Warm { bases, runs: &s.warm_runs, run_bytes, share });
            let warm_qkv = warm(&here[..], (0.0, 1.0)).filter(|_| li == 0);
            let [warm_o, warm_gate_up, warm_down] = layer.warm_shares().map(|share| warm(&next[..], share).filter(|_| li + 1 < n_layers));
            // The residual add of the previous layer's down projection (none before layer 0)
            // and RMSNorm run per row inside the projection's parallel activation
            // quantization, as do the add of the O projection and SiLU·mul below.
            let proj = &s.proj;
            let prev_post = li.checked_sub(1).and_then(|p| self.layers[p].post_ffn_norm.as_deref());
            matmul_rows_state(&self.pool, &layer.wqkv, t_total, &mut s.qkv, &mut s.mm, warm_qkv.as_ref(), &mut s.x, |i, x, out| {
                if li > 0 {
                    residual_add(x, &proj[i * d..(i + 1) * d], prev_post, eps, out);
                }
                rms_norm_row(x, &layer.attn_norm, eps, out)
            });
            // Bias, Q/K norms, RoPE and the K/V write, per row in parallel.
            let window = cfg.window_of(li);
            let rope = if window > 0 { self.rope_local.as_ref().unwrap_or(&self.rope) } else { &self.rope };
            let (bias, qk_norm) = (layer.bqkv.as_deref(), layer.qk_norm.as_ref());
            cache.write_rows(li, &self.pool, &rows, &mut s.qkv, qkv_w, (qd, qd + kvd), &|t, rr| {
                if let Some(b) = bias {
                    add_assign(rr, b);
                }
                let (q, rest) = rr.split_at_mut(qd);
                let k = &mut rest[..kvd];
                if let Some((qn, kn)) = qk_norm {
                    norm_heads(q, qn, eps);
                    norm_heads(k, kn, eps);
                }
                let pos = rows[t].pos;
                rope.apply(q, pos);
                rope.apply(k, pos);
            });
            cache.attend(li, window, &self.pool, &rows, &s.qkv, qkv_w, cfg.n_heads, scale, &mut s.att);
            matmul_warming(&self.pool, &layer.wo, &s.att, &mut s.proj, &mut s.mm, warm_o.as_ref());
            self.group.all_reduce_sum(&mut s.proj).map_err(|e| WorkerError::Unavailable(e.to_string()))?;
            let proj = &s.proj;
            let post = layer.post_attn_norm.as_deref();
            matmul_rows_state(&self.pool, &layer.wgate_up, t_total, &mut s.gu, &mut s.mm, warm_gate_up.as_ref(), &mut s.x, |i, x, out| {
                residual_add(x, &proj[i * d..(i + 1) * d], post, eps, out);
                rms_norm_row(x, &layer.ffn_norm, eps, out)
            });
            // act(gate)·up per row, inside the down projection's activation quantization.
            let (gu, act) = (&s.gu, cfg.activation);
            matmul_rows_warming(&self.pool, &layer.wdown, t_total, &mut s.proj, &mut s.mm, warm_down.as_ref(), |i, out| {
                let (g, u) = gu[i * 2 * f..(i + 1) * 2 * f].split_at(f);
                match act {
                    Activation::Silu => silu_mul_to(g, u, out),
                    Activation::GeluTanh => gelu_mul_to(g, u, out),
                }
            });
            self.group.all_reduce_sum(&mut s.proj).map_err(|e| WorkerError::Unavailable(e.to_string()))?;
        }
        // The last layer's residual add (the next layer's projection would have fused it).
        let last_post = self.layers.last().and_then(|l| l.post_ffn_norm.as_deref());
        resize(&mut s.row, d);
        for (x, p) in s.x.chunks_exact_mut(d).zip(s.proj.chunks_exact(d)) {
            residual_add(x, p, last_post, eps, &mut s.row);
        }
        // Final norm and logits, only for the rows that are sampled.
        let mut last_rows = std::mem::take(&mut s.last_rows);
        logit_rows(items, self.rank, &mut last_rows);
        let n_last = last_rows.len();
        if n_last > 0 {
            let v = cfg.vocab_size;
            resize(logits, last_rows.len() * v);
            let x = &s.x;
            matmul_rows(&self.pool, &self.output, last_rows.len(), logits, &mut s.mm, |i, out| {
                let row = last_rows[i];
                rms_norm_row(&x[row * d..(row + 1) * d], &self.norm, eps, out)
            });
        }
        s.last_rows = last_rows;
        self.scratch.rows = recycle(rows);
        Ok(n_last)
    }
}

/// `x += p`, or `x += rms_norm(p)` where the layer normalizes its output before the residual
/// add (`post`; `tmp` holds the normalized row).
fn residual_add(x: &mut [f32], p: &[f32], post: Option<&[f32]>, eps: f32, tmp: &mut [f32]) {
    match post {
        Some(w) => {
            rms_norm_row(p, w, eps, tmp);
            add_assign(x, tmp);
        }
        None => add_assign(x, p),
    }
}

/// RMSNorm of every head of `x` (`weight.len()` values each) in place.
fn norm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    let mut buf = [0f32; 512];
    let hd = weight.len();
    for h in x.chunks_exact_mut(hd) {
        let tmp = &mut buf[..hd];
        rms_norm_row(h, weight, eps, tmp);
        h.copy_from_slice(tmp);
    }
}

/// The KV attention reads of a step, by runs (byte offsets of each item's blocks, per KV head),
/// into `out`: with several sequences in the step, each layer's projections bring the next
/// layer's into the caches as they compute (`Warm`). Empty when warming does not pay. Returns
/// the bytes of one run.
fn warm_runs(out: &mut Vec<usize>, items: &[ForwardItem<'_>], cache: &KvCache) -> usize {
    out.clear();
    let layout = cache.layout;
    let elem = cache.dtype.bytes();
    let run_bytes = layout.block_size * layout.head_dim * elem;
    if items.len() >= 2 && run_bytes % 64 == 0 && kv_warming() {
        for it in items {
            let blocks = (it.start_pos + it.tokens.len()).div_ceil(layout.block_size);
            for h in 0..layout.n_kv_heads {
                out.extend(it.block_table[..blocks].iter().map(|&b| layout.offset(b as usize, h, 0) * elem));
            }
        }
    }
    run_bytes
}

/// Every item's token embeddings, row after row, into `x` (`d` values a row).
fn embed(table: &Weight, items: &[ForwardItem<'_>], x: &mut [f32], d: usize) -> Result<()> {
    let mut r = 0;
    for it in items {
        for &tok in it.tokens {
            if tok as usize >= table.rows {
                return Err(WorkerError::Invalid(format!("token id {tok} out of vocabulary")));
            }
            table.dequantize_row(tok as usize, &mut x[r * d..(r + 1) * d]);
            r += 1;
        }
    }
    Ok(())
}

/// The rows whose logits a step computes (each item's last row, where it wants logits) into
/// `out`. Every rank holds the same final activations; rank 0 alone computes the logits.
fn logit_rows(items: &[ForwardItem<'_>], rank: usize, out: &mut Vec<usize>) {
    out.clear();
    if rank != 0 {
        return;
    }
    let mut r = 0;
    for it in items {
        r += it.tokens.len();
        out.extend(r - it.logits.min(it.tokens.len())..r);
    }
}

/// Refuses an item the kernels must not see: past the context, a block table too short for
/// its positions, or naming a block outside the cache where the step reads or writes (the
/// kernels index what they are given; a rank host's tables come from its leader, over the
/// network).
fn check_item(it: &ForwardItem<'_>, max_pos: usize, cache: &KvCache) -> Result<()> {
    let end = it.start_pos + it.tokens.len();
    if end > max_pos {
        return Err(WorkerError::TooLong { needed: end, limit: max_pos });
    }
    let bs = cache.layout.block_size;
    if it.block_table.len() * bs < end {
        return Err(WorkerError::Invalid(format!("block table covers {} tokens, need {end}", it.block_table.len() * bs)));
    }
    if let Some(&b) = it.block_table[..end.div_ceil(bs)].iter().find(|&&b| b as usize >= cache.num_blocks) {
        return Err(WorkerError::Invalid(format!("block {b} is outside the cache ({} blocks)", cache.num_blocks)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycle_keeps_the_allocation() {
        let table = [1u32, 2, 3];
        let mut v: Vec<AttnRow<'_>> = Vec::with_capacity(64);
        v.push(AttnRow { table: &table, pos: 0 });
        let (ptr, cap) = (v.as_ptr() as usize, v.capacity());
        let back: Vec<AttnRow<'static>> = recycle(v);
        assert_eq!((back.as_ptr() as usize, back.capacity(), back.len()), (ptr, cap, 0));
    }
}
