//! The paged KV cache in host memory: per layer, K and V arrays of `num_blocks` blocks, in the
//! element type the worker's `kv_dtype` names (f32, or f16 at half the bytes).
//!
//! The forward pass reaches the arrays only through this type (write a token's K and V, attend
//! over a layer, the layers' base addresses for warming), so the element type is decided in one
//! `match` per call and the kernels run monomorphized for it.

use zerolayer_common::config::KvDtype;
use zerolayer_kernels::attention::{kv_bytes, kv_from_bytes, paged_attention, run_group, write_kv_rows, AttnRow, KvElement, KvLayout, KvView};
use zerolayer_kernels::memory::{HugeBuf, Plain};
use zerolayer_kernels::pool::ThreadPool;

use super::config::ModelConfig;
use crate::error::{Result, WorkerError};

/// Every layer's K and V arrays in one element type, on huge pages (`HugeBuf`): a step's
/// attention reads K/V runs scattered over the whole cache.
struct Planes<E: Plain> {
    k: Vec<HugeBuf<E>>,
    v: Vec<HugeBuf<E>>,
}

impl<E: KvElement + Plain> Planes<E> {
    fn new(layers: usize, elems: usize) -> Self {
        // Commit every page now (as vLLM reserves its KV cache at startup): `HugeBuf` writes
        // its zeros, so the budget is real memory from the start, a machine without it fails
        // at load rather than mid-request, and RSS stays flat while blocks are first used.
        Planes { k: (0..layers).map(|_| HugeBuf::zeroed(elems)).collect(), v: (0..layers).map(|_| HugeBuf::zeroed(elems)).collect() }
    }
}

enum Store {
    F32(Planes<f32>),
    F16(Planes<half::f16>),
}

/// Runs `$body` with `$p` bound to the store's planes, whatever their element type.
macro_rules! planes {
    ($store:expr, $p:ident => $body:expr) => {
        match $store {
            Store::F32($p) => $body,
            Store::F16($p) => $body,
        }
    };
}

/// The paged KV cache: per layer, K and V arrays of `num_blocks` blocks.
pub struct KvCache {
    pub layout: KvLayout,
    pub num_blocks: usize,
    pub dtype: KvDtype,
    store: Store,
}

impl KvCache {
    /// A cache holding as many blocks as fit in `budget_bytes`.
    pub fn with_budget(cfg: &ModelConfig, block_size: usize, dtype: KvDtype, budget_bytes: usize) -> Result<Self> {
        Ok(Self::new(cfg, block_size, dtype, Self::blocks_for(cfg, block_size, dtype, budget_bytes)?))
    }

    /// How many `block_size`-token blocks of `cfg`'s K/V in `dtype` fit in `budget_bytes` (at
    /// least one; whole layout groups, [`run_group`], when at least one fits). A
    /// tensor-parallel group sizes every rank's cache by the whole model's count.
    pub fn blocks_for(cfg: &ModelConfig, block_size: usize, dtype: KvDtype, budget_bytes: usize) -> Result<usize> {
        let per_block = cfg.kv_bytes_per_token(dtype) * block_size;
        let group = run_group(block_size);
        match budget_bytes / per_block {
            0 => Err(WorkerError::Invalid(format!("KV budget {budget_bytes} B is below one block ({per_block} B)"))),
            n if n >= group => Ok(n / group * group),
            n => Ok(n),
        }
    }

    pub fn new(cfg: &ModelConfig, block_size: usize, dtype: KvDtype, num_blocks: usize) -> Self {
        let layout = KvLayout::new(block_size, cfg.n_kv_heads, cfg.head_dim);
        let n = layout.elems(num_blocks);
        let store = match dtype {
            KvDtype::F32 => Store::F32(Planes::new(cfg.n_layers, n)),
            KvDtype::F16 => Store::F16(Planes::new(cfg.n_layers, n)),
        };
        KvCache { layout, num_blocks, dtype, store }
    }

