//! A small Llama-architecture GGUF with random weights, written on the spot: for device checks
//! (`gpu-check` compares a GPU backend with the CPU one on it, where shipping a real model is
//! too slow) and tests. Its tensors use every weight format the engine runs natively, so a
//! forward over it exercises every matmul kernel: Q8_0 embeddings, Q4_K attention Q/K/V, Q6_K
//! attention output and output head, Q4_1 gate/up, Q4_0 down. As a Qwen2 (`Shape::qwen2`) it
//! also has Q/K/V biases and half-split RoPE; as a Llama, interleaved RoPE and no biases.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{Result, WorkerError};

/// The shape of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    pub context: usize,
    /// Qwen2's architecture (Q/K/V biases, half-split RoPE) instead of Llama's.
    pub qwen2: bool,
}

impl Default for Shape {
    /// About 12M parameters (8 MB quantized): a second to write and load.
    fn default() -> Self {
        Shape { n_layers: 4, dim: 512, n_heads: 8, n_kv_heads: 2, ffn_dim: 1536, vocab: 4096, context: 4096, qwen2: false }
    }
}

/// Deterministic pseudo-random values in `[-scale, scale)` (xorshift), so a seed names a model.
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Writes the model of `shape` and `seed` to `path`.
pub fn write(path: &Path, shape: Shape, seed: u64) -> Result<()> {
    let e = |x: candle_core::Error| WorkerError::Model(format!("writing a synthetic GGUF: {x}"));
    let hd = shape.dim / shape.n_heads;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut n = 0u64;
    let mut add = |name: String, rows: usize, cols: usize, dtype: GgmlDType, scale: f32, offset: f32| -> Result<()> {
        n += 1;
        let v: Vec<f32> = values(rows * cols, seed ^ n, scale).into_iter().map(|x| x + offset).collect();
        let shape: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
        let t = Tensor::from_vec(v, shape, &Device::Cpu).map_err(e)?;
        tensors.push((name, QTensor::quantize(&t, dtype).map_err(e)?));
        Ok(())
    };
    add("token_embd.weight".into(), shape.vocab, shape.dim, GgmlDType::Q8_0, 1.0, 0.0)?;
    add("output_norm.weight".into(), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
    add("output.weight".into(), shape.vocab, shape.dim, GgmlDType::Q6K, 0.08, 0.0)?;
    let attn = 1.0 / (shape.dim as f32).sqrt();
    for i in 0..shape.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        add(p("attn_norm"), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
        add(p("attn_q"), shape.n_heads * hd, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        add(p("attn_k"), shape.n_kv_heads * hd, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        add(p("attn_v"), shape.n_kv_heads * hd, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        if shape.qwen2 {
            for (t, rows) in [("attn_q", shape.n_heads * hd), ("attn_k", shape.n_kv_heads * hd), ("attn_v", shape.n_kv_heads * hd)] {
                add(format!("blk.{i}.{t}.bias"), 1, rows, GgmlDType::F32, 0.5, 0.0)?;
            }
        }
        add(p("attn_output"), shape.dim, shape.n_heads * hd, GgmlDType::Q6K, attn, 0.0)?;
        add(p("ffn_norm"), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
        add(p("ffn_gate"), shape.ffn_dim, shape.dim, GgmlDType::Q4_1, 2.0 * attn, 0.0)?;
        add(p("ffn_up"), shape.ffn_dim, shape.dim, GgmlDType::Q4_1, 2.0 * attn, 0.0)?;
        add(p("ffn_down"), shape.dim, shape.ffn_dim, GgmlDType::Q4_0, 1.0 / (shape.ffn_dim as f32).sqrt(), 0.0)?;
    }
    let u = |x: usize| gguf_file::Value::U32(x as u32);
    let arch = if shape.qwen2 { "qwen2" } else { "llama" };
    let md: Vec<(String, gguf_file::Value)> = vec![
        ("general.architecture".into(), gguf_file::Value::String(arch.into())),
        ("general.name".into(), gguf_file::Value::String(format!("zerolayer synthetic {arch} {seed}"))),
        (format!("{arch}.block_count"), u(shape.n_layers)),
        (format!("{arch}.embedding_length"), u(shape.dim)),
        (format!("{arch}.feed_forward_length"), u(shape.ffn_dim)),
        (format!("{arch}.attention.head_count"), u(shape.n_heads)),
        (format!("{arch}.attention.head_count_kv"), u(shape.n_kv_heads)),
        (format!("{arch}.rope.dimension_count"), u(hd)),
        (format!("{arch}.context_length"), u(shape.context)),
        (format!("{arch}.rope.freq_base"), gguf_file::Value::F32(10000.0)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), gguf_file::Value::F32(1e-5)),
    ];
    let mut f = std::fs::File::create(path).map_err(|x| WorkerError::Model(format!("creating {}: {x}", path.display())))?;
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ForwardItem, KvCache, Model};
    use zerolayer_kernels::quant::WeightFormat;

    /// The model loads with the shape written, in every native format, and its forward gives
    /// logits that are finite and not flat (so greedy comparisons on it mean something).
    #[test]
    fn a_synthetic_model_loads_and_runs() {
        let dir = std::env::temp_dir().join(format!("zl-synth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        let shape = Shape { n_layers: 2, vocab: 512, ..Shape::default() };
        write(&path, shape, 7).unwrap();
        let (mut m, _) = Model::from_gguf(&path, 1, |_, _| {}).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!((m.cfg.n_layers, m.cfg.dim, m.cfg.n_heads, m.cfg.n_kv_heads, m.cfg.vocab_size), (2, 512, 8, 2, 512));
        let p = m.parts();
        let formats = [p.embed.format, p.output.format, p.layers[0].wqkv.format, p.layers[0].wo.format, p.layers[0].wgate_up.format, p.layers[0].wdown.format];
        assert_eq!(formats, [WeightFormat::Q8_0, WeightFormat::Q6K, WeightFormat::Q4K, WeightFormat::Q6K, WeightFormat::Q4_1, WeightFormat::Q4_0]);
        let mut cache = KvCache::new(&m.cfg, 16, zerolayer_common::config::KvDtype::F32, 8);
        let table: Vec<u32> = (0..8).collect();
        let l = m.forward(&mut cache, &[ForwardItem { tokens: &[1, 20, 300, 4], start_pos: 0, block_table: &table, want_logits: true }]).unwrap().remove(0);
        assert!(l.iter().all(|x| x.is_finite()));
        let (mn, mx) = l.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(mx - mn > 1.0, "logits span {mn}..{mx}");
    }

    /// As a Qwen2 it loads as one: half-split RoPE and Q/K/V biases.
    #[test]
    fn a_synthetic_qwen2_has_biases_and_half_split_rope() {
        let dir = std::env::temp_dir().join(format!("zl-synth-qwen2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        write(&path, Shape { n_layers: 2, vocab: 512, qwen2: true, ..Shape::default() }, 7).unwrap();
        let (m, _) = Model::from_gguf(&path, 1, |_, _| {}).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(m.cfg.arch, "qwen2");
        assert_eq!(m.cfg.rope_style, zerolayer_kernels::ops::RopeStyle::HalfSplit);
        let bias = m.parts().layers[0].bqkv.expect("Q/K/V biases");
        assert_eq!(bias.len(), (8 + 2 + 2) * 64);
        assert!(bias.iter().any(|b| *b != 0.0));
    }
}
