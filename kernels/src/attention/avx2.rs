//! The AVX2 attention kernel: one pass over a KV head's keys and values for all the query heads
//! that read it (grouped-query attention), bit-identical per head to the portable code.
//!
//! Each query head's arithmetic is exactly the portable code's: scores as [`dot8_fma`] (eight
//! FMA lanes, reduced in its fixed order), softmax with the max subtracted, and V accumulated
//! in position order with one FMA chain per output lane. What changes is the order of *memory*
//! work: every 8 keys are loaded once and used by all the group's heads while they sit in L1,
//! and V is walked in runs of [`V_RUN`] positions, each run used by every head before the next
//! is loaded (the heads' accumulators go back to `out` between runs). Per KV head, K and V
//! stream from memory once per step instead of once per query head.
//!
//! With AVX-512VL (32 vector registers, [`attend_group_wide`]) up to [`WIDE_HEADS`] heads run
//! side by side inside the inner loops: each 8-lane load of K or V feeds that many heads' FMA
//! chains, which halves the loads per (head, position) and gives the out-of-order core
//! independent chains to hide the FMA latency and the misses behind. The per-head order of
//! every operation is unchanged, so both entry points are bit-identical to the portable code.

use std::arch::x86_64::*;

use super::kv::{KvElement, KvView, Query, Scratch, MAX_GROUP};
use super::portable::dot8_fma;
use crate::ops::avx2::{exp8, exp8_wide};
use crate::ops::exp_fast;

/// Positions of V per run: 16 × 64 × 4 B = 4 KiB at head size 64, well inside L1.
const V_RUN: usize = 16;

/// How many positions ahead the score loop prefetches K (and V, for the accumulation pass).
const PREFETCH_AHEAD: usize = 16;

/// Heads per pass in the wide kernel: 3 heads × 8 accumulators (head size 64) + 3 query or
/// weight vectors + 1 loaded vector = 28 of the 32 registers.
pub(super) const WIDE_HEADS: usize = 3;

/// Attention for the query heads in `query.q` (`group * head_dim` values, consecutive heads
/// that all read `query.kv_head`); `out` receives `group * head_dim` values. `scratch` is
/// scratch. One head per pass (16 vector registers).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `head_dim` must be a multiple of 8, at most 256.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_group<E: KvElement>(kv: &KvView<'_, E>, query: &Query<'_>, scratch: &mut Scratch, out: &mut [f32]) {
    attend::<E, 1>(kv, query, scratch, out)
}

/// As [`attend_group`], up to [`WIDE_HEADS`] heads per pass (32 vector registers).
///
/// # Safety
/// As [`attend_group`], and the CPU must support AVX-512F and AVX-512VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(super) unsafe fn attend_group_wide<E: KvElement>(kv: &KvView<'_, E>, query: &Query<'_>, scratch: &mut Scratch, out: &mut [f32]) {
    attend::<E, WIDE_HEADS>(kv, query, scratch, out)
}

