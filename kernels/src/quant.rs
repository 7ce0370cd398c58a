//! Weight formats and the matrix kernels that read them.
//!
//! Weights stay in their GGUF block layout (`Q4_0`, `Q4_1`, `Q8_0`) or as `F32`. For quantized
//! weights the activation rows are first quantized to 32-element int8 blocks ([`ActBlock`],
//! the Q8_1 scheme of llama.cpp and candle: scale `d`, and `s = d * Σq` for the offset formats),
//! then every output element is one integer-accumulated dot product per block, summed over the
//! blocks in order.
//!
//! **Batch invariance.** Output `y[i][j]` depends only on activation row `i` and weight row `j`,
//! and is computed by exactly one call of the same dot routine with a fixed reduction order. Work
//! is split over weight-row tiles whose size depends only on the weight shape, never on the batch.
//! So a row's result is bit-identical whatever else shares the batch, its position in it, or the
//! number of threads.
//!
//! **Batch efficiency.** A tile of weight rows is read once per call and dotted against every
//! activation row while it is hot in L1, so a batch of B rows costs far less than B mat-vecs.

use crate::pool::ThreadPool;
use crate::SyncPtr;
use half::f16;

/// Elements per quantization block for the 32-element formats.
pub const QK: usize = 32;

/// Supported weight storage formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl WeightFormat {
    /// Bytes per 32-element block (per element for F32 × 32).
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4 * QK,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
        }
    }
}

/// A weight matrix of `rows` output features by `cols` input features, row-major in blocks.
#[derive(Clone)]
pub struct Weight {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// Raw bytes: `rows * cols / 32` blocks in GGUF layout, or little-endian f32 for `F32`.
    pub data: Vec<u8>,
}

impl Weight {
    pub fn new(format: WeightFormat, rows: usize, cols: usize, data: Vec<u8>) -> Self {
        assert!(cols % QK == 0 || format == WeightFormat::F32, "cols {cols} not a multiple of {QK}");
        let want = if format == WeightFormat::F32 { rows * cols * 4 } else { rows * cols / QK * format.block_bytes() };
        assert_eq!(data.len(), want, "weight data size for {format:?} {rows}x{cols}");
        Weight { format, rows, cols, data }
    }

    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols);
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Weight::new(WeightFormat::F32, rows, cols, data)
    }

    fn row_bytes(&self) -> usize {
        match self.format {
            WeightFormat::F32 => self.cols * 4,
            f => self.cols / QK * f.block_bytes(),
        }
    }

    /// Dequantizes row `r` into `out` (length `cols`). Used for embeddings and tests.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let rb = self.row_bytes();
        let row = &self.data[r * rb..(r + 1) * rb];
        match self.format {
            WeightFormat::F32 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            WeightFormat::Q8_0 => {
                for (b, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                    let d = f16_at(b, 0);
                    for i in 0..QK {
                        o[i] = d * (b[2 + i] as i8) as f32;
                    }
                }
            }
            WeightFormat::Q4_0 => {
                for (b, o) in row.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
                    let d = f16_at(b, 0);
                    for i in 0..16 {
                        o[i] = d * ((b[2 + i] & 0xF) as i32 - 8) as f32;
                        o[i + 16] = d * ((b[2 + i] >> 4) as i32 - 8) as f32;
                    }
                }
            }
            WeightFormat::Q4_1 => {
                for (b, o) in row.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                    let d = f16_at(b, 0);
                    let m = f16_at(b, 2);
                    for i in 0..16 {
                        o[i] = d * (b[4 + i] & 0xF) as f32 + m;
                        o[i + 16] = d * (b[4 + i] >> 4) as f32 + m;
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One quantized activation block: `x[i] ≈ d * qs[i]`, and `s = d * Σ qs` (both rounded to f16).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ActBlock {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

/// Quantizes one activation row (length a multiple of 32) into `out` (length/32 blocks).
pub fn quantize_row(x: &[f32], out: &mut [ActBlock]) {
    assert_eq!(x.len(), out.len() * QK);
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let mut amax = 0f32;
        for &v in xb {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            let r = (v * id).round() as i32;
            *q = r as i8;
            sum += r;
        }
        // Scales are kept at f16 precision, as in ggml's and candle's Q8_0/Q8_1 blocks, so
        // results match those references (and llama.cpp) closely.
        let d16 = f16::from_f32(d);
        ob.d = d16.to_f32();
        ob.s = (f16::from_f32(sum as f32) * d16).to_f32();
    }
}

#[inline(always)]
fn dot_q8_0(w: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, ab) in w.chunks_exact(34).zip(a) {
        let mut sumi = 0i32;
        for i in 0..QK {
            sumi += (b[2 + i] as i8) as i32 * ab.qs[i] as i32;
        }
        acc += sumi as f32 * f16_at(b, 0) * ab.d;
    }
    acc
}

#[inline(always)]
fn dot_q4_0(w: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, ab) in w.chunks_exact(18).zip(a) {
        let mut sumi = 0i32;
        for i in 0..16 {
            let q = b[2 + i];
            sumi += ((q & 0xF) as i32 - 8) * ab.qs[i] as i32 + ((q >> 4) as i32 - 8) * ab.qs[i + 16] as i32;
        }
        acc += sumi as f32 * f16_at(b, 0) * ab.d;
    }
    acc
}

