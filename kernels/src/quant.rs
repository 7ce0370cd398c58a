//! Weight formats and the matrix kernels that read them.
//!
//! Quantized weights (`Q4_0`, `Q4_1`, `Q8_0`) keep GGUF's 32-element blocks and their f16
//! scales, but are **repacked at load into 8-row panels** (below); `F32` stays row-major. For
//! quantized weights the activation rows are first quantized to 32-element int8 blocks
//! ([`ActBlock`], the Q8_1 scheme of llama.cpp and candle: scale `d`, and `s = d * Σq` for the
//! offset formats), then every output element is one integer-accumulated dot product per block,
//! summed over the blocks in order.
//!
//! **Panels.** Rows `8p..8p+8` form panel `p`; within it, block `j` of all 8 rows is stored
//! together as `[8 × f16 d][8 × f16 m, Q4_1 only][quants]`, the same bytes per block as GGUF.
//! The quants are interleaved so that one 32-byte vector holds *4 consecutive elements of each
//! of the 8 rows* (lane `r` = row `r`): one `vpdpbusd` (or `pmaddubsw` + `pmaddwd`) against the
//! matching 4 activation bytes broadcast to every lane adds those 4 products into each row's
//! lane. Eight such vectors cover a block, so a block's 8 exact integer row sums come out in
//! 8 lanes with no horizontal reduction, and the 8 scales load as one vector. 4-bit quants
//! pack two element groups per byte (low nibble: group `2q`, high: `2q + 1`); `Q8_0` quants are
//! stored offset by 128 (as unsigned bytes) and the offset is taken back out exactly with the
//! activation block's integer sum, as is `Q4_0`'s 8.
//!
//! **Batch invariance.** Output `y[i][j]` depends only on activation row `i` and weight row `j`,
//! and is computed with the same operations in the same order (exact integer block sums, then
//! `sumi * d_w * d_a + m_w * s_a` per block, added in block order) whatever the batch. Work is
//! split over weight-row tiles whose size depends only on the weight shape, never on the batch.
//! So a row's result is bit-identical whatever else shares the batch, its position in it, or the
//! number of threads — and bit-identical to the scalar reference code (tested).
//!
//! **Batch efficiency.** A tile of weight panels (about 32 KiB) stays in L1/L2 while a chunk of up
//! to 8 activation rows is dotted against it; each block's quants are decoded once per chunk.

use crate::pool::ThreadPool;
use crate::SyncPtr;
use half::f16;

/// Elements per quantization block for the 32-element formats.
pub const QK: usize = 32;
/// Elements per GGUF K-quant super-block.
pub const QK_K: usize = 256;
/// Rows per panel.
pub const PANEL: usize = 8;

/// Supported weight storage formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
    /// GGUF's `Q4_K`, repacked: 32-element blocks of 4-bit quants with an f32 scale and min
    /// each (the exact products of the super-block's f16 `d`/`dmin` and 6-bit sub-scales).
    Q4K,
    /// GGUF's `Q6_K`, repacked: 32-element blocks of 6-bit quants (offset 32) with an f32 scale
    /// per 16 elements (the exact product of the super-block's f16 `d` and an int8 sub-scale).
    Q6K,
}

impl WeightFormat {
    /// Bytes per 32-element block (per element for F32 × 32).
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4 * QK,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4K => 24,
            WeightFormat::Q6K => 40,
        }
    }

    /// Bytes of one scale (f16 for the GGUF 32-element formats, f32 for the repacked K-quants).
    fn scale_bytes(self) -> usize {
        match self {
            WeightFormat::Q4K | WeightFormat::Q6K => 4,
            _ => 2,
        }
    }

    /// Whether a block carries a second scale array (Q4_1/Q4K: the min; Q6K: the upper half's
    /// scale).
    fn two_scales(self) -> bool {
        matches!(self, WeightFormat::Q4_1 | WeightFormat::Q4K | WeightFormat::Q6K)
    }

    /// Whether quants are stored one per byte (else two per byte).
    fn byte_codes(self) -> bool {
        matches!(self, WeightFormat::Q8_0 | WeightFormat::Q6K)
    }

    /// What a stored code is above the quant it stands for.
    fn code_offset(self) -> i32 {
        match self {
            WeightFormat::Q4_0 => 8,
            WeightFormat::Q8_0 => 128,
            WeightFormat::Q6K => 32,
            _ => 0,
        }
    }

    /// Offset of the quants within a panel block (after the 8 `d`s, and the 8 `m`s for Q4_1).
    fn quant_offset(self) -> usize {
        PANEL * self.scale_bytes() * if self.two_scales() { 2 } else { 1 }
    }
}

/// A weight matrix of `rows` output features by `cols` input features.
#[derive(Clone)]
pub struct Weight {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// `F32`: row-major little-endian f32. Quantized: `rows.div_ceil(8)` panels (module docs);
    /// the padding rows of the last panel have zero scales.
    data: Vec<u8>,
}

/// One block of one row, decoded: scale, second scale (Q4_1/Q4K: the min; Q6K: the scale of
/// elements 16..32; else 0) and the 32 integer quants.
struct BlockView {
    d: f32,
    m: f32,
    q: [i32; QK],
}

