//! AVX2 (and AVX-512 VNNI) panel kernels. Each block's integer row sums are exact and the
//! float arithmetic per block is the scalar code's, in the same order (no fused multiply-add),
//! with lane `r` holding row `r`, so results are bit-identical to [`dot_block_row`].
use super::activation::ActBlock;
use super::format::{PANEL, QK};
use std::arch::x86_64::*;

/// A quantized block format as the panel kernel sees it.
pub trait Fmt {
    /// Bytes per panel block (8 rows).
    const PB: usize;
    /// Whether blocks carry a min (8 `m`s after the `d`s), as Q4_1 and Q4K do.
    const MIN: bool;
    /// Whether scales are f32 (else f16).
    const F32_SCALES: bool = false;
    /// Whether each 16-element half has its own scale (Q6K: 8 `d_lo`, then 8 `d_hi`).
    const HALVES: bool = false;
    /// Offset of the quants in a panel block.
    const QOFF: usize;
    /// What the integer sums must lose, times the activation block's `Σq` (the stored
    /// quant offset; 0 where the AVX2 path decodes to signed values instead).
    const OFFSET_VNNI: i32;
    const OFFSET_AVX2: i32;
    /// The 8 group vectors of one panel block (lane `r`: elements `4g..4g+4` of row `r`).
    /// Default: two groups per byte (4-bit codes).
    #[inline(always)]
    unsafe fn decode<const V: bool>(q: *const u8) -> [__m256i; 8] {
        nibbles(q)
    }
    /// How many `pmaddubsw` results (each a sum of two products) the AVX2 path may add in
    /// 16 bits before widening, exactly: 8 for 4-bit codes (8 · 2 · 15 · 127 = 30,480 <
    /// 2¹⁵), 2 for Q6K's 6-bit codes (2 · 2 · 63 · 127 = 32,004), 1 for Q8_0.
    const I16_TERMS: usize = 8;
    /// Whether the codes are 4-bit nibbles, two groups per 32 bytes (the default `decode`).
    const NIBBLES: bool = true;
    /// Whether the codes are signed bytes stored `+ 128`, one group per 32 bytes (Q8_0).
    const SIGNED_BYTES: bool = false;
    /// `acc + Σ₄ w·a` per lane. Default: unsigned codes.
    #[inline(always)]
    unsafe fn dot<const V: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        udot::<V>(acc, w, a)
    }
}

pub struct Q41;
pub struct Q40;
pub struct Q80;
pub struct Q4K;
pub struct Q6K;
pub struct Q5K;

#[inline(always)]
unsafe fn nibbles(q: *const u8) -> [__m256i; 8] {
    let m = _mm256_set1_epi8(0x0F);
    let mut out = [_mm256_setzero_si256(); 8];
    for h in 0..4 {
        let v = _mm256_loadu_si256(q.add(32 * h) as *const __m256i);
        out[2 * h] = _mm256_and_si256(v, m);
        out[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
    }
    out
}

/// Unsigned weights × signed activations, 4 products per lane added to `acc`. Without VNNI
/// this is `pmaddubsw` + `pmaddwd`, exact for weights ≤ 15 (no i16 saturation).
#[inline(always)]
unsafe fn udot<const V: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    if V {
        _mm256_dpbusd_epi32(acc, w, a)
    } else {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)))
    }
}

