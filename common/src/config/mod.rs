//! The cluster configuration: defaults < `cluster.toml` < `ZEROLAYER_*` environment variables.
//!
//! Environment variables use `__` between levels, e.g. `ZEROLAYER_MODEL__PATH=...` or
//! `ZEROLAYER_SERVER__SHUTDOWN_GRACE_SECS=5`. Every limit has a default and a reason next to it.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod access;
mod validate;
mod worker;
pub use access::{AuthSection, KeyConfig, LimitsSection, Tenant, TenantLimits};
pub use worker::{KvDtype, WorkerConfig};

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
    /// The default model: workers that name no `model` load it.
    pub model: ModelSection,
    /// More models the cluster serves (`[[models]]`): a worker loads one with `model = "<id>"`.
    /// Every node reads the tokenizer and chat template of every model (it renders prompts for
    /// all of them), so each node needs every model's file.
    pub models: Vec<ModelSection>,
    pub server: ServerSection,
    pub auth: AuthSection,
    pub limits: LimitsSection,
    pub cluster: ClusterSection,
    pub placement: PlacementConfig,
    pub nodes: Vec<NodeConfig>,
}

/// How nodes find and trust each other. Only used when the nodes have `quic` addresses.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClusterSection {
    /// Gossip between nodes with another cluster id is ignored.
    pub id: String,
    /// Made by `zerolayer cluster init`: `ca.pem`, and `<node>.pem` + `<node>.key` per node.
    /// Relative to the config file. (`ZEROLAYER_CLUSTER__TLS_DIR`)
    pub tls_dir: Option<PathBuf>,
    /// How often a node gossips with peers, which bounds signal staleness.
    pub gossip_interval_ms: u64,
    /// A silent peer is dead once its silence exceeds this many mean heartbeat gaps (chitchat's
    /// phi is elapsed ÷ mean interval). 40 gaps ≈ 2–4 s at a 100 ms gossip interval: fast, yet
    /// a node stalled by a long prefill on a starved CPU is not declared dead.
    pub phi_threshold: f64,
    /// A QUIC connection with no traffic for this long is closed (keep-alives flow at a third of
    /// it), so a vanished peer fails its open streams within this time.
    pub idle_timeout_ms: u64,
    /// Signals and prefix-cache digests are republished at this interval.
    pub publish_interval_ms: u64,
    /// How many times one request may continue elsewhere (its worker lost, or its node
    /// drained) before it fails with the error it would have had without the move.
    pub migration_limit: u32,
    /// Let nodes whose ids are not in `[[nodes]]` join (their certificate must still come from
    /// the cluster CA and name them). Off: only the configured nodes can connect or gossip.
    pub allow_join: bool,
    /// A dead node's gossip state (and everything kept about it) is dropped this long after
    /// it died, so that restarts and lost nodes do not accumulate.
    pub dead_node_grace_secs: u64,
    /// A worker whose tensor-parallel ranks span nodes (`rank_nodes`) waits at most this long at
    /// startup for every rank's node to answer and build its rank; then the node fails to
    /// start, saying which rank is missing.
    pub rank_join_timeout_ms: u64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            id: "zerolayer".into(),
            tls_dir: None,
            gossip_interval_ms: 100,
            phi_threshold: 40.0,
            idle_timeout_ms: 3000,
            publish_interval_ms: 100,
            migration_limit: 3,
            allow_join: false,
            dead_node_grace_secs: 60,
            rank_join_timeout_ms: 120_000,
        }
    }
}

/// Which placement policy a coordinator uses (benchmarks compare them).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PlacementPolicy {
    RoundRobin,
    LeastLoaded,
    CacheAware,
}

