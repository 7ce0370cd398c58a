//! A model's architecture hyper-parameters: what its weights, its shards and its KV cache are
//! sized by.

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
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub rope_style: RopeStyle,
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
}
