//! Activation rows quantized to 32-element int8 blocks (Q8_1 scheme), scalar and AVX2, bit-identical.

use half::f16;

use super::format::QK;

/// One quantized activation block: `x[i] ≈ d * qs[i]`, `s = d * Σ qs` (both rounded to f16),
/// and the exact integer `sum = Σ qs`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ActBlock {
    pub d: f32,
    pub s: f32,
    pub sum: i32,
    /// `Σ qs[..16]` (for Q6K's per-half offsets).
    pub sum_lo: i32,
    pub qs: [i8; QK],
}

/// Quantizes one activation row (length a multiple of 32) into `out` (length/32 blocks).
///
/// `q = round(x / d)` rounds half away from zero (Rust's `f32::round`, as candle does); the
/// AVX2 path computes exactly the same bytes and sums (tested).
pub fn quantize_row(x: &[f32], out: &mut [ActBlock]) {
    assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        // SAFETY: AVX2/FMA/F16C detected; lengths checked above.
        unsafe { quantize_row_avx2(x, out) };
        return;
    }
    quantize_row_portable(x, out)
}

pub(super) fn quantize_row_portable(x: &[f32], out: &mut [ActBlock]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let mut amax = 0f32;
        for &v in xb {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut sum, mut sum_lo) = (0i32, 0i32);
        for (k, (q, &v)) in ob.qs.iter_mut().zip(xb).enumerate() {
            let r = (v * id).round() as i32;
            *q = r as i8;
            sum += r;
            if k < QK / 2 {
                sum_lo += r;
            }
        }
        set_scales(ob, d, sum, sum_lo);
    }
}

/// Scales are kept at f16 precision, as in ggml's and candle's Q8_0/Q8_1 blocks, so results
/// match those references (and llama.cpp) closely.
#[inline(always)]
pub(super) fn set_scales(ob: &mut ActBlock, d: f32, sum: i32, sum_lo: i32) {
    let d16 = f16::from_f32(d);
    ob.d = d16.to_f32();
    ob.s = (f16::from_f32(sum as f32) * d16).to_f32();
    ob.sum = sum;
    ob.sum_lo = sum_lo;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_row_avx2(x: &[f32], out: &mut [ActBlock]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
        // max is exact and order-free; NaN lanes are dropped as `f32::max` drops them.
        let mut m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)), _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
        m = _mm256_max_ps(m, _mm256_permute_ps::<0b01_00_11_10>(m));
        m = _mm256_max_ps(m, _mm256_permute_ps::<0b10_11_00_01>(m));
        let amax = _mm256_cvtss_f32(m);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let r = _mm256_mul_ps(v[i], id);
            // Round half away from zero: truncate, then step away from zero when the (exact)
            // remainder is at least one half.
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(r);
            let rem = _mm256_and_ps(_mm256_sub_ps(r, t), abs_mask);
            let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(rem, half), _mm256_or_ps(one, _mm256_and_ps(r, sign_mask)));
            _mm256_cvttps_epi32(_mm256_add_ps(t, step))
        });
        let hsum = |s: __m256i| {
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            _mm_cvtsi128_si32(s)
        };
        let lo = _mm256_add_epi32(q[0], q[1]);
        let sum_lo = hsum(lo);
        let sum = hsum(_mm256_add_epi32(lo, _mm256_add_epi32(q[2], q[3])));
        // i32 → i8 in element order (as ggml's quantize_row_q8 does).
        let p01 = _mm256_packs_epi32(q[0], q[1]);
        let p23 = _mm256_packs_epi32(q[2], q[3]);
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(ob.qs.as_mut_ptr() as *mut __m256i, bytes);
        // `set_scales` with F16C conversions (round to nearest even, as `half`'s): d and sum
        // to f16, s = f16(f32(sum16) * f32(d16)).
        #[inline(always)]
        unsafe fn to16(v: __m128) -> __m128 {
            _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
        }
        let d16 = to16(_mm_set_ss(d));
        let s16 = to16(_mm_mul_ss(to16(_mm_set_ss(sum as f32)), d16));
        ob.d = _mm_cvtss_f32(d16);
        ob.s = _mm_cvtss_f32(s16);
        ob.sum = sum;
        ob.sum_lo = sum_lo;
    }
}