#[inline(always)]
fn dot_q4_1(w: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, ab) in w.chunks_exact(20).zip(a) {
        let mut sumi = 0i32;
        for i in 0..16 {
            let q = b[4 + i];
            sumi += (q & 0xF) as i32 * ab.qs[i] as i32 + (q >> 4) as i32 * ab.qs[i + 16] as i32;
        }
        acc += sumi as f32 * f16_at(b, 0) * ab.d + f16_at(b, 2) * ab.s;
    }
    acc
}

/// f32 dot product with eight independent lanes, reduced in a fixed tree order.
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn f32_row(bytes: &[u8]) -> &[f32] {
    // Weight data is built from f32 values in `Weight::from_f32` or loaded little-endian; on a
    // little-endian target reinterpretation is exact. Alignment is checked.
    crate::cast_f32(bytes)
}

/// Scratch space reused across calls so the decode loop does not allocate.
#[derive(Default)]
pub struct MatmulScratch {
    act: Vec<ActBlock>,
}

/// Rows of weights per task: a function of the weight shape only (never of the batch).
/// Activation rows from which the 8-row AVX2 kernel is used.
const ROWS8_MIN_BATCH: usize = 2;

fn tile_rows(w: &Weight) -> usize {
    let rb = w.row_bytes().max(1);
    // About 16 KiB of weights per task, between 8 and 64 rows, a multiple of 8 (the AVX2
    // kernel's row group). It depends only on the weight's shape (batch invariance).
    ((16384 / rb).clamp(8, 64) / 8) * 8
}

/// `y[b × rows] = x[b × cols] · Wᵀ` for `b = x.len() / cols` activation rows.
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], y: &mut [f32], scratch: &mut MatmulScratch) {
    let k = w.cols;
    let n = w.rows;
    assert_eq!(x.len() % k, 0);
    let b = x.len() / k;
    assert_eq!(y.len(), b * n);
    if b == 0 {
        return;
    }
    let quantized = w.format != WeightFormat::F32;
    if quantized {
        let nb = k / QK;
        scratch.act.resize(b * nb, ActBlock::default());
        for (xr, ar) in x.chunks_exact(k).zip(scratch.act.chunks_exact_mut(nb)) {
            quantize_row(xr, ar);
        }
    }
    let act: &[ActBlock] = &scratch.act;
    let tile = tile_rows(w);
    let n_tasks = n.div_ceil(tile);
    let yp = SyncPtr(y.as_mut_ptr());
    let use_avx2 = crate::has_avx2();
    pool.run(n_tasks, |t| {
        let r0 = t * tile;
        let r1 = (r0 + tile).min(n);
        // SAFETY: each task writes only columns r0..r1 of every output row, disjoint across
        // tasks, and `y` outlives `pool.run`.
        let y = unsafe { std::slice::from_raw_parts_mut(yp.get(), b * n) };
        #[cfg(target_arch = "x86_64")]
        if use_avx2 {
            // SAFETY: AVX2 and FMA were detected at run time.
            unsafe { tile_avx2(w, x, act, y, r0, r1, b) };
            return;
        }
        let _ = use_avx2;
        tile_portable(w, x, act, y, r0, r1, b);
    });
}

