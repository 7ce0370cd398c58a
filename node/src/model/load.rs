//! Loading a [`Model`] from a GGUF file or a Hugging Face safetensors checkpoint: the
//! architecture from metadata, each tensor into the kernels' weight formats (F32, F16 and BF16
//! keep their values and Q4_0, Q4_1 and Q8_0 their blocks, Q5_0 becomes Q8_0 exactly, Q4_K, Q5_K
//! and Q6_K are repacked exactly, Q5_1 becomes Q5K exactly, the rest is dequantized to F32).

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use zerolayer_kernels::ops::RopeStyle;
use zerolayer_kernels::quant::{Weight, WeightFormat};

use super::{Activation, Layer, Model, ModelConfig};
use crate::error::{Result, WorkerError};

/// The GGUF architectures this engine runs, each checked against llama.cpp's forward pass (Llama
/// 3.1's `rope_freqs` and Qwen3 on synthetic files: `tests/tests/synthetic.rs`).
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

/// A GGUF file's metadata, read by key under its architecture's prefix.
struct Meta<'a> {
    md: &'a HashMap<String, gguf_file::Value>,
    arch: &'a str,
}

impl Meta<'_> {
    fn get(&self, k: &str) -> Option<&gguf_file::Value> {
        self.md.get(&format!("{}.{k}", self.arch))
    }
    fn u(&self, k: &str) -> Result<usize> {
        let v = self.get(k).ok_or_else(|| WorkerError::Model(format!("GGUF metadata lacks {}.{k}", self.arch)))?;
        v.to_u64().map(|v| v as usize).or_else(|_| v.to_u32().map(|v| v as usize)).map_err(WorkerError::candle)
    }
    fn f(&self, k: &str, default: f32) -> f32 {
        self.get(k).and_then(|v| v.to_f32().ok()).unwrap_or(default)
    }
    fn s(&self, k: &str) -> Option<String> {
        self.get(k).and_then(|v| v.to_string().ok()).cloned()
    }
}

/// The architecture's hyper-parameters from GGUF metadata (`vocab_size` from the embedding).
fn gguf_config(md: &HashMap<String, gguf_file::Value>, arch: &str, vocab_size: usize, rope_freqs: bool) -> Result<ModelConfig> {
    let m = Meta { md, arch };
    let (n_heads, dim, n_layers) = (m.u("attention.head_count")?, m.u("embedding_length")?, m.u("block_count")?);
    let head_dim = m.u("attention.key_length").or_else(|_| m.u("rope.dimension_count")).unwrap_or(dim / n_heads.max(1));
    if m.u("attention.value_length").is_ok_and(|v| v != head_dim) || m.u("rope.dimension_count").is_ok_and(|r| r != head_dim) {
        return Err(WorkerError::Model(format!("{arch}: value heads or rotary dimensions narrower than the key heads ({head_dim}) are not supported")));
    }
    let mut cfg = ModelConfig {
        arch: arch.into(),
        n_layers,
        dim,
        ffn_dim: m.u("feed_forward_length")?,
        n_heads,
        n_kv_heads: m.u("attention.head_count_kv").unwrap_or(n_heads),
        head_dim,
        vocab_size,
        rope_base: m.f("rope.freq_base", 10000.0),
        rms_eps: m.f("attention.layer_norm_rms_epsilon", 1e-5),
        context_length: m.u("context_length").unwrap_or(4096),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        ..ModelConfig::default()
    };
    // llama.cpp permutes Q and K of Llama GGUFs for interleaved RoPE; the others rotate by
    // halves ("NEOX" style).
    cfg.rope_style = if arch == "llama" { RopeStyle::Interleaved } else { RopeStyle::HalfSplit };
    match m.s("rope.scaling.type").as_deref() {
        None | Some("none") => {}
        Some("linear") => cfg.rope_pos_scale = 1.0 / m.f("rope.scaling.factor", 1.0),
        Some(other) => return Err(WorkerError::Model(format!("{arch}: RoPE scaling {other:?} is not supported (none, linear)"))),
    }
    if rope_freqs && arch != "llama" {
        return Err(WorkerError::Model(format!("{arch}: a rope_freqs tensor is read for llama only")));
    }
    match arch {
        "qwen3" => cfg.qk_norm = true,
        "gemma3" => {
            cfg.qk_norm = true;
            cfg.post_norms = true;
            cfg.activation = Activation::GeluTanh;
            cfg.embed_scale = (dim as f32).sqrt();
            cfg.sliding_window = m.u("attention.sliding_window")?;
            cfg.swa_period = m.u("attention.sliding_window_pattern").unwrap_or(6);
            cfg.rope_base_local = 10000.0;
            // llama.cpp: Gemma 3 27B (62 layers) scales queries by the model's width per head.
            if n_layers == 62 {
                cfg.attn_scale = 1.0 / ((dim / n_heads) as f32).sqrt();
            }
        }
        _ => {}
    }
    Ok(cfg)
}