/// The kernel body, `MAXG` heads per pass (at most 3).
#[inline(always)]
unsafe fn attend<E: KvElement, const MAXG: usize>(kv: &KvView<'_, E>, query: &Query<'_>, scratch: &mut Scratch, out: &mut [f32]) {
    let (layout, k_cache, v_cache) = (kv.layout, kv.k, kv.v);
    let (table, pos, kv_head, q, scale) = (query.table, query.pos, query.kv_head, query.q, query.scale);
    let hd = layout.head_dim;
    debug_assert!(hd % 8 == 0 && hd <= 256);
    let group = q.len() / hd;
    debug_assert_eq!(out.len(), group * hd);
    let bs = layout.block_size;
    // The visible positions `first..=pos` (all of them outside a sliding window).
    let first = kv.first_visible(pos);
    let n = pos + 1 - first;
    let chunks = hd / 8;
    let Scratch { scores, offsets } = scratch;
    scores.clear();
    scores.resize(group * n, 0.0);
    // Every visible position's offset in the layer's K (and V) array, once: the passes below
    // look them up instead of dividing by the block size per key.
    offsets.clear();
    let mut slot = first % bs;
    for &b in &table[first / bs..] {
        let base = layout.offset(b as usize, kv_head, 0);
        let take = (bs - slot).min(n - offsets.len());
        offsets.extend((slot..slot + take).map(|s| base + s * hd));
        slot = 0;
        if offsets.len() == n {
            break;
        }
    }
    assert_eq!(offsets.len(), n, "block table too short");
    let offsets = &offsets[..];
    // Scores, 8 keys at a time: 8 independent FMA chains (one per key), then each key's
    // horizontal sum in a lane of one vector (`reduce8`), in `dot8_fma`'s exact order
    // ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). The 8 keys may span blocks (any block size).
    // Each head's maximum is kept per lane as its scores are stored (`maxps(s, m)` keeps `m`
    // unless `s > m`, the scalar comparison: the maximum does not depend on the order it is
    // taken in, NaNs never win, and a `-0.0`/`0.0` tie gives the same `e^(s - max)` either way).
    let (kbase, vbase) = (k_cache.as_ptr(), v_cache.as_ptr());
    let mut maxv = [_mm256_set1_ps(f32::NEG_INFINITY); MAX_GROUP];
    let mut p = 0;
    while p + 8 <= n {
        let kp: [*const E; 8] = std::array::from_fn(|j| kbase.add(offsets[p + j]));
        // K and V sit in runs of `block_size` positions that the hardware prefetcher cannot
        // follow through the block table: ask for them ahead.
        for f in p + PREFETCH_AHEAD..(p + PREFETCH_AHEAD + 8).min(n) {
            let off = offsets[f];
            prefetch(kbase.add(off), hd, false);
            prefetch(vbase.add(off), hd, true);
        }
        let mut h = 0;
        while h < group {
            let g = (group - h).min(MAXG);
            let (qh, sp, mp) = (q.as_ptr().add(h * hd), scores.as_mut_ptr().add(h * n + p), maxv.as_mut_ptr().add(h));
            match g {
                3 => scores8::<E, 3>(qh, hd, &kp, sp, n, scale, mp),
                2 => scores8::<E, 2>(qh, hd, &kp, sp, n, scale, mp),
                _ => scores8::<E, 1>(qh, hd, &kp, sp, n, scale, mp),
            }
            h += g;
        }
        p += 8;
    }
    let mut maxes = [f32::NEG_INFINITY; MAX_GROUP];
    for (m, v) in maxes.iter_mut().zip(&maxv).take(group) {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *v);
        *m = lanes.into_iter().fold(f32::NEG_INFINITY, max_of);
    }
    while p < n {
        let off = offsets[p];
        let mut kb = [0f32; 256];
        for (d, s) in kb.iter_mut().zip(&k_cache[off..off + hd]) {
            *d = s.to_f32();
        }
        for h in 0..group {
            let s = dot8_fma(&q[h * hd..(h + 1) * hd], &kb[..hd]) * scale;
            scores[h * n + p] = s;
            maxes[h] = max_of(maxes[h], s);
        }
        p += 1;
    }
    // Per head: e^(s - max) (8 at a time, bit-identical to `exp_fast`) and the sum in position
    // order, up to 4 heads side by side (independent chains); then the weights `s / sum` (a
    // vector division rounds exactly as the scalar one).
    let mut sums = [0f32; MAX_GROUP];
    let mut h = 0;
    while h < group {
        let g = (group - h).min(4);
        let (sp, m, sum) = (scores.as_mut_ptr().add(h * n), &maxes[h..h + g], &mut sums[h..h + g]);
        match g {
            4 => exp_sum::<4, MAXG>(sp, n, m, sum),
            3 => exp_sum::<3, MAXG>(sp, n, m, sum),
            2 => exp_sum::<2, MAXG>(sp, n, m, sum),
            _ => exp_sum::<1, MAXG>(sp, n, m, sum),
        }
        h += g;
    }
    for h in 0..group {
        let s = &mut scores[h * n..(h + 1) * n];
        let sum = sums[h];
        let sv = _mm256_set1_ps(sum);
        let mut p = 0;
        while p + 8 <= n {
            let sp = s.as_mut_ptr().add(p);
            _mm256_storeu_ps(sp, _mm256_div_ps(_mm256_loadu_ps(sp), sv));
            p += 8;
        }
        for x in &mut s[p..] {
            *x /= sum;
        }
    }
    // V, in position order per head; the accumulators live in registers within a run (a const
    // count for the common head sizes).
    // On the AVX-512 entry point, head sizes 64 and 32 accumulate V on 512-bit vectors (two
    // 8-lane chunks per register): each output lane keeps its own FMA chain in position order,
    // so the bits are the 256-bit path's; half the loads and FMAs per (head, position).
    if MAXG > 1 && (chunks == 8 || chunks == 4) {
        if chunks == 8 {
            accumulate_v_wide::<E, 4, MAXG>(hd, v_cache, offsets, scores, out);
        } else {
            accumulate_v_wide::<E, 2, MAXG>(hd, v_cache, offsets, scores, out);
        }
        return;
    }
    match chunks {
        8 => accumulate_v::<E, 8, MAXG>(hd, v_cache, offsets, scores, out),
        4 => accumulate_v::<E, 4, MAXG>(hd, v_cache, offsets, scores, out),
        // Wider heads: one head per pass (more accumulators than registers otherwise).
        16 => accumulate_v::<E, 16, 1>(hd, v_cache, offsets, scores, out),
        _ => accumulate_v::<E, 32, 1>(hd, v_cache, offsets, scores, out),
    }
}

