//! Tensor-parallel shards, Megatron style: each rank of a group of `size` computes a contiguous
//! range of KV heads (and the query heads that read them) and of the FFN's inner width. Q, K,
//! V, gate and up are split by output rows, so each rank's values are exactly the whole
//! model's; the attention output and FFN down projections are split by input columns, so each
//! rank computes a partial sum that the group adds up (in rank order) before the residual.
//!
//! Splits need not be even: SmolLM2's 3 KV heads split 2 + 1 over two ranks. FFN columns are
//! cut on 32-element block boundaries, since quantized blocks cannot be cut.

use std::ops::Range;
use std::sync::Arc;

use zerolayer_kernels::collective::{Collective, Solo};
use zerolayer_kernels::pool::ThreadPool;
use zerolayer_kernels::quant::{Weight, QK};

use super::{Layer, Model, ModelConfig, Scratch};
use crate::error::{Result, WorkerError};

/// What rank `rank` of a group of `size` computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub rank: usize,
    pub size: usize,
    /// Its KV heads; its query heads are the groups that read them.
    pub kv_heads: Range<usize>,
    /// Its columns of the FFN's inner width.
    pub ffn: Range<usize>,
}

/// Part `i` of `0..n` cut into `parts` contiguous ranges whose lengths differ by at most one
/// (the first ones longer).
fn even_part(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

impl ShardPlan {
    /// The plan of every rank of a group of `size` for `cfg`. Errors name what cannot be split.
    pub fn for_group(cfg: &ModelConfig, size: usize) -> Result<Vec<ShardPlan>> {
        if size == 0 {
            return Err(WorkerError::Invalid("tensor_parallel must be at least 1".into()));
        }
        if size > cfg.n_kv_heads {
            return Err(WorkerError::Invalid(format!(
                "tensor_parallel = {size} is more ranks than this model has KV heads ({}); each rank needs at least one",
                cfg.n_kv_heads
            )));
        }
        if !cfg.ffn_dim.is_multiple_of(QK) || !cfg.head_dim.is_multiple_of(QK) {
            return Err(WorkerError::Invalid(format!("tensor parallelism cuts on {QK}-element blocks; ffn_dim {} or head_dim {} is not a multiple", cfg.ffn_dim, cfg.head_dim)));
        }
        let units = cfg.ffn_dim / QK;
        if size > units {
            return Err(WorkerError::Invalid(format!("tensor_parallel = {size} exceeds the FFN's {units} blocks")));
        }
        Ok((0..size)
            .map(|rank| {
                let f = even_part(units, size, rank);
                ShardPlan { rank, size, kv_heads: even_part(cfg.n_kv_heads, size, rank), ffn: f.start * QK..f.end * QK }
            })
            .collect())
    }

    /// Query heads: the `n_heads / n_kv_heads` that read each of its KV heads.
    pub fn q_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let g = cfg.n_heads / cfg.n_kv_heads;
        self.kv_heads.start * g..self.kv_heads.end * g
    }

    /// The share of `cfg` this rank computes.
    pub fn shard_cfg(&self, cfg: &ModelConfig) -> ModelConfig {
        ModelConfig { n_heads: self.q_heads(cfg).len(), n_kv_heads: self.kv_heads.len(), ffn_dim: self.ffn.len(), ..cfg.clone() }
    }
}

fn scaled(r: &Range<usize>, by: usize, plus: usize) -> Range<usize> {
    r.start * by + plus..r.end * by + plus
}