/// Weights and thresholds of the placement cost (units: KV blocks).
///
/// `cost = overlap_weight × uncached_prefill_blocks + active_decode_blocks
///         + queue_weight × waiting_prefill_blocks + remote_hop_blocks (if remote)
///         + fragmentation_weight × fragmentation + memory_weight × memory pressure`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PlacementConfig {
    pub policy: PlacementPolicy,
    /// Weight of each prompt block the worker would have to compute.
    pub overlap_weight: f64,
    /// Weight of each block of prompt already queued on the worker.
    pub queue_weight: f64,
    /// Cost of one QUIC hop, in blocks. The hop itself adds ~1 ms (BENCHMARKS.md); the penalty
    /// keeps a small shared prefix (a chat template's header, ~30 tokens) from pulling cold
    /// requests off an idle local worker. 8 blocks = 32 tokens at the default block size.
    pub remote_hop_blocks: f64,
    /// Penalty per unit of KV fragmentation (0..1).
    pub fragmentation_weight: f64,
    /// Penalty per unit of memory use above `memory_soft_limit` (fraction of the limit).
    pub memory_weight: f64,
    pub memory_soft_limit: f64,
    /// Workers above this fraction of their memory limit are skipped.
    pub memory_high_water: f64,
    /// Blocks of decode room a worker must have beyond the uncached prompt.
    pub decode_headroom_blocks: u32,
    /// Imbalance guard: when max load − min load > abs and max load > rel × min load
    /// (load = running + waiting sequences), pick the least loaded worker.
    pub balance_abs_threshold: u32,
    pub balance_rel_threshold: f64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            policy: PlacementPolicy::CacheAware,
            overlap_weight: 1.0,
            queue_weight: 1.0,
            remote_hop_blocks: 8.0,
            fragmentation_weight: 4.0,
            memory_weight: 64.0,
            memory_soft_limit: 0.85,
            memory_high_water: 0.97,
            decode_headroom_blocks: 8,
            balance_abs_threshold: 16,
            balance_rel_threshold: 1.5,
        }
    }
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
    /// The model id clients send in `model` (vLLM's served model name). Empty: the file names
    /// it at startup ([`ClusterConfig::name_models`]: the GGUF's `general.name` as a slug, else
    /// the file's stem).
    pub id: String,
    /// Other names accepted for the same model.
    pub aliases: Vec<String>,
    pub display_name: String,
    /// Whether special-token strings that clients write (`<|im_start|>` in a message) become
    /// control tokens. Off (the default): what clients write is text, and only the chat
    /// template's own scaffolding yields control tokens, so no one can forge a turn.
    pub special_tokens_in_content: bool,
}

/// Empty: what a `[[models]]` entry's missing fields are (a `display_name` left empty is the
/// id). `[model]`'s missing fields come from [`ModelSection::default_model`] instead.
impl Default for ModelSection {
    fn default() -> Self {
        ModelSection { path: PathBuf::new(), tokenizer: None, id: String::new(), aliases: vec![], display_name: String::new(), special_tokens_in_content: false }
    }
}

impl ModelSection {
    /// The default model, SmolLM2-135M-Instruct (`scripts/fetch-model` fetches it).
    pub fn default_model() -> Self {
        ModelSection {
            path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            id: "smollm2-135m-instruct".into(),
            aliases: vec!["SmolLM2-135M-Instruct".into()],
            display_name: "SmolLM2 135M Instruct (Q4_1)".into(),
            ..ModelSection::default()
        }
    }

    /// The name `/v1/models` shows.
    pub fn shown_name(&self) -> &str {
        if self.display_name.is_empty() {
            &self.id
        } else {
            &self.display_name
        }
    }
}

/// A model name as an id: lowercase ASCII letters, digits, '.', '_' and '-', every other run
/// of characters one '-', at most 64 bytes ("Gemma 3 270m" → `gemma-3-270m`). Empty when
/// nothing of `name` is left.
pub fn model_slug(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars().flat_map(char::to_lowercase) {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let mut slug = out.trim_matches(|c| c == '-' || c == '.').to_string();
    slug.truncate(64);
    slug.trim_end_matches(['-', '.']).to_string()
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
    /// Threads that parse request bodies and run the chat template and tokenizer, off the async
    /// runtime (0: one per CPU core). Requests wait for one inside their in-flight slot, so
    /// gossip and streaming never wait behind a large body.
    pub prepare_threads: usize,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection { max_body_bytes: 32 * 1024 * 1024, shutdown_grace_secs: 30, ping_interval_ms: 5000, max_inflight: 256, prepare_threads: 0 }
    }
}

