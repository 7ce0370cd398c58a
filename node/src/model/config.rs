//! A model's architecture hyper-parameters: what its weights, its shards and its KV cache are
//! sized by, and what its layers compute beyond a Llama layer.

use zerolayer_common::config::KvDtype;
use zerolayer_kernels::ops::RopeStyle;

/// Architecture hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Each head's width. `n_heads * head_dim` (the attention width) may differ from `dim`
    /// (Gemma 3, Qwen3).
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub rope_style: RopeStyle,
    /// The softmax scale of attention scores (`1 / sqrt(head_dim)` but in Gemma 3 27B).
    pub attn_scale: f32,
    /// Every token embedding is multiplied by this before layer 0 (Gemma: `sqrt(dim)`; 1 else).
    pub embed_scale: f32,
    /// The FFN's gate activation.
    pub activation: Activation,
    /// Q and K are RMS-normalized per head before RoPE (Gemma 3, Qwen3: `attn_q_norm`,
    /// `attn_k_norm`).
    pub qk_norm: bool,
    /// The attention and FFN outputs are RMS-normalized before each residual add (Gemma 3:
    /// `post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Sliding-window attention: local layers read the last `sliding_window` positions (0:
    /// every layer reads the whole context).
    pub sliding_window: usize,
    /// Every `swa_period`-th layer is global, the others local (Gemma 3: 6; llama.cpp's
    /// `swa_pattern`).
    pub swa_period: usize,
    /// The local layers' RoPE base (Gemma 3: 10000, where the global layers' is 1e6).
    pub rope_base_local: f32,
    /// Global layers' RoPE position scale (linear scaling: `1 / factor`; 1 without scaling).
    pub rope_pos_scale: f32,
}

/// A gated FFN's activation: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (Llama, Qwen, Mistral).
    Silu,
    /// GELU, tanh approximation (Gemma's GeGLU), as llama.cpp computes it: looked up by the
    /// input rounded to f16.
    GeluTanh,
}

impl Default for ModelConfig {
    /// A Llama layer's choices, with no sizes: what a test or a converter fills in.
    fn default() -> Self {
        ModelConfig {
            arch: "llama".into(),
            n_layers: 0,
            dim: 0,
            ffn_dim: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            vocab_size: 0,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            context_length: 4096,
            rope_style: RopeStyle::Interleaved,
            attn_scale: 0.0,
            embed_scale: 1.0,
            activation: Activation::Silu,
            qk_norm: false,
            post_norms: false,
            sliding_window: 0,
            swa_period: 0,
            rope_base_local: 10000.0,
            rope_pos_scale: 1.0,
        }
    }
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// Bytes of KV cache per token across all layers (K and V), in elements of `dtype`.
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> usize {
        self.n_layers * 2 * self.kv_dim() * dtype.bytes()
    }
    /// Layer `layer`'s sliding window: `sliding_window` on a local layer, 0 on a global one
    /// (llama.cpp: layer `il` is local when `il % period < period - 1`).
    pub fn window_of(&self, layer: usize) -> usize {
        if self.sliding_window > 0 && self.swa_period > 0 && layer % self.swa_period < self.swa_period - 1 {
            self.sliding_window
        } else {
            0
        }
    }
    /// Whether the model computes anything a plain Llama layer does not (what only the CPU
    /// backend runs so far).
    pub fn is_llama_layer(&self) -> bool {
        !self.qk_norm && !self.post_norms && self.sliding_window == 0 && self.embed_scale == 1.0 && self.activation == Activation::Silu
    }
}
