//! The AVX-512 VNNI panel kernel on 512-bit vectors: two adjacent 8-row panels per vector
//! (lanes 0–7 the first panel's rows, 8–15 the second's), so each instruction does twice the
//! 256-bit kernel's work. Every lane runs the 256-bit VNNI kernel's operations in the same
//! order (exact integer block sums, then the scalar code's float term per block, added in block
//! order), so results are bit-identical to it and to [`super::matmul::dot_block_row`].
//!
//! Where it pays: CPUs with two full 512-bit pipes (Intel Xeon since Skylake-SP, AMD Zen 5) run
//! a 512-bit `vpdpbusd` or `vmulps` at the rate of a 256-bit one, so the arithmetic bound of the
//! batched matmul doubles. Zen 4 splits each 512-bit operation over its two 256-bit pipes: there
//! it pays only with several rows per decoded block (16-row chunks decode each block once per
//! 16-sequence step), and batch-1 keeps the 256-bit kernel (`crate::vnni512_min_rows`). On the
//! Zen 5 host measured so far (EPYC family 1Ah, 2 vCPUs) the same holds: 16 rows 1.29–1.35×
//! the 256-bit kernel, batch-1 0.87–0.92×.
use super::activation::ActBlock;
use super::format::{PANEL, QK};
use super::simd::{self, rows, Fmt, Panels, Rows, WarmCursor};
use std::arch::x86_64::*;

/// Two 256-bit vectors as one 512-bit (low half `lo`).
#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The 8 group vectors of one block of two panels (`lo` and `hi`: the blocks' quants), lane
/// `r` of the first panel's rows in 0–7 and of the second's in 8–15. 4-bit codes: two groups
/// per byte; byte codes (Q8_0, stored +128, and Q6K): one group per 32 bytes, as stored.
#[inline(always)]
unsafe fn decode<F: Fmt>(lo: *const u8, hi: *const u8) -> [__m512i; 8] {
    let load = |g: usize| join(_mm256_loadu_si256(lo.add(32 * g) as *const __m256i), _mm256_loadu_si256(hi.add(32 * g) as *const __m256i));
    if F::NIBBLES {
        let m = _mm512_set1_epi8(0x0F);
        let mut out = [_mm512_setzero_si512(); 8];
        for h in 0..4 {
            let v = load(h);
            out[2 * h] = _mm512_and_si512(v, m);
            out[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m);
        }
        out
    } else {
        std::array::from_fn(load)
    }
}

/// Scale array `at` (0: `d`, 1: `m` or Q6K's upper-half `d`) of a block of two panels, as 16
/// f32 lanes.
#[inline(always)]
unsafe fn scales<F: Fmt>(lo: *const u8, hi: *const u8, at: usize) -> __m512 {
    if F::F32_SCALES {
        let (l, h) = (_mm256_loadu_ps(lo.add(at * 32) as *const f32), _mm256_loadu_ps(hi.add(at * 32) as *const f32));
        _mm512_castsi512_ps(join(_mm256_castps_si256(l), _mm256_castps_si256(h)))
    } else {
        let (l, h) = (_mm_loadu_si128(lo.add(at * 16) as *const __m128i), _mm_loadu_si128(hi.add(at * 16) as *const __m128i));
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(l), h))
    }
}

/// `Σ w·a` over groups `gs` of one activation block, per lane (the 4 bytes of each group
/// broadcast to every lane): one `vpdpbusd` chain.
#[inline(always)]
unsafe fn dot(w: &[__m512i; 8], q: *const i8, gs: std::ops::Range<usize>) -> __m512i {
    let mut s = _mm512_setzero_si512();
    for g in gs {
        s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32((q.add(4 * g) as *const i32).read_unaligned()));
    }
    s
}

/// One block's float term per lane, as the 256-bit kernel's `block_term` (and, for Q6K, its
/// halves): `sumi * d_w * d_a (+ m_w * s_a)`, or `(Σlo · d_lo + Σhi · d_hi) · d_a`.
#[inline(always)]
unsafe fn term<F: Fmt>(w: &[__m512i; 8], a: &ActBlock, dw: __m512, mw: __m512) -> __m512 {
    let offset = F::OFFSET_VNNI;
    if F::HALVES {
        let lo = _mm512_sub_epi32(dot(w, a.qs.as_ptr(), 0..4), _mm512_set1_epi32(offset * a.sum_lo));
        let hi = _mm512_sub_epi32(dot(w, a.qs.as_ptr(), 4..8), _mm512_set1_epi32(offset * (a.sum - a.sum_lo)));
        let t = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), dw), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), mw));
        return _mm512_mul_ps(t, _mm512_set1_ps(a.d));
    }
    let si = dot(w, a.qs.as_ptr(), 0..8);
    let si = if offset != 0 { _mm512_sub_epi32(si, _mm512_set1_epi32(offset * a.sum)) } else { si };
    let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(si), dw), _mm512_set1_ps(a.d));
    if F::MIN {
        _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_set1_ps(a.s)))
    } else {
        t
    }
}