impl Model {
    /// Loads a GGUF file (the architectures in [`ARCHITECTURES`]). Anything else is refused,
    /// naming the file, what it holds and what is supported.
    pub fn from_gguf(path: &Path, threads: usize, mut progress: impl FnMut(usize, usize)) -> Result<(Self, HashMap<String, gguf_file::Value>)> {
        let mut file = std::fs::File::open(path).map_err(|e| WorkerError::Model(format!("opening {}: {e}", path.display())))?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| WorkerError::Model(format!("reading GGUF {}: {e}", path.display())))?;
        let md = &content.metadata;
        let arch = md.get("general.architecture").and_then(|v| v.to_string().ok()).cloned().unwrap_or_else(|| "llama".into());
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(WorkerError::Model(format!(
                "{}: GGUF architecture {arch:?} is not supported (supported: {})",
                path.display(),
                ARCHITECTURES.join(", ")
            )));
        }
        let has = |name: &str| content.tensor_infos.contains_key(name);
        let mut get = |name: &str| -> Result<QTensor> {
            content.tensor(&mut file, name, &Device::Cpu).map_err(|e| WorkerError::Model(format!("{}: tensor {name}: {e}", path.display())))
        };
        let embed = to_weight(get("token_embd.weight")?)?;
        let cfg = gguf_config(md, &arch, embed.rows, has("rope_freqs.weight")).map_err(|e| WorkerError::Model(format!("{}: {e}", path.display())))?;
        let rope_freqs = if has("rope_freqs.weight") { Some(to_vec(get("rope_freqs.weight")?)?) } else { None };
        let output = if has("output.weight") { Some(to_weight(get("output.weight")?)?) } else { None };
        let norm = to_vec(get("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let bias = |s: &str| format!("blk.{i}.{s}.bias");
            let (wq, wk, wv) = (to_weight(get(&p("attn_q"))?)?, to_weight(get(&p("attn_k"))?)?, to_weight(get(&p("attn_v"))?)?);
            let bqkv = if has(&bias("attn_q")) {
                let b = [to_vec(get(&bias("attn_q"))?)?, to_vec(get(&bias("attn_k"))?)?, to_vec(get(&bias("attn_v"))?)?].concat();
                if b.len() != wq.rows + wk.rows + wv.rows {
                    return Err(WorkerError::Model(format!("layer {i}: Q/K/V biases have {} values for {} rows", b.len(), wq.rows + wk.rows + wv.rows)));
                }
                Some(b)
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm { Some((to_vec(get(&p("attn_q_norm"))?)?, to_vec(get(&p("attn_k_norm"))?)?)) } else { None };
            let (post_attn_norm, post_ffn_norm) = if cfg.post_norms {
                (Some(to_vec(get(&p("post_attention_norm"))?)?), Some(to_vec(get(&p("post_ffw_norm"))?)?))
            } else {
                (None, None)
            };
            layers.push(Layer {
                attn_norm: to_vec(get(&p("attn_norm"))?)?,
                wqkv: stack(&[&wq, &wk, &wv]),
                bqkv,
                qk_norm,
                wo: to_weight(get(&p("attn_output"))?)?,
                post_attn_norm,
                ffn_norm: to_vec(get(&p("ffn_norm"))?)?,
                wgate_up: stack(&[&to_weight(get(&p("ffn_gate"))?)?, &to_weight(get(&p("ffn_up"))?)?]),
                wdown: to_weight(get(&p("ffn_down"))?)?,
                post_ffn_norm,
            });
            progress(i + 1, cfg.n_layers);
        }
        let md = content.metadata.clone();
        Ok((Self::assemble(cfg, embed, output, norm, layers, rope_freqs.as_deref(), threads)?, md))
    }

    /// Loads a Hugging Face checkpoint: a directory with `config.json` and `*.safetensors`
    /// (F32, F16 or BF16).
    pub fn from_safetensors(dir: &Path, threads: usize, mut progress: impl FnMut(usize, usize)) -> Result<(Self, serde_json::Value)> {
        let cfg_json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)
            .map_err(|e| WorkerError::Model(format!("config.json: {e}")))?;
        let gu = |k: &str| cfg_json.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
        let need = |k: &str| gu(k).ok_or_else(|| WorkerError::Model(format!("config.json lacks {k}")));
        let dim = need("hidden_size")?;
        let n_heads = need("num_attention_heads")?;
        let vocab_size = need("vocab_size")?;
        let arch = cfg_json.get("model_type").and_then(|v| v.as_str()).unwrap_or("llama").to_string();
        if !["llama", "qwen2"].contains(&arch.as_str()) {
            return Err(WorkerError::Model(format!("{}: safetensors model_type {arch:?} is not supported (llama, qwen2; other architectures load from GGUF)", dir.display())));
        }
        let head_dim = gu("head_dim").unwrap_or(dim / n_heads);
        let cfg = ModelConfig {
            arch,
            n_layers: need("num_hidden_layers")?,
            dim,
            ffn_dim: need("intermediate_size")?,
            n_heads,
            n_kv_heads: gu("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
            vocab_size,
            rope_base: cfg_json.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(10000.0) as f32,
            rms_eps: cfg_json.get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-5) as f32,
            context_length: gu("max_position_embeddings").unwrap_or(4096),
            rope_style: RopeStyle::HalfSplit,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            ..ModelConfig::default()
        };
        let mut files: Vec<_> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(WorkerError::Model(format!("no *.safetensors in {}", dir.display())));
        }
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for f in &files {
            tensors.extend(candle_core::safetensors::load(f, &Device::Cpu).map_err(WorkerError::candle)?);
        }
        let mut take = |name: &str| tensors.remove(name).ok_or_else(|| WorkerError::Model(format!("safetensors lack {name}")));
        let embed = dense_weight(&take("model.embed_tokens.weight")?)?;
        let output = match take("lm_head.weight") {
            Ok(t) => Some(dense_weight(&t)?),
            Err(_) => None,
        };
        let norm = dense_vec(&take("model.norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}.weight");
            let wq = dense_weight(&take(&p("self_attn.q_proj"))?)?;
            let wk = dense_weight(&take(&p("self_attn.k_proj"))?)?;
            let wv = dense_weight(&take(&p("self_attn.v_proj"))?)?;
            let wg = dense_weight(&take(&p("mlp.gate_proj"))?)?;
            let wu = dense_weight(&take(&p("mlp.up_proj"))?)?;
            let bias = |s: &str| format!("model.layers.{i}.{s}.bias");
            let bqkv = match take(&bias("self_attn.q_proj")) {
                Ok(bq) => {
                    let mut b = dense_vec(&bq)?;
                    b.extend(dense_vec(&take(&bias("self_attn.k_proj"))?)?);
                    b.extend(dense_vec(&take(&bias("self_attn.v_proj"))?)?);
                    Some(b)
                }
                Err(_) => None,
            };
            layers.push(Layer {
                attn_norm: dense_vec(&take(&p("input_layernorm"))?)?,
                wqkv: stack(&[&wq, &wk, &wv]),
                bqkv,
                qk_norm: None,
                wo: dense_weight(&take(&p("self_attn.o_proj"))?)?,
                post_attn_norm: None,
                ffn_norm: dense_vec(&take(&p("post_attention_layernorm"))?)?,
                wgate_up: stack(&[&wg, &wu]),
                wdown: dense_weight(&take(&p("mlp.down_proj"))?)?,
                post_ffn_norm: None,
            });
            progress(i + 1, cfg.n_layers);
        }
        Ok((Self::assemble(cfg, embed, output, norm, layers, None, threads)?, cfg_json))
    }

}