impl Weight {
    /// A weight from GGUF-layout bytes (`rows * cols / 32` blocks, row-major; or f32 for `F32`).
    pub fn new(format: WeightFormat, rows: usize, cols: usize, gguf: Vec<u8>) -> Self {
        assert!(cols.is_multiple_of(QK) || format == WeightFormat::F32, "cols {cols} not a multiple of {QK}");
        assert!(!matches!(format, WeightFormat::Q4K | WeightFormat::Q6K), "K-quants load through from_q4_k / from_q6_k");
        let want = if format == WeightFormat::F32 { rows * cols * 4 } else { rows * cols / QK * format.block_bytes() };
        assert_eq!(gguf.len(), want, "weight data size for {format:?} {rows}x{cols}");
        if format == WeightFormat::F32 {
            return Weight { format, rows, cols, data: gguf };
        }
        let nb = cols / QK;
        let bb = format.block_bytes();
        let mut w = Weight::empty(format, rows, cols);
        for r in 0..rows {
            for j in 0..nb {
                let src = &gguf[(r * nb + j) * bb..(r * nb + j + 1) * bb];
                let (d, m, codes) = match format {
                    WeightFormat::Q4_1 => ([src[0], src[1]], [src[2], src[3]], nibble_codes(&src[4..20])),
                    WeightFormat::Q4_0 => ([src[0], src[1]], [0, 0], nibble_codes(&src[2..18])),
                    _ => {
                        let mut c = [0u8; QK];
                        for (c, &b) in c.iter_mut().zip(&src[2..34]) {
                            *c = b ^ 0x80;
                        }
                        ([src[0], src[1]], [0, 0], c)
                    }
                };
                w.set_block(r, j, &d, &m, &codes);
            }
        }
        w
    }

    /// Zeroed panels for `rows` × `cols` (padding rows stay zero-scaled).
    fn empty(format: WeightFormat, rows: usize, cols: usize) -> Self {
        let nb = cols / QK;
        let mut w = Weight { format, rows, cols, data: vec![0u8; rows.div_ceil(PANEL) * PANEL * nb * format.block_bytes()] };
        if format == WeightFormat::Q8_0 {
            // Stored quants are offset by 128: the padding rows' zeros are code 0x80.
            for p in 0..rows.div_ceil(PANEL) {
                for j in 0..nb {
                    let at = w.panel_block(p, j) + format.quant_offset();
                    w.data[at..at + PANEL * QK].fill(0x80);
                }
            }
        }
        w
    }

    /// A weight from GGUF `Q4_K` bytes (`rows × cols / 256` super-blocks of 144 bytes: f16 `d`,
    /// f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants), repacked as
    /// [`WeightFormat::Q4K`]. Dequantized values are bit-identical to ggml's.
    pub fn from_q4_k(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        assert!(cols.is_multiple_of(QK_K), "Q4_K needs cols a multiple of {QK_K}, got {cols}");
        assert_eq!(bytes.len(), rows * cols / QK_K * 144, "Q4_K data size for {rows}x{cols}");
        let mut w = Weight::empty(WeightFormat::Q4K, rows, cols);
        for (sb, b) in bytes.chunks_exact(144).enumerate() {
            let (r, s0) = (sb / (cols / QK_K), sb % (cols / QK_K) * (QK_K / QK));
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let (sc, qs) = (&b[4..16], &b[16..144]);
            for j in 0..8 {
                // ggml's get_scale_min_k4.
                let (s, m) = if j < 4 {
                    (sc[j] & 63, sc[j + 4] & 63)
                } else {
                    ((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))
                };
                // Sub-block j: nibble (j % 2) of bytes 32·(j / 2) .. +32.
                let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                let codes: [u8; QK] = std::array::from_fn(|l| if j % 2 == 0 { q[l] & 0xF } else { q[l] >> 4 });
                // d·sc and dmin·m are exact in f32 (11 × 6 significant bits); ggml computes
                // `d1 * q - m1`, which equals `d1 * q + (-m1)`.
                let (d1, m1) = (d * s as f32, -(dmin * m as f32));
                w.set_block(r, s0 + j, &d1.to_le_bytes(), &m1.to_le_bytes(), &codes);
            }
        }
        w
    }