/// The scores of 8 keys (`kp`) for `G` consecutive query heads from `q` (`hd` values each),
/// scaled, to `out + g * n` (8 values per head): per head and key, 8 independent FMA lanes over
/// the head's chunks in order, then each key's horizontal sum in a lane ([`reduce8`]), in
/// [`dot8_fma`]'s exact order ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). Each loaded chunk of a
/// key feeds all `G` heads. Head `g`'s lane-wise maximum `max + g` takes in its 8 scores.
#[inline(always)]
unsafe fn scores8<E: KvElement, const G: usize>(q: *const f32, hd: usize, kp: &[*const E; 8], out: *mut f32, n: usize, scale: f32, max: *mut __m256) {
    let mut acc = [[_mm256_setzero_ps(); 8]; G];
    for c in 0..hd / 8 {
        let qv: [__m256; G] = std::array::from_fn(|g| _mm256_loadu_ps(q.add(g * hd + c * 8)));
        for (j, k) in kp.iter().enumerate() {
            let kv = load8(k.add(c * 8));
            for (a, qg) in acc.iter_mut().zip(&qv) {
                a[j] = _mm256_fmadd_ps(*qg, kv, a[j]);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        let sc = _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale));
        _mm256_storeu_ps(out.add(g * n), sc);
        *max.add(g) = _mm256_max_ps(sc, *max.add(g));
    }
}

/// The scalar form of `maxps(x, m)`: `x` if `x > m`, else `m`.
#[inline(always)]
fn max_of(m: f32, x: f32) -> f32 {
    if x > m {
        x
    } else {
        m
    }
}

/// For `G` consecutive heads' scores (head `g`'s `n` at `s + g * n`, its maximum `max[g]`):
/// each score becomes `e^(score - max)` in place, and `sum[g]` the sum of a head's in position
/// order. The heads' exponentials and sums run side by side. `MAXG > 1` only in the AVX-512
/// entry point, which uses the 512-bit exponential (the same bits).
#[inline(always)]
unsafe fn exp_sum<const G: usize, const MAXG: usize>(s: *mut f32, n: usize, max: &[f32], sum: &mut [f32]) {
    let mv: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(max[g]));
    let mut acc = [0f32; G];
    let mut p = 0;
    while p + 8 <= n {
        for (g, m) in mv.iter().enumerate() {
            let sp = s.add(g * n + p);
            let x = _mm256_sub_ps(_mm256_loadu_ps(sp), *m);
            _mm256_storeu_ps(sp, if MAXG > 1 { exp8_wide(x) } else { exp8(x) });
        }
        for l in 0..8 {
            for (g, a) in acc.iter_mut().enumerate() {
                *a += *s.add(g * n + p + l);
            }
        }
        p += 8;
    }
    while p < n {
        for (g, a) in acc.iter_mut().enumerate() {
            let e = exp_fast(*s.add(g * n + p) - max[g]);
            *s.add(g * n + p) = e;
            *a += e;
        }
        p += 1;
    }
    sum.copy_from_slice(&acc);
}