fn stack(parts: &[&Weight]) -> Weight {
    Weight::concat_rows(parts).unwrap_or_else(|| {
        // Mixed formats: fall back to F32 for the stacked weight.
        let cols = parts[0].cols;
        let mut vals = Vec::new();
        let mut row = vec![0f32; cols];
        for p in parts {
            for r in 0..p.rows {
                p.dequantize_row(r, &mut row);
                vals.extend_from_slice(&row);
            }
        }
        Weight::from_f32(vals.len() / cols, cols, &vals)
    })
}

fn to_vec(qt: QTensor) -> Result<Vec<f32>> {
    qt.dequantize(&Device::Cpu).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).map_err(WorkerError::candle)
}

/// Converts a GGUF tensor to a kernel weight: F32/F16/BF16 keep their values and Q4_0/Q4_1/Q8_0
/// their blocks, Q5_0 becomes Q8_0, Q4_K/Q5_K/Q6_K are repacked and Q5_1 stored as Q5K (all
/// exactly), everything else is dequantized through candle to F32.
fn to_weight(qt: QTensor) -> Result<Weight> {
    let (rows, cols) = qt.shape().dims2().map_err(WorkerError::candle)?;
    let fmt = match qt.dtype() {
        GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
        GgmlDType::Q4_1 => Some(WeightFormat::Q4_1),
        GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
        GgmlDType::F32 => Some(WeightFormat::F32),
        GgmlDType::F16 => Some(WeightFormat::F16),
        GgmlDType::BF16 => Some(WeightFormat::BF16),
        _ => None,
    };
    match (qt.dtype(), fmt) {
        // K-quants are repacked into our 32-element panels (exact scales, no precision lost).
        (GgmlDType::Q4K, _) if cols % 256 == 0 => Ok(Weight::from_q4_k(rows, cols, &qt.data().map_err(WorkerError::candle)?)),
        (GgmlDType::Q6K, _) if cols % 256 == 0 => Ok(Weight::from_q6_k(rows, cols, &qt.data().map_err(WorkerError::candle)?)),
        // 5-bit quants with a min, one per byte (Q5_K repacked; Q5_1 with its own scales).
        (GgmlDType::Q5K, _) if cols % 256 == 0 => Ok(Weight::from_q5_k(rows, cols, &qt.data().map_err(WorkerError::candle)?)),
        (GgmlDType::Q5_1, _) => Ok(Weight::from_q5_1(rows, cols, &qt.data().map_err(WorkerError::candle)?)),
        // Q5_0 quants fit Q8_0's bytes: same scales, exact values, the Q8_0 kernels.
        (GgmlDType::Q5_0, _) => Ok(Weight::from_q5_0(rows, cols, &qt.data().map_err(WorkerError::candle)?)),
        (_, Some(f)) => Ok(Weight::new(f, rows, cols, qt.data().map_err(WorkerError::candle)?.into_owned())),
        (_, None) => {
            let t = qt.dequantize(&Device::Cpu).map_err(WorkerError::candle)?;
            dense_weight(&t)
        }
    }
}

