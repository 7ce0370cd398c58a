//! Weight formats: GGUF blocks repacked into 8-row panels (see the parent module), and back.

use half::f16;
use crate::memory::Slab;

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
    /// IEEE half precision, row-major little-endian (GGUF's `F16`): each value widens to f32
    /// exactly as a row is multiplied.
    F16,
    /// bfloat16, row-major little-endian (GGUF's `BF16`): the upper 16 bits of an f32.
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// GGUF's `Q4_K`, repacked: 32-element blocks of 4-bit quants with an f32 scale and min
    /// each (the exact products of the super-block's f16 `d`/`dmin` and 6-bit sub-scales).
    Q4K,
    /// GGUF's `Q6_K`, repacked: 32-element blocks of 6-bit quants (offset 32) with an f32 scale
    /// per 16 elements (the exact product of the super-block's f16 `d` and an int8 sub-scale).
    Q6K,
    /// 5-bit quants (0..=31, one per byte) with an f32 scale and min per 32-element block:
    /// GGUF's `Q5_K` repacked (the exact products of the super-block's f16 `d`/`dmin` and 6-bit
    /// sub-scales, as Q4K), and GGUF's `Q5_1` (its f16 `d` and `m`, exactly). 1.25 bytes per
    /// weight, against GGUF's 0.69 (Q5_K) and 0.75 (Q5_1): the byte codes are what the integer
    /// kernels read directly.
    Q5K,
}

impl WeightFormat {
    /// Bytes per 32-element block (per element × 32 for the float formats).
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4 * QK,
            WeightFormat::F16 | WeightFormat::BF16 => 2 * QK,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4K => 24,
            WeightFormat::Q6K => 40,
            WeightFormat::Q5K => 40,
        }
    }

    /// Whether the weight is row-major floats (F32, F16, BF16) rather than quantized panels.
    pub fn is_float(self) -> bool {
        matches!(self, WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16)
    }

    /// Bytes per element of a float format.
    pub(super) fn float_bytes(self) -> usize {
        if self == WeightFormat::F32 { 4 } else { 2 }
    }

    /// Bytes of one scale (f16 for the GGUF 32-element formats, f32 for the repacked K-quants).
    pub(super) fn scale_bytes(self) -> usize {
        match self {
            WeightFormat::Q4K | WeightFormat::Q6K | WeightFormat::Q5K => 4,
            _ => 2,
        }
    }

    /// Whether a block carries a second scale array (Q4_1/Q4K/Q5K: the min; Q6K: the upper
    /// half's scale).
    pub(super) fn two_scales(self) -> bool {
        matches!(self, WeightFormat::Q4_1 | WeightFormat::Q4K | WeightFormat::Q6K | WeightFormat::Q5K)
    }

    /// Whether a block's value is `d · q + m` (a min), rather than `d · q`.
    pub(super) fn has_min(self) -> bool {
        matches!(self, WeightFormat::Q4_1 | WeightFormat::Q4K | WeightFormat::Q5K)
    }

    /// Whether quants are stored one per byte (else two per byte).
    pub(super) fn byte_codes(self) -> bool {
        matches!(self, WeightFormat::Q8_0 | WeightFormat::Q6K | WeightFormat::Q5K)
    }

    /// What a stored code is above the quant it stands for.
    pub(super) fn code_offset(self) -> i32 {
        match self {
            WeightFormat::Q4_0 => 8,
            WeightFormat::Q8_0 => 128,
            WeightFormat::Q6K => 32,
            _ => 0,
        }
    }

    /// Offset of the quants within a panel block (after the 8 `d`s, and the 8 `m`s for Q4_1).
    pub(super) fn quant_offset(self) -> usize {
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
    /// the padding rows of the last panel have zero scales. On huge pages (`memory`), alone or
    /// packed with other weights ([`Weight::pack`]): a step streams every panel.
    pub(super) data: Slab,
}

/// One block of one row, decoded: scale, second scale (Q4_1/Q4K: the min; Q6K: the scale of
/// elements 16..32; else 0) and the 32 integer quants.
pub(super) struct BlockView {
    pub(super) d: f32,
    pub(super) m: f32,
    pub(super) q: [i32; QK],
}

