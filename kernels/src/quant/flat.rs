//! Weights as device kernels read them: quantized blocks flattened ([`FlatBlocks`]: two f32
//! scales and the codes per 32-element block), and float weights as f32 values.

use super::format::{widen, Weight, WeightFormat, QK};

/// A quantized weight as flat blocks, the layout device kernels read: for block `j` of row `r`
/// (index `r * cols / 32 + j`), two f32 scales at `scales[2 * index..]` (`d`, and `m`: the min
/// of Q4_1/Q4K, the upper half's scale of Q6K, else 0) and the stored codes (quant +
/// [`FlatBlocks::code_offset`]) at `codes[index * code_bytes..]`: 16 bytes of nibbles for the
/// 4-bit formats (element `k < 16` in the low nibble of byte `k`, `k ≥ 16` in the high nibble of
/// byte `k - 16`, GGUF's order), else 32 bytes. Every scale and code is the panel's, exactly.
pub struct FlatBlocks {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub scales: Vec<f32>,
    pub codes: Vec<u8>,
}

impl FlatBlocks {
    /// The kernels' number for the format (`kernels.cu`): 1 Q4_0, 2 Q4_1, 3 Q8_0, 4 Q4K, 5 Q6K,
    /// 6 Q5K.
    pub fn format_id(&self) -> i32 {
        match self.format {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => 0,
            WeightFormat::Q4_0 => 1,
            WeightFormat::Q4_1 => 2,
            WeightFormat::Q8_0 => 3,
            WeightFormat::Q4K => 4,
            WeightFormat::Q6K => 5,
            WeightFormat::Q5K => 6,
        }
    }

    pub fn code_bytes(&self) -> usize {
        if self.format.byte_codes() { QK } else { QK / 2 }
    }

    pub fn code_offset(&self) -> i32 {
        self.format.code_offset()
    }

    /// Element `i` of row `r`, decoded the way the device kernels decode it.
    pub fn value(&self, r: usize, i: usize) -> f32 {
        let (j, k) = (i / QK, i % QK);
        let at = r * (self.cols / QK) + j;
        let c = &self.codes[at * self.code_bytes()..(at + 1) * self.code_bytes()];
        let code = if self.format.byte_codes() { c[k] } else if k < QK / 2 { c[k] & 0xF } else { c[k - QK / 2] >> 4 };
        let q = (code as i32 - self.code_offset()) as f32;
        let (d, m) = (self.scales[2 * at], self.scales[2 * at + 1]);
        match self.format {
            f if f.has_min() => d * q + m,
            WeightFormat::Q6K if k >= QK / 2 => m * q,
            _ => d * q,
        }
    }
}

impl Weight {
    /// The weight as flat blocks (`None` for the float formats, which devices read as f32
    /// values: [`Weight::f32_values`]).
    pub fn flat_blocks(&self) -> Option<FlatBlocks> {
        if self.format.is_float() {
            return None;
        }
        let nb = self.cols / QK;
        let cb = if self.format.byte_codes() { QK } else { QK / 2 };
        let mut f = FlatBlocks { format: self.format, rows: self.rows, cols: self.cols, scales: Vec::with_capacity(self.rows * nb * 2), codes: Vec::with_capacity(self.rows * nb * cb) };
        for r in 0..self.rows {
            for j in 0..nb {
                let b = self.block(r, j);
                f.scales.push(b.d);
                f.scales.push(b.m);
                let (_, _, c) = self.codes(r, j);
                if self.format.byte_codes() {
                    f.codes.extend_from_slice(&c);
                } else {
                    f.codes.extend((0..QK / 2).map(|k| c[k] | (c[k + QK / 2] << 4)));
                }
            }
        }
        Some(f)
    }

    /// A float weight's values as f32, row-major (F16 and BF16 widened exactly; `None` for
    /// quantized formats). Devices hold float weights as f32.
    pub fn f32_values(&self) -> Option<Vec<f32>> {
        self.format.is_float().then(|| {
            let mut out = vec![0f32; self.rows * self.cols];
            widen(self.format, &self.data, &mut out);
            out
        })
    }
}