    /// A weight from GGUF `Q6_K` bytes (`rows × cols / 256` super-blocks of 210 bytes: 128
    /// bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, f16 `d`), repacked as
    /// [`WeightFormat::Q6K`]. Dequantized values are bit-identical to ggml's.
    pub fn from_q6_k(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        assert!(cols.is_multiple_of(QK_K), "Q6_K needs cols a multiple of {QK_K}, got {cols}");
        assert_eq!(bytes.len(), rows * cols / QK_K * 210, "Q6_K data size for {rows}x{cols}");
        let mut w = Weight::empty(WeightFormat::Q6K, rows, cols);
        for (sb, b) in bytes.chunks_exact(210).enumerate() {
            let (r, s0) = (sb / (cols / QK_K), sb % (cols / QK_K) * (QK_K / QK));
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            // ggml's dequantize_row_q6_K: element e = 128·n + 32·quarter + l.
            let code = |e: usize| -> u8 {
                let (n, quarter, l) = (e / 128, e % 128 / 32, e % 32);
                let (lo, h) = (ql[64 * n + l + 32 * (quarter % 2)], qh[32 * n + l]);
                let low = if quarter < 2 { lo & 0xF } else { lo >> 4 };
                low | (((h >> (2 * quarter)) & 3) << 4)
            };
            for j in 0..8 {
                let codes: [u8; QK] = std::array::from_fn(|k| code(32 * j + k));
                // `d * sc` is exact in f32 (11 × 8 significant bits), as ggml's `d * sc[is]`.
                let (dlo, dhi) = (d * sc[2 * j] as i8 as f32, d * sc[2 * j + 1] as i8 as f32);
                w.set_block(r, s0 + j, &dlo.to_le_bytes(), &dhi.to_le_bytes(), &codes);
            }
        }
        w
    }

    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols);
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Weight::new(WeightFormat::F32, rows, cols, data)
    }

    /// Bytes held (padding included).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
        match self.format {
            WeightFormat::F32 => self.cols * 4,
            f => self.cols / QK * f.block_bytes(),
        }
    }

    /// Byte offset of block `j` of panel `p`.
    fn panel_block(&self, p: usize, j: usize) -> usize {
        let pb = PANEL * self.format.block_bytes();
        p * (self.cols / QK) * pb + j * pb
    }

    /// Where the stored code of element `k` of lane `r` lives: (byte offset in the quants, shift).
    fn code_at(&self, r: usize, k: usize) -> (usize, u32) {
        let (g, e) = (k / 4, k % 4);
        if self.format.byte_codes() {
            (g * 32 + r * 4 + e, 0)
        } else {
            ((g / 2) * 32 + r * 4 + e, 4 * (g % 2) as u32)
        }
    }

    /// Writes block `j` of row `r`: raw scale bytes (`scale_bytes` each) and stored codes.
    fn set_block(&mut self, r: usize, j: usize, d: &[u8], m: &[u8], codes: &[u8; QK]) {
        let (p, lane) = (r / PANEL, r % PANEL);
        let at = self.panel_block(p, j);
        let sb = self.format.scale_bytes();
        self.data[at + sb * lane..at + sb * (lane + 1)].copy_from_slice(&d[..sb]);
        if self.format.two_scales() {
            let m0 = at + PANEL * sb;
            self.data[m0 + sb * lane..m0 + sb * (lane + 1)].copy_from_slice(&m[..sb]);
        }
        let q0 = at + self.format.quant_offset();
        for (k, &c) in codes.iter().enumerate() {
            let (o, sh) = self.code_at(lane, k);
            if self.format.byte_codes() {
                self.data[q0 + o] = c;
            } else {
                self.data[q0 + o] |= c << sh;
            }
        }
    }

    /// The stored codes of block `j` of row `r` (quant + `code_offset`) and the raw bytes of its
    /// scales (`scale_bytes` each; the second is zero where there is none).
    fn codes(&self, r: usize, j: usize) -> ([u8; 4], [u8; 4], [u8; QK]) {
        let (p, lane) = (r / PANEL, r % PANEL);
        let at = self.panel_block(p, j);
        let sb = self.format.scale_bytes();
        let (mut d, mut m) = ([0u8; 4], [0u8; 4]);
        d[..sb].copy_from_slice(&self.data[at + sb * lane..at + sb * (lane + 1)]);
        if self.format.two_scales() {
            let m0 = at + PANEL * sb;
            m[..sb].copy_from_slice(&self.data[m0 + sb * lane..m0 + sb * (lane + 1)]);
        }
        let q0 = at + self.format.quant_offset();
        let mut c = [0u8; QK];
        for (k, c) in c.iter_mut().enumerate() {
            let (o, sh) = self.code_at(lane, k);
            *c = if self.format.byte_codes() { self.data[q0 + o] } else { (self.data[q0 + o] >> sh) & 0xF };
        }
        (d, m, c)
    }

    fn block(&self, r: usize, j: usize) -> BlockView {
        let (d, m, c) = self.codes(r, j);
        let scale = |b: [u8; 4]| if self.format.scale_bytes() == 4 { f32::from_le_bytes(b) } else { f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() };
        let off = self.format.code_offset();
        BlockView { d: scale(d), m: scale(m), q: c.map(|c| c as i32 - off) }
    }

    /// The weight in GGUF layout again (lossless). Not for the repacked K-quants, whose
    /// 32-element blocks have no GGUF form.
    pub fn to_gguf(&self) -> Vec<u8> {
        assert!(!matches!(self.format, WeightFormat::Q4K | WeightFormat::Q6K), "no GGUF form for {:?}", self.format);
        if self.format == WeightFormat::F32 {
            return self.data.clone();
        }
        let nb = self.cols / QK;
        let mut out = Vec::with_capacity(self.rows * self.row_bytes());
        for r in 0..self.rows {
            for j in 0..nb {
                let (d, m, c) = self.codes(r, j);
                out.extend_from_slice(&d[..2]);
                match self.format {
                    WeightFormat::Q8_0 => out.extend(c.iter().map(|c| c ^ 0x80)),
                    f => {
                        if f == WeightFormat::Q4_1 {
                            out.extend_from_slice(&m[..2]);
                        }
                        out.extend((0..16).map(|i| c[i] | (c[i + 16] << 4)));
                    }
                }
            }
        }
        out
    }

    /// Dequantizes row `r` into `out` (length `cols`). Used for embeddings and tests.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        assert!(r < self.rows);
        if self.format == WeightFormat::F32 {
            let rb = self.row_bytes();
            for (o, c) in out.iter_mut().zip(self.data[r * rb..(r + 1) * rb].chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            return;
        }
        for (j, o) in out.chunks_exact_mut(QK).enumerate() {
            let b = self.block(r, j);
            for (k, (o, &q)) in o.iter_mut().zip(&b.q).enumerate() {
                *o = match self.format {
                    WeightFormat::Q4_1 | WeightFormat::Q4K => b.d * q as f32 + b.m,
                    WeightFormat::Q6K if k >= QK / 2 => b.m * q as f32,
                    _ => b.d * q as f32,
                };
            }
        }
    }

    /// Stacks weights with the same format and column count into one (rows concatenated), so
    /// that e.g. Q, K and V projections run as a single matmul.
    pub fn concat_rows(parts: &[&Weight]) -> Option<Weight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        if first.format == WeightFormat::F32 || parts.iter().all(|p| p.rows.is_multiple_of(PANEL)) {
            // Whole panels (or row-major f32): the bytes simply follow each other.
            let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
            return Some(Weight { format: first.format, rows, cols: first.cols, data });
        }
        if matches!(first.format, WeightFormat::Q4K | WeightFormat::Q6K) {
            return None;
        }
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.rows * p.row_bytes()).sum());
        for p in parts {
            data.extend_from_slice(&p.to_gguf());
        }
        Some(Weight::new(first.format, rows, first.cols, data))
    }
}