    fn layers(&self) -> usize {
        planes!(&self.store, p => p.k.len())
    }

    /// Bytes of one block across every layer, K and V: what a KV transfer moves per block.
    pub fn block_bytes(&self) -> usize {
        2 * self.layers() * self.layout.block_elems() * self.dtype.bytes()
    }

    pub fn bytes(&self) -> usize {
        self.num_blocks * self.block_bytes()
    }

    /// Appends block `b`'s K and V, layer by layer (`[K₀ V₀ K₁ V₁ …]`, each
    /// `[kv_head][slot][head_dim]`, in the cache's element type, little-endian), to `out`. The
    /// bytes do not depend on where the layout keeps the block (the GPU backend's are the same).
    pub fn read_block(&self, b: u32, out: &mut Vec<u8>) {
        let runs = self.head_runs(b);
        planes!(&self.store, p => {
            for (k, v) in p.k.iter().zip(&p.v) {
                for r in runs.clone() {
                    out.extend_from_slice(kv_bytes(&k[r]));
                }
                for r in runs.clone() {
                    out.extend_from_slice(kv_bytes(&v[r]));
                }
            }
        })
    }

    /// Overwrites block `b` with bytes in [`Self::read_block`]'s layout (aligned or not).
    pub fn write_block(&mut self, b: u32, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.block_bytes(), "KV block size");
        let runs = self.head_runs(b);
        let run_bytes = self.layout.block_size * self.layout.head_dim * self.dtype.bytes();
        let mut parts = bytes.chunks_exact(run_bytes);
        planes!(&mut self.store, p => {
            for (k, v) in p.k.iter_mut().zip(p.v.iter_mut()) {
                for r in runs.clone() {
                    kv_from_bytes(&mut k[r], parts.next().unwrap());
                }
                for r in runs.clone() {
                    kv_from_bytes(&mut v[r], parts.next().unwrap());
                }
            }
        })
    }

    /// Block `b`'s element ranges in a layer's K (or V) array, one per KV head, in head order.
    fn head_runs(&self, b: u32) -> impl Iterator<Item = std::ops::Range<usize>> + Clone + use<> {
        let l = self.layout;
        let run = l.block_size * l.head_dim;
        (0..l.n_kv_heads).map(move |h| {
            let at = l.offset(b as usize, h, 0);
            at..at + run
        })
    }

    /// The base addresses of layer `l`'s K and V arrays (for warming: offsets in bytes from them).
    pub(super) fn bases(&self, l: usize) -> [*const u8; 2] {
        planes!(&self.store, p => [p.k[l].as_ptr() as *const u8, p.v[l].as_ptr() as *const u8])
    }

    /// Writes one token's K and V rows (`n_kv_heads * head_dim` each, f32) at `pos` through
    /// `table`, rounded to the element type, in layer `l` (the tests' form; the forward pass
    /// writes all its rows at once, [`Self::write_rows`]).
    #[cfg(test)]
    pub(super) fn write(&mut self, l: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let layout = &self.layout;
        planes!(&mut self.store, p => zerolayer_kernels::attention::write_kv(layout, &mut p.k[l], &mut p.v[l], table, pos, k, v))
    }

    /// Writes every row's K and V (at `at.0` and `at.1` of its `stride` values in `src`) in
    /// layer `l`, in parallel over rows, after `prep(t, row)` on each (see [`write_kv_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_rows(&mut self, l: usize, pool: &ThreadPool, rows: &[AttnRow<'_>], src: &mut [f32], stride: usize, at: (usize, usize), prep: &(dyn Fn(usize, &mut [f32]) + Sync)) {
        let layout = &self.layout;
        planes!(&mut self.store, p => write_kv_rows(pool, layout, &mut p.k[l], &mut p.v[l], rows, src, stride, at, prep))
    }

    /// Paged attention over layer `l` (see [`paged_attention`]); `window` is the layer's
    /// sliding window (0: the whole context).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(&self, l: usize, window: usize, pool: &ThreadPool, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]) {
        let layout = &self.layout;
        planes!(&self.store, p => paged_attention(pool, &KvView { layout, k: &p.k[l], v: &p.v[l], window }, rows, q, q_stride, n_heads, scale, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_kernels::ops::RopeStyle;

    fn cfg() -> ModelConfig {
        ModelConfig {
            arch: "llama".into(),
            n_layers: 3,
            dim: 16,
            ffn_dim: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            vocab_size: 10,
            rope_base: 1e4,
            rms_eps: 1e-5,
            context_length: 64,
            rope_style: RopeStyle::Interleaved,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn kv_blocks_round_trip_through_bytes() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let cfg = cfg();
            let mut a = KvCache::new(&cfg, 4, dtype, 8);
            assert_eq!(a.block_bytes(), cfg.kv_bytes_per_token(dtype) * 4);
            assert_eq!(a.block_bytes(), 2 * 3 * 4 * 2 * 4 * dtype.bytes());
            // Every token of every block gets distinct values (exact in f16 too: small integers
            // and halves).
            let table: Vec<u32> = (0..8).collect();
            for l in 0..3 {
                for pos in 0..32 {
                    let k: Vec<f32> = (0..8).map(|i| (l * 1000 + pos * 8 + i) as f32 * 0.5).collect();
                    let v: Vec<f32> = k.iter().map(|x| -x).collect();
                    a.write(l, &table, pos, &k, &v);
                }
            }
            let mut bytes = Vec::new();
            a.read_block(5, &mut bytes);
            assert_eq!(bytes.len(), a.block_bytes(), "{dtype}");
            let mut b = KvCache::new(&cfg, 4, dtype, 8);
            b.write_block(2, &bytes);
            // Unaligned bytes give the same values.
            let mut shifted = vec![0u8; 1];
            shifted.extend_from_slice(&bytes);
            b.write_block(3, &shifted[1..]);
            for blk in [2, 3] {
                let mut back = Vec::new();
                b.read_block(blk, &mut back);
                assert_eq!(back, bytes, "{dtype}: block {blk}");
            }
            let mut other = Vec::new();
            a.read_block(4, &mut other);
            assert_ne!(other, bytes, "{dtype}: blocks differ");
            if dtype == KvDtype::F32 {
                // The bytes are block 5's values as `[layer][K, then V][kv_head][slot][dim]`,
                // whatever group the layout keeps it in (several blocks here, so block 5 is
                // not contiguous in the arrays).
                assert!(a.layout.group == run_group(4) && a.layout.group > 1, "{:?}", a.layout);
                let mut want = Vec::new();
                for l in 0..3 {
                    for sign in [1.0f32, -1.0] {
                        for h in 0..2 {
                            for slot in 0..4 {
                                let pos = 5 * 4 + slot;
                                want.extend((0..4).map(|i| sign * (l * 1000 + pos * 8 + h * 4 + i) as f32 * 0.5));
                            }
                        }
                    }
                }
                assert_eq!(bytes, kv_bytes(&want), "block 5 in the canonical order");
            }
        }
    }

    #[test]
    fn f16_holds_twice_the_blocks_of_f32_in_a_budget() {
        let cfg = cfg();
        let budget = 1 << 20;
        let f32_blocks = KvCache::blocks_for(&cfg, 4, KvDtype::F32, budget).unwrap();
        let f16_blocks = KvCache::blocks_for(&cfg, 4, KvDtype::F16, budget).unwrap();
        assert_eq!(f16_blocks, 2 * f32_blocks);
        let c = KvCache::with_budget(&cfg, 4, KvDtype::F16, budget).unwrap();
        // Whole layout groups: less than one group's bytes left over.
        assert!(c.bytes() <= budget && c.bytes() + run_group(4) * c.block_bytes() > budget);
        assert_eq!(c.num_blocks % run_group(4), 0);
    }
}
