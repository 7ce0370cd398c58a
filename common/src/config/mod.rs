//! The cluster configuration: defaults < `cluster.toml` < `ZEROLAYER_*` environment variables.
//!
//! Environment variables use `__` between levels, e.g. `ZEROLAYER_MODEL__PATH=...` or
//! `ZEROLAYER_SERVER__SHUTDOWN_GRACE_SECS=5`. Every limit has a default and a reason next to it.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod access;
pub mod keys;
mod logging;
mod policy;
mod validate;
mod worker;
pub use access::{AuthSection, CacheScope, KeyConfig, LimitsSection, Tenant, TenantLimits};
pub use logging::{compile as compile_pattern, LoggingSection, Redaction};
pub use policy::{AppliesTo, PolicyRule, PolicySection};
pub use worker::{KvDtype, Speculative, WorkerConfig, MAX_DRAFT};

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
    /// What log lines may hold (`[logging]`).
    pub logging: LoggingSection,
    /// What clients may send and answers may say (`[[policy.rules]]`).
    pub policy: PolicySection,
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
    /// A drain's warm-up: once its workers hold no sequence, each worker's hottest cached
    /// prefix chains (at most this many) are copied to the workers placement would choose for
    /// them, so they stay cache hits after the node stops. 0: no warm-up; at most 1,024 are
    /// copied.
    pub drain_warm_chains: u32,
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
            drain_warm_chains: 32,
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
    /// `cache_aware` (the cost below), `least_loaded` or `round_robin`.
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
    /// The fraction of a worker's memory limit above which `memory_weight` applies.
    pub memory_soft_limit: f64,
    /// Workers above this fraction of their memory limit are skipped.
    pub memory_high_water: f64,
    /// Blocks of decode room a worker must have beyond the uncached prompt.
    pub decode_headroom_blocks: u32,
    /// Imbalance guard: when max load − min load > abs and max load > rel × min load
    /// (load = running + waiting sequences), pick the least loaded worker.
    pub balance_abs_threshold: u32,
    /// The relative half of the imbalance guard (see `balance_abs_threshold`).
    pub balance_rel_threshold: f64,
    /// Remote prefix fetch: a worker placement chooses pulls the prompt's prefix blocks that
    /// another worker of the cluster caches (ready or draining) before it prefills, instead of
    /// recomputing them, when that costs less (`cache_aware` only).
    pub fetch: bool,
    /// What fetching a block costs relative to computing it, until this node has measured its
    /// own fetches (then: measured seconds per fetched block ÷ the worker's measured prefill
    /// seconds per block).
    pub fetch_cost_prior: f64,
    /// The fewest blocks worth a fetch (a round trip costs a few milliseconds).
    pub min_fetch_blocks: u32,
    /// What a prefix block on a worker's disk tier costs relative to computing it (it is read
    /// back into RAM before the prompt runs): placement counts such a block as this share of
    /// an uncached one, between a RAM hit (0) and a miss (1).
    pub disk_hit_cost: f64,
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
            fetch: true,
            fetch_cost_prior: 0.1,
            min_fetch_blocks: 4,
            disk_hit_cost: 0.2,
        }
    }
}

/// The longest chain of `fallback` models.
pub const MAX_FALLBACKS: usize = 3;

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
    /// The name `/v1/models` shows (empty: the id).
    pub display_name: String,
    /// Whether special-token strings that clients write (`<|im_start|>` in a message) become
    /// control tokens. Off (the default): what clients write is text, and only the chat
    /// template's own scaffolding yields control tokens, so no one can forge a turn.
    pub special_tokens_in_content: bool,
    /// The model that serves this one's requests when no worker of the cluster can take them
    /// (all draining, dead, or past their admission limits): a model id. Fallbacks chain, at
    /// most 3 long, with no cycle. A key with `allow_fallback = false` gets the error instead.
    pub fallback: Option<String>,
    /// The temperature of a request that sets none, in [0, 2] (vLLM's generation config; the
    /// APIs' own default, 1, when unset). 0 makes such requests greedy: agents that never send
    /// a temperature (OpenAI's Codex) then get exact, repeatable answers.
    pub default_temperature: Option<f32>,
    /// The `top_p` of a request that sets none, in (0, 1] (unset: no nucleus cut). With the
    /// three below, the sampling a model's authors recommend (its `generation_config.json`,
    /// which vLLM applies by default), for clients that send none: Qwen2.5's is
    /// `default_temperature = 0.7`, `default_top_p = 0.8`, `default_top_k = 20`,
    /// `default_repetition_penalty = 1.05`.
    pub default_top_p: Option<f32>,
    /// The `top_k` of a request that sets none, at least 1 (unset: no cut).
    pub default_top_k: Option<u32>,
    /// The `min_p` of a request that sets none, in [0, 1] (unset: none).
    pub default_min_p: Option<f32>,
    /// The `repetition_penalty` of a request that sets none, in (0, 2] (unset: none).
    pub default_repetition_penalty: Option<f32>,
}

/// Empty: what a `[[models]]` entry's missing fields are (a `display_name` left empty is the
/// id). `[model]`'s missing fields come from [`ModelSection::default_model`] instead.
impl Default for ModelSection {
    fn default() -> Self {
        ModelSection { path: PathBuf::new(), tokenizer: None, id: String::new(), aliases: vec![], display_name: String::new(), special_tokens_in_content: false, fallback: None, default_temperature: None, default_top_p: None, default_top_k: None, default_min_p: None, default_repetition_penalty: None }
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
    /// The node's id: unique in the cluster, named by its certificate (letters, digits, '-').
    pub id: String,
    /// HTTP listen address; port 0 picks one.
    pub http: String,
    /// QUIC address for peers (gossip and forwarded requests). Absent on a single-node cluster.
    pub quic: Option<String>,
    /// Its workers, one per device (`[[nodes.workers]]`).
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
            logging: LoggingSection::default(),
            policy: PolicySection::default(),
            nodes: vec![NodeConfig::default()],
        }
    }
}

