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
        let half = head_dim / 2;
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        for i in 0..half {
            let inv = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
            for p in 0..max_pos {
                let a = p as f32 * inv;
                cos[p * half + i] = a.cos();
                sin[p * half + i] = a.sin();
            }
        }
        RopeTable { head_dim, style, cos, sin }
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

/// `gate = silu(gate) * up`, elementwise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let v = *g;
        *g = v / (1.0 + (-v).exp()) * u;
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
