//! Who may call the API and how much: `[auth]` (API keys, named keys with their own settings,
//! the admin key) and `[limits]` (per-key rate limits, enforced cluster-wide). Resolved into one
//! [`Tenant`] per key, the unit that limits, fairness and logs speak of.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;


/// API keys. With none configured the node is open (a development default, announced at
/// startup). Keys are compared in constant time and never logged.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct AuthSection {
    /// Keys accepted as `x-api-key` or `Authorization: Bearer` on the API. Each is its own
    /// tenant, named `key#<n>` (its position among the unnamed keys) in logs and limits.
    pub api_keys: Vec<String>,
    /// A file with one API key per line (blank lines and `#` comments ignored); named like
    /// `api_keys`, after them.
    pub api_keys_file: Option<PathBuf>,
    /// The key for `/admin/*` and the admin CLI. A user key there gets 403.
    pub admin_key: Option<String>,
    /// Keys with a name and settings of their own (`[[auth.keys]]`). The name is what every
    /// node calls the tenant, so give keys names when nodes' key lists may differ.
    pub keys: Vec<KeyConfig>,
}

/// Whose cached prefixes a key's requests see (`[[auth.keys]] cache_scope`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CacheScope {
    /// The key's own prefixes only (the default for a named key).
    #[default]
    Key,
    /// One namespace shared by every key of this scope (the unnamed `api_keys` and an open
    /// node are in it).
    Shared,
}

/// One named key (`[[auth.keys]]`). Unset limits fall back to `[limits]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct KeyConfig {
    /// 1 to 64 ASCII letters, digits, `-`, `_` or `.`.
    pub name: String,
/// The key clients send (`x-api-key` or `Authorization: Bearer`).
    pub key: String,
    /// This key's share of running slots and KV when keys compete (equal by default).
    pub weight: f64,
    /// Whether this key may send `ignore_eos` (keep generating past end tokens; benchmarks).
    /// Off for every key unless the operator turns it on; an open (keyless) node allows it.
    pub allow_ignore_eos: bool,
    /// Whether this key's requests may be served by a model's `fallback` when the model they
    /// name cannot take them (on by default; off: the error, as without a fallback).
    pub allow_fallback: bool,
    /// Whose cached prompt prefixes this key's requests see: `"key"` (its own only: no other
    /// key can read them, or learn by timing or `cache_read_input_tokens` that it sent them) or
    /// `"shared"` (one namespace with every other key of the shared scope). A request's
    /// `cache_salt` narrows either further.
    pub cache_scope: CacheScope,
    /// This key's limits; each unset one is `[limits]`'s.
    pub requests_per_minute: Option<u32>,
    /// Input plus output tokens per minute.
    pub tokens_per_minute: Option<u32>,
    /// Prompt tokens per minute.
    pub input_tokens_per_minute: Option<u32>,
    /// Output tokens per minute.
    pub output_tokens_per_minute: Option<u32>,
    /// Requests in flight across the cluster.
    pub max_concurrent_requests: Option<u32>,
}

impl Default for KeyConfig {
    fn default() -> Self {
        KeyConfig {
            name: String::new(),
            key: String::new(),
            weight: 1.0,
            allow_ignore_eos: false,
            allow_fallback: true,
            cache_scope: CacheScope::Key,
            requests_per_minute: None,
            tokens_per_minute: None,
            input_tokens_per_minute: None,
            output_tokens_per_minute: None,
            max_concurrent_requests: None,
        }
    }
}

/// Per-key limits, held across the whole cluster (each node's token buckets take in every other
/// node's charges through gossip; see the coordinator's `quota`). 0 means unlimited.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LimitsSection {
    /// Requests per minute, per key.
    pub requests_per_minute: u32,
    /// Input plus output tokens per minute.
    pub tokens_per_minute: u32,
    /// Prompt tokens per minute.
    pub input_tokens_per_minute: u32,
    /// Output tokens per minute: charged as they are generated; a key with none left gets 429
    /// before its next request starts.
    pub output_tokens_per_minute: u32,
    /// Requests one key may have in flight across the cluster (generations and token counts).
    pub max_concurrent_requests: u32,
    /// The share of a `count_tokens` call's tokens charged to the key's input and token limits
    /// (it runs the tokenizer, not the model).
    pub count_tokens_charge: f64,
}

impl Default for LimitsSection {
    fn default() -> Self {
        LimitsSection {
            requests_per_minute: 0,
            tokens_per_minute: 0,
            input_tokens_per_minute: 0,
            output_tokens_per_minute: 0,
            max_concurrent_requests: 0,
            count_tokens_charge: 0.1,
        }
    }
}