impl Fmt for Q41 {
    const PB: usize = 8 * 20;
    const MIN: bool = true;
    const QOFF: usize = 32;
    const OFFSET_VNNI: i32 = 0;
    const OFFSET_AVX2: i32 = 0;
}
impl Fmt for Q4K {
    const PB: usize = 8 * 24;
    const MIN: bool = true;
    const F32_SCALES: bool = true;
    const QOFF: usize = 64;
    const OFFSET_VNNI: i32 = 0;
    const OFFSET_AVX2: i32 = 0;
}
impl Fmt for Q6K {
    const PB: usize = 8 * 40;
    const MIN: bool = false;
    const F32_SCALES: bool = true;
    const HALVES: bool = true;
    const QOFF: usize = 64;
    // Codes are the quants + 32 (0..63): unsigned for both paths (pmaddubsw cannot
    // saturate: 63 · 127 · 2 < 2¹⁵).
    const OFFSET_VNNI: i32 = 32;
    const OFFSET_AVX2: i32 = 32;
    const I16_TERMS: usize = 2;
    const NIBBLES: bool = false;
    #[inline(always)]
    unsafe fn decode<const V: bool>(q: *const u8) -> [__m256i; 8] {
        std::array::from_fn(|g| _mm256_loadu_si256(q.add(32 * g) as *const __m256i))
    }
}
impl Fmt for Q5K {
    const PB: usize = 8 * 40;
    const MIN: bool = true;
    const F32_SCALES: bool = true;
    const QOFF: usize = 64;
    // Codes are the quants (0..31), unsigned for both paths.
    const OFFSET_VNNI: i32 = 0;
    const OFFSET_AVX2: i32 = 0;
    const I16_TERMS: usize = 2;
    const NIBBLES: bool = false;
    #[inline(always)]
    unsafe fn decode<const V: bool>(q: *const u8) -> [__m256i; 8] {
        std::array::from_fn(|g| _mm256_loadu_si256(q.add(32 * g) as *const __m256i))
    }
}
impl Fmt for Q40 {
    const PB: usize = 8 * 18;
    const MIN: bool = false;
    const QOFF: usize = 16;
    const OFFSET_VNNI: i32 = 8;
    const OFFSET_AVX2: i32 = 8;
}
impl Fmt for Q80 {
    const PB: usize = 8 * 34;
    const MIN: bool = false;
    const QOFF: usize = 16;
    const OFFSET_VNNI: i32 = 128;
    const OFFSET_AVX2: i32 = 0;
    const I16_TERMS: usize = 1;
    const NIBBLES: bool = false;
    const SIGNED_BYTES: bool = true;
    #[inline(always)]
    unsafe fn decode<const V: bool>(q: *const u8) -> [__m256i; 8] {
        let mut out = [_mm256_setzero_si256(); 8];
        for (g, o) in out.iter_mut().enumerate() {
            let v = _mm256_loadu_si256(q.add(32 * g) as *const __m256i);
            // VNNI: stored codes are the quants + 128, unsigned. AVX2: back to signed i8,
            // for the sign trick below.
            *o = if V { v } else { _mm256_xor_si256(v, _mm256_set1_epi8(-128)) };
        }
        out
    }
    #[inline(always)]
    unsafe fn dot<const V: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        if V {
            _mm256_dpbusd_epi32(acc, w, a)
        } else {
            // |w| ≤ 128 and |a| ≤ 127: pmaddubsw(|w|, ±a) cannot saturate.
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
}

/// The exact integer sums `Σ w·a` of one panel block against one activation block, per lane:
/// elements 0..16 and 16..32 (the halves Q6K scales separately; other formats add them).
#[inline(always)]
unsafe fn block_sums<F: Fmt, const V: bool>(w: &[__m256i; 8], q: *const i8) -> (__m256i, __m256i) {
    let bc = |g: usize| _mm256_set1_epi32((q.add(4 * g) as *const i32).read_unaligned());
    if !V && F::I16_TERMS >= 2 {
        // `pmaddubsw` results added in pairs in 16 bits (exact within `I16_TERMS`, see there),
        // then one `pmaddwd` per pair: half the multiplier work of widening every result.
        // (4-bit codes take `chunk`'s own path, which sums all eight in 16 bits.)
        let p = |g: usize| _mm256_maddubs_epi16(w[g], bc(g));
        let pair = |g: usize| _mm256_madd_epi16(_mm256_add_epi16(p(g), p(g + 1)), _mm256_set1_epi16(1));
        return (_mm256_add_epi32(pair(0), pair(2)), _mm256_add_epi32(pair(4), pair(6)));
    }
    // Four chains (elements 0..8, 8..16, 16..24, 24..32); integer adds are exact, so the
    // split changes nothing.
    let z = _mm256_setzero_si256();
    let mut s0 = F::dot::<V>(z, w[0], bc(0));
    let mut s1 = F::dot::<V>(z, w[1], bc(1));
    let mut s2 = F::dot::<V>(z, w[4], bc(4));
    let mut s3 = F::dot::<V>(z, w[5], bc(5));
    s0 = F::dot::<V>(s0, w[2], bc(2));
    s1 = F::dot::<V>(s1, w[3], bc(3));
    s2 = F::dot::<V>(s2, w[6], bc(6));
    s3 = F::dot::<V>(s3, w[7], bc(7));
    (_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3))
}

