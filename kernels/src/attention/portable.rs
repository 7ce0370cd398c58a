//! The portable attention code: one query head at a time, and the fixed-order dot product
//! every path (portable and SIMD) shares.

use super::kv::{KvElement, KvView, Query};
use crate::ops::exp_fast;

#[inline(always)]
pub(super) fn attend_one<E: KvElement>(kv: &KvView<'_, E>, query: &Query<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let (layout, k_cache, v_cache) = (kv.layout, kv.k, kv.v);
    let (table, pos, kv_head, q, scale) = (query.table, query.pos, query.kv_head, query.q, query.scale);
    let hd = layout.head_dim;
    let bs = layout.block_size;
    let first = kv.first_visible(pos);
    let n = pos + 1 - first;
    scores.clear();
    scores.resize(n, 0.0);
    let mut kbuf = [0f32; 256];
    let kb = &mut kbuf[..hd];
    let mut max = f32::NEG_INFINITY;
    for i in 0..n {
        let p = first + i;
        let off = layout.offset(table[p / bs] as usize, kv_head, p % bs);
        for (d, s) in kb.iter_mut().zip(&k_cache[off..off + hd]) {
            *d = s.to_f32();
        }
        let s = dot8_fma(q, kb) * scale;
        scores[i] = s;
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
    for (i, score) in scores.iter().enumerate() {
        let p = first + i;
        let off = layout.offset(table[p / bs] as usize, kv_head, p % bs);
        let w = score / sum;
        for (o, v) in out.iter_mut().zip(&v_cache[off..off + hd]) {
            *o = w.mul_add(v.to_f32(), *o);
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
