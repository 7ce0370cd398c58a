//! A small GGUF with random weights, written on the spot, in the architectures the engine runs:
//! for device checks (`gpu-check` compares a GPU backend with the CPU one on it, where shipping a
//! real model is too slow) and for tests against llama.cpp of architectures we have no small
//! file of (`tests/tests/synthetic.rs`).
//!
//! By default its tensors use every weight format the engine runs natively, so a forward over it
//! exercises every matmul kernel: Q8_0 embeddings, Q4_K attention Q/K/V, Q6_K attention output
//! and output head, Q4_1 gate/up, Q4_0 down. `dense` writes every matrix in F32 instead: what
//! llama.cpp multiplies without rounding the activations, so its greedy tokens and ours may be
//! compared exactly. With a tokenizer file, its vocabulary (every `tokenizer.*` key) is copied in,
//! so that llama.cpp loads the model too.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{Result, WorkerError};

/// The architecture of a synthetic model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama: interleaved RoPE, no biases, an output head of its own.
    Llama,
    /// Qwen2: Q/K/V biases and half-split RoPE.
    Qwen2,
    /// Qwen3: Q and K RMS-normed per head, no biases, half-split RoPE.
    Qwen3,
    /// Llama 3.1: Llama with the `rope_freqs` tensor (its long-context RoPE factors, base
    /// 500000) and tied embeddings (no `output.weight`).
    Llama31,
}

impl Arch {
    /// The GGUF `general.architecture`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama | Arch::Llama31 => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// The shape of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Width of one attention head (heads × head_dim need not be `dim`).
    pub head_dim: usize,
    pub ffn_dim: usize,
    /// Ignored when a tokenizer is copied in (its vocabulary's size is used).
    pub vocab: usize,
    pub context: usize,
    pub arch: Arch,
    /// Every matrix in F32 (module docs).
    pub dense: bool,
}