/// The exact integer sum `Σ w·a` of one panel block against one activation block, per lane, for
/// the VNNI path of formats without halves: one `vpdpbusd` chain over the 8 groups, so a
/// block costs 8 dot instructions and no zeroing or adding of partial chains. The rows of a
/// chunk are independent chains, enough to cover the instruction's latency.
#[inline(always)]
unsafe fn block_sum_vnni<F: Fmt>(w: &[__m256i; 8], q: *const i8) -> __m256i {
    let bc = |g: usize| _mm256_set1_epi32((q.add(4 * g) as *const i32).read_unaligned());
    let mut s = F::dot::<true>(_mm256_setzero_si256(), w[0], bc(0));
    for (g, wg) in w.iter().enumerate().skip(1) {
        s = F::dot::<true>(s, *wg, bc(g));
    }
    s
}

/// A tile's weight panels: `np` panels of `pb` bytes from `ptr`; the last has `lanes_last`
/// real rows.
#[derive(Clone, Copy)]
pub struct Panels {
    pub ptr: *const u8,
    pub pb: usize,
    pub np: usize,
    pub lanes_last: usize,
}

/// Activation rows and where their outputs go: `b` rows of `nb` blocks from `acts`; row
/// `i`'s output for the tile's first weight row is at `out + i * stride`.
#[derive(Clone, Copy)]
pub struct Rows {
    pub acts: *const ActBlock,
    pub nb: usize,
    pub b: usize,
    pub out: *mut f32,
    pub stride: usize,
}

impl Rows {
    pub(super) unsafe fn skip(self, i: usize) -> Rows {
        Rows { acts: self.acts.add(i * self.nb), b: self.b - i, out: self.out.add(i * self.stride), ..self }
    }
}

/// Cache lines a matmul task brings in as it computes (built by `matmul::Warm`): line `line`
/// of run `run` (at byte offset `runs[run]`) from `bases[base]`, then onwards, `per_block`
/// lines after each panel block, until `left` lines are done. Prefetches only: no value
/// depends on it.
///
/// Invariant (what makes [`WarmCursor::next_line`] sound): `bases` holds `n_bases` pointers and
/// `runs` `n_runs` offsets, alive while the cursor is used, and `left` counts no more lines than
/// remain from (`base`, `run`, `line`). The fields are private to `quant`, and only
/// `matmul::Warm::cursor` (which sizes `left` from the lists) and [`WarmCursor::NONE`] build one.
#[derive(Clone, Copy)]
pub struct WarmCursor {
    pub(super) bases: *const *const u8,
    pub(super) n_bases: usize,
    pub(super) runs: *const usize,
    pub(super) n_runs: usize,
    pub(super) lines_per_run: usize,
    pub(super) per_block: usize,
    pub(super) base: usize,
    pub(super) run: usize,
    pub(super) line: usize,
    pub(super) left: usize,
}

impl WarmCursor {
    /// Nothing to warm.
    pub const NONE: WarmCursor = WarmCursor {
        bases: std::ptr::null(),
        n_bases: 0,
        runs: std::ptr::null(),
        n_runs: 0,
        lines_per_run: 1,
        per_block: 0,
        base: 0,
        run: 0,
        line: 0,
        left: 0,
    };

    /// The next line's address, if any are left.
    #[inline(always)]
    pub(super) fn next_line(&mut self) -> Option<*const u8> {
        if self.left == 0 {
            return None;
        }
        debug_assert!(self.base < self.n_bases && self.run < self.n_runs);
        // SAFETY: `base < n_bases` and `run < n_runs` while lines are left (`Warm::cursor`
        // sizes `left` to the lines that exist); the address is only ever prefetched.
        let p = unsafe { (*self.bases.add(self.base)).wrapping_add(*self.runs.add(self.run) + self.line * 64) };
        self.left -= 1;
        self.line += 1;
        if self.line == self.lines_per_run {
            self.line = 0;
            self.run += 1;
            if self.run == self.n_runs {
                self.run = 0;
                self.base += 1;
            }
        }
        Some(p)
    }

    /// Prefetches this panel block's share of lines into L2.
    #[inline(always)]
    pub(super) unsafe fn step(&mut self) {
        for _ in 0..self.per_block {
            match self.next_line() {
                Some(p) => _mm_prefetch::<_MM_HINT_T1>(p as *const i8),
                None => return,
            }
        }
    }
}

