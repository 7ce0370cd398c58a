//! Row-wise elementwise kernels: RMSNorm, rotary embeddings, SiLU·mul, softmax helpers.
//!
//! Every kernel works on one row at a time with a fixed reduction order, so a row's result never
//! depends on the other rows it is computed with.

/// `out = x / sqrt(mean(x²) + eps) * weight`, one row.
///
/// The arithmetic follows candle's and llama.cpp's reference form (a sequential sum of squares,
/// then `x / rms * w`), so that results agree with those references as closely as f32 allows:
/// the int8 quantization of activations downstream turns one-ulp differences into visible ones.
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0f32;
    for &v in x {
        ss += v * v;
    }
    let rms = (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v / rms * w;
    }
}

/// RMSNorm over every row of `x` (row length `weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm_row(xr, weight, eps, or);
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF llama checkpoints (Q/K permuted at conversion).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: Hugging Face checkpoints.
    HalfSplit,
}

/// Precomputed cos/sin for every position up to `max_pos` and every frequency of a head.
pub struct RopeTable {
    pub head_dim: usize,
    pub style: RopeStyle,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, max_pos: usize, base: f32, style: RopeStyle) -> Self {
        Self::scaled(head_dim, max_pos, base, style, 1.0, None)
    }

    /// With linear position scaling (`pos_scale`: 1 / the scaling factor) and per-frequency
    /// divisors (`freq_factors`, one per pair: Llama 3.1's `rope_freqs`), as llama.cpp's RoPE:
    /// the angle of pair `i` at position `p` is `p · base^(-2i/d) / factor_i · pos_scale`.
    pub fn scaled(head_dim: usize, max_pos: usize, base: f32, style: RopeStyle, pos_scale: f32, freq_factors: Option<&[f32]>) -> Self {
        let half = head_dim / 2;
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        for i in 0..half {
            let ff = freq_factors.and_then(|f| f.get(i)).copied().unwrap_or(1.0);
            let inv = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
            for p in 0..max_pos {
                let a = if ff == 1.0 && pos_scale == 1.0 { p as f32 * inv } else { p as f32 * inv / ff * pos_scale };
                cos[p * half + i] = a.cos();
                sin[p * half + i] = a.sin();
            }
        }
        RopeTable { head_dim, style, cos, sin }
    }

    /// The tables, `max_pos × head_dim / 2` each (position-major): what device backends upload.
    pub fn cos_sin(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    pub fn max_pos(&self) -> usize {
        self.cos.len() / (self.head_dim / 2)
    }

    /// Rotates every head in `x` (a row of `n_heads * head_dim`) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.head_dim / 2;
        let c = &self.cos[pos * half..(pos + 1) * half];
        let s = &self.sin[pos * half..(pos + 1) * half];
        for h in x.chunks_exact_mut(self.head_dim) {
            match self.style {
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (a, b) = (h[2 * i], h[2 * i + 1]);
                        h[2 * i] = a * c[i] - b * s[i];
                        h[2 * i + 1] = a * s[i] + b * c[i];
                    }
                }
                RopeStyle::HalfSplit => {
                    for i in 0..half {
                        let (a, b) = (h[i], h[i + half]);
                        h[i] = a * c[i] - b * s[i];
                        h[i + half] = a * s[i] + b * c[i];
                    }
                }
            }
        }
    }
}

/// `e^x` in f32, computed in f64 and rounded once: `2^n · p(r)` with `n = round(x / ln 2)`,
/// `r = x − n·ln 2` (two-part ln 2, fused) and `p` the degree-11 Taylor polynomial (relative
/// error below 1e-13 on |r| ≤ ln 2 / 2), so the f32 result is the correctly rounded `e^x`
/// except within ~1e-13 of a rounding boundary — the same value as a correctly rounded libm
/// `expf` (glibc's, which candle uses) practically always.
///
/// Written as a fixed sequence of IEEE operations (fused multiply-adds are `mul_add`, exact on
/// every target) so that [`avx2::exp8`] computes the same bits 8 at a time; libm cannot be
/// vectorized bit-for-bit.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    // Not `clamp`: max-then-min maps NaN to EXP_LO exactly as the vector form's maxps/minps do.
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_LO).min(EXP_HI) as f64;
    let n = x.mul_add(std::f64::consts::LOG2_E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut y = EXP_C[0];
    for c in &EXP_C[1..] {
        y = y.mul_add(r, *c);
    }
    (y * f64::from_bits(((n as i64 + 1023) << 52) as u64)) as f32
}

