//! The cluster configuration: defaults < `cluster.toml` < `ZEROLAYER_*` environment variables.
//!
//! Environment variables use `__` between levels, e.g. `ZEROLAYER_MODEL__PATH=...` or
//! `ZEROLAYER_SERVER__SHUTDOWN_GRACE_SECS=5`. Every limit has a default and a reason next to it.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Figment(#[from] Box<figment::Error>),
    #[error("configuration: {0}")]
    Invalid(String),
}

/// The whole cluster, as every node sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClusterConfig {
    pub model: ModelSection,
    pub server: ServerSection,
    pub auth: AuthSection,
    pub limits: LimitsSection,
    pub nodes: Vec<NodeConfig>,
}

/// API keys. With none configured the node is open (a development default, announced at
/// startup). Keys are compared in constant time and never logged.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct AuthSection {
    /// Keys accepted as `x-api-key` or `Authorization: Bearer` on the API.
    pub api_keys: Vec<String>,
    /// A file with one API key per line (blank lines and `#` comments ignored).
    pub api_keys_file: Option<PathBuf>,
    /// The key for `/admin/*` and the admin CLI. A user key there gets 403.
    pub admin_key: Option<String>,
}

/// Per-key rate limits (token buckets). 0 means unlimited.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LimitsSection {
    pub requests_per_minute: u32,
    /// Prompt tokens per minute.
    pub tokens_per_minute: u32,
}

/// The served model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ModelSection {
    /// A GGUF file, or a directory with `config.json` and `*.safetensors`.
    /// Relative paths resolve against the config file's directory. (`ZEROLAYER_MODEL__PATH`)
    pub path: PathBuf,
    /// Optional `tokenizer.json` (otherwise the GGUF metadata, or `tokenizer.json` beside the weights).
    pub tokenizer: Option<PathBuf>,
    /// The model id clients send in `model`.
    pub id: String,
    /// Other names accepted for the same model.
    pub aliases: Vec<String>,
    pub display_name: String,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            tokenizer: None,
            id: "smollm2-135m-instruct".into(),
            aliases: vec!["SmolLM2-135M-Instruct".into()],
            display_name: "SmolLM2 135M Instruct (Q4_1)".into(),
        }
    }
}

/// HTTP serving limits.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ServerSection {
    /// Request bodies above this get 413 (Anthropic's limit is 32 MB).
    pub max_body_bytes: usize,
    /// On SIGTERM, in-flight requests get this long to finish.
    pub shutdown_grace_secs: u64,
    /// A streaming response sends `ping` after this much idle time.
    pub ping_interval_ms: u64,
    /// Most requests in flight on one node; more get 529.
    pub max_inflight: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection { max_body_bytes: 32 * 1024 * 1024, shutdown_grace_secs: 30, ping_interval_ms: 5000, max_inflight: 256 }
    }
}

/// One node (one process).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct NodeConfig {
    pub id: String,
    /// HTTP listen address; port 0 picks one.
    pub http: String,
    pub workers: Vec<WorkerConfig>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig { id: "n1".into(), http: "127.0.0.1:8080".into(), workers: vec![WorkerConfig::default()] }
    }
}

/// One worker (one device).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct WorkerConfig {
    pub id: String,
    /// `cpu` (a `cuda:N` backend comes later).
    pub device: String,
    /// Kernel threads (0: all cores).
    pub threads: usize,
    /// KV cache memory budget.
    pub kv_cache_mb: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most tokens computed in one engine step (chunked prefill budget).
    pub max_batch_tokens: usize,
    /// Most sequences in the running batch.
    pub max_running: usize,
    /// Most sequences waiting for admission; more are refused (529 upstream).
    pub max_waiting: usize,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            id: "cpu0".into(),
            device: "cpu".into(),
            threads: 0,
            kv_cache_mb: 1024,
            block_size: 16,
            max_batch_tokens: 512,
            max_running: 32,
            max_waiting: 256,
        }
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            model: ModelSection::default(),
            server: ServerSection::default(),
            auth: AuthSection::default(),
            limits: LimitsSection::default(),
            nodes: vec![NodeConfig::default()],
        }
    }
}