/// Runs `$body` with `$i` = 0, 1, … `$n - 1` (`$n` ≤ 16, a constant), unrolled.
macro_rules! rows {
    ($n:expr, $i:ident, $body:block) => {
        rows!(@ $n, $i, $body, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
    };
    (@ $n:expr, $i:ident, $body:block, $($k:literal),*) => {
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}
pub(super) use rows;

/// The first `N` of `rows` against every panel, writing `out[i * stride + 8p + r]` for lanes
/// `r < 8` (`< lanes_last` in the last panel).
#[inline(always)]
pub(super) unsafe fn chunk<F: Fmt, const V: bool, const N: usize>(w: Panels, rows: Rows, prefetch: bool, warm: &mut WarmCursor) {
    let Panels { ptr: panels, pb, np, lanes_last } = w;
    let Rows { acts, nb, out, stride, .. } = rows;
    debug_assert!(rows.b >= N);
    let offset = if V { F::OFFSET_VNNI } else { F::OFFSET_AVX2 };
    for p in 0..np {
        let mut acc = [_mm256_setzero_ps(); N];
        for j in 0..nb {
            let blk = panels.add(p * pb + j * F::PB);
            warm.step();
            if prefetch {
                // The first chunk streams the tile from memory: ask for blocks ahead (a few
                // blocks of the next panel at the end of a row; past the tile it is harmless).
                // Later chunks find the tile in L1.
                let ahead = blk.wrapping_add(PREFETCH_BLOCKS * F::PB);
                let mut line = 0;
                while line < F::PB {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                    line += 64;
                }
            }
            let scales = |at: usize| {
                if F::F32_SCALES {
                    _mm256_loadu_ps(blk.add(at * 32) as *const f32)
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.add(at * 16) as *const __m128i))
                }
            };
            let dw = scales(0);
            let mw = if F::MIN || F::HALVES { scales(1) } else { _mm256_setzero_ps() };
            if !V && F::NIBBLES {
                // 4-bit codes on AVX2: each 32-byte load of codes is two groups (low and high
                // nibbles), used by every row of the chunk before the next load, and each row's
                // products are summed in 16 bits (exact: see `I16_TERMS`), widened once per
                // block. Two weight registers instead of eight keep the rows' sums and
                // accumulators in registers.
                let q = blk.add(F::QOFF);
                let mask = _mm256_set1_epi8(0x0F);
                let mut s16 = [_mm256_setzero_si256(); N];
                for h in 0..4 {
                    let v = _mm256_loadu_si256(q.add(32 * h) as *const __m256i);
                    let (lo, hi) = (_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
                    rows!(N, i, {
                        let a = (*acts.add(i * nb + j)).qs.as_ptr();
                        let bc = |g: usize| _mm256_set1_epi32((a.add(4 * g) as *const i32).read_unaligned());
                        let t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bc(2 * h)), _mm256_maddubs_epi16(hi, bc(2 * h + 1)));
                        s16[i] = _mm256_add_epi16(s16[i], t);
                    });
                }
                rows!(N, i, {
                    let a = &*acts.add(i * nb + j);
                    let si = _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1));
                    acc[i] = _mm256_add_ps(acc[i], block_term::<F>(si, dw, mw, a, offset));
                });
                continue;
            }
            if !V && F::SIGNED_BYTES {
                // Q8_0 on AVX2: group by group (one 32-byte load each), every row of the chunk
                // using the group's signed codes and their magnitudes before the next load
                // (the sign trick's `|w|` once per group, not per row).
                let q = blk.add(F::QOFF);
                let ones = _mm256_set1_epi16(1);
                let mut s32 = [_mm256_setzero_si256(); N];
                for g in 0..8 {
                    let w = _mm256_xor_si256(_mm256_loadu_si256(q.add(32 * g) as *const __m256i), _mm256_set1_epi8(-128));
                    let wabs = _mm256_sign_epi8(w, w);
                    rows!(N, i, {
                        let a = (*acts.add(i * nb + j)).qs.as_ptr();
                        let bc = _mm256_set1_epi32((a.add(4 * g) as *const i32).read_unaligned());
                        // |w| ≤ 128 and |a| ≤ 127: pmaddubsw(|w|, ±a) cannot saturate.
                        let p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(bc, w));
                        s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(p, ones));
                    });
                }
                rows!(N, i, {
                    let a = &*acts.add(i * nb + j);
                    acc[i] = _mm256_add_ps(acc[i], block_term::<F>(s32[i], dw, mw, a, offset));
                });
                continue;
            }
            let w = F::decode::<V>(blk.add(F::QOFF));
            // Unrolled by hand (`rows!`): LLVM leaves an 8-row loop rolled, with the
            // accumulators on the stack.
            rows!(N, i, {
                let acc = &mut acc[i];
                let a = &*acts.add(i * nb + j);
                let t = if V && !F::HALVES {
                    block_term::<F>(block_sum_vnni::<F>(&w, a.qs.as_ptr()), dw, mw, a, offset)
                } else if F::HALVES {
                    let (lo, hi) = block_sums::<F, V>(&w, a.qs.as_ptr());
                    // Q6K: `(Σlo · d_lo + Σhi · d_hi) · d_a`, as the scalar code.
                    let lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(offset * a.sum_lo));
                    let hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(offset * (a.sum - a.sum_lo)));
                    let t = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), dw), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), mw));
                    _mm256_mul_ps(t, _mm256_set1_ps(a.d))
                } else {
                    let (lo, hi) = block_sums::<F, V>(&w, a.qs.as_ptr());
                    block_term::<F>(_mm256_add_epi32(lo, hi), dw, mw, a, offset)
                };
                *acc = _mm256_add_ps(*acc, t);
            });
        }
        let lanes = if p + 1 == np { lanes_last } else { PANEL };
        for (i, acc) in acc.iter().enumerate() {
            let o = out.add(i * stride + p * PANEL);
            if lanes == PANEL {
                _mm256_storeu_ps(o, *acc);
            } else {
                let mut tmp = [0f32; PANEL];
                _mm256_storeu_ps(tmp.as_mut_ptr(), *acc);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, lanes);
            }
        }
    }
}

