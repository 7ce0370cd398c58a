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
//!
//! Files: [`format`] (weight formats, panels and repacking), [`flat`] (weights as device
//! kernels read them), [`activation`] (int8 activation
//! blocks), [`matmul`] (the driver: tiles on the pool, the scalar reference, kernel choice) and
//! `simd` (the AVX2 / AVX-512 VNNI panel kernels on 256-bit vectors) and `simd512` (the VNNI
//! kernel on 512-bit vectors, two panels per vector).

mod activation;
mod flat;
mod format;
mod matmul;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(target_arch = "x86_64")]
mod simd512;
#[cfg(test)]
mod tests;

pub use activation::{quantize_row, ActBlock};
pub use flat::FlatBlocks;
pub use format::{Weight, WeightFormat, PANEL, QK, QK_K};
pub use matmul::{dot_f32, matmul, matmul_rows, matmul_rows_state, matmul_rows_warming, matmul_warming, MatmulScratch, Warm};