impl ClusterConfig {
    /// Loads defaults, then `path` (if given and present), then `ZEROLAYER_*` env, then validates.
    /// Relative model paths are resolved against the config file's directory.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(ClusterConfig::default()));
        if let Some(p) = path {
            if !p.exists() {
                return Err(ConfigError::Invalid(format!("config file {} does not exist", p.display())));
            }
            fig = fig.merge(Toml::file(p));
        }
        fig = fig.merge(Env::prefixed("ZEROLAYER_").split("__"));
        let mut cfg: ClusterConfig = fig.extract().map_err(Box::new)?;
        if let Some(dir) = path.and_then(|p| p.parent()) {
            cfg.resolve_paths(dir);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a TOML string over the defaults (no env), for tests.
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let cfg: ClusterConfig =
            Figment::from(Serialized::defaults(ClusterConfig::default())).merge(Toml::string(s)).extract().map_err(Box::new)?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn resolve_paths(&mut self, dir: &Path) {
        if self.model.path.is_relative() && !dir.as_os_str().is_empty() {
            self.model.path = dir.join(&self.model.path);
        }
        if let Some(f) = &self.auth.api_keys_file {
            if f.is_relative() && !dir.as_os_str().is_empty() {
                self.auth.api_keys_file = Some(dir.join(f));
            }
        }
        if let Some(t) = &self.model.tokenizer {
            if t.is_relative() && !dir.as_os_str().is_empty() {
                self.model.tokenizer = Some(dir.join(t));
            }
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.nodes.is_empty() {
            return bad("at least one [[nodes]] entry is required".into());
        }
        let mut ids = std::collections::HashSet::new();
        for n in &self.nodes {
            if !ids.insert(&n.id) {
                return bad(format!("duplicate node id {:?}", n.id));
            }
            if n.workers.is_empty() {
                return bad(format!("node {:?} has no workers", n.id));
            }
            for w in &n.workers {
                if w.block_size == 0 || w.block_size > 256 {
                    return bad(format!("worker {}/{}: block_size must be in 1..=256", n.id, w.id));
                }
                if w.max_batch_tokens == 0 || w.max_running == 0 {
                    return bad(format!("worker {}/{}: max_batch_tokens and max_running must be > 0", n.id, w.id));
                }
                if w.kv_cache_mb == 0 {
                    return bad(format!("worker {}/{}: kv_cache_mb must be > 0", n.id, w.id));
                }
                if w.device != "cpu" {
                    return bad(format!("worker {}/{}: device {:?} is not supported yet (use \"cpu\")", n.id, w.id, w.device));
                }
            }
        }
        if self.model.id.is_empty() {
            return bad("model.id must not be empty".into());
        }
        Ok(())
    }

    /// Every configured API key: `auth.api_keys` plus the lines of `auth.api_keys_file`.
    pub fn api_keys(&self) -> Result<Vec<String>, ConfigError> {
        let mut keys = self.auth.api_keys.clone();
        if let Some(f) = &self.auth.api_keys_file {
            let text = std::fs::read_to_string(f)
                .map_err(|e| ConfigError::Invalid(format!("auth.api_keys_file {}: {e}", f.display())))?;
            keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from));
        }
        if keys.iter().any(|k| k.len() < 8) {
            return Err(ConfigError::Invalid("API keys must be at least 8 characters".into()));
        }
        Ok(keys)
    }

    pub fn node(&self, id: &str) -> Option<&NodeConfig> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_overrides_defaults() {
        let c = ClusterConfig::from_toml(
            r#"
            [model]
            id = "m"
            [[nodes]]
            id = "a"
            http = "127.0.0.1:0"
            [[nodes.workers]]
            id = "cpu0"
            kv_cache_mb = 64
            "#,
        )
        .unwrap();
        assert_eq!(c.model.id, "m");
        assert_eq!(c.nodes[0].workers[0].kv_cache_mb, 64);
        assert_eq!(c.nodes[0].workers[0].block_size, 16);
        assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes]]\nid='a'\n").is_err());
    }
}