fn dense_weight(t: &Tensor) -> Result<Weight> {
    let (rows, cols) = t.dims2().map_err(WorkerError::candle)?;
    let v = dense_vec(t)?;
    Ok(Weight::from_f32(rows, cols, &v))
}

fn dense_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>()).map_err(WorkerError::candle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Module;
    use zerolayer_kernels::pool::ThreadPool;
    use zerolayer_kernels::quant::{matmul, MatmulScratch};

    /// A GGUF of an architecture this engine does not run is refused at load, naming the file,
    /// the architecture found and those supported.
    #[test]
    fn an_unknown_architecture_is_refused_naming_file_and_choices() {
        let path = std::env::temp_dir().join(format!("zl-phi3-{}.gguf", std::process::id()));
        let t = QTensor::quantize(&Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
        let arch = gguf_file::Value::String("phi3".into());
        let mut f = std::fs::File::create(&path).unwrap();
        gguf_file::write(&mut f, &[("general.architecture", &arch)], &[("token_embd.weight", &t)]).unwrap();
        drop(f);
        let e = match Model::from_gguf(&path, 1, |_, _| {}) {
            Ok(_) => panic!("phi3 loaded"),
            Err(e) => e.to_string(),
        };
        let _ = std::fs::remove_file(&path);
        assert!(e.contains(&path.display().to_string()) && e.contains("\"phi3\"") && e.contains("llama, qwen2, qwen3, gemma3"), "{e}");
    }

    /// Every GGUF tensor type the engine loads, from the bytes gguf-py (llama.cpp's Python
    /// reference) dequantized (`scripts/gen-dequant-fixtures`, `tests/fixtures/dequant.json`):
    /// loaded as a model's tensors are, each value is gguf-py's bit for bit, and each type lands
    /// in the format its docs promise (all natively: Q5_0 as Q8_0, Q5_1 as Q5K).
    #[test]
    fn every_tensor_type_loads_as_gguf_py_dequantizes_it() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/dequant.json");
        let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).expect("tests/fixtures/dequant.json (scripts/gen-dequant-fixtures)")).unwrap();
        let cases = fx["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 10);
        for c in cases {
            let name = c["type"].as_str().unwrap();
            let (dt, format) = match name {
                "F16" => (GgmlDType::F16, WeightFormat::F16),
                "BF16" => (GgmlDType::BF16, WeightFormat::BF16),
                "Q4_0" => (GgmlDType::Q4_0, WeightFormat::Q4_0),
                "Q4_1" => (GgmlDType::Q4_1, WeightFormat::Q4_1),
                "Q5_0" => (GgmlDType::Q5_0, WeightFormat::Q8_0),
                "Q5_1" => (GgmlDType::Q5_1, WeightFormat::Q5K),
                "Q8_0" => (GgmlDType::Q8_0, WeightFormat::Q8_0),
                "Q4_K" => (GgmlDType::Q4K, WeightFormat::Q4K),
                "Q5_K" => (GgmlDType::Q5K, WeightFormat::Q5K),
                "Q6_K" => (GgmlDType::Q6K, WeightFormat::Q6K),
                other => panic!("unexpected type {other}"),
            };
            let (rows, cols) = (c["rows"].as_u64().unwrap() as usize, c["cols"].as_u64().unwrap() as usize);
            let hex = c["bytes"].as_str().unwrap().as_bytes();
            let bytes: Vec<u8> = hex.chunks_exact(2).map(|h| u8::from_str_radix(std::str::from_utf8(h).unwrap(), 16).unwrap()).collect();
            let qt = candle_core::quantized::ggml_file::qtensor_from_ggml(dt, &bytes, vec![rows, cols], &Device::Cpu).unwrap();
            let w = to_weight(qt).unwrap();
            assert_eq!(w.format, format, "{name}");
            let want: Vec<u32> = c["f32_bits"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u32).collect();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for (i, v) in row.iter().enumerate() {
                    assert_eq!(v.to_bits(), want[r * cols + i], "{name}: row {r} element {i}: {v} where gguf-py has {}", f32::from_bits(want[r * cols + i]));
                }
            }
        }
    }

    /// Our view of candle's block formats agrees with candle's own dequantization and matmul.
    #[test]
    fn native_formats_match_candle() {
        let (rows, cols) = (48, 256);
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i % 13) as f32)).collect();
        let t = Tensor::from_vec(vals, (rows, cols), &Device::Cpu).unwrap();
        let x: Vec<f32> = (0..3 * cols).map(|i| (i * 31 % 97) as f32 / 97.0 - 0.5).collect();
        let xt = Tensor::from_vec(x.clone(), (3, cols), &Device::Cpu).unwrap();
        let pool = ThreadPool::new(2);
        for dt in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_0, GgmlDType::F32, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K, GgmlDType::F16] {
            let q = QTensor::quantize(&t, dt).unwrap();
            let want = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let q2 = QTensor::quantize(&t, dt).unwrap();
            let w = to_weight(q2).unwrap();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                assert_eq!(&row[..], &want[r * cols..(r + 1) * cols], "{dt:?} row {r}");
            }
            let qm = candle_core::quantized::QMatMul::from_qtensor(QTensor::quantize(&t, dt).unwrap()).unwrap();
            let cand = qm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut ours = vec![0f32; 3 * rows];
            matmul(&pool, &w, &x, &mut ours, &mut MatmulScratch::default());
            let err = ours.iter().zip(&cand).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let scale = cand.iter().map(|v| v.abs()).fold(0f32, f32::max);
            // Float weights multiply in f32 on both sides (only the summation order differs);
            // quantized ones go through int8 activations here and candle's own quantized dots.
            let tolerance = if matches!(dt, GgmlDType::F32 | GgmlDType::F16) { 1e-5 } else { 2e-2 };
            assert!(err <= tolerance * scale, "{dt:?}: matmul differs from candle by {err} (scale {scale}, tolerance {tolerance})");
        }
    }
}