/// `out[h] = Σ_p w[h][p] · V[p]` for each head `h` of the group, `w[h]` at `weights[h * n..]`
/// (`n` positions, V of position `p` at `offsets[p]`), with `C` 8-lane accumulators per head
/// (`C * 8 >= head_dim`; only `head_dim / 8` are used), up to `MAXG` heads per pass over a run.
#[inline(always)]
unsafe fn accumulate_v<E: KvElement, const C: usize, const MAXG: usize>(hd: usize, v_cache: &[E], offsets: &[usize], weights: &[f32], out: &mut [f32]) {
    let n = offsets.len();
    let group = out.len() / hd;
    debug_assert!(hd / 8 <= C);
    let mut p0 = 0;
    while p0 < n {
        let run = V_RUN.min(n - p0);
        let mut vp = [v_cache.as_ptr(); V_RUN];
        for (j, v) in vp.iter_mut().enumerate().take(run) {
            *v = v_cache.as_ptr().add(offsets[p0 + j]);
        }
        let mut h = 0;
        while h < group {
            let g = (group - h).min(MAXG);
            let (w, oh) = (weights.as_ptr().add(h * n + p0), out.as_mut_ptr().add(h * hd));
            match g {
                3 => v_run::<E, C, 3>(hd, &vp[..run], w, n, oh, p0 == 0),
                2 => v_run::<E, C, 2>(hd, &vp[..run], w, n, oh, p0 == 0),
                _ => v_run::<E, C, 1>(hd, &vp[..run], w, n, oh, p0 == 0),
            }
            h += g;
        }
        p0 += run;
    }
}

/// One run of V positions (`vp`) for `G` consecutive heads: head `g`'s weights at `w + g * n`,
/// its output at `out + g * hd` (read back first unless this is the first run). Each output
/// lane is one FMA chain in position order; each loaded chunk of V feeds all `G` heads.
#[inline(always)]
unsafe fn v_run<E: KvElement, const C: usize, const G: usize>(hd: usize, vp: &[*const E], w: *const f32, n: usize, out: *mut f32, first: bool) {
    let chunks = hd / 8;
    let used = |c: usize| C == chunks || c < chunks;
    let mut o = [[_mm256_setzero_ps(); C]; G];
    if !first {
        for (g, og) in o.iter_mut().enumerate() {
            for (c, oc) in og.iter_mut().enumerate() {
                if used(c) {
                    *oc = _mm256_loadu_ps(out.add(g * hd + c * 8));
                }
            }
        }
    }
    for (j, v) in vp.iter().enumerate() {
        let wj: [__m256; G] = std::array::from_fn(|g| _mm256_broadcast_ss(&*w.add(g * n + j)));
        for c in 0..C {
            if used(c) {
                let vv = load8(v.add(c * 8));
                for (og, wg) in o.iter_mut().zip(&wj) {
                    og[c] = _mm256_fmadd_ps(*wg, vv, og[c]);
                }
            }
        }
    }
    for (g, og) in o.iter().enumerate() {
        for (c, oc) in og.iter().enumerate() {
            if used(c) {
                _mm256_storeu_ps(out.add(g * hd + c * 8), *oc);
            }
        }
    }
}

/// As [`accumulate_v`], on 512-bit vectors: `C` 16-lane accumulators per head (`C * 16 ==
/// head_dim`). The caller runs with AVX-512F.
#[inline(always)]
unsafe fn accumulate_v_wide<E: KvElement, const C: usize, const MAXG: usize>(hd: usize, v_cache: &[E], offsets: &[usize], weights: &[f32], out: &mut [f32]) {
    let n = offsets.len();
    let group = out.len() / hd;
    debug_assert_eq!(hd, C * 16);
    let mut p0 = 0;
    while p0 < n {
        let run = V_RUN.min(n - p0);
        let mut vp = [v_cache.as_ptr(); V_RUN];
        for (j, v) in vp.iter_mut().enumerate().take(run) {
            *v = v_cache.as_ptr().add(offsets[p0 + j]);
        }
        let mut h = 0;
        while h < group {
            let g = (group - h).min(MAXG);
            let (w, oh) = (weights.as_ptr().add(h * n + p0), out.as_mut_ptr().add(h * hd));
            match g {
                3 => v_run_wide::<E, C, 3>(hd, &vp[..run], w, n, oh, p0 == 0),
                2 => v_run_wide::<E, C, 2>(hd, &vp[..run], w, n, oh, p0 == 0),
                _ => v_run_wide::<E, C, 1>(hd, &vp[..run], w, n, oh, p0 == 0),
            }
            h += g;
        }
        p0 += run;
    }
}