/// One block's term for a format without halves, from its exact integer sums `si` (before
/// the offset): the scalar code's `sumi * d_w * d_a (+ m_w * s_a)`.
#[inline(always)]
unsafe fn block_term<F: Fmt>(si: __m256i, dw: __m256, mw: __m256, a: &ActBlock, offset: i32) -> __m256 {
    let si = if offset != 0 { _mm256_sub_epi32(si, _mm256_set1_epi32(offset * a.sum)) } else { si };
    let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(si), dw), _mm256_set1_ps(a.d));
    if F::MIN {
        _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a.s)))
    } else {
        t
    }
}

/// All rows in chunks of `MAX` (then 4, 2, 1, as [`chunk_rows`] says), each chunk against
/// every panel of the tile while the tile's weights stay in L1.
#[inline(always)]
unsafe fn tile_body<F: Fmt, const V: bool, const MAX: usize>(w: Panels, rows: Rows, warm: &mut WarmCursor) {
    const { assert!(MAX == 4 || MAX == 8) };
    let mut i = 0;
    while i < rows.b {
        let (r, first) = (rows.skip(i), i == 0);
        let n = chunk_rows(r.b, MAX);
        if n == MAX {
            chunk::<F, V, MAX>(w, r, first, warm)
        } else if n == 4 {
            chunk::<F, V, 4>(w, r, first, warm)
        } else if n == 2 {
            chunk::<F, V, 2>(w, r, first, warm)
        } else {
            chunk::<F, V, 1>(w, r, first, warm)
        }
        i += n;
    }
}

/// The rows of the next chunk when `b` rows are left and chunks hold at most `max`: `max`,
/// then 8 (below a larger `max`), 4, 2, 1.
pub(super) fn chunk_rows(b: usize, max: usize) -> usize {
    if b >= max {
        max
    } else if b >= 8 && max > 8 {
        8
    } else if b >= 4 {
        4
    } else if b >= 2 {
        2
    } else {
        1
    }
}

/// How many chunks [`tile_body`] (or the 512-bit kernel's) splits `b` rows into, with chunks
/// of at most `max`.
pub fn chunks(b: usize, max: usize) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < b {
        i += chunk_rows(b - i, max);
        n += 1;
    }
    n
}

/// The AVX2 panel kernel (16 vector registers: chunks of 4 activation rows).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_avx2<F: Fmt>(w: Panels, rows: Rows, warm: &mut WarmCursor) {
    tile_body::<F, false, AVX2_ROWS>(w, rows, warm)
}

/// Activation rows per chunk in the AVX2 kernel.
pub const AVX2_ROWS: usize = 4;

/// How far ahead (in panel blocks) the kernel prefetches weights.
pub(super) const PREFETCH_BLOCKS: usize = 4;

/// Activation rows per chunk in the VNNI kernel.
pub const VNNI_ROWS: usize = 8;

/// The AVX-512 VNNI panel kernel on 256-bit vectors (32 registers: chunks of 8 rows).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub unsafe fn tile_vnni<F: Fmt>(w: Panels, rows: Rows, warm: &mut WarmCursor) {
    tile_body::<F, true, VNNI_ROWS>(w, rows, warm)
}

const _: () = assert!(QK == 32 && PANEL == 8);
// `rows!` unrolls at most 16.
const _: () = assert!(VNNI_ROWS <= 16);