/// The little-endian f16 at `b[at..at + 2]`, as f32.
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 32 codes of a 4-bit GGUF block's 16 bytes (element `i` low nibble, `i + 16` high).
fn nibble_codes(qs: &[u8]) -> [u8; QK] {
    let mut c = [0u8; QK];
    for i in 0..16 {
        c[i] = qs[i] & 0xF;
        c[i + 16] = qs[i] >> 4;
    }
    c
}

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

fn quantize_row_portable(x: &[f32], out: &mut [ActBlock]) {
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
fn set_scales(ob: &mut ActBlock, d: f32, sum: i32, sum_lo: i32) {
    let d16 = f16::from_f32(d);
    ob.d = d16.to_f32();
    ob.s = (f16::from_f32(sum as f32) * d16).to_f32();
    ob.sum = sum;
    ob.sum_lo = sum_lo;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [ActBlock]) {
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

/// The scalar reference: row `r` of `w` against one quantized activation row. Exactly the
/// arithmetic of candle's and ggml's `vec_dot` for these formats (per block: exact integer sum,
/// then `sumi * d_w * d_a (+ m_w * s_a)`, accumulated in block order).
fn dot_block_row(w: &Weight, r: usize, a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (j, ab) in a.iter().enumerate() {
        let b = w.block(r, j);
        let term = if w.format == WeightFormat::Q6K {
            // Two 16-element halves with their own scales: `(Σlo·d_lo + Σhi·d_hi) · d_a`.
            let half = |h: std::ops::Range<usize>| h.map(|k| b.q[k] * ab.qs[k] as i32).sum::<i32>() as f32;
            (half(0..QK / 2) * b.d + half(QK / 2..QK) * b.m) * ab.d
        } else {
            let mut sumi = 0i32;
            for (q, &x) in b.q.iter().zip(&ab.qs) {
                sumi += q * x as i32;
            }
            let mut term = sumi as f32 * b.d * ab.d;
            if matches!(w.format, WeightFormat::Q4_1 | WeightFormat::Q4K) {
                term += b.m * ab.s;
            }
            term
        };
        acc += term;
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
    x: Vec<f32>,
}

/// Rows of weights per task: a function of the weight shape only (never of the batch).
fn tile_rows(w: &Weight) -> usize {
    let rb = w.row_bytes().max(1);
    // About 32 KiB of weights per task, between 8 and 128 rows, a multiple of 8 (whole panels):
    // fewer, larger tasks than 16 KiB measured faster at batch 1 (task claiming costs a shared
    // atomic per task) and no slower batched.
    // It depends only on the weight's shape (batch invariance).
    ((32768 / rb).clamp(8, 128) / PANEL) * PANEL
}

/// `y[b × rows] = x[b × cols] · Wᵀ` for `b = x.len() / cols` activation rows.
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], y: &mut [f32], scratch: &mut MatmulScratch) {
    let k = w.cols;
    assert_eq!(x.len() % k, 0);
    let b = x.len() / k;
    if w.format == WeightFormat::F32 {
        return multiply(pool, w, x, b, y, &[]);
    }
    let nb = k / QK;
    scratch.act.resize(b * nb, ActBlock::default());
    let ap = ActPtr(scratch.act.as_mut_ptr());
    pool.run(row_tasks(pool, b), |t| {
        for i in row_range(pool, b, t) {
            // SAFETY: task t writes only the blocks of its own rows, disjoint across tasks;
            // `scratch.act` holds b * nb blocks and outlives `pool.run`.
            let a = unsafe { std::slice::from_raw_parts_mut(ap.get().add(i * nb), nb) };
            quantize_row(&x[i * k..(i + 1) * k], a);
        }
    });
    multiply(pool, w, x, b, y, &scratch.act);
}

/// `y = X · Wᵀ` where row `i` of the `b × cols` matrix `X` is written by `row(i, out)`: the rows
/// are produced (and quantized, for quantized weights) in parallel on the pool, then
/// multiplied. This fuses per-row work that feeds a projection (RMSNorm, SiLU·mul) into the
/// projection's activation quantization, in parallel instead of on the calling thread.
pub fn matmul_rows<R: Fn(usize, &mut [f32]) + Sync>(pool: &ThreadPool, w: &Weight, b: usize, y: &mut [f32], scratch: &mut MatmulScratch, row: R) {
    let k = w.cols;
    let nb = k / QK;
    let quantized = w.format != WeightFormat::F32;
    scratch.x.resize(b * k, 0.0);
    if quantized {
        scratch.act.resize(b * nb, ActBlock::default());
    }
    let (xp, ap) = (SyncPtr(scratch.x.as_mut_ptr()), ActPtr(scratch.act.as_mut_ptr()));
    pool.run(row_tasks(pool, b), |t| {
        for i in row_range(pool, b, t) {
            // SAFETY: task t writes only row i's slices of `x` and `act` for its own rows,
            // disjoint across tasks; both hold b rows and outlive `pool.run`.
            let xr = unsafe { std::slice::from_raw_parts_mut(xp.get().add(i * k), k) };
            row(i, xr);
            if quantized {
                let a = unsafe { std::slice::from_raw_parts_mut(ap.get().add(i * nb), nb) };
                quantize_row(xr, a);
            }
        }
    });
    let act: &[ActBlock] = if quantized { &scratch.act } else { &[] };
    multiply(pool, w, &scratch.x, b, y, act);
}

/// Pool tasks for `b` rows of per-row work: a few per thread (rows are cheap, regions are not).
fn row_tasks(pool: &ThreadPool, b: usize) -> usize {
    b.min(2 * pool.n_threads())
}

/// The rows of task `t` of [`row_tasks`]: contiguous, sizes differing by at most one.
fn row_range(pool: &ThreadPool, b: usize, t: usize) -> std::ops::Range<usize> {
    let n = row_tasks(pool, b);
    (t * b / n)..((t + 1) * b / n)
}

/// A raw pointer to activation blocks handed to pool tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct ActPtr(*mut ActBlock);
// SAFETY: only used to give pool tasks disjoint rows of a buffer that outlives the region.
unsafe impl Send for ActPtr {}
unsafe impl Sync for ActPtr {}
impl ActPtr {
    fn get(self) -> *mut ActBlock {
        self.0
    }
}

/// The weight-tile region: `act` holds `b` quantized rows (quantized weights) and `x` the f32
/// rows (F32 weights).
fn multiply(pool: &ThreadPool, w: &Weight, x: &[f32], b: usize, y: &mut [f32], act: &[ActBlock]) {
    let n = w.rows;
    assert_eq!(y.len(), b * n);
    if b == 0 {
        return;
    }
    let tile = tile_rows(w);
    let n_tasks = n.div_ceil(tile);
    let yp = SyncPtr(y.as_mut_ptr());
    let kernel = Kernel::detect();
    pool.run(n_tasks, |t| {
        let r0 = t * tile;
        let r1 = (r0 + tile).min(n);
        // SAFETY: each task writes only columns r0..r1 of every output row, disjoint across
        // tasks, and `y` outlives `pool.run`.
        let y = unsafe { std::slice::from_raw_parts_mut(yp.get(), b * n) };
        tile_run(kernel, w, x, act, y, r0, r1, b);
    });
}

/// Which implementation runs (detected once per call; tests pick each explicitly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::has_vnni() {
                return Kernel::Vnni;
            }
            if crate::has_avx2() {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }
}