/// As [`v_run`], on 512-bit vectors (`C` per head, `C * 16 == hd`).
#[inline(always)]
unsafe fn v_run_wide<E: KvElement, const C: usize, const G: usize>(hd: usize, vp: &[*const E], w: *const f32, n: usize, out: *mut f32, first: bool) {
    let mut o = [[_mm512_setzero_ps(); C]; G];
    if !first {
        for (g, og) in o.iter_mut().enumerate() {
            for (c, oc) in og.iter_mut().enumerate() {
                *oc = _mm512_loadu_ps(out.add(g * hd + c * 16));
            }
        }
    }
    for (j, v) in vp.iter().enumerate() {
        let wj: [__m512; G] = std::array::from_fn(|g| _mm512_set1_ps(*w.add(g * n + j)));
        for c in 0..C {
            let vv = load16(v.add(c * 16));
            for (og, wg) in o.iter_mut().zip(&wj) {
                og[c] = _mm512_fmadd_ps(*wg, vv, og[c]);
            }
        }
    }
    for (g, og) in o.iter().enumerate() {
        for (c, oc) in og.iter().enumerate() {
            _mm512_storeu_ps(out.add(g * hd + c * 16), *oc);
        }
    }
}

/// Sixteen cache elements widened to f32 lanes (exact for f16). The caller runs with AVX-512F.
#[inline(always)]
unsafe fn load16<E: KvElement>(p: *const E) -> __m512 {
    if E::IS_F16 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// Eight cache elements widened to f32 lanes (F16C for f16: exact).
#[inline(always)]
unsafe fn load8<E: KvElement>(p: *const E) -> __m256 {
    if E::IS_F16 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Prefetches the `hd` cache elements at `p` (one position of one head): into L1, or into L2
/// (`far`) for data used after the current pass.
#[inline(always)]
unsafe fn prefetch<E: KvElement>(p: *const E, hd: usize, far: bool) {
    let bytes = hd * std::mem::size_of::<E>();
    let mut at = 0;
    while at < bytes {
        let a = (p as *const i8).add(at);
        if far {
            _mm_prefetch::<_MM_HINT_T1>(a);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(a);
        }
        at += 64;
    }
}

/// Each of 8 vectors' lanes summed in [`dot8_fma`]'s order, ((l0+l4) + (l2+l6)) + ((l1+l5) +
/// (l3+l7)), vector `k`'s sum to lane `k`: the tree's levels run on pairs and quads of keys
/// (14 shuffles and 7 additions, where a transpose and then the sums take 24 and 7).
#[inline(always)]
unsafe fn reduce8(a: &[__m256; 8]) -> __m256 {
    // Keys k and k+4 side by side: lanes (l0+l4, l1+l5, l2+l6, l3+l7) of each.
    let pair = |k: usize| {
        let lo = _mm256_permute2f128_ps::<0x20>(a[k], a[k + 4]);
        let hi = _mm256_permute2f128_ps::<0x31>(a[k], a[k + 4]);
        _mm256_add_ps(lo, hi)
    };
    let b: [__m256; 4] = std::array::from_fn(pair);
    // (l0+l4) + (l2+l6) and (l1+l5) + (l3+l7) of keys (k, k+1, k+4, k+5).
    let quad = |x: __m256, y: __m256| _mm256_add_ps(_mm256_shuffle_ps::<0x44>(x, y), _mm256_shuffle_ps::<0xEE>(x, y));
    let (e01, e23) = (quad(b[0], b[1]), quad(b[2], b[3]));
    // The two halves of every key, keys in lane order.
    _mm256_add_ps(_mm256_shuffle_ps::<0x88>(e01, e23), _mm256_shuffle_ps::<0xDD>(e01, e23))
}