/// The first `N` of `rows` against panel pairs `(0, 1), (2, 3), …` of `w` (`w.np` even),
/// writing `out[i * stride + 8p + r]`; the last pair's second panel has `w.lanes_last` rows.
#[inline(always)]
unsafe fn chunk<F: Fmt, const N: usize>(w: Panels, rows: Rows, prefetch: bool, warm: &mut WarmCursor) {
    let Panels { ptr: panels, pb, np, lanes_last } = w;
    let Rows { acts, nb, out, stride, .. } = rows;
    debug_assert!(rows.b >= N && np % 2 == 0);
    for p in (0..np).step_by(2) {
        let mut acc = [_mm512_setzero_ps(); N];
        for j in 0..nb {
            let lo = panels.add(p * pb + j * F::PB);
            let hi = lo.add(pb);
            // Each panel block is one panel block of the warming's count (`simd::chunks`).
            warm.step();
            warm.step();
            if prefetch {
                // The first chunk streams the tile from memory: ask for both panels' block
                // `j + PREFETCH_BLOCKS`, which near a pair's end lies in the next pair (the
                // 256-bit kernel's `blk + ahead` would land in this pair's second panel, already
                // loaded, and leave the next pair's second panel to miss at its start).
                let (q, k) = if j + PREFETCH_BLOCKS < nb { (p, j + PREFETCH_BLOCKS) } else { (p + 2, j + PREFETCH_BLOCKS - nb) };
                for s in 0..2 {
                    let ahead = panels.wrapping_add((q + s) * pb + k * F::PB);
                    let mut line = 0;
                    while line < F::PB {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                        line += 64;
                    }
                }
            }
            let dw = scales::<F>(lo, hi, 0);
            let mw = if F::MIN || F::HALVES { scales::<F>(lo, hi, 1) } else { _mm512_setzero_ps() };
            let wv = decode::<F>(lo.add(F::QOFF), hi.add(F::QOFF));
            rows!(N, i, {
                acc[i] = _mm512_add_ps(acc[i], term::<F>(&wv, &*acts.add(i * nb + j), dw, mw));
            });
        }
        let lanes = if p + 2 == np { PANEL + lanes_last } else { 2 * PANEL };
        let mask: __mmask16 = if lanes == 2 * PANEL { !0 } else { (1u16 << lanes) - 1 };
        for (i, acc) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(i * stride + p * PANEL), mask, *acc);
        }
    }
}

/// All rows in chunks of [`VNNI512_ROWS`] (then 8, 4, 2, 1, as [`simd::chunks`] counts
/// them): the tile's panel pairs here, and an odd last panel through the 256-bit kernel (the
/// same arithmetic; at most 8 rows per chunk there).
#[inline(always)]
unsafe fn tile_body<F: Fmt>(w: Panels, rows: Rows, warm: &mut WarmCursor) {
    let pairs = Panels { np: w.np & !1, lanes_last: if w.np % 2 == 0 { w.lanes_last } else { PANEL }, ..w };
    let odd = (w.np % 2 == 1).then(|| Panels { ptr: w.ptr.add((w.np - 1) * w.pb), np: 1, ..w });
    let mut i = 0;
    while i < rows.b {
        let (r, first) = (rows.skip(i), i == 0);
        let n = simd::chunk_rows(r.b, VNNI512_ROWS);
        if pairs.np > 0 {
            match n {
                16 => chunk::<F, 16>(pairs, r, first, warm),
                8 => chunk::<F, 8>(pairs, r, first, warm),
                4 => chunk::<F, 4>(pairs, r, first, warm),
                2 => chunk::<F, 2>(pairs, r, first, warm),
                _ => chunk::<F, 1>(pairs, r, first, warm),
            }
        }
        if let Some(last) = odd {
            let r = Rows { out: r.out.add((w.np - 1) * PANEL), ..r };
            let mut k = 0;
            while k < n {
                let (r, first) = (r.skip(k), first && k == 0);
                let m = simd::chunk_rows(n - k, simd::VNNI_ROWS);
                match m {
                    8 => simd::chunk::<F, true, 8>(last, r, first, warm),
                    4 => simd::chunk::<F, true, 4>(last, r, first, warm),
                    2 => simd::chunk::<F, true, 2>(last, r, first, warm),
                    _ => simd::chunk::<F, true, 1>(last, r, first, warm),
                }
                k += m;
            }
        }
        i += n;
    }
}

/// Activation rows per chunk: 16 accumulators, the block's 8 weight vectors, its two scale
/// vectors and the term's temporaries fit the 32 registers, and each decoded block of two
/// panels feeds 16 rows (a 16-sequence step decodes every weight once, not twice as in chunks
/// of 8).
pub const VNNI512_ROWS: usize = 16;

/// How many panel blocks ahead the first chunk prefetches each panel of a pair: twice the
/// 256-bit kernel's distance, as a block here takes half its time. Engine side by side on an
/// Intel Xeon (Emerald Rapids), 1 thread each: 8 blocks ahead against 4, 16 sequences 0.98-1.07
/// (4 pairs) and batch-1 1.13-1.20 (4 pairs); 16 blocks no better. On Zen 4, where a block takes
/// as long as the 256-bit kernel's, 4 blocks ahead measured no better than 8 (BENCHMARKS).
const PREFETCH_BLOCKS: usize = 8;

/// The AVX-512 VNNI panel kernel on 512-bit vectors.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile_vnni512<F: Fmt>(w: Panels, rows: Rows, warm: &mut WarmCursor) {
    tile_body::<F>(w, rows, warm)
}

const _: () = assert!(QK == 32 && PANEL == 8 && VNNI512_ROWS == 16 && simd::VNNI_ROWS == 8);
