//! Paged attention on the CPU.
//!
//! K and V live in a block pool (f32, so results match the reference implementation exactly), laid out per layer as
//! `[block][kv_head][slot][head_dim]`: the 16 (block size) keys of one head in one block are
//! contiguous. A sequence names its blocks in a block table; position `p` lives in block
//! `table[p / block_size]` at slot `p % block_size`. Attention reads K/V through the table in
//! place: nothing is gathered into a contiguous copy.
//!
//! For each query (a token at position `pos`) and head, scores over positions `0..=pos` are
//! computed in order, softmaxed with the max subtracted, and V is accumulated in order. The
//! arithmetic for one query depends only on its own q and the cached K/V, never on the other
//! queries in the batch or on how a prompt was chunked.

#[cfg(target_arch = "x86_64")]
mod avx2;

/// The element type of the KV cache.
pub type KvElem = f32;

use crate::ops::exp_fast;
#[inline(always)]
fn to_kv(x: f32) -> KvElem {
    x
}
#[inline(always)]
fn from_kv(x: KvElem) -> f32 {
    x
}
/// A zero KV element.
pub const KV_ZERO: KvElem = 0.0;

/// Geometry of one layer's cache.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one block of one layer, for K (or V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Offset of (block, head, slot) in a layer's K (or V) array.
    #[inline(always)]
    pub fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.n_kv_heads + head) * self.block_size + slot) * self.head_dim
    }
}

/// Writes one token's K and V rows (`n_kv_heads * head_dim` each) at `pos` through `table`.
pub fn write_kv(layout: &KvLayout, k_cache: &mut [KvElem], v_cache: &mut [KvElem], table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
    let block = table[pos / layout.block_size] as usize;
    let slot = pos % layout.block_size;
    let hd = layout.head_dim;
    for h in 0..layout.n_kv_heads {
        let off = layout.offset(block, h, slot);
        for i in 0..hd {
            k_cache[off + i] = to_kv(k[h * hd + i]);
            v_cache[off + i] = to_kv(v[h * hd + i]);
        }
    }
}

/// One layer's K and V caches and their geometry.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    pub layout: &'a KvLayout,
    pub k: &'a [KvElem],
    pub v: &'a [KvElem],
}

/// The query heads of one row that read one KV head: their queries (`group * head_dim` values,
/// consecutive heads), the sequence's block table, the row's position, the KV head, and the
/// softmax scale.
#[derive(Clone, Copy, Debug)]
pub struct Query<'a> {
    pub table: &'a [u32],
    pub pos: usize,
    pub kv_head: usize,
    pub q: &'a [f32],
    pub scale: f32,
}

/// The most query heads per KV head (grouped-query attention) the kernels take.
pub const MAX_GROUP: usize = 64;

/// Scratch space for [`attend_group`], reused across calls.
#[derive(Default)]
pub struct Scratch {
    /// Scores (then softmax weights), `n` per head.
    scores: Vec<f32>,
    /// Each position's offset in the layer's K and V arrays.
    offsets: Vec<usize>,
}

/// Attention for one row's query heads that share a KV head: `out` receives `group *
/// head_dim` values, each head's exactly as if it ran alone.
pub fn attend_group(kv: &KvView<'_>, query: &Query<'_>, scratch: &mut Scratch, out: &mut [f32]) {
    let hd = kv.layout.head_dim;
    let group = query.q.len() / hd;
    assert!(query.q.len() % hd == 0 && out.len() == query.q.len() && group <= MAX_GROUP);
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() && hd % 8 == 0 && hd <= 256 {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the head size is checked.
        unsafe { avx2::attend_group(kv, query, scratch, out) };
        return;
    }
    for h in 0..group {
        let one = Query { q: &query.q[h * hd..(h + 1) * hd], ..*query };
        attend_one_impl(kv, &one, &mut scratch.scores, &mut out[h * hd..(h + 1) * hd]);
    }
}