impl ClusterConfig {
    /// Loads defaults, then `path` (if given and present), then `ZEROLAYER_*` env, then validates.
    /// Relative model paths are resolved against the config file's directory. A key the
    /// config does not have, in the file or the environment, is an error naming it.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(ClusterConfig::default()));
        if let Some(p) = path {
            if !p.exists() {
                return Err(ConfigError::Invalid(format!("config file {} does not exist", p.display())));
            }
            refuse_unknown_keys(&parsed(Toml::file(p))?, &p.display().to_string())?;
            fig = fig.merge(Toml::file(p));
        }
        refuse_unknown_keys(&env_value()?, "the environment")?;
        fig = fig.merge(env());
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
        refuse_unknown_keys(&parsed(Toml::string(s))?, "the config")?;
        let mut cfg: ClusterConfig =
            Figment::from(Serialized::defaults(ClusterConfig::default())).merge(Toml::string(s)).extract().map_err(Box::new)?;
        cfg.forget_default_names();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every leaf of this (effective) config, with its value and its source: `cli` names the
    /// keys that command-line flags set (key prefix, flag), then the environment, the file at
    /// `path`, or the default (`zerolayer config`).
    pub fn explain(&self, path: Option<&Path>, cli: &[(String, String)]) -> Result<Vec<(String, String, String)>, ConfigError> {
        let file = match path {
            Some(p) if p.exists() => Some((p.display().to_string(), parsed(Toml::file(p))?)),
            _ => None,
        };
        let effective = serde_json::to_value(self).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(keys::sources(&effective, file.as_ref().map(|(n, v)| (n.as_str(), v)), &env_value()?, cli))
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

    /// The models that serve `id`'s requests when it cannot, in order (its `fallback`, that
    /// one's, …; at most [`MAX_FALLBACKS`], validated free of cycles).
    pub fn fallbacks(&self, id: &str) -> Vec<&ModelSection> {
        let mut out: Vec<&ModelSection> = Vec::new();
        let mut at = self.all_models().find(|m| m.id == id);
        while let Some(next) = at.and_then(|m| m.fallback.as_deref()) {
            at = self.all_models().find(|m| m.id == next);
            match at {
                Some(m) if m.id != id && !out.iter().any(|o| o.id == m.id) && out.len() < MAX_FALLBACKS => out.push(m),
                _ => break,
            }
        }
        out
    }

    /// Fills in what a request for model `id` left unset with the model's sampling defaults:
    /// the temperature (1 unless configured) when `temperature_set` is false, and `top_p`,
    /// `top_k`, `min_p` and `repetition_penalty` where they are `None`.
    pub fn apply_sampling_defaults(&self, id: &str, params: &mut crate::types::SamplingParams, temperature_set: bool) {
        let m = self.all_models().find(|m| m.id == id);
        if !temperature_set {
            params.temperature = m.and_then(|m| m.default_temperature).unwrap_or(1.0);
        }
        let Some(m) = m else { return };
        params.top_p = params.top_p.or(m.default_top_p);
        params.top_k = params.top_k.or(m.default_top_k);
        params.min_p = params.min_p.or(m.default_min_p);
        params.repetition_penalty = params.repetition_penalty.or(m.default_repetition_penalty);
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

/// The `ZEROLAYER_<SECTION>__<KEY>` variables (other `ZEROLAYER_*` names are the CLI's).
fn env() -> Env {
    Env::prefixed("ZEROLAYER_").split("__")
}

/// What one source holds, as a tree.
fn parsed(p: impl figment::Provider) -> Result<serde_json::Value, ConfigError> {
    Ok(Figment::from(p).extract().map_err(Box::new)?)
}

/// The config sections of the environment.
fn env_value() -> Result<serde_json::Value, ConfigError> {
    let mut v = parsed(env())?;
    if let serde_json::Value::Object(m) = &mut v {
        m.retain(|k, _| keys::SECTIONS.contains(&k.as_str()));
    }
    Ok(v)
}

fn shape(v: impl Serialize) -> serde_json::Value {
    serde_json::to_value(v).expect("config structs serialize")
}

/// The known keys of a whole config: the defaults' own tree (the structs are the one list of
/// keys, so this cannot go stale).
pub fn known_keys() -> serde_json::Value {
    shape(ClusterConfig::default())
}

/// The shape of one element of the config's array at `path` (dotted, without indices): its
/// element's defaults.
pub fn element_shape(path: &str) -> Option<serde_json::Value> {
    Some(match path {
        "models" => shape(ModelSection::default()),
        "nodes" => shape(NodeConfig::default()),
        "nodes.workers" => shape(WorkerConfig::default()),
        "auth.keys" => shape(KeyConfig::default()),
        "policy.rules" => shape(PolicyRule::default()),
        _ => return None,
    })
}

/// A key the config does not have is a typo until shown otherwise: refuse it, naming it, its
/// source, and the nearest known key.
fn refuse_unknown_keys(given: &serde_json::Value, source: &str) -> Result<(), ConfigError> {
    let unknown = keys::unknown_keys(given, &known_keys(), &element_shape);
    if unknown.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = unknown.iter().map(|u| u.to_string()).collect();
    Err(ConfigError::Invalid(format!("{} in {source}", list.join("; "))))
}

#[cfg(test)]
mod tests;