/// One node (one process).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct NodeConfig {
    pub id: String,
    /// HTTP listen address; port 0 picks one.
    pub http: String,
    /// QUIC address for peers (gossip and forwarded requests). Absent on a single-node cluster.
    pub quic: Option<String>,
    pub workers: Vec<WorkerConfig>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig { id: "n1".into(), http: "127.0.0.1:8080".into(), quic: None, workers: vec![WorkerConfig::default()] }
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            model: ModelSection::default_model(),
            models: Vec::new(),
            server: ServerSection::default(),
            auth: AuthSection::default(),
            limits: LimitsSection::default(),
            cluster: ClusterSection::default(),
            placement: PlacementConfig::default(),
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
        cfg.forget_default_names();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a TOML string over the defaults (no env), for tests.
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let mut cfg: ClusterConfig =
            Figment::from(Serialized::defaults(ClusterConfig::default())).merge(Toml::string(s)).extract().map_err(Box::new)?;
        cfg.forget_default_names();
        cfg.validate()?;
        Ok(cfg)
    }

    /// A `[model]` that loads another file than the default's does not keep the default's id,
    /// aliases and display name (the defaults the file is merged over): a request for
    /// `smollm2-135m-instruct` must not reach another model, which is named by its own file
    /// instead. (The default file under a new id keeps the aliases: they still name it.)
    fn forget_default_names(&mut self) {
        let d = ModelSection::default_model();
        if self.model.path.file_name() != d.path.file_name() {
            if self.model.id == d.id {
                self.model.id.clear();
            }
            if self.model.aliases == d.aliases {
                self.model.aliases.clear();
            }
            if self.model.display_name == d.display_name {
                self.model.display_name.clear();
            }
        }
    }

    /// Names every model whose config gives no `id`, by `name_of(path)` (the loader reads the
    /// file's own name), then checks the whole config again: two files of the same name need
    /// an `id` each.
    pub fn name_models(&mut self, name_of: impl Fn(&Path) -> Result<String, String>) -> Result<(), ConfigError> {
        for m in std::iter::once(&mut self.model).chain(&mut self.models) {
            if m.id.is_empty() {
                m.id = name_of(&m.path).map_err(|e| ConfigError::Invalid(format!("naming the model at {}: {e}", m.path.display())))?;
            }
        }
        self.validate()
    }

    /// Every model the cluster serves: `[model]`, then `[[models]]`.
    pub fn all_models(&self) -> impl Iterator<Item = &ModelSection> {
        std::iter::once(&self.model).chain(&self.models)
    }

    /// The model worker `w` loads.
    pub fn model_of(&self, w: &WorkerConfig) -> &ModelSection {
        match &w.model {
            Some(id) => self.all_models().find(|m| &m.id == id).unwrap_or(&self.model),
            None => &self.model,
        }
    }

    fn resolve_paths(&mut self, dir: &Path) {
        if dir.as_os_str().is_empty() {
            return;
        }
        for m in std::iter::once(&mut self.model).chain(&mut self.models) {
            if m.path.is_relative() {
                m.path = dir.join(&m.path);
            }
            if let Some(t) = &m.tokenizer {
                if t.is_relative() {
                    m.tokenizer = Some(dir.join(t));
                }
            }
        }
        if let Some(f) = &self.auth.api_keys_file {
            if f.is_relative() && !dir.as_os_str().is_empty() {
                self.auth.api_keys_file = Some(dir.join(f));
            }
        }
        if let Some(t) = &self.cluster.tls_dir {
            if t.is_relative() && !dir.as_os_str().is_empty() {
                self.cluster.tls_dir = Some(dir.join(t));
            }
        }
    }

    /// Every unnamed API key: `auth.api_keys` plus the lines of `auth.api_keys_file`.
    pub fn api_keys(&self) -> Result<Vec<String>, ConfigError> {
        self.auth.unnamed_keys().map_err(ConfigError::Invalid)
    }

    /// Every user key as a tenant (see [`access::tenants`]).
    pub fn tenants(&self) -> Result<Vec<Tenant>, ConfigError> {
        access::tenants(&self.auth, &self.limits).map_err(ConfigError::Invalid)
    }

    /// The `[limits]` defaults as one tenant's limits.
    pub fn default_limits(&self) -> TenantLimits {
        self.limits.per_key()
    }

    pub fn node(&self, id: &str) -> Option<&NodeConfig> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_become_ids() {
        assert_eq!(model_slug("Gemma 3 270m"), "gemma-3-270m");
        assert_eq!(model_slug("Qwen2.5 Coder 0.5B Instruct AWQ"), "qwen2.5-coder-0.5b-instruct-awq");
        assert_eq!(model_slug("  Llama-3.2-1B-Instruct.Q4_K_M "), "llama-3.2-1b-instruct.q4_k_m");
        assert_eq!(model_slug("Mistral 7B (v0.3) / Instruct!"), "mistral-7b-v0.3-instruct");
        assert_eq!(model_slug("日本語"), "");
        assert_eq!(model_slug(&"a".repeat(100)).len(), 64);
        assert_eq!(model_slug(&format!("{} b", "a".repeat(63))), "a".repeat(63));
    }

    #[test]
    fn several_models_each_worker_names_one() {
        let c = ClusterConfig::from_toml(
            r#"
            [[models]]
            path = "models/qwen.gguf"
            id = "qwen"
            aliases = ["Qwen2.5-Coder"]
            [[nodes]]
            id = "a"
            [[nodes.workers]]
            id = "cpu0"
            [[nodes.workers]]
            id = "cpu1"
            model = "qwen"
            "#,
        )
        .unwrap();
        let ids: Vec<&str> = c.all_models().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["smollm2-135m-instruct", "qwen"]);
        assert_eq!(c.model_of(&c.nodes[0].workers[0]).id, "smollm2-135m-instruct");
        assert_eq!(c.model_of(&c.nodes[0].workers[1]).id, "qwen");
        let base = "[[models]]\npath='q.gguf'\nid='qwen'\n[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\n";
        // An entry inherits nothing from the default model: no aliases, its id as its name.
        let plain = ClusterConfig::from_toml(base).unwrap();
        assert_eq!((plain.models[0].aliases.len(), plain.models[0].shown_name()), (0, "qwen"));
        assert_eq!(plain.model.aliases, ["SmolLM2-135M-Instruct"]);
        // A [model] naming another model keeps none of the default's names.
        let other = ClusterConfig::from_toml("[model]\npath='q.gguf'\nid='qwen'\n").unwrap();
        assert_eq!((other.model.aliases.len(), other.model.shown_name()), (0, "qwen"));
        assert!(ClusterConfig::from_toml(&format!("{base}model='llama'\n")).is_err(), "a worker names a model that is not configured");
        assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='smollm2-135m-instruct'")).is_err(), "two models share an id");
        assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='SmolLM2-135M-Instruct'")).is_err(), "an id is another's alias");
        assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='q w'")).is_err(), "a model id with a space");
        // A model without an id is named by its file at startup; until then nothing refers to it.
        let mut unnamed = ClusterConfig::from_toml(&base.replace("id='qwen'\n", "")).unwrap();
        assert_eq!(unnamed.models[0].id, "");
        unnamed.name_models(|p| Ok(model_slug(&p.file_stem().unwrap().to_string_lossy()))).unwrap();
        assert_eq!(unnamed.models[0].id, "q");
        let mut twins = ClusterConfig::from_toml(&base.replace("id='qwen'\n", "")).unwrap();
        let err = twins.name_models(|_| Ok("smollm2-135m-instruct".into())).unwrap_err().to_string();
        assert!(err.contains("used twice"), "two files of one name: {err}");
        // A [model] on another file forgets the default's id too: the file names it.
        let moved = ClusterConfig::from_toml("[model]\npath='other.gguf'\n").unwrap();
        assert_eq!((moved.model.id.as_str(), moved.model.aliases.len()), ("", 0));
        assert!(ClusterConfig::from_toml(&format!("{base}tensor_parallel=0\n")).unwrap_err().to_string().contains("tensor_parallel"));
        assert_eq!(ClusterConfig::from_toml(&format!("{base}tensor_parallel=2\n")).unwrap().nodes[0].workers[0].tensor_parallel, 2);
        // A GPU is named `cuda:N`; anything else is refused, saying what is accepted. (Whether the
        // build and the machine can drive it is the node's to check at startup.)
        assert_eq!(ClusterConfig::from_toml(&format!("{base}device='cuda:1'\n")).unwrap().nodes[0].workers[0].gpu(), Ok(Some(1)));
        let bad_dev = ClusterConfig::from_toml(&format!("{base}device='gpu0'\n")).unwrap_err().to_string();
        assert!(bad_dev.contains("unknown device") && bad_dev.contains("cuda:N"), "{bad_dev}");
        assert_eq!(ClusterConfig::from_toml(&format!("{base}device='cuda:2'\ntensor_parallel=2\n")).unwrap().nodes[0].workers[0].tensor_parallel, 2);
        assert!(ClusterConfig::from_toml(&format!("{base}kv_cache_mb=0\n")).is_err(), "a CPU cache needs a size");
        // A group across nodes: one node per rank, this one first, the others configured nodes.
        let two = "[cluster]\ntls_dir='t'\n[[nodes]]\nid='a'\nquic='127.0.0.1:1'\n[[nodes.workers]]\nid='w'\ntensor_parallel=2\nRANKS\n[[nodes]]\nid='b'\nquic='127.0.0.1:2'\n[[nodes.workers]]\nid='w'\n";
        let ok = ClusterConfig::from_toml(&two.replace("RANKS", "rank_nodes=['a','b']")).unwrap();
        assert_eq!(ok.nodes[0].workers[0].rank_nodes, ["a", "b"]);
        assert!(ok.nodes[1].workers[0].rank_nodes.is_empty(), "by default every rank is local");
        assert!(ClusterConfig::from_toml(&two.replace("RANKS", "rank_nodes=['a','b']\ndevice='cuda:0'")).is_ok(), "GPU ranks across nodes");
        for (ranks, why) in [
            ("rank_nodes=['a']", "one node per rank"),
            ("rank_nodes=['b','a']", "rank 0 is this node"),
            ("rank_nodes=['a','a']", "a remote rank on this node"),
            ("rank_nodes=['a','c']", "no such node"),
            ("rank_nodes=['a','b']\ndevice='cuda:0'\nkv_cache_mb=0", "a GPU group across nodes sizes its cache alike on every node"),
        ] {
            let e = ClusterConfig::from_toml(&two.replace("RANKS", ranks)).unwrap_err().to_string();
            assert!(e.contains("rank_nodes"), "{why}: {e}");
        }
        assert!(ClusterConfig::from_toml(&format!("{base}device='cuda:0'\nkv_cache_mb=0\n")).is_ok(), "a GPU cache may take a share of free memory");
    }

    #[test]
    fn kv_dtype_is_f32_unless_set_and_the_same_for_every_worker() {
        let one = "[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\nKV\n";
        assert_eq!(ClusterConfig::from_toml(&one.replace("KV", "")).unwrap().nodes[0].workers[0].kv_dtype, KvDtype::F32);
        let half = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='f16'")).unwrap();
        assert_eq!((half.nodes[0].workers[0].kv_dtype, half.nodes[0].workers[0].kv_dtype.bytes()), (KvDtype::F16, 2));
        let e = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='bf16'")).unwrap_err().to_string();
        assert!(e.contains("bf16") && e.contains("f16") && e.contains("f32"), "an unknown element names the known ones: {e}");
        let e = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='f16'\ndevice='cuda:0'")).unwrap_err().to_string();
        assert!(e.contains("kv_dtype f16 runs on the CPU only"), "{e}");
        let mixed = "[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\nkv_dtype='f16'\n[[nodes.workers]]\nid='cpu1'\n";
        let e = ClusterConfig::from_toml(mixed).unwrap_err().to_string();
        assert!(e.contains("same kv_dtype"), "{e}");
    }

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
        assert_eq!(c.nodes[0].workers[0].block_size, 4);
        assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes]]\nid='a'\n").is_err());
        assert_eq!(c.placement.policy, PlacementPolicy::CacheAware);
        // Several nodes need QUIC addresses and TLS material.
        assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes]]\nid='b'\n").is_err());
        let three = ClusterConfig::from_toml(
            r#"
            [cluster]
            tls_dir = "certs"
            [placement]
            policy = "round_robin"
            [[nodes]]
            id = "a"
            quic = "127.0.0.1:7001"
            [[nodes]]
            id = "b"
            quic = "127.0.0.1:7002"
            "#,
        )
        .unwrap();
        assert_eq!(three.placement.policy, PlacementPolicy::RoundRobin);
        assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\nquic='127.0.0.1:1'\n").is_err(), "no tls_dir");
    }
}