/// Inputs are clamped to where f32 `e^x` is 0 below and infinite above.
const EXP_HI: f32 = 89.0;
const EXP_LO: f32 = -104.0;
/// ln 2 in two parts: `LN2_HI` has trailing zero bits, so `n · LN2_HI` is exact for |n| < 2¹¹.
const LN2_HI: f64 = 6.931_471_803_691_238_164_9e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_700_0e-10;
/// 1/11!, 1/10!, …, 1/1!, 1/0! (Horner order).
const EXP_C: [f64; 12] = [
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// GELU with the tanh approximation, in f32 as llama.cpp's `ggml_gelu_f32`.
fn gelu_tanh(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// GELU of every f16 value, rounded to f16: llama.cpp's `ggml_table_gelu_f16`.
fn gelu_table() -> &'static [half::f16] {
    static TABLE: std::sync::OnceLock<Vec<half::f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|b| half::f16::from_f32(gelu_tanh(half::f16::from_bits(b).to_f32()))).collect())
}

/// `out = gelu(gate) * up`, elementwise (GeGLU), exactly as llama.cpp's CPU backend computes
/// it (`ggml_vec_geglu_f32` with `GGML_GELU_FP16`): 0 at or below -10, the identity at or above
/// 10, and between them GELU looked up by the input rounded to f16.
pub fn gelu_mul_to(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && out.len() == gate.len());
    let table = gelu_table();
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g * u
        } else {
            table[half::f16::from_f32(g).to_bits() as usize].to_f32() * u
        };
    }
}

/// `gate = silu(gate) * up`, elementwise: `g / (1 + e^-g) * u`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    let (n, g) = (gate.len(), gate.as_mut_ptr());
    // SAFETY: `gate` and `up` hold `n` values each (checked); each output overwrites the gate
    // value it was computed from, after reading it.
    unsafe { silu_mul_raw(g, up.as_ptr(), g, n) }
}

/// `out = silu(gate) * up`, elementwise, as [`silu_mul`] (the same bits) without first copying
/// `gate` into `out`.
pub fn silu_mul_to(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && out.len() == gate.len());
    // SAFETY: the three slices hold `out.len()` values each (checked), and `out` is a `&mut`,
    // so it overlaps neither input.
    unsafe { silu_mul_raw(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len()) }
}