/// Rows `r0..r1` (whole panels, except at the end) of all `b` outputs.
#[allow(clippy::too_many_arguments)]
fn tile_run(kernel: Kernel, w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize) {
    let k = w.cols;
    let n = w.rows;
    if w.format == WeightFormat::F32 {
        let rb = w.row_bytes();
        for r in r0..r1 {
            let wf = f32_row(&w.data[r * rb..(r + 1) * rb]);
            for i in 0..b {
                y[i * n + r] = dot_f32(wf, &x[i * k..(i + 1) * k]);
            }
        }
        return;
    }
    let nb = k / QK;
    assert!(act.len() >= b * nb && y.len() >= b * n && r0.is_multiple_of(PANEL) && r1 <= n);
    match kernel {
        Kernel::Portable => {
            for r in r0..r1 {
                for i in 0..b {
                    y[i * n + r] = dot_block_row(w, r, &act[i * nb..(i + 1) * nb]);
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Vnni => {
            let p0 = r0 / PANEL;
            let p1 = r1.div_ceil(PANEL);
            let pb = nb * PANEL * w.format.block_bytes();
            // SAFETY: panels p0..p1 exist (r1 <= rows); `act` holds b rows of nb blocks and `y`
            // b rows of n (asserted above); each panel writes lanes r < n only; the CPU
            // features of the chosen kernel were detected at run time (`Kernel::detect`).
            unsafe {
                let panels = avx2::Panels { ptr: w.data.as_ptr().add(p0 * pb), pb, np: p1 - p0, lanes_last: r1 - (p1 - 1) * PANEL };
                let rows = avx2::Rows { acts: act.as_ptr(), nb, b, out: y.as_mut_ptr().add(p0 * PANEL), stride: n };
                match (w.format, kernel == Kernel::Vnni) {
                    (WeightFormat::Q4_1, true) => avx2::tile_vnni::<avx2::Q41>(panels, rows),
                    (WeightFormat::Q4_0, true) => avx2::tile_vnni::<avx2::Q40>(panels, rows),
                    (WeightFormat::Q8_0, true) => avx2::tile_vnni::<avx2::Q80>(panels, rows),
                    (WeightFormat::Q4K, true) => avx2::tile_vnni::<avx2::Q4K>(panels, rows),
                    (WeightFormat::Q6K, true) => avx2::tile_vnni::<avx2::Q6K>(panels, rows),
                    (WeightFormat::Q4K, false) => avx2::tile_avx2::<avx2::Q4K>(panels, rows),
                    (WeightFormat::Q6K, false) => avx2::tile_avx2::<avx2::Q6K>(panels, rows),
                    (WeightFormat::Q4_1, false) => avx2::tile_avx2::<avx2::Q41>(panels, rows),
                    (WeightFormat::Q4_0, false) => avx2::tile_avx2::<avx2::Q40>(panels, rows),
                    (WeightFormat::Q8_0, false) => avx2::tile_avx2::<avx2::Q80>(panels, rows),
                    (WeightFormat::F32, _) => unreachable!(),
                }
            }
        }
    }
}

/// AVX2 (and AVX-512 VNNI) panel kernels. Each block's integer row sums are exact and the
/// float arithmetic per block is the scalar code's, in the same order (no fused multiply-add),
/// with lane `r` holding row `r`, so results are bit-identical to [`dot_block_row`].
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ActBlock, PANEL, QK};
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
        unsafe fn skip(self, i: usize) -> Rows {
            Rows { acts: self.acts.add(i * self.nb), b: self.b - i, out: self.out.add(i * self.stride), ..self }
        }
    }

    /// Runs `$body` with `$i` = 0, 1, … `$n - 1` (`$n` ≤ 8, a constant), unrolled.
    macro_rules! rows {
        ($n:expr, $i:ident, $body:block) => {
            rows!(@ $n, $i, $body, 0, 1, 2, 3, 4, 5, 6, 7)
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

    /// The first `N` of `rows` against every panel, writing `out[i * stride + 8p + r]` for lanes
    /// `r < 8` (`< lanes_last` in the last panel).
    #[inline(always)]
    unsafe fn chunk<F: Fmt, const V: bool, const N: usize>(w: Panels, rows: Rows) {
        let Panels { ptr: panels, pb, np, lanes_last } = w;
        let Rows { acts, nb, out, stride, .. } = rows;
        debug_assert!(rows.b >= N);
        let offset = if V { F::OFFSET_VNNI } else { F::OFFSET_AVX2 };
        for p in 0..np {
            let mut acc = [_mm256_setzero_ps(); N];
            for j in 0..nb {
                let blk = panels.add(p * pb + j * F::PB);
                // The first chunk streams the tile from memory: ask for blocks ahead (a few
                // blocks of the next panel at the end of a row; past the tile it is harmless).
                let ahead = blk.wrapping_add(PREFETCH_BLOCKS * F::PB);
                let mut line = 0;
                while line < F::PB {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                    line += 64;
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
                let w = F::decode::<V>(blk.add(F::QOFF));
                // Unrolled by hand (`rows!`): LLVM leaves an 8-row loop rolled, with the
                // accumulators on the stack.
                rows!(N, i, {
                    let acc = &mut acc[i];
                    let a = &*acts.add(i * nb + j);
                    let q = a.qs.as_ptr();
                    let bc = |g: usize| _mm256_set1_epi32((q.add(4 * g) as *const i32).read_unaligned());
                    // Four chains (elements 0..8, 8..16, 16..24, 24..32); integer adds are exact,
                    // so the split changes nothing.
                    let z = _mm256_setzero_si256();
                    let mut s0 = F::dot::<V>(z, w[0], bc(0));
                    let mut s1 = F::dot::<V>(z, w[1], bc(1));
                    let mut s2 = F::dot::<V>(z, w[4], bc(4));
                    let mut s3 = F::dot::<V>(z, w[5], bc(5));
                    s0 = F::dot::<V>(s0, w[2], bc(2));
                    s1 = F::dot::<V>(s1, w[3], bc(3));
                    s2 = F::dot::<V>(s2, w[6], bc(6));
                    s3 = F::dot::<V>(s3, w[7], bc(7));
                    let (lo, hi) = (_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
                    let t = if F::HALVES {
                        // Q6K: `(Σlo · d_lo + Σhi · d_hi) · d_a`, as the scalar code.
                        let lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(offset * a.sum_lo));
                        let hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(offset * (a.sum - a.sum_lo)));
                        let t = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), dw), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), mw));
                        _mm256_mul_ps(t, _mm256_set1_ps(a.d))
                    } else {
                        let mut si = _mm256_add_epi32(lo, hi);
                        if offset != 0 {
                            si = _mm256_sub_epi32(si, _mm256_set1_epi32(offset * a.sum));
                        }
                        // The scalar code's `sumi * d_w * d_a (+ m_w * s_a)`.
                        let mut t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(si), dw), _mm256_set1_ps(a.d));
                        if F::MIN {
                            t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a.s)));
                        }
                        t
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

    /// All rows in chunks of `MAX` (then 4, 2, 1), each chunk against every panel of the tile
    /// while the tile's weights stay in L1.
    #[inline(always)]
    unsafe fn tile_body<F: Fmt, const V: bool, const MAX: usize>(w: Panels, rows: Rows) {
        let mut i = 0;
        while i < rows.b {
            let r = rows.skip(i);
            i += if r.b >= MAX {
                chunk::<F, V, MAX>(w, r);
                MAX
            } else if r.b >= 4 {
                chunk::<F, V, 4>(w, r);
                4
            } else if r.b >= 2 {
                chunk::<F, V, 2>(w, r);
                2
            } else {
                chunk::<F, V, 1>(w, r);
                1
            };
        }
    }

    /// The AVX2 panel kernel (16 vector registers: chunks of 4 activation rows).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_avx2<F: Fmt>(w: Panels, rows: Rows) {
        tile_body::<F, false, 4>(w, rows)
    }

    /// How far ahead (in panel blocks) the kernel prefetches weights.
    const PREFETCH_BLOCKS: usize = 4;

    /// Activation rows per chunk in the VNNI kernel.
    const VNNI_ROWS: usize = 8;

    /// The AVX-512 VNNI panel kernel on 256-bit vectors (32 registers: chunks of 8 rows).
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn tile_vnni<F: Fmt>(w: Panels, rows: Rows) {
        tile_body::<F, true, VNNI_ROWS>(w, rows)
    }

    const _: () = assert!(QK == 32 && PANEL == 8);
    // `rows!` unrolls at most 8.
    const _: () = assert!(VNNI_ROWS <= 8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// GGUF-layout bytes of `v` quantized to `format` (as llama.cpp's reference quantizers do).
    fn quantize_gguf(format: WeightFormat, v: &[f32]) -> Vec<u8> {
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
                f => unreachable!("{f:?}"),
            }
        }
        data
    }

    fn quantize_weight(format: WeightFormat, rows: usize, cols: usize, v: &[f32]) -> Weight {
        Weight::new(format, rows, cols, quantize_gguf(format, v))
    }

    /// ggml's scalar `vec_dot` on one GGUF-layout row: independent of the panel layout.
    fn gguf_dot(format: WeightFormat, row: &[u8], a: &[ActBlock]) -> f32 {
        let mut acc = 0f32;
        for (b, ab) in row.chunks_exact(format.block_bytes()).zip(a) {
            let mut sumi = 0i32;
            let term = match format {
                WeightFormat::Q8_0 => {
                    for i in 0..QK {
                        sumi += (b[2 + i] as i8) as i32 * ab.qs[i] as i32;
                    }
                    sumi as f32 * f16_at(b, 0) * ab.d
                }
                WeightFormat::Q4_0 => {
                    for i in 0..16 {
                        let q = b[2 + i];
                        sumi += ((q & 0xF) as i32 - 8) * ab.qs[i] as i32 + ((q >> 4) as i32 - 8) * ab.qs[i + 16] as i32;
                    }
                    sumi as f32 * f16_at(b, 0) * ab.d
                }
                _ => {
                    for i in 0..16 {
                        let q = b[4 + i];
                        sumi += (q & 0xF) as i32 * ab.qs[i] as i32 + (q >> 4) as i32 * ab.qs[i + 16] as i32;
                    }
                    sumi as f32 * f16_at(b, 0) * ab.d + f16_at(b, 2) * ab.s
                }
            };
            acc += term;
        }
        acc
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

    #[test]
    fn quantize_row_paths_agree_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for n in [32usize, 64, 576, 1536] {
            let mut x = rand_vec(&mut rng, n);
            // Exact halves after scaling (ties round away from zero), zeros and a zero block.
            x[0] = 1.0;
            x[1] = 0.5 / 127.0 * 3.0;
            x[2] = -2.5 / 127.0;
            x[3] = 0.0;
            if n >= 64 {
                x[32..64].fill(0.0);
            }
            let mut a = vec![ActBlock::default(); n / QK];
            let mut b = a.clone();
            quantize_row_portable(&x, &mut a);
            quantize_row(&x, &mut b);
            for (a, b) in a.iter().zip(&b) {
                assert_eq!((a.d.to_bits(), a.s.to_bits(), a.sum, a.qs), (b.d.to_bits(), b.s.to_bits(), b.sum, b.qs));
                assert_eq!(a.sum, a.qs.iter().map(|&q| q as i32).sum::<i32>());
            }
        }
    }

    /// `x`'s rows (of `cols`) quantized, as `matmul` does.
    fn quantize_rows(x: &[f32], cols: usize) -> Vec<ActBlock> {
        let nb = cols / QK;
        let mut act = vec![ActBlock::default(); x.len() / cols * nb];
        for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(nb)) {
            quantize_row(xr, ar);
        }
        act
    }

    /// Every kernel this CPU can run (portable, AVX2, VNNI) gives exactly `want` (output bits)
    /// for `b` rows, the work split into two tiles (the first whole panels), as `matmul` does.
    fn assert_every_kernel_gives(w: &Weight, x: &[f32], act: &[ActBlock], b: usize, want: &[u32], what: &str) {
        let mut kernels = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::has_avx2() {
                kernels.push(Kernel::Avx2);
            }
            if crate::has_vnni() {
                kernels.push(Kernel::Vnni);
            }
        }
        let rows = w.rows;
        let split = rows.min(PANEL);
        for kernel in kernels {
            let mut y = vec![f32::NAN; b * rows];
            tile_run(kernel, w, x, act, &mut y, 0, split, b);
            tile_run(kernel, w, x, act, &mut y, split, rows, b);
            let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{kernel:?} {what}");
        }
    }

    const QFORMATS: [WeightFormat; 3] = [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1];

    #[test]
    fn panels_round_trip_to_gguf() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for format in QFORMATS {
            for &(rows, cols) in &[(1usize, 32usize), (8, 64), (13, 96), (24, 576)] {
                let gguf = quantize_gguf(format, &rand_vec(&mut rng, rows * cols));
                let w = Weight::new(format, rows, cols, gguf.clone());
                assert_eq!(w.to_gguf(), gguf, "{format:?} {rows}x{cols}");
                assert_eq!(w.bytes(), rows.div_ceil(PANEL) * PANEL * cols / QK * format.block_bytes());
                // Dequantization through the panels equals dequantizing the GGUF bytes.
                let rb = cols / QK * format.block_bytes();
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    w.dequantize_row(r, &mut row);
                    for (j, b) in gguf[r * rb..(r + 1) * rb].chunks_exact(format.block_bytes()).enumerate() {
                        for k in 0..QK {
                            let want = match format {
                                WeightFormat::Q8_0 => f16_at(b, 0) * (b[2 + k] as i8) as f32,
                                WeightFormat::Q4_0 => f16_at(b, 0) * ((if k < 16 { b[2 + k] & 0xF } else { b[2 + k - 16] >> 4 }) as i32 - 8) as f32,
                                _ => f16_at(b, 0) * (if k < 16 { b[4 + k] & 0xF } else { b[4 + k - 16] >> 4 }) as f32 + f16_at(b, 2),
                            };
                            assert_eq!(row[j * QK + k].to_bits(), want.to_bits(), "{format:?} row {r} elem {}", j * QK + k);
                        }
                    }
                }
                let cat = Weight::concat_rows(&[&w, &w]).unwrap();
                assert_eq!(cat.to_gguf(), [gguf.clone(), gguf].concat());
            }
        }
    }

    /// Every kernel (portable, AVX2, VNNI where present) equals ggml's scalar dot on the GGUF
    /// bytes bit for bit: ragged batches, partial last panels, every chunk size.
    #[test]
    fn kernels_equal_scalar_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for format in QFORMATS {
            for &(rows, cols) in &[(8usize, 32usize), (11, 96), (16, 160), (27, 576), (8, 1536)] {
                let nb = cols / QK;
                let gguf = quantize_gguf(format, &rand_vec(&mut rng, rows * cols));
                let w = Weight::new(format, rows, cols, gguf.clone());
                let rb = nb * format.block_bytes();
                for b in [1usize, 2, 3, 4, 5, 8, 9, 13, 17] {
                    let x = rand_vec(&mut rng, b * cols);
                    let act = quantize_rows(&x, cols);
                    let want: Vec<u32> = (0..b * rows)
                        .map(|o| gguf_dot(format, &gguf[(o % rows) * rb..(o % rows + 1) * rb], &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits())
                        .collect();
                    assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("{format:?} {rows}x{cols} b {b}"));
                }
            }
        }
    }

    /// Random GGUF K-quant super-blocks (any bytes are valid quants and sub-scales; the f16
    /// super-scales are set to sane values).
    fn random_k(rng: &mut impl Rng, format: WeightFormat, rows: usize, cols: usize) -> Weight {
        let (bb, d_at) = if format == WeightFormat::Q4K { (144, &[0usize, 2][..]) } else { (210, &[208usize][..]) };
        let mut bytes: Vec<u8> = (0..rows * cols / QK_K * bb).map(|_| rng.random()).collect();
        for b in bytes.chunks_exact_mut(bb) {
            for &at in d_at {
                let d = f16::from_f32(rng.random_range(0.001f32..0.01));
                b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        if format == WeightFormat::Q4K {
            Weight::from_q4_k(rows, cols, &bytes)
        } else {
            Weight::from_q6_k(rows, cols, &bytes)
        }
    }

    /// The repacked K-quants: every kernel equals the scalar code bit for bit, and the matmul is
    /// batch invariant and close to the dequantized reference.
    #[test]
    fn k_quant_kernels_agree() {
        let pool = ThreadPool::new(2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for format in [WeightFormat::Q4K, WeightFormat::Q6K] {
            for &(rows, cols) in &[(8usize, 256usize), (13, 512), (27, 256)] {
                let w = random_k(&mut rng, format, rows, cols);
                let nb = cols / QK;
                for b in [1usize, 2, 3, 5, 8, 9, 17] {
                    let x = rand_vec(&mut rng, b * cols);
                    let act = quantize_rows(&x, cols);
                    let want: Vec<u32> = (0..b * rows).map(|o| dot_block_row(&w, o % rows, &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits()).collect();
                    assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("{format:?} {rows}x{cols} b {b}"));
                    let mut y = vec![0f32; b * rows];
                    matmul(&pool, &w, &x, &mut y, &mut MatmulScratch::default());
                    let reference = reference(&w, &x, b);
                    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (i, (a, r)) in y.iter().zip(&reference).enumerate() {
                        assert!((a - r).abs() <= 0.02 * scale, "{format:?} b {b} out {i}: {a} vs {r}");
                    }
                    // Each row alone gives the same bits.
                    for row in 0..b {
                        let mut y1 = vec![0f32; rows];
                        matmul(&pool, &w, &x[row * cols..(row + 1) * cols], &mut y1, &mut MatmulScratch::default());
                        assert_eq!(&y1[..], &y[row * rows..(row + 1) * rows]);
                    }
                }
            }
            // Stacking whole panels keeps every value.
            let w = random_k(&mut rng, format, 16, 256);
            let cat = Weight::concat_rows(&[&w, &w]).unwrap();
            let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
            for r in 0..32 {
                w.dequantize_row(r % 16, &mut a);
                cat.dequantize_row(r, &mut b);
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn matmul_rows_equals_matmul_on_the_same_rows() {
        let pool = ThreadPool::new(2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for format in [WeightFormat::F32, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let (rows, cols) = (40, 96);
            let wv = rand_vec(&mut rng, rows * cols);
            let w = if format == WeightFormat::F32 { Weight::from_f32(rows, cols, &wv) } else { quantize_weight(format, rows, cols, &wv) };
            for b in [1usize, 5, 16] {
                let src = rand_vec(&mut rng, b * cols);
                // The rows as produced: each source row doubled.
                let x: Vec<f32> = src.iter().map(|v| v * 2.0).collect();
                let (mut y0, mut y1) = (vec![0f32; b * rows], vec![0f32; b * rows]);
                let mut scratch = MatmulScratch::default();
                matmul(&pool, &w, &x, &mut y0, &mut scratch);
                matmul_rows(&pool, &w, b, &mut y1, &mut scratch, |i, out| {
                    for (o, v) in out.iter_mut().zip(&src[i * cols..(i + 1) * cols]) {
                        *o = v * 2.0;
                    }
                });
                assert_eq!(y0, y1, "{format:?} b {b}");
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
                for &b in &[1usize, 3, 8, 11] {
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