impl Model {
    /// This (whole) model's shard for `plan`, with its own `threads` kernel threads. The
    /// embedding, output head and norms are shared with `self`, not copied. It runs alone
    /// ([`Solo`]) until [`Model::join`] gives it its group; a device backend uploads its
    /// weights and sums through the device's own collective instead.
    pub fn shard(&self, plan: &ShardPlan, threads: usize) -> Result<Model> {
        let cfg = &self.cfg;
        if self.shard_cfg != self.cfg {
            return Err(WorkerError::Invalid("only a whole model can be sharded".into()));
        }
        let (hd, qd, kvd, d, f) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim(), cfg.dim, cfg.ffn_dim);
        let (q_rows, k_rows, v_rows) = (scaled(&plan.q_heads(cfg), hd, 0), scaled(&plan.kv_heads, hd, qd), scaled(&plan.kv_heads, hd, qd + kvd));
        let stack = |w: &Weight, parts: &[Range<usize>]| -> Weight {
            let pieces: Vec<Weight> = parts.iter().map(|r| w.slice(r.clone(), 0..w.cols)).collect();
            Weight::concat_rows(&pieces.iter().collect::<Vec<_>>()).expect("slices of one weight share format and width")
        };
        let mut layers: Vec<Layer> = self
            .layers
            .iter()
            .map(|l| Layer {
                attn_norm: l.attn_norm.clone(),
                wqkv: stack(&l.wqkv, &[q_rows.clone(), k_rows.clone(), v_rows.clone()]),
                bqkv: l.bqkv.as_ref().map(|b| [&b[q_rows.clone()], &b[k_rows.clone()], &b[v_rows.clone()]].concat()),
                // Per-head norms are the same for every head; post-norms act on whole rows
                // after the group's sum.
                qk_norm: l.qk_norm.clone(),
                wo: l.wo.slice(0..d, q_rows.clone()),
                post_attn_norm: l.post_attn_norm.clone(),
                ffn_norm: l.ffn_norm.clone(),
                wgate_up: stack(&l.wgate_up, &[plan.ffn.clone(), scaled(&plan.ffn, 1, f)]),
                wdown: l.wdown.slice(0..d, plan.ffn.clone()),
                post_ffn_norm: l.post_ffn_norm.clone(),
            })
            .collect();
        super::pack_layers(&mut layers);
        let layer_bytes: usize = layers.iter().map(|l| l.wqkv.bytes() + l.wo.bytes() + l.wgate_up.bytes() + l.wdown.bytes()).sum();
        let head_bytes = self.embed.bytes() + if Arc::ptr_eq(&self.embed, &self.output) { 0 } else { self.output.bytes() };
        Ok(Model {
            cfg: cfg.clone(),
            shard_cfg: plan.shard_cfg(cfg),
            embed: self.embed.clone(),
            layers,
            norm: self.norm.clone(),
            output: self.output.clone(),
            rope: self.rope.clone(),
            rope_local: self.rope_local.clone(),
            pool: ThreadPool::new(threads.max(1)),
            group: Box::new(Solo),
            rank: plan.rank,
            ranks: plan.size,
            scratch: Scratch::default(),
            weight_bytes: head_bytes + layer_bytes,
        })
    }

    /// Makes this shard sum through `group`, which must be its rank of a group of its size.
    pub fn join(&mut self, group: Box<dyn Collective>) -> Result<()> {
        if (group.rank(), group.size()) != (self.rank, self.ranks) {
            return Err(WorkerError::Invalid(format!("rank {}/{} of a group given to shard {}/{}", group.rank(), group.size(), self.rank, self.ranks)));
        }
        self.group = group;
        Ok(())
    }

    /// This shard's rank (0 for a whole model): rank 0 computes the logits.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_kernels::ops::RopeStyle;

    fn cfg(n_heads: usize, n_kv_heads: usize, ffn_dim: usize) -> ModelConfig {
        ModelConfig {
            arch: "llama".into(),
            n_layers: 2,
            dim: 64 * n_heads,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim: 64,
            vocab_size: 100,
            rope_base: 1e4,
            rms_eps: 1e-5,
            context_length: 64,
            rope_style: RopeStyle::Interleaved,
            ..ModelConfig::default()
        }
    }

    /// Ranks cover every head and FFN column once, in order, as evenly as blocks allow.
    #[test]
    fn plans_cover_every_head_and_column_once() {
        for (c, size) in [(cfg(9, 3, 1536), 2), (cfg(9, 3, 1536), 3), (cfg(14, 2, 4864), 2), (cfg(8, 8, 96), 3)] {
            let plans = ShardPlan::for_group(&c, size).unwrap();
            assert_eq!(plans.len(), size);
            let (mut kv, mut ffn, mut q) = (0, 0, 0);
            for p in &plans {
                assert_eq!((p.kv_heads.start, p.ffn.start, p.q_heads(&c).start), (kv, ffn, q));
                assert!(!p.kv_heads.is_empty() && p.ffn.len() % QK == 0 && !p.ffn.is_empty());
                (kv, ffn, q) = (p.kv_heads.end, p.ffn.end, p.q_heads(&c).end);
                let s = p.shard_cfg(&c);
                assert_eq!(s.n_heads / s.n_kv_heads, c.n_heads / c.n_kv_heads, "a shard keeps the GQA grouping");
            }
            assert_eq!((kv, ffn, q), (c.n_kv_heads, c.ffn_dim, c.n_heads));
            let lens: Vec<usize> = plans.iter().map(|p| p.ffn.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= QK, "{lens:?}");
        }
        // SmolLM2: 3 KV heads over 2 ranks is 2 + 1.
        let p = ShardPlan::for_group(&cfg(9, 3, 1536), 2).unwrap();
        assert_eq!((p[0].kv_heads.clone(), p[1].kv_heads.clone()), (0..2, 2..3));
        // Qwen2.5-0.5B's 4864-wide FFN is 152 blocks: 76 each.
        let p = ShardPlan::for_group(&cfg(14, 2, 4864), 2).unwrap();
        assert_eq!(p[0].ffn, 0..2432);
    }

    #[test]
    fn impossible_groups_are_refused_saying_why() {
        let e = ShardPlan::for_group(&cfg(9, 3, 1536), 4).unwrap_err().to_string();
        assert!(e.contains("KV heads (3)"), "{e}");
        assert!(ShardPlan::for_group(&cfg(9, 3, 1536), 0).is_err());
        assert!(ShardPlan::for_group(&cfg(9, 3, 1000), 2).unwrap_err().to_string().contains("multiple"));
    }
}