#[inline(always)]
fn attend_one_impl(kv: &KvView<'_>, query: &Query<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let (layout, k_cache, v_cache) = (kv.layout, kv.k, kv.v);
    let (table, pos, kv_head, q, scale) = (query.table, query.pos, query.kv_head, query.q, query.scale);
    let hd = layout.head_dim;
    let bs = layout.block_size;
    let n = pos + 1;
    scores.clear();
    scores.resize(n, 0.0);
    let mut kbuf = [0f32; 256];
    let kb = &mut kbuf[..hd];
    let mut max = f32::NEG_INFINITY;
    for p in 0..n {
        let off = layout.offset(table[p / bs] as usize, kv_head, p % bs);
        for (d, s) in kb.iter_mut().zip(&k_cache[off..off + hd]) {
            *d = from_kv(*s);
        }
        let s = dot8_fma(q, kb) * scale;
        scores[p] = s;
        if s > max {
            max = s;
        }
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = exp_fast(*s - max);
        sum += *s;
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for p in 0..n {
        let off = layout.offset(table[p / bs] as usize, kv_head, p % bs);
        let w = scores[p] / sum;
        for (o, v) in out.iter_mut().zip(&v_cache[off..off + hd]) {
            *o = w.mul_add(from_kv(*v), *o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_attention_equals_portable_bit_for_bit() {
        if !crate::test_simd_paths("attention") {
            return;
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        for (bs, hd) in [(16usize, 64usize), (4, 8), (8, 32), (16, 128), (5, 16)] {
            let layout = KvLayout { block_size: bs, n_kv_heads: 3, head_dim: hd };
            let n_blocks = 12;
            let kc: Vec<f32> = (0..n_blocks * layout.block_elems()).map(|_| rnd()).collect();
            let vc: Vec<f32> = (0..n_blocks * layout.block_elems()).map(|_| rnd()).collect();
            let table: Vec<u32> = (0..n_blocks as u32).rev().collect(); // scattered
            let q: Vec<f32> = (0..4 * hd).map(|_| rnd()).collect();
            for pos in [0usize, 6, 7, 8, 15, 16, 17, 23, 24, 33, n_blocks * bs - 1] {
                for head in 0..3 {
                    for group in [1usize, 3, 4] {
                        // `group` query heads read this KV head; each alone through the
                        // portable code, then all together through the AVX2 kernel.
                        let kv = KvView { layout: &layout, k: &kc, v: &vc };
                        let query = Query { table: &table, pos, kv_head: head, q: &q[..group * hd], scale: 0.125 };
                        let mut want = vec![0f32; group * hd];
                        let mut s1 = vec![];
                        for h in 0..group {
                            let one = Query { q: &q[h * hd..(h + 1) * hd], ..query };
                            attend_one_impl(&kv, &one, &mut s1, &mut want[h * hd..(h + 1) * hd]);
                        }
                        let (mut s2, mut got) = (Scratch::default(), vec![f32::NAN; group * hd]);
                        // SAFETY: AVX2, FMA and F16C detected above; head sizes are multiples of 8.
                        unsafe { avx2::attend_group(&kv, &query, &mut s2, &mut got) };
                        let b1: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                        let b2: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(b1, b2, "bs {bs} hd {hd} pos {pos} head {head} group {group}");
                    }
                }
            }
        }
    }

    #[test]
    fn paged_attention_matches_contiguous_reference() {
        let layout = KvLayout { block_size: 4, n_kv_heads: 2, head_dim: 8 };
        let n_blocks = 6;
        let mut kc = vec![KV_ZERO; n_blocks * layout.block_elems()];
        let mut vc = vec![KV_ZERO; n_blocks * layout.block_elems()];
        // A scattered block table.
        let table = [4u32, 1, 5, 0];
        let len = 13;
        let kv = |p: usize, i: usize, s: f32| ((p * 31 + i * 7) as f32 * s).sin();
        let mut ks = vec![];
        let mut vs = vec![];
        for p in 0..len {
            let k: Vec<f32> = (0..16).map(|i| kv(p, i, 0.13)).collect();
            let v: Vec<f32> = (0..16).map(|i| kv(p, i, 0.29)).collect();
            write_kv(&layout, &mut kc, &mut vc, &table, p, &k, &v);
            ks.push(k);
            vs.push(v);
        }
        let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
        for head in 0..2 {
            let pos = len - 1;
            let mut out = vec![0f32; 8];
            let mut scratch = Scratch::default();
            attend_group(&KvView { layout: &layout, k: &kc, v: &vc }, &Query { table: &table, pos, kv_head: head, q: &q, scale: 0.35 }, &mut scratch, &mut out);
            // Reference over contiguous copies (rounded to the cache element type), in f64.
            let r = |x: f32| from_kv(to_kv(x)) as f64;
            let sc: Vec<f64> = (0..=pos).map(|p| (0..8).map(|i| q[i] as f64 * r(ks[p][head * 8 + i])).sum::<f64>() * 0.35).collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..8 {
                let want: f64 = (0..=pos).map(|p| e[p] / z * r(vs[p][head * 8 + i])).sum();
                assert!((out[i] as f64 - want).abs() < 1e-5, "head {head} dim {i}");
            }
        }
    }
}

/// Dot product in 8 fused-multiply-add lanes, reduced as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
///
/// This is the reduction order of the `gemm` crate's AVX2/FMA horizontal kernel, which candle
/// (our reference implementation) uses for attention scores; matching it keeps our logits
/// within rounding of the reference instead of drifting by int8 re-quantization of one-ulp
/// differences. The order is fixed, so results never depend on the batch or on which code
/// path (SIMD or portable) runs.
#[inline(always)]
pub fn dot8_fma(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    let x = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (x[0] + x[2]) + (x[1] + x[3])
}

/// One query row of a batched attention call: its sequence's block table and its position.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow<'a> {
    pub table: &'a [u32],
    pub pos: usize,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Attention for a batch of query rows, parallel over (row, head).
///
/// `q` holds row `t`'s query heads at `q[t * q_stride .. t * q_stride + n_heads * head_dim]`;
/// `out` receives `n_heads * head_dim` values per row. Query head `h` reads KV head
/// `h / (n_heads / n_kv_heads)` (grouped-query attention).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(pool: &crate::pool::ThreadPool, kv: &KvView<'_>, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]) {
    let layout = kv.layout;
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    assert!(group >= 1 && n_heads % layout.n_kv_heads == 0);
    let od = n_heads * hd;
    assert_eq!(out.len(), rows.len() * od);
    assert!(q.len() >= (rows.len().saturating_sub(1)) * q_stride + od);
    let op = crate::SyncPtr(out.as_mut_ptr());
    let n_out = out.len();
    // One task per (row, KV head): the `group` query heads that read the same K/V run together
    // (one pass over K and V for all of them).
    let n_kv = layout.n_kv_heads;
    pool.run(rows.len() * n_kv, |task| {
        let (t, kvh) = (task / n_kv, task % n_kv);
        let row = rows[t];
        // SAFETY: task (t, kvh) writes only out[t*od + h*hd .. + hd] for its own query heads h,
        // disjoint across tasks; `out` outlives `pool.run`.
        let out_all = unsafe { std::slice::from_raw_parts_mut(op.get(), n_out) };
        let heads = kvh * group * hd..(kvh + 1) * group * hd;
        let qg = &q[t * q_stride + heads.start..t * q_stride + heads.end];
        let o = &mut out_all[t * od + heads.start..t * od + heads.end];
        SCRATCH.with(|s| attend_group(kv, &Query { table: row.table, pos: row.pos, kv_head: kvh, q: qg, scale }, &mut s.borrow_mut(), o));
    });
}