/// # Safety
/// `gate`, `up` and `out` point to `n` values each; `out` may be `gate` (in place), and
/// overlaps nothing else.
unsafe fn silu_mul_raw(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx512vl() {
        // SAFETY: AVX2, FMA and AVX-512F detected; the pointers as this function's contract.
        unsafe { avx2::silu_mul_wide(gate, up, out, n) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        // SAFETY: AVX2/FMA detected; the pointers as this function's contract.
        unsafe { avx2::silu_mul(gate, up, out, n) };
        return;
    }
    // SAFETY: as this function's contract.
    unsafe { silu_mul_portable(gate, up, out, n) }
}

/// # Safety
/// As [`silu_mul_raw`].
unsafe fn silu_mul_portable(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    for i in 0..n {
        // SAFETY: `i < n`; each value is read before its output is written.
        unsafe {
            let (v, u) = (*gate.add(i), *up.add(i));
            *out.add(i) = v / (1.0 + exp_fast(-v)) * u;
        }
    }
}

/// Index of the largest value (the first, on ties; `-0.0` and `0.0` tie). NaNs are never
/// chosen over numbers; a row of NaNs and `-inf`s gives 0. The greedy draw: the sampler's
/// serial per-row step, so it runs 8 lanes at a time (about 8 times the scalar loop's speed,
/// the same index).
pub fn argmax(xs: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() {
        // SAFETY: AVX2 was detected at run time.
        return unsafe { avx2::argmax(xs) };
    }
    argmax_portable(xs)
}

fn argmax_portable(xs: &[f32]) -> usize {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in xs.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best
}

/// Vector forms, bit-identical to the scalar ones above (tested).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`exp_fast`] on 8 lanes (two halves of 4 in f64).
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
        let lo = exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        _mm256_set_m128(hi, lo)
    }

    /// [`exp_fast`] on 8 lanes in one 512-bit f64 vector: [`exp8`]'s operations on all 8
    /// lanes at once (half the instructions, the same bits). The caller must run with
    /// AVX-512F.
    #[inline(always)]
    pub(crate) unsafe fn exp8_wide(x: __m256) -> __m256 {
        let x = _mm512_cvtps_pd(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI)));
        let fma = |a, b: f64, c: f64| _mm512_fmadd_pd(a, _mm512_set1_pd(b), _mm512_set1_pd(c));
        let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(fma(x, std::f64::consts::LOG2_E, 0.5));
        let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_HI), x);
        let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_LO), r);
        let mut y = _mm512_set1_pd(EXP_C[0]);
        for c in &EXP_C[1..] {
            y = _mm512_fmadd_pd(y, r, _mm512_set1_pd(*c));
        }
        let e = _mm512_slli_epi64::<52>(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n)), _mm512_set1_epi64(1023)));
        _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(e)))
    }

    /// [`exp8`], or [`exp8_wide`] when `WIDE` (the caller then runs with AVX-512F).
    #[inline(always)]
    pub(crate) unsafe fn exp8_in<const WIDE: bool>(x: __m256) -> __m256 {
        if WIDE {
            exp8_wide(x)
        } else {
            exp8(x)
        }
    }

    /// The f64 core of [`exp_fast`] on 4 lanes, rounded to f32. (A function, not a closure:
    /// closures do not inherit the caller's target features and would not inline here.)
    #[inline(always)]
    unsafe fn exp4(x: __m256d) -> __m128 {
        let n = _mm256_floor_pd(_mm256_fmadd_pd(x, _mm256_set1_pd(std::f64::consts::LOG2_E), _mm256_set1_pd(0.5)));
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_HI), x);
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_LO), r);
        let mut y = _mm256_set1_pd(EXP_C[0]);
        for c in &EXP_C[1..] {
            y = _mm256_fmadd_pd(y, r, _mm256_set1_pd(*c));
        }
        let e = _mm256_slli_epi64::<52>(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023)));
        _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(e)))
    }

    /// [`argmax`] in two passes: the largest value `m` (`maxps(v, m)` keeps `m` unless `v > m`,
    /// NaN included, exactly the scalar comparison), then the first index holding a value equal
    /// to it, which is the scalar loop's answer whatever order the lanes met the values in.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn argmax(xs: &[f32]) -> usize {
        let n = xs.len();
        let p = xs.as_ptr();
        let n32 = n / 32 * 32;
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut i = 0;
        while i < n32 {
            for (j, mj) in m.iter_mut().enumerate() {
                *mj = _mm256_max_ps(_mm256_loadu_ps(p.add(i + 8 * j)), *mj);
            }
            i += 32;
        }
        let mut lanes = [0f32; 32];
        for (j, mj) in m.iter().enumerate() {
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * j), *mj);
        }
        let mut best = f32::NEG_INFINITY;
        for &v in lanes.iter().chain(&xs[n32..]) {
            if v > best {
                best = v;
            }
        }
        if best == f32::NEG_INFINITY {
            // Nothing beats -inf: the scalar loop never moves off index 0.
            return 0;
        }
        let bv = _mm256_set1_ps(best);
        let mut i = 0;
        while i + 8 <= n {
            let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(p.add(i)), bv));
            if eq != 0 {
                return i + eq.trailing_zeros() as usize;
            }
            i += 8;
        }
        i + xs[i..].iter().position(|&v| v == best).expect("the maximum is in the row")
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
        silu_mul_body::<false>(gate, up, out, n)
    }

    /// [`silu_mul`] with [`exp8_wide`] (the CPU must support AVX-512F).
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(crate) unsafe fn silu_mul_wide(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
        silu_mul_body::<true>(gate, up, out, n)
    }

    #[inline(always)]
    unsafe fn silu_mul_body<const WIDE: bool>(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
        let n8 = n / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let neg = _mm256_set1_ps(-0.0);
        for i in (0..n8).step_by(8) {
            let g = _mm256_loadu_ps(gate.add(i));
            let u = _mm256_loadu_ps(up.add(i));
            let e = exp8_in::<WIDE>(_mm256_xor_ps(g, neg));
            _mm256_storeu_ps(out.add(i), _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
        }
        silu_mul_portable(gate.add(n8), up.add(n8), out.add(n8), n - n8);
    }
}