/// One tenant's effective limits (0: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TenantLimits {
    pub requests_per_minute: u32,
    pub tokens_per_minute: u32,
    pub input_tokens_per_minute: u32,
    pub output_tokens_per_minute: u32,
    pub max_concurrent_requests: u32,
}

/// One key as limits, fairness and logs see it.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    /// `key#<n>`, the configured name, `open` (no keys configured) or `admin`.
    pub name: String,
    /// The key itself (empty for `open`). Never logged.
    pub key: String,
    pub weight: f64,
    pub allow_ignore_eos: bool,
    pub allow_fallback: bool,
    pub cache_scope: CacheScope,
    pub limits: TenantLimits,
}

impl Tenant {
    /// The name of the cache namespace this tenant's requests run in, narrowed by a request's
    /// `cache_salt`: its own (`key:<name>`) or the shared one.
    pub fn cache_scope_name(&self, salt: Option<&str>) -> String {
        let base = match self.cache_scope {
            CacheScope::Key => format!("key:{}", self.name),
            CacheScope::Shared => "shared".to_string(),
        };
        match salt {
            Some(s) => format!("{base}\0salt:{s}"),
            None => base,
        }
    }
}

/// A tenant name from `[[auth.keys]]`.
fn valid_tenant_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl AuthSection {
    /// Every unnamed API key: `api_keys` plus the lines of `api_keys_file`.
    pub fn unnamed_keys(&self) -> Result<Vec<String>, String> {
        let mut keys = self.api_keys.clone();
        if let Some(f) = &self.api_keys_file {
            let text = std::fs::read_to_string(f).map_err(|e| format!("auth.api_keys_file {}: {e}", f.display()))?;
            keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from));
        }
        if keys.iter().any(|k| k.len() < 8) {
            return Err("API keys must be at least 8 characters".into());
        }
        Ok(keys)
    }
}

impl LimitsSection {
    /// These limits as one tenant's.
    pub fn per_key(&self) -> TenantLimits {
        TenantLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            input_tokens_per_minute: self.input_tokens_per_minute,
            output_tokens_per_minute: self.output_tokens_per_minute,
            max_concurrent_requests: self.max_concurrent_requests,
        }
    }
}

/// Every user key as a tenant: the unnamed keys (`key#0`, `key#1`, … in order), then the named
/// ones. Reads `api_keys_file`.
pub fn tenants(auth: &AuthSection, limits: &LimitsSection) -> Result<Vec<Tenant>, String> {
    let base = limits.per_key();
    let mut out: Vec<Tenant> = auth
        .unnamed_keys()?
        .into_iter()
        .enumerate()
        .map(|(i, key)| Tenant { name: format!("key#{i}"), key, weight: 1.0, allow_ignore_eos: false, allow_fallback: true, cache_scope: CacheScope::Shared, limits: base })
        .collect();
    for k in &auth.keys {
        let or = |v: Option<u32>, d: u32| v.unwrap_or(d);
        out.push(Tenant {
            name: k.name.clone(),
            key: k.key.clone(),
            weight: k.weight,
            allow_ignore_eos: k.allow_ignore_eos,
            allow_fallback: k.allow_fallback,
            cache_scope: k.cache_scope,
            limits: TenantLimits {
                requests_per_minute: or(k.requests_per_minute, base.requests_per_minute),
                tokens_per_minute: or(k.tokens_per_minute, base.tokens_per_minute),
                input_tokens_per_minute: or(k.input_tokens_per_minute, base.input_tokens_per_minute),
                output_tokens_per_minute: or(k.output_tokens_per_minute, base.output_tokens_per_minute),
                max_concurrent_requests: or(k.max_concurrent_requests, base.max_concurrent_requests),
            },
        });
    }
    Ok(out)
}

/// Checks `[[auth.keys]]` and `[limits]`.
pub fn validate(auth: &AuthSection, limits: &LimitsSection) -> Result<(), String> {
    let mut names = std::collections::HashSet::new();
    for k in &auth.keys {
        if !valid_tenant_name(&k.name) {
            return Err(format!("auth.keys: name {:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'", k.name));
        }
        if !names.insert(&k.name) {
            return Err(format!("auth.keys: duplicate name {:?}", k.name));
        }
        if k.key.len() < 8 {
            return Err(format!("auth.keys {:?}: the key must be at least 8 characters", k.name));
        }
        if !(k.weight.is_finite() && k.weight > 0.0 && k.weight <= 1000.0) {
            return Err(format!("auth.keys {:?}: weight must be in (0, 1000]", k.name));
        }
    }
    let c = limits.count_tokens_charge;
    if !(c.is_finite() && (0.0..=1.0).contains(&c)) {
        return Err("limits.count_tokens_charge must be in [0, 1]".into());
    }
    Ok(())
}