#[inline(always)]
fn tile_impl(w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize) {
    let k = w.cols;
    let n = w.rows;
    let rb = w.row_bytes();
    let nb = k / QK;
    for r in r0..r1 {
        let wr = &w.data[r * rb..(r + 1) * rb];
        match w.format {
            WeightFormat::F32 => {
                let wf = f32_row(wr);
                for i in 0..b {
                    y[i * n + r] = dot_f32(wf, &x[i * k..(i + 1) * k]);
                }
            }
            WeightFormat::Q8_0 => {
                for i in 0..b {
                    y[i * n + r] = dot_q8_0(wr, &act[i * nb..(i + 1) * nb]);
                }
            }
            WeightFormat::Q4_0 => {
                for i in 0..b {
                    y[i * n + r] = dot_q4_0(wr, &act[i * nb..(i + 1) * nb]);
                }
            }
            WeightFormat::Q4_1 => {
                for i in 0..b {
                    y[i * n + r] = dot_q4_1(wr, &act[i * nb..(i + 1) * nb]);
                }
            }
        }
    }
}

fn tile_portable(w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize) {
    tile_impl(w, x, act, y, r0, r1, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize) {
    let k = w.cols;
    let n = w.rows;
    let rb = w.row_bytes();
    let nb = k / QK;
    // Groups of 8 rows: lanes are rows, so each output accumulates in a vector lane. It pays
    // from 2 activation rows on; a single row (batch-1 decode, bandwidth-bound) reads each
    // weight row as one sequential stream instead. Both give bit-identical results.
    let mut r = r0;
    if w.format != WeightFormat::F32 && b >= ROWS8_MIN_BATCH {
        while r + 8 <= r1 {
            let w0 = w.data.as_ptr().add(r * rb);
            let out = y.as_mut_ptr().add(r);
            // SAFETY: rows r..r+8 exist (r + 8 <= r1 <= rows); `act` holds `b` rows of `nb`
            // blocks and `y` holds `b` rows of `n` (checked by `matmul`); AVX2/FMA/F16C are
            // enabled for this function.
            // SAFETY (VNNI arms): AVX-512 VNNI and VL were detected at run time.
            match (w.format, crate::has_vnni()) {
                (WeightFormat::Q4_1, true) => avx2::dot_rows8_vnni::<avx2::Q41>(w0, rb, act, nb, b, out, n),
                (WeightFormat::Q8_0, true) => avx2::dot_rows8_vnni::<avx2::Q80>(w0, rb, act, nb, b, out, n),
                (WeightFormat::Q4_0, true) => avx2::dot_rows8_vnni::<avx2::Q40>(w0, rb, act, nb, b, out, n),
                (WeightFormat::Q4_1, false) => avx2::dot_rows8::<avx2::Q41>(w0, rb, act, nb, b, out, n),
                (WeightFormat::Q8_0, false) => avx2::dot_rows8::<avx2::Q80>(w0, rb, act, nb, b, out, n),
                (WeightFormat::Q4_0, false) => avx2::dot_rows8::<avx2::Q40>(w0, rb, act, nb, b, out, n),
                (WeightFormat::F32, _) => unreachable!(),
            }
            r += 8;
        }
    }
    for r in r..r1 {
        let wr = &w.data[r * rb..(r + 1) * rb];
        // SAFETY (all arms): AVX2/FMA/F16C are enabled for this function; `act` holds `b`
        // rows of exactly `nb` blocks and `y` holds `b` rows of `n` (checked by `matmul`).
        let out = y.as_mut_ptr().add(r);
        match w.format {
            WeightFormat::Q4_1 => avx2::dot_rows::<avx2::Q41>(wr, act, nb, b, out, n),
            WeightFormat::Q8_0 => avx2::dot_rows::<avx2::Q80>(wr, act, nb, b, out, n),
            WeightFormat::Q4_0 => avx2::dot_rows::<avx2::Q40>(wr, act, nb, b, out, n),
            WeightFormat::F32 => {
                for i in 0..b {
                    y[i * n + r] = dot_f32(f32_row(wr), &x[i * k..(i + 1) * k]);
                }
            }
        }
    }
}

/// AVX2 block dot products. Each block's integer sum is exact, and the float arithmetic per
/// block is the portable code's, in the same order, so results are bit-identical to
/// `dot_q4_1` & co. (asserted by `avx2_equals_portable`).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{f16_at, ActBlock, QK};
    use std::arch::x86_64::*;

    /// The four lane-sums of `a`, `b`, `c`, `d`.
    #[inline(always)]
    unsafe fn hsum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> [i32; 4] {
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        let abcd = _mm256_hadd_epi32(ab, cd);
        let s = _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256::<1>(abcd));
        let mut out = [0i32; 4];
        _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, s);
        out
    }

    #[inline(always)]
    unsafe fn hsum1(a: __m256i) -> i32 {
        hsum4(a, a, a, a)[0]
    }

    /// u8 weights (0..15) × i8 activations → 8 i32 partial sums.
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> __m256i {
        let raw = _mm_loadu_si128(qs as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(raw, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), m);
        _mm256_set_m128i(hi, lo)
    }

    #[inline(always)]
    unsafe fn udot(w: __m256i, a: *const i8) -> __m256i {
        let av = _mm256_loadu_si256(a as *const __m256i);
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), _mm256_set1_epi16(1))
    }

    /// Signed × signed through the sign trick (|w| ≤ 128, |a| ≤ 127: no i16 saturation).
    #[inline(always)]
    unsafe fn sdot(w: __m256i, a: *const i8) -> __m256i {
        let av = _mm256_loadu_si256(a as *const __m256i);
        let aw = _mm256_sign_epi8(w, w);
        let sa = _mm256_sign_epi8(av, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1))
    }

    /// `udot` with AVX-512 VNNI: `vpdpbusd` sums the same 4 adjacent byte products into each i32
    /// lane as `maddubs` + `madd` do (no saturation either way for these formats), in one op.
    #[inline(always)]
    unsafe fn udot_v(w: __m256i, a: *const i8) -> __m256i {
        let av = _mm256_loadu_si256(a as *const __m256i);
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, av)
    }

    /// `sdot` with AVX-512 VNNI (the same sign trick).
    #[inline(always)]
    unsafe fn sdot_v(w: __m256i, a: *const i8) -> __m256i {
        let av = _mm256_loadu_si256(a as *const __m256i);
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w))
    }

    /// A quantized block format as the batched kernel sees it.
    pub trait Fmt {
        /// Bytes per block.
        const BB: usize;
        /// Whether blocks carry a min (`m` at byte 2), as Q4_1 does.
        const MIN: bool;
        /// The block's 32 quants as a vector (u8 for unsigned formats, i8 for signed).
        unsafe fn quants(p: *const u8) -> __m256i;
        /// The 8 integer partial sums of a block's quants against activation quants.
        unsafe fn isum(w: __m256i, a: *const i8) -> __m256i;
        /// The same sums with AVX-512 VNNI (only called where it was detected).
        unsafe fn isum_v(w: __m256i, a: *const i8) -> __m256i;
    }

    pub struct Q41;
    pub struct Q40;
    pub struct Q80;

    impl Fmt for Q41 {
        const BB: usize = 20;
        const MIN: bool = true;
        #[inline(always)]
        unsafe fn quants(p: *const u8) -> __m256i {
            nibbles(p.add(4))
        }
        #[inline(always)]
        unsafe fn isum(w: __m256i, a: *const i8) -> __m256i {
            udot(w, a)
        }
        #[inline(always)]
        unsafe fn isum_v(w: __m256i, a: *const i8) -> __m256i {
            udot_v(w, a)
        }
    }
    impl Fmt for Q40 {
        const BB: usize = 18;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn quants(p: *const u8) -> __m256i {
            _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8))
        }
        #[inline(always)]
        unsafe fn isum(w: __m256i, a: *const i8) -> __m256i {
            sdot(w, a)
        }
        #[inline(always)]
        unsafe fn isum_v(w: __m256i, a: *const i8) -> __m256i {
            sdot_v(w, a)
        }
    }
    impl Fmt for Q80 {
        const BB: usize = 34;
        const MIN: bool = false;
        #[inline(always)]
        unsafe fn quants(p: *const u8) -> __m256i {
            _mm256_loadu_si256(p.add(2) as *const __m256i)
        }
        #[inline(always)]
        unsafe fn isum(w: __m256i, a: *const i8) -> __m256i {
            sdot(w, a)
        }
        #[inline(always)]
        unsafe fn isum_v(w: __m256i, a: *const i8) -> __m256i {
            sdot_v(w, a)
        }
    }

    /// Lane sums of eight vectors, in order: `[Σv0, …, Σv7]` (exact integer adds).
    #[inline(always)]
    unsafe fn hsum8(v: &[__m256i; 8]) -> __m256i {
        let a = _mm256_hadd_epi32(v[0], v[1]);
        let b = _mm256_hadd_epi32(v[2], v[3]);
        let c = _mm256_hadd_epi32(v[4], v[5]);
        let d = _mm256_hadd_epi32(v[6], v[7]);
        let ab = _mm256_hadd_epi32(a, b);
        let cd = _mm256_hadd_epi32(c, d);
        let lo = _mm256_permute2x128_si256::<0x20>(ab, cd);
        let hi = _mm256_permute2x128_si256::<0x31>(ab, cd);
        _mm256_add_epi32(lo, hi)
    }

    /// Eight f16 values at `p + j * stride` as f32s.
    #[inline(always)]
    unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
        let h = |j: usize| i16::from_le_bytes([*p.add(j * stride), *p.add(j * stride + 1)]);
        _mm256_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7)))
    }

    /// One weight row against `b` activation rows, writing `out[i * stride]`.
    ///
    /// Weight blocks are decoded once per group of 8 and reused for up to 4 activation rows.
    /// Each (row, block) float term is computed in a vector lane with exactly the scalar code's
    /// operations and order (`sumi * d_w * d_a + m_w * s_a`, no fused multiply-add) and the
    /// terms are accumulated one by one in block order, so every result equals the portable
    /// path's bit for bit.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows<F: Fmt>(w: &[u8], acts: &[ActBlock], nb: usize, b: usize, out: *mut f32, stride: usize) {
        debug_assert_eq!(w.len(), nb * F::BB);
        debug_assert!(acts.len() >= b * nb);
        let wp = w.as_ptr();
        let groups = nb / 8;
        let mut i0 = 0;
        while i0 < b {
            let ib = (b - i0).min(4);
            let mut acc = [0f32; 4];
            for g in 0..groups {
                let base = wp.add(g * 8 * F::BB);
                let mut wv = [_mm256_setzero_si256(); 8];
                for (j, v) in wv.iter_mut().enumerate() {
                    *v = F::quants(base.add(j * F::BB));
                }
                let dw = f16x8(base, F::BB);
                let mw = if F::MIN { f16x8(base.add(2), F::BB) } else { _mm256_setzero_ps() };
                for (ii, acc) in acc.iter_mut().enumerate().take(ib) {
                    let a = &acts[(i0 + ii) * nb + g * 8..(i0 + ii) * nb + g * 8 + 8];
                    let mut p = [_mm256_setzero_si256(); 8];
                    for j in 0..8 {
                        p[j] = F::isum(wv[j], a[j].qs.as_ptr());
                    }
                    let sumi = _mm256_cvtepi32_ps(hsum8(&p));
                    let da = _mm256_setr_ps(a[0].d, a[1].d, a[2].d, a[3].d, a[4].d, a[5].d, a[6].d, a[7].d);
                    let mut t = _mm256_mul_ps(_mm256_mul_ps(sumi, dw), da);
                    if F::MIN {
                        let sa = _mm256_setr_ps(a[0].s, a[1].s, a[2].s, a[3].s, a[4].s, a[5].s, a[6].s, a[7].s);
                        t = _mm256_add_ps(t, _mm256_mul_ps(mw, sa));
                    }
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), t);
                    for l in lanes {
                        *acc += l;
                    }
                }
            }
            for (ii, acc) in acc.iter_mut().enumerate().take(ib) {
                for blk in groups * 8..nb {
                    let bw = &w[blk * F::BB..(blk + 1) * F::BB];
                    let ab = &acts[(i0 + ii) * nb + blk];
                    let sumi = hsum1(F::isum(F::quants(bw.as_ptr()), ab.qs.as_ptr()));
                    let mut term = sumi as f32 * f16_at(bw, 0) * ab.d;
                    if F::MIN {
                        term += f16_at(bw, 2) * ab.s;
                    }
                    *acc += term;
                }
                *out.add((i0 + ii) * stride) = *acc;
            }
            i0 += ib;
        }
    }

    /// Eight weight rows (`w0 + r * rb`, r = 0..8) against `b` activation rows, writing
    /// `out[i * stride + r]`.
    ///
    /// Lanes are the 8 rows. For each block, the rows' integer sums come out of one `hsum8`, the
    /// float term is formed with the scalar code's operations (`sumi * d_w * d_a + m_w * s_a`,
    /// no fused multiply-add), and each lane adds its term to its own accumulator. So every
    /// output still accumulates its blocks one by one in block order — bit-identical to the
    /// portable path — while the adds of 8 outputs run as one vector add instead of 8 dependent
    /// scalar adds. Each block's 8 weight vectors are decoded once for up to 4 activation rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows8<F: Fmt>(w0: *const u8, rb: usize, acts: &[ActBlock], nb: usize, b: usize, out: *mut f32, stride: usize) {
        rows8_body::<F, false>(w0, rb, acts, nb, b, out, stride)
    }

    /// [`dot_rows8`] with AVX-512 VNNI integer dot products (bit-identical results).
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn dot_rows8_vnni<F: Fmt>(w0: *const u8, rb: usize, acts: &[ActBlock], nb: usize, b: usize, out: *mut f32, stride: usize) {
        rows8_body::<F, true>(w0, rb, acts, nb, b, out, stride)
    }

    #[inline(always)]
    unsafe fn rows8_body<F: Fmt, const V: bool>(w0: *const u8, rb: usize, acts: &[ActBlock], nb: usize, b: usize, out: *mut f32, stride: usize) {
        debug_assert!(acts.len() >= b * nb);
        debug_assert!(rb == nb * F::BB);
        let mut i0 = 0;
        while i0 < b {
            let ib = (b - i0).min(4);
            let mut acc = [_mm256_setzero_ps(); 4];
            for j in 0..nb {
                let base = w0.add(j * F::BB);
                let mut wv = [_mm256_setzero_si256(); 8];
                for (r, v) in wv.iter_mut().enumerate() {
                    *v = F::quants(base.add(r * rb));
                }
                let dw = f16x8(base, rb);
                let mw = if F::MIN { f16x8(base.add(2), rb) } else { _mm256_setzero_ps() };
                for (ii, acc) in acc.iter_mut().enumerate().take(ib) {
                    let a = &acts[(i0 + ii) * nb + j];
                    let qa = a.qs.as_ptr();
                    let dot = |w: __m256i| if V { F::isum_v(w, qa) } else { F::isum(w, qa) };
                    let p = [dot(wv[0]), dot(wv[1]), dot(wv[2]), dot(wv[3]), dot(wv[4]), dot(wv[5]), dot(wv[6]), dot(wv[7])];
                    let sumi = _mm256_cvtepi32_ps(hsum8(&p));
                    let mut t = _mm256_mul_ps(_mm256_mul_ps(sumi, dw), _mm256_set1_ps(a.d));
                    if F::MIN {
                        t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a.s)));
                    }
                    *acc = _mm256_add_ps(*acc, t);
                }
            }
            for (ii, acc) in acc.iter().enumerate().take(ib) {
                _mm256_storeu_ps(out.add((i0 + ii) * stride), *acc);
            }
            i0 += ib;
        }
    }

    const _: () = assert!(QK == 32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn quantize_weight(format: WeightFormat, rows: usize, cols: usize, v: &[f32]) -> Weight {
        let mut data = Vec::new();
        for blk in v.chunks_exact(QK) {
            let amax = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
            match format {
                WeightFormat::Q8_0 => {
                    let d = amax / 127.0;
                    data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    for x in blk {
                        data.push(((x / d).round() as i8) as u8);
                    }
                }
                WeightFormat::Q4_0 => {
                    let d = amax / 8.0;
                    data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    for i in 0..16 {
                        let q = |x: f32| (((x / d) + 8.5) as i32).clamp(0, 15) as u8;
                        data.push(q(blk[i]) | (q(blk[i + 16]) << 4));
                    }
                }
                WeightFormat::Q4_1 => {
                    let mn = blk.iter().cloned().fold(f32::MAX, f32::min);
                    let mx = blk.iter().cloned().fold(f32::MIN, f32::max);
                    let d = (mx - mn) / 15.0;
                    data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    data.extend_from_slice(&f16::from_f32(mn).to_bits().to_le_bytes());
                    for i in 0..16 {
                        let q = |x: f32| (((x - mn) / d + 0.5) as i32).clamp(0, 15) as u8;
                        data.push(q(blk[i]) | (q(blk[i + 16]) << 4));
                    }
                }
                WeightFormat::F32 => unreachable!(),
            }
        }
        Weight::new(format, rows, cols, data)
    }

    /// Reference: dequantize the weights, use the f32 activations, accumulate in f64.
    fn reference(w: &Weight, x: &[f32], b: usize) -> Vec<f32> {
        let mut row = vec![0f32; w.cols];
        let mut y = vec![0f32; b * w.rows];
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            for i in 0..b {
                let xr = &x[i * w.cols..(i + 1) * w.cols];
                y[i * w.rows + r] = row.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_equals_portable() {
        if !crate::has_avx2() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1] {
            for cols in [32usize, 96, 160, 256, 576, 1536] {
                let nb = cols / QK;
                let w = quantize_weight(format, 11, cols, &rand_vec(&mut rng, 11 * cols));
                for b in [1usize, 3, 4, 5, 9] {
                    let x = rand_vec(&mut rng, b * cols);
                    let mut act = vec![ActBlock::default(); b * nb];
                    for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(nb)) {
                        quantize_row(xr, ar);
                    }
                    let rb = w.row_bytes();
                    // Rows 3..11 as one group of 8 (lanes = rows), against the scalar code.
                    let mut fast8 = vec![0f32; b * 8];
                    // SAFETY: AVX2/FMA/F16C detected above; rows 3..11 exist; `fast8` holds b rows of 8.
                    unsafe {
                        let w0 = w.data.as_ptr().add(3 * rb);
                        match format {
                            WeightFormat::Q8_0 => avx2::dot_rows8::<avx2::Q80>(w0, rb, &act, nb, b, fast8.as_mut_ptr(), 8),
                            WeightFormat::Q4_0 => avx2::dot_rows8::<avx2::Q40>(w0, rb, &act, nb, b, fast8.as_mut_ptr(), 8),
                            _ => avx2::dot_rows8::<avx2::Q41>(w0, rb, &act, nb, b, fast8.as_mut_ptr(), 8),
                        }
                    }
                    if crate::has_vnni() {
                        let mut v8 = vec![0f32; b * 8];
                        // SAFETY: VNNI detected; same bounds as above.
                        unsafe {
                            let w0 = w.data.as_ptr().add(3 * rb);
                            match format {
                                WeightFormat::Q8_0 => avx2::dot_rows8_vnni::<avx2::Q80>(w0, rb, &act, nb, b, v8.as_mut_ptr(), 8),
                                WeightFormat::Q4_0 => avx2::dot_rows8_vnni::<avx2::Q40>(w0, rb, &act, nb, b, v8.as_mut_ptr(), 8),
                                _ => avx2::dot_rows8_vnni::<avx2::Q41>(w0, rb, &act, nb, b, v8.as_mut_ptr(), 8),
                            }
                        }
                        let a: Vec<u32> = fast8.iter().map(|x| x.to_bits()).collect();
                        let c: Vec<u32> = v8.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(a, c, "vnni {format:?} cols {cols} b {b}");
                    }
                    for r in 0..8 {
                        let wr = &w.data[(3 + r) * rb..(4 + r) * rb];
                        for i in 0..b {
                            let a = &act[i * nb..(i + 1) * nb];
                            let slow = match format {
                                WeightFormat::Q8_0 => dot_q8_0(wr, a),
                                WeightFormat::Q4_0 => dot_q4_0(wr, a),
                                _ => dot_q4_1(wr, a),
                            };
                            assert_eq!(fast8[i * 8 + r].to_bits(), slow.to_bits(), "rows8 {format:?} cols {cols} b {b} row {r} act {i}");
                        }
                    }
                    for r in 0..3 {
                        let wr = &w.data[r * rb..(r + 1) * rb];
                        let mut fast = vec![0f32; b];
                        // SAFETY: AVX2/FMA/F16C detected above; `act` has b rows of nb blocks.
                        unsafe {
                            match format {
                                WeightFormat::Q8_0 => avx2::dot_rows::<avx2::Q80>(wr, &act, nb, b, fast.as_mut_ptr(), 1),
                                WeightFormat::Q4_0 => avx2::dot_rows::<avx2::Q40>(wr, &act, nb, b, fast.as_mut_ptr(), 1),
                                _ => avx2::dot_rows::<avx2::Q41>(wr, &act, nb, b, fast.as_mut_ptr(), 1),
                            }
                        }
                        for i in 0..b {
                            let a = &act[i * nb..(i + 1) * nb];
                            let slow = match format {
                                WeightFormat::Q8_0 => dot_q8_0(wr, a),
                                WeightFormat::Q4_0 => dot_q4_0(wr, a),
                                _ => dot_q4_1(wr, a),
                            };
                            assert_eq!(fast[i].to_bits(), slow.to_bits(), "{format:?} cols {cols} b {b} row {r} act {i}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_matches_reference_and_is_batch_invariant() {
        let pool = ThreadPool::new(2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for format in [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1] {
            for &(rows, cols) in &[(1usize, 32usize), (7, 64), (130, 96), (576, 576)] {
                let wv = rand_vec(&mut rng, rows * cols);
                let w = if format == WeightFormat::F32 {
                    Weight::from_f32(rows, cols, &wv)
                } else {
                    quantize_weight(format, rows, cols, &wv)
                };
                for &b in &[1usize, 3, 8] {
                    let x = rand_vec(&mut rng, b * cols);
                    let mut y = vec![0f32; b * rows];
                    let mut scratch = MatmulScratch::default();
                    matmul(&pool, &w, &x, &mut y, &mut scratch);
                    let want = reference(&w, &x, b);
                    // Activation quantization to int8 bounds the error relative to the row norm.
                    for i in 0..b * rows {
                        let tol = if format == WeightFormat::F32 { 1e-4 } else { 0.02 * (cols as f32).sqrt() };
                        assert!((y[i] - want[i]).abs() <= tol, "{format:?} {rows}x{cols} b={b} i={i}: {} vs {}", y[i], want[i]);
                    }
                    // Each row alone gives bit-identical results (ragged batches included).
                    for i in 0..b {
                        let mut y1 = vec![0f32; rows];
                        matmul(&pool, &w, &x[i * cols..(i + 1) * cols], &mut y1, &mut scratch);
                        assert_eq!(&y[i * rows..(i + 1) * rows], &y1[..], "{format:?} row {i} of {b}");
                    }
                }
            }
        }
    }
}

impl Weight {
    /// Stacks weights with the same format and column count into one (rows concatenated), so
    /// that e.g. Q, K and V projections run as a single matmul.
    pub fn concat_rows(parts: &[&Weight]) -> Option<Weight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Some(Weight::new(first.format, rows, first.cols, data))
    }
}