/// `x += y`, elementwise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GeGLU against the reference formula `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))·u`: within
    /// the f16 rounding of the table (input and output), exact at the clamps.
    #[test]
    fn gelu_mul_follows_the_formula_through_f16() {
        let gate: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) / 150.0).collect();
        let up: Vec<f32> = (0..4001).map(|i| 1.0 + (i % 7) as f32 / 7.0).collect();
        let mut out = vec![0f32; gate.len()];
        gelu_mul_to(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            let x = g as f64;
            let want = 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()) * u as f64;
            if g <= -10.0 {
                assert_eq!(o, 0.0);
            } else if g >= 10.0 {
                assert_eq!(o, g * u);
            } else {
                // f16 input rounding moves gelu by at most |g'|·2⁻¹¹·|g| (|g'| < 1.13), and the
                // f16 output by 2⁻¹¹ of itself.
                let tol = (1.13 * x.abs() * u as f64 + want.abs()) / 2048.0 + 1e-6;
                assert!((o as f64 - want).abs() <= tol, "gelu({g})·{u} = {o}, want {want}");
            }
        }
    }


    #[test]
    fn exp_fast_is_accurate_and_vector_equals_scalar() {
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0467).collect();
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 88.0, -87.0, 88.37, -88.37, 100.0, -100.0, f32::INFINITY, f32::NEG_INFINITY]);
        for &x in &xs {
            let (got, want) = (exp_fast(x) as f64, (x as f64).exp());
            if (-87.0..=88.0).contains(&x) {
                // Correctly rounded: within half an f32 ulp of the true value.
                assert!(((got - want) / want).abs() <= 0.5 * f32::EPSILON as f64 * 1.0000001, "exp({x}) = {got}, want {want}");
                assert_eq!(exp_fast(x), want as f32, "exp({x}) is the correctly rounded value");
            }
        }
        assert_eq!(exp_fast(-110.0), 0.0);
        assert_eq!(exp_fast(100.0), f32::INFINITY);
        #[cfg(target_arch = "x86_64")]
        if crate::test_simd_paths("silu_mul / exp8") {
            let gate: Vec<f32> = xs.iter().map(|x| x * 0.25).collect();
            let up: Vec<f32> = (0..gate.len()).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut a, mut b, mut c) = (gate.clone(), gate.clone(), vec![f32::NAN; gate.len()]);
            let n = a.len();
            // SAFETY: each holds `n` values; in place is allowed.
            unsafe { silu_mul_portable(a.as_ptr(), up.as_ptr(), a.as_mut_ptr(), n) };
            // AVX2/FMA detected: the vector path, in place and into a separate output.
            silu_mul(&mut b, &up);
            silu_mul_to(&gate, &up, &mut c);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b));
            assert_eq!(bits(&a), bits(&c));
            // Each vector form by name (the calls above take the widest this CPU has).
            let mut d = vec![f32::NAN; n];
            // SAFETY: AVX2/FMA detected; each buffer holds `n` values.
            unsafe { avx2::silu_mul(gate.as_ptr(), up.as_ptr(), d.as_mut_ptr(), n) };
            assert_eq!(bits(&a), bits(&d), "256-bit exp");
            if crate::has_avx512vl() {
                let mut w = vec![f32::NAN; n];
                // SAFETY: AVX-512F detected as well; each buffer holds `n` values.
                unsafe { avx2::silu_mul_wide(gate.as_ptr(), up.as_ptr(), w.as_mut_ptr(), n) };
                assert_eq!(bits(&a), bits(&w), "512-bit exp");
            } else {
                eprintln!("silu_mul / exp8: the 512-bit exp was NOT exercised (no AVX-512F/VL on this CPU)");
            }
            for (i, &g) in gate.iter().enumerate().filter(|(_, g)| g.is_finite()) {
                let want = g as f64 / (1.0 + (-(g as f64)).exp()) * up[i] as f64;
                assert!((a[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "silu({g})");
            }
        }
    }

    #[test]
    fn argmax_is_the_first_largest_and_the_vector_form_agrees() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut rows: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN; 40],
            vec![f32::NEG_INFINITY; 33],
            vec![f32::NAN, f32::NEG_INFINITY, f32::NAN],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
            vec![-1.0, f32::NAN, -0.5, f32::INFINITY, 3.0, f32::INFINITY],
        ];
        for len in [1usize, 7, 8, 9, 31, 32, 33, 100, 49_152] {
            for _ in 0..4 {
                // Few distinct values, so ties (and signed zeros) are common; some NaNs.
                let row: Vec<f32> = (0..len)
                    .map(|_| match next() % 16 {
                        0 => f32::NAN,
                        1 => -0.0,
                        2 => 0.0,
                        r => (r as f32 - 9.0) * 0.5,
                    })
                    .collect();
                rows.push(row);
            }
            rows.push((0..len).map(|i| -(i as f32)).collect());
            rows.push((0..len).map(|i| i as f32).collect());
        }
        for row in &rows {
            let want = argmax_portable(row);
            if let Some(&w) = row.get(want) {
                assert!(row.iter().all(|&v| v.is_nan() || !(v > w)), "not the largest");
                assert!(row[..want].iter().all(|&v| v.is_nan() || v < w), "not the first");
            }
            assert_eq!(argmax(row), want, "row of {}", row.len());
        }
        #[cfg(target_arch = "x86_64")]
        assert!(crate::test_simd_paths("argmax") || !crate::has_avx2());
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..64).map(|i| 0.5 + i as f32 / 64.0).collect();
        let mut out = vec![0f32; 64];
        rms_norm_row(&x, &w, 1e-5, &mut out);
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 64.0;
        for i in 0..64 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5, "{i}");
        }
    }

    #[test]
    fn rope_styles_agree_under_permutation_and_preserve_norm() {
        let d = 8;
        let t = RopeTable::new(d, 16, 10000.0, RopeStyle::Interleaved);
        let h = RopeTable::new(d, 16, 10000.0, RopeStyle::HalfSplit);
        let x: Vec<f32> = (0..d).map(|i| i as f32 + 1.0).collect();
        // Interleaved layout of the half-split vector: [x0, x4, x1, x5, ...].
        let mut xi: Vec<f32> = (0..d).map(|j| if j % 2 == 0 { x[j / 2] } else { x[j / 2 + d / 2] }).collect();
        let mut xh = x.clone();
        t.apply(&mut xi, 5);
        h.apply(&mut xh, 5);
        for j in 0..d {
            let want = if j % 2 == 0 { xh[j / 2] } else { xh[j / 2 + d / 2] };
            assert!((xi[j] - want).abs() < 1e-5);
        }
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = xh.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
    }
}