impl Weight {
    /// A weight from GGUF-layout bytes (`rows * cols / 32` blocks, row-major; or the values
    /// row-major for the float formats).
    pub fn new(format: WeightFormat, rows: usize, cols: usize, gguf: Vec<u8>) -> Self {
        assert!(cols.is_multiple_of(QK) || format.is_float(), "cols {cols} not a multiple of {QK}");
        assert!(!matches!(format, WeightFormat::Q4K | WeightFormat::Q6K | WeightFormat::Q5K), "{format:?} loads through its from_* constructor");
        let want = if format.is_float() { rows * cols * format.float_bytes() } else { rows * cols / QK * format.block_bytes() };
        assert_eq!(gguf.len(), want, "weight data size for {format:?} {rows}x{cols}");
        if format.is_float() {
            return Weight { format, rows, cols, data: Slab::from(gguf) };
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
    pub(super) fn empty(format: WeightFormat, rows: usize, cols: usize) -> Self {
        let nb = cols / QK;
        let mut w = Weight { format, rows, cols, data: Slab::zeroed(rows.div_ceil(PANEL) * PANEL * nb * format.block_bytes()) };
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

    /// A weight from GGUF `Q5_0` bytes (`rows × cols / 32` blocks of 22 bytes: f16 `d`, 32 high
    /// bits, 16 bytes of low nibbles), stored as [`WeightFormat::Q8_0`] with the same `d`: a
    /// 5-bit quant (`-16..=15`) is an 8-bit one, so the dequantized values, and the integer dot
    /// products with 8-bit activations, are exactly ggml's `q5_0 × q8_0`.
    pub fn from_q5_0(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        assert!(cols.is_multiple_of(QK), "Q5_0 needs cols a multiple of {QK}, got {cols}");
        assert_eq!(bytes.len(), rows * cols / QK * 22, "Q5_0 data size for {rows}x{cols}");
        let nb = cols / QK;
        let mut w = Weight::empty(WeightFormat::Q8_0, rows, cols);
        for (i, b) in bytes.chunks_exact(22).enumerate() {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            // ggml's dequantize_row_q5_0: element l < 16 is the low nibble of qs[l] with bit l of
            // qh; element l + 16 the high nibble with bit l + 16.
            let codes: [u8; QK] = std::array::from_fn(|l| {
                let (nib, bit) = if l < 16 { (qs[l] & 0xF, (qh >> l) & 1) } else { (qs[l - 16] >> 4, (qh >> l) & 1) };
                // Quant (nib | bit << 4) - 16, stored offset by 128 as Q8_0 codes are.
                ((nib as u32 | bit << 4) + 112) as u8
            });
            w.set_block(i / nb, i % nb, &b[0..2], &[0, 0], &codes);
        }
        w
    }

    /// A weight from GGUF `Q5_1` bytes (`rows × cols / 32` blocks of 24 bytes: f16 `d`, f16 `m`,
    /// 32 high bits, 16 bytes of low nibbles), stored as [`WeightFormat::Q5K`] with the same
    /// scales (f16 widened to f32, exactly): dequantized values are bit-identical to ggml's
    /// `x · d + m`.
    pub fn from_q5_1(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        assert!(cols.is_multiple_of(QK), "Q5_1 needs cols a multiple of {QK}, got {cols}");
        assert_eq!(bytes.len(), rows * cols / QK * 24, "Q5_1 data size for {rows}x{cols}");
        let nb = cols / QK;
        let mut w = Weight::empty(WeightFormat::Q5K, rows, cols);
        for (i, b) in bytes.chunks_exact(24).enumerate() {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            // ggml's dequantize_row_q5_1: element l < 16 is the low nibble of qs[l] with bit l of
            // qh; element l + 16 the high nibble with bit l + 16.
            let codes: [u8; QK] = std::array::from_fn(|l| {
                let nib = if l < 16 { qs[l] & 0xF } else { qs[l - 16] >> 4 };
                nib | (((qh >> l) & 1) << 4) as u8
            });
            w.set_block(i / nb, i % nb, &d.to_le_bytes(), &m.to_le_bytes(), &codes);
        }
        w
    }

    /// A weight from GGUF `Q5_K` bytes (`rows × cols / 256` super-blocks of 176 bytes: f16 `d`,
    /// f16 `dmin`, 12 bytes of 6-bit scales and mins, 32 bytes of high bits, 128 bytes of low
    /// nibbles), repacked as [`WeightFormat::Q5K`]. Dequantized values are bit-identical to
    /// ggml's.
    pub fn from_q5_k(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        Weight::from_super_blocks(WeightFormat::Q5K, rows, cols, bytes, 176, |w, r, s0, b| {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for j in 0..8 {
                let (s, m) = scale_min_k4(sc, j);
                // Sub-block j: nibble (j % 2) of bytes 32·(j / 2) .. +32, and bit j of qh[l]
                // (ggml's dequantize_row_q5_K: u1 = 1 << 2·(j / 2), u2 = u1 << 1).
                let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                let codes: [u8; QK] = std::array::from_fn(|l| {
                    let nib = if j % 2 == 0 { q[l] & 0xF } else { q[l] >> 4 };
                    nib | (((qh[l] >> j) & 1) << 4)
                });
                // As Q4_K: `d1 * q - m1`, which equals `d1 * q + (-m1)`.
                let (d1, m1) = (d * s as f32, -(dmin * m as f32));
                w.set_block(r, s0 + j, &d1.to_le_bytes(), &m1.to_le_bytes(), &codes);
            }
        })
    }

    /// A weight from GGUF `Q4_K` bytes (`rows × cols / 256` super-blocks of 144 bytes: f16 `d`,
    /// f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants), repacked as
    /// [`WeightFormat::Q4K`]. Dequantized values are bit-identical to ggml's.
    pub fn from_q4_k(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        Weight::from_super_blocks(WeightFormat::Q4K, rows, cols, bytes, 144, |w, r, s0, b| {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let (sc, qs) = (&b[4..16], &b[16..144]);
            for j in 0..8 {
                let (s, m) = scale_min_k4(sc, j);
                // Sub-block j: nibble (j % 2) of bytes 32·(j / 2) .. +32.
                let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                let codes: [u8; QK] = std::array::from_fn(|l| if j % 2 == 0 { q[l] & 0xF } else { q[l] >> 4 });
                // d·sc and dmin·m are exact in f32 (11 × 6 significant bits); ggml computes
                // `d1 * q - m1`, which equals `d1 * q + (-m1)`.
                let (d1, m1) = (d * s as f32, -(dmin * m as f32));
                w.set_block(r, s0 + j, &d1.to_le_bytes(), &m1.to_le_bytes(), &codes);
            }
        })
    }

    /// A weight from GGUF `Q6_K` bytes (`rows × cols / 256` super-blocks of 210 bytes: 128
    /// bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, f16 `d`), repacked as
    /// [`WeightFormat::Q6K`]. Dequantized values are bit-identical to ggml's.
    pub fn from_q6_k(rows: usize, cols: usize, bytes: &[u8]) -> Self {
        Weight::from_super_blocks(WeightFormat::Q6K, rows, cols, bytes, 210, |w, r, s0, b| {
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
        })
    }

    /// Repacks GGUF K-quant super-blocks (`sb_bytes` each, 256 elements, row-major) into
    /// `format`: `repack(w, row, first 32-element block, super-block bytes)` writes the 8 blocks
    /// of one super-block.
    fn from_super_blocks(format: WeightFormat, rows: usize, cols: usize, bytes: &[u8], sb_bytes: usize, mut repack: impl FnMut(&mut Weight, usize, usize, &[u8])) -> Self {
        assert!(cols.is_multiple_of(QK_K), "{format:?} needs cols a multiple of {QK_K}, got {cols}");
        assert_eq!(bytes.len(), rows * cols / QK_K * sb_bytes, "{format:?} data size for {rows}x{cols}");
        let mut w = Weight::empty(format, rows, cols);
        for (sb, b) in bytes.chunks_exact(sb_bytes).enumerate() {
            let (r, s0) = (sb / (cols / QK_K), sb % (cols / QK_K) * (QK_K / QK));
            repack(&mut w, r, s0, b);
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

    /// Moves `weights`' bytes into one huge-page arena, in the order given (a model's layers in
    /// the order a step streams them). Values and formats are unchanged.
    pub fn pack<'a>(weights: impl IntoIterator<Item = &'a mut Weight>) {
        crate::memory::pack(weights.into_iter().map(|w| &mut w.data));
    }

    /// Bytes held (padding included).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub(super) fn row_bytes(&self) -> usize {
        match self.format {
            f if f.is_float() => self.cols * f.float_bytes(),
            f => self.cols / QK * f.block_bytes(),
        }
    }

    /// Byte offset of block `j` of panel `p`.
    pub(super) fn panel_block(&self, p: usize, j: usize) -> usize {
        let pb = PANEL * self.format.block_bytes();
        p * (self.cols / QK) * pb + j * pb
    }

    /// Where the stored code of element `k` of lane `r` lives: (byte offset in the quants, shift).
    pub(super) fn code_at(&self, r: usize, k: usize) -> (usize, u32) {
        let (g, e) = (k / 4, k % 4);
        if self.format.byte_codes() {
            (g * 32 + r * 4 + e, 0)
        } else {
            ((g / 2) * 32 + r * 4 + e, 4 * (g % 2) as u32)
        }
    }

    /// Writes block `j` of row `r`: raw scale bytes (`scale_bytes` each) and stored codes.
    pub(super) fn set_block(&mut self, r: usize, j: usize, d: &[u8], m: &[u8], codes: &[u8; QK]) {
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
    pub(super) fn codes(&self, r: usize, j: usize) -> ([u8; 4], [u8; 4], [u8; QK]) {
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

    pub(super) fn block(&self, r: usize, j: usize) -> BlockView {
        let (d, m, c) = self.codes(r, j);
        let scale = |b: [u8; 4]| if self.format.scale_bytes() == 4 { f32::from_le_bytes(b) } else { f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32() };
        let off = self.format.code_offset();
        BlockView { d: scale(d), m: scale(m), q: c.map(|c| c as i32 - off) }
    }

    /// The weight in GGUF layout again (lossless). Not for the repacked K-quants, whose
    /// 32-element blocks have no GGUF form.
    pub fn to_gguf(&self) -> Vec<u8> {
        assert!(!matches!(self.format, WeightFormat::Q4K | WeightFormat::Q6K | WeightFormat::Q5K), "no GGUF form for {:?}", self.format);
        if self.format.is_float() {
            return self.data.to_vec();
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
        if self.format.is_float() {
            let rb = self.row_bytes();
            widen(self.format, &self.data[r * rb..(r + 1) * rb], out);
            return;
        }
        for (j, o) in out.chunks_exact_mut(QK).enumerate() {
            let b = self.block(r, j);
            for (k, (o, &q)) in o.iter_mut().zip(&b.q).enumerate() {
                *o = match self.format {
                    f if f.has_min() => b.d * q as f32 + b.m,
                    WeightFormat::Q6K if k >= QK / 2 => b.m * q as f32,
                    _ => b.d * q as f32,
                };
            }
        }
    }

    /// Stacks weights with the same format and column count into one (rows concatenated), so
    /// that e.g. Q, K and V projections run as a single matmul. Every block is copied exactly.
    pub fn concat_rows(parts: &[&Weight]) -> Option<Weight> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        if first.format.is_float() || parts.iter().all(|p| p.rows.is_multiple_of(PANEL)) {
            // Whole panels (or row-major floats): the bytes simply follow each other.
            let data: Vec<u8> = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
            return Some(Weight { format: first.format, rows, cols: first.cols, data: Slab::from(data) });
        }
        let mut w = Weight::empty(first.format, rows, first.cols);
        let mut r0 = 0;
        for p in parts {
            w.copy_blocks(p, 0..p.rows, 0, r0);
            r0 += p.rows;
        }
        Some(w)
    }

    /// The sub-matrix of `rows` × `cols`, in the same format. For quantized formats `cols` must
    /// start and end on 32-element block boundaries. Blocks are copied exactly (scales and
    /// quants), so each product with the slice is bit-identical to the same block's product with
    /// the whole: what tensor-parallel shards rely on.
    pub fn slice(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Weight {
        assert!(rows.end <= self.rows && cols.end <= self.cols && rows.start <= rows.end && cols.start <= cols.end, "slice {rows:?} × {cols:?} of {}x{}", self.rows, self.cols);
        if self.format.is_float() {
            let (rb, e) = (self.row_bytes(), self.format.float_bytes());
            let mut data = Vec::with_capacity(rows.len() * cols.len() * e);
            for r in rows.clone() {
                data.extend_from_slice(&self.data[r * rb + cols.start * e..r * rb + cols.end * e]);
            }
            return Weight { format: self.format, rows: rows.len(), cols: cols.len(), data: Slab::from(data) };
        }
        assert!(cols.start.is_multiple_of(QK) && cols.end.is_multiple_of(QK), "quantized columns {cols:?} must lie on {QK}-element blocks");
        let mut w = Weight::empty(self.format, rows.len(), cols.len());
        w.copy_blocks(self, rows, cols.start / QK, 0);
        w
    }

    /// Copies rows `rows` of `src`, blocks `j0..j0 + self.cols / 32`, to rows `to..` of `self`.
    fn copy_blocks(&mut self, src: &Weight, rows: std::ops::Range<usize>, j0: usize, to: usize) {
        for (i, r) in rows.enumerate() {
            for j in 0..self.cols / QK {
                let (d, m, c) = src.codes(r, j0 + j);
                self.set_block(to + i, j, &d, &m, &c);
            }
        }
    }
}

/// The f32 values of a float format's little-endian `bytes` (exact: F16 and BF16 widen without
/// rounding), into `out`.
pub(super) fn widen(format: WeightFormat, bytes: &[u8], out: &mut [f32]) {
    match format {
        WeightFormat::F32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        WeightFormat::F16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, c)| *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        WeightFormat::BF16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, c)| *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)),
        f => unreachable!("{f:?} is not a float format"),
    }
}

/// Sub-block `j`'s 6-bit scale and min from a K-quant super-block's 12 packed bytes (ggml's
/// `get_scale_min_k4`).
fn scale_min_k4(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        ((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))
    }
}

/// The little-endian f16 at `b[at..at + 2]`, as f32.
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 32 codes of a 4-bit GGUF block's 16 bytes (element `i` low nibble, `i + 16` high).
pub(super) fn nibble_codes(qs: &[u8]) -> [u8; QK] {
    let mut c = [0u8; QK];
    for i in 0..16 {
        c[i] = qs[i] & 0xF;
        c[i + 16] = qs[i] >> 4;
    }
    c
}