impl Default for Shape {
    /// About 12M parameters (8 MB quantized): a second to write and load.
    fn default() -> Self {
        Shape { n_layers: 4, dim: 512, n_heads: 8, n_kv_heads: 2, head_dim: 64, ffn_dim: 1536, vocab: 4096, context: 4096, arch: Arch::Llama, dense: false }
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
    write_with(path, shape, seed, None)
}

/// Llama 3.1's RoPE factors for `head_dim` at `base` (`convert_hf_to_gguf.py`: factor 8, low and
/// high frequency factors 1 and 4, an original context of 8192).
pub fn llama31_rope_factors(head_dim: usize, base: f32) -> Vec<f32> {
    let (factor, low, high, old_context) = (8.0f32, 1.0f32, 4.0f32, 8192.0f32);
    let (low_wavelen, high_wavelen) = (old_context / low, old_context / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_context / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// [`write`], with the vocabulary of the GGUF at `tokenizer` copied in (module docs).
pub fn write_with(path: &Path, mut shape: Shape, seed: u64, tokenizer: Option<&Path>) -> Result<()> {
    let e = |x: candle_core::Error| WorkerError::Model(format!("writing a synthetic GGUF: {x}"));
    let vocab_md = match tokenizer {
        Some(t) => {
            let mut f = std::fs::File::open(t).map_err(|x| WorkerError::Model(format!("opening {}: {x}", t.display())))?;
            let content = gguf_file::Content::read(&mut f).map_err(e)?;
            let md: Vec<(String, gguf_file::Value)> = content.metadata.into_iter().filter(|(k, _)| k.starts_with("tokenizer.")).collect();
            let tokens = md.iter().find(|(k, _)| k == "tokenizer.ggml.tokens").and_then(|(_, v)| v.to_vec().ok()).map(|v| v.len());
            shape.vocab = tokens.ok_or_else(|| WorkerError::Model(format!("{}: no tokenizer.ggml.tokens", t.display())))?;
            md
        }
        None => Vec::new(),
    };
    let tensors = tensors(shape, seed)?;
    let mut md = metadata(shape, seed);
    md.extend(vocab_md);
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut f = std::fs::File::create(path).map_err(|x| WorkerError::Model(format!("creating {}: {x}", path.display())))?;
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).map_err(e)
}

/// The model's tensors, in the order written.
fn tensors(shape: Shape, seed: u64) -> Result<Vec<(String, QTensor)>> {
    let e = |x: candle_core::Error| WorkerError::Model(format!("writing a synthetic GGUF: {x}"));
    let hd = shape.head_dim;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut n = 0u64;
    let mut add = |name: String, rows: usize, cols: usize, dtype: GgmlDType, scale: f32, offset: f32| -> Result<()> {
        n += 1;
        let v: Vec<f32> = values(rows * cols, seed ^ n, scale).into_iter().map(|x| x + offset).collect();
        let shape_of: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
        let t = Tensor::from_vec(v, shape_of, &Device::Cpu).map_err(e)?;
        let dtype = if shape.dense { GgmlDType::F32 } else { dtype };
        tensors.push((name, QTensor::quantize(&t, dtype).map_err(e)?));
        Ok(())
    };
    add("token_embd.weight".into(), shape.vocab, shape.dim, GgmlDType::Q8_0, 1.0, 0.0)?;
    add("output_norm.weight".into(), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
    if shape.arch != Arch::Llama31 {
        // A dense model's logits spread as widely as a tied head's (±1 weights), so that its
        // greedy choices are rarely near-ties: exactness tests compare them.
        add("output.weight".into(), shape.vocab, shape.dim, GgmlDType::Q6K, if shape.dense { 1.0 } else { 0.08 }, 0.0)?;
    }
    let (q_rows, kv_rows) = (shape.n_heads * hd, shape.n_kv_heads * hd);
    let attn = 1.0 / (shape.dim as f32).sqrt();
    // A dense model's layers write 8 times more into the residual stream than its embeddings
    // do: with tied embeddings, a smaller share would leave the last token's own embedding the
    // greedy choice at every step, and the layers untested.
    let out = if shape.dense { 8.0 } else { 1.0 };
    for i in 0..shape.n_layers {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        add(p("attn_norm"), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
        add(p("attn_q"), q_rows, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        add(p("attn_k"), kv_rows, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        add(p("attn_v"), kv_rows, shape.dim, GgmlDType::Q4K, 2.0 * attn, 0.0)?;
        if shape.arch == Arch::Qwen2 {
            for (t, rows) in [("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)] {
                add(format!("blk.{i}.{t}.bias"), 1, rows, GgmlDType::F32, 0.5, 0.0)?;
            }
        }
        if shape.arch == Arch::Qwen3 {
            add(p("attn_q_norm"), 1, hd, GgmlDType::F32, 0.2, 1.0)?;
            add(p("attn_k_norm"), 1, hd, GgmlDType::F32, 0.2, 1.0)?;
        }
        add(p("attn_output"), shape.dim, q_rows, GgmlDType::Q6K, out * attn, 0.0)?;
        add(p("ffn_norm"), 1, shape.dim, GgmlDType::F32, 0.2, 1.0)?;
        add(p("ffn_gate"), shape.ffn_dim, shape.dim, GgmlDType::Q4_1, 2.0 * attn, 0.0)?;
        add(p("ffn_up"), shape.ffn_dim, shape.dim, GgmlDType::Q4_1, 2.0 * attn, 0.0)?;
        add(p("ffn_down"), shape.dim, shape.ffn_dim, GgmlDType::Q4_0, out / (shape.ffn_dim as f32).sqrt(), 0.0)?;
    }
    if shape.arch == Arch::Llama31 {
        let t = Tensor::from_vec(llama31_rope_factors(hd, ROPE_BASE_31), &[hd / 2], &Device::Cpu).map_err(e)?;
        tensors.push(("rope_freqs.weight".into(), QTensor::quantize(&t, GgmlDType::F32).map_err(e)?));
    }
    Ok(tensors)
}

/// Llama 3.1's RoPE base.
const ROPE_BASE_31: f32 = 500_000.0;

/// The model's metadata under its architecture's prefix.
fn metadata(shape: Shape, seed: u64) -> Vec<(String, gguf_file::Value)> {
    let u = |x: usize| gguf_file::Value::U32(x as u32);
    let arch = shape.arch.gguf_name();
    let base = if shape.arch == Arch::Llama31 { ROPE_BASE_31 } else { 10000.0 };
    vec![
        ("general.architecture".into(), gguf_file::Value::String(arch.into())),
        ("general.name".into(), gguf_file::Value::String(format!("zerolayer synthetic {arch} {seed}"))),
        (format!("{arch}.block_count"), u(shape.n_layers)),
        (format!("{arch}.embedding_length"), u(shape.dim)),
        (format!("{arch}.feed_forward_length"), u(shape.ffn_dim)),
        (format!("{arch}.attention.head_count"), u(shape.n_heads)),
        (format!("{arch}.attention.head_count_kv"), u(shape.n_kv_heads)),
        (format!("{arch}.attention.key_length"), u(shape.head_dim)),
        (format!("{arch}.attention.value_length"), u(shape.head_dim)),
        (format!("{arch}.rope.dimension_count"), u(shape.head_dim)),
        (format!("{arch}.context_length"), u(shape.context)),
        (format!("{arch}.rope.freq_base"), gguf_file::Value::F32(base)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), gguf_file::Value::F32(1e-5)),
    ]
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
        let l = m.forward(&mut cache, &[ForwardItem { tokens: &[1, 20, 300, 4], start_pos: 0, block_table: &table, logits: 1 }]).unwrap().remove(0);
        assert!(l.iter().all(|x| x.is_finite()));
        let (mn, mx) = l.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(mx - mn > 1.0, "logits span {mn}..{mx}");
    }

    /// A block table naming a block outside the cache, where the step reads or writes, is
    /// refused before any kernel runs (a rank host's tables come from the network); entries past
    /// the sequence's end are never read, and may be anything.
    #[test]
    fn a_block_outside_the_cache_is_refused_before_any_kernel() {
        let dir = std::env::temp_dir().join(format!("zl-synth-oob-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        write(&path, Shape { n_layers: 1, vocab: 512, ..Shape::default() }, 9).unwrap();
        let (mut m, _) = Model::from_gguf(&path, 1, |_, _| {}).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let mut cache = KvCache::new(&m.cfg, 16, zerolayer_common::config::KvDtype::F32, 4);
        let tokens: Vec<u32> = (1..=20).collect();
        for bad in [[0u32, 4], [u32::MAX, 1], [4_000_000, 0]] {
            let e = m.forward(&mut cache, &[ForwardItem { tokens: &tokens, start_pos: 0, block_table: &bad, logits: 1 }]).unwrap_err();
            assert!(e.to_string().contains("outside the cache"), "{e}");
        }
        // Reading back blocks 0 and 1 from a later position too.
        let e = m.forward(&mut cache, &[ForwardItem { tokens: &[7], start_pos: 20, block_table: &[9, 1], logits: 1 }]).unwrap_err();
        assert!(e.to_string().contains("block 9 is outside the cache (4 blocks)"), "{e}");
        let ok = m.forward(&mut cache, &[ForwardItem { tokens: &tokens, start_pos: 0, block_table: &[2, 3, 77, u32::MAX], logits: 1 }]).unwrap();
        assert!(ok[0].iter().all(|x| x.is_finite()));
    }

    /// As a Qwen2 it loads as one: half-split RoPE and Q/K/V biases.
    #[test]
    fn a_synthetic_qwen2_has_biases_and_half_split_rope() {
        let dir = std::env::temp_dir().join(format!("zl-synth-qwen2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        write(&path, Shape { n_layers: 2, vocab: 512, arch: Arch::Qwen2, ..Shape::default() }, 7).unwrap();
        let (m, _) = Model::from_gguf(&path, 1, |_, _| {}).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(m.cfg.arch, "qwen2");
        assert_eq!(m.cfg.rope_style, zerolayer_kernels::ops::RopeStyle::HalfSplit);
        let bias = m.parts().layers[0].bqkv.expect("Q/K/V biases");
        assert_eq!(bias.len(), (8 + 2 + 2) * 64);
        assert!(bias.iter().any(|b| *b != 0.0));
    }
}
