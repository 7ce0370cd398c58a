//! What a configuration may not say: each rule refuses a config at load, naming the node,
//! worker or field at fault, so a node never starts on a config it would misread.

use super::{ClusterConfig, ConfigError, KvDtype, MAX_DRAFT, MAX_FALLBACKS};

impl ClusterConfig {
    /// Checks every rule; the first broken one is the error.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.nodes.is_empty() {
            return bad("at least one [[nodes]] entry is required".into());
        }
        let mut names = std::collections::HashSet::new();
        // An empty id is named by the model's file at startup (`name_models`), and checked then.
        let all_named = self.all_models().all(|m| !m.id.is_empty());
        for m in self.all_models() {
            for name in std::iter::once(&m.id).filter(|id| !id.is_empty()).chain(&m.aliases) {
                if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)) {
                    return bad(format!("model name {name:?}: 1 to 64 ASCII letters, digits, '-', '_', '.' or ':'"));
                }
                if !names.insert(name) {
                    return bad(format!("model name {name:?} is used twice"));
                }
            }
        }
        if all_named {
            self.validate_fallbacks().map_err(ConfigError::Invalid)?;
            self.validate_sampling_defaults().map_err(ConfigError::Invalid)?;
        }
        let dtypes: std::collections::HashSet<KvDtype> = self.nodes.iter().flat_map(|n| n.workers.iter().map(|w| w.kv_dtype)).collect();
        if dtypes.len() > 1 {
            return bad("every worker needs the same kv_dtype (a sequence moved by a drain or a loss continues with the same tokens only on a cache of the same element type)".into());
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
                if w.kv_dtype != KvDtype::F32 && !matches!(w.gpu(), Ok(None)) {
                    return bad(format!("worker {}/{}: kv_dtype {} runs on the CPU only (GPU KV caches are f32)", n.id, w.id, w.kv_dtype));
                }
                if w.max_batch_tokens == 0 || w.max_running == 0 {
                    return bad(format!("worker {}/{}: max_batch_tokens and max_running must be > 0", n.id, w.id));
                }
                if !(w.step_stretch == 0.0 || (1.0..=100.0).contains(&w.step_stretch)) || !(0.0..=10_000.0).contains(&w.min_step_ms) {
                    return bad(format!("worker {}/{}: step_stretch must be 0 (off) or 1 to 100, min_step_ms 0 to 10000", n.id, w.id));
                }
                if let Some(m) = &w.model {
                    if all_named && !self.all_models().any(|x| &x.id == m) {
                        return bad(format!("worker {}/{}: model {m:?} is not a [model] or [[models]] id", n.id, w.id));
                    }
                }
                if w.max_draft > MAX_DRAFT {
                    return bad(format!("worker {}/{}: max_draft must be at most {MAX_DRAFT}", n.id, w.id));
                }
                if !(0.0..=1.0).contains(&w.pinned_kv_share) {
                    return bad(format!("worker {}/{}: pinned_kv_share must be in 0..=1", n.id, w.id));
                }
                if !(w.gpu_kv_share > 0.0 && w.gpu_kv_share <= 0.95) {
                    return bad(format!("worker {}/{}: gpu_kv_share must be in (0, 0.95]", n.id, w.id));
                }
                validate_disk_tier(&format!("worker {}/{}", n.id, w.id), w).map_err(ConfigError::Invalid)?;
                if w.kv_cache_mb == 0 && !matches!(w.gpu(), Ok(Some(_))) {
                    return bad(format!("worker {}/{}: kv_cache_mb must be > 0 (0, a share of free memory, is for GPUs)", n.id, w.id));
                }
                if w.tensor_parallel == 0 || w.tensor_parallel > 64 {
                    return bad(format!("worker {}/{}: tensor_parallel must be 1..=64, got {}", n.id, w.id, w.tensor_parallel));
                }
                if w.gpu().is_err() {
                    return bad(format!("worker {}/{}: device {:?}: unknown device; use \"cpu\" or \"cuda:N\"", n.id, w.id, w.device));
                }
                if !w.rank_nodes.is_empty() {
                    let at = format!("worker {}/{}: rank_nodes", n.id, w.id);
                    if w.rank_nodes.len() != w.tensor_parallel {
                        return bad(format!("{at} names {} nodes for tensor_parallel = {}: one per rank", w.rank_nodes.len(), w.tensor_parallel));
                    }
                    if w.rank_nodes[0] != n.id {
                        return bad(format!("{at}: rank 0 runs the engine, so it is this node, {:?}", n.id));
                    }
                    if let Some(r) = w.rank_nodes[1..].iter().find(|r| **r == n.id || !self.nodes.iter().any(|m| &m.id == *r)) {
                        return bad(format!("{at}: {r:?} is this node or no node of the config (ranks here need no rank_nodes)"));
                    }
                    if w.device != "cpu" && w.kv_cache_mb == 0 {
                        return bad(format!("{at}: a GPU group across nodes needs kv_cache_mb > 0, so that every node sizes the same KV cache"));
                    }
                    if n.quic.is_none() {
                        return bad(format!("{at}: a group across nodes needs a cluster (a `quic` address on every node)"));
                    }
                }
            }
        }
        let with_quic = self.nodes.iter().filter(|n| n.quic.is_some()).count();
        if with_quic != 0 && with_quic != self.nodes.len() {
            return bad("either every node has a `quic` address (a cluster) or none does (one node)".into());
        }
        if self.nodes.len() > 1 && with_quic == 0 {
            return bad("a cluster of several nodes needs a `quic` address on each node".into());
        }
        if with_quic > 0 && self.cluster.tls_dir.is_none() {
            return bad("a cluster needs [cluster] tls_dir (made by `zerolayer cluster init`)".into());
        }
        if self.cluster.gossip_interval_ms == 0 || self.cluster.publish_interval_ms == 0 || self.cluster.idle_timeout_ms < 300 {
            return bad("cluster: gossip and publish intervals must be > 0 and idle_timeout_ms >= 300".into());
        }
        if with_quic > 0 {
            let bs: std::collections::HashSet<usize> = self.nodes.iter().flat_map(|n| n.workers.iter().map(|w| w.block_size)).collect();
            if bs.len() > 1 {
                return bad("every worker of a cluster needs the same block_size (prefix hashes are per block)".into());
            }
        }
        self.validate_placement().map_err(ConfigError::Invalid)?;
        self.logging.validate().map_err(ConfigError::Invalid)?;
        let key_names: Vec<&str> = self.auth.keys.iter().map(|k| k.name.as_str()).collect();
        self.policy.validate(&key_names).map_err(ConfigError::Invalid)?;
        super::access::validate(&self.auth, &self.limits).map_err(ConfigError::Invalid)
    }

    fn validate_placement(&self) -> Result<(), String> {
        let p = &self.placement;
        if !(p.overlap_weight >= 0.0 && p.queue_weight >= 0.0 && p.remote_hop_blocks >= 0.0 && p.balance_rel_threshold >= 1.0) {
            return Err("placement: weights must be >= 0 and balance_rel_threshold >= 1".into());
        }
        if !(0.0..=1.0).contains(&p.disk_hit_cost) {
            return Err(format!("placement.disk_hit_cost: {} is not in 0..=1", p.disk_hit_cost));
        }
        if !(p.fetch_cost_prior.is_finite() && p.fetch_cost_prior > 0.0) {
            return Err(format!("placement.fetch_cost_prior: {} is not a positive number", p.fetch_cost_prior));
        }
        Ok(())
    }

    /// Each model's sampling defaults are values a request could send.
    fn validate_sampling_defaults(&self) -> Result<(), String> {
        for m in self.all_models() {
            let out = |v: Option<f32>, ok: fn(f32) -> bool| v.is_some_and(|x| !ok(x));
            let bad = if out(m.default_temperature, |t| (0.0..=2.0).contains(&t)) {
                "default_temperature must be in [0, 2]"
            } else if out(m.default_top_p, |p| p > 0.0 && p <= 1.0) {
                "default_top_p must be in (0, 1]"
            } else if m.default_top_k == Some(0) {
                "default_top_k must be at least 1"
            } else if out(m.default_min_p, |p| (0.0..=1.0).contains(&p)) {
                "default_min_p must be in [0, 1]"
            } else if out(m.default_repetition_penalty, |r| r > 0.0 && r <= 2.0) {
                "default_repetition_penalty must be in (0, 2]"
            } else {
                continue;
            };
            return Err(format!("model {:?}: {bad}", m.id));
        }
        Ok(())
    }

    /// Each `fallback` names another model, and following them never loops nor runs past
    /// [`MAX_FALLBACKS`].
    fn validate_fallbacks(&self) -> Result<(), String> {
        for m in self.all_models() {
            let mut seen = vec![m.id.as_str()];
            let mut at = m;
            while let Some(next) = at.fallback.as_deref() {
                let Some(n) = self.all_models().find(|x| x.id == next) else {
                    return Err(format!("model {:?}: fallback {next:?} is not a model id of this config", at.id));
                };
                if seen.contains(&n.id.as_str()) {
                    return Err(format!("model {:?}: its fallbacks loop ({} -> {next})", m.id, seen.join(" -> ")));
                }
                seen.push(&n.id);
                if seen.len() > MAX_FALLBACKS + 1 {
                    return Err(format!("model {:?}: fallbacks chain at most {MAX_FALLBACKS} models ({})", m.id, seen.join(" -> ")));
                }
                at = n;
            }
        }
        Ok(())
    }
}

/// A worker's disk tier: it needs a directory, and every rank of the worker on this node.
fn validate_disk_tier(at: &str, w: &super::WorkerConfig) -> Result<(), String> {
    if w.kv_disk_mb > 0 && w.kv_disk_dir.is_none() {
        return Err(format!("{at}: kv_disk_mb needs kv_disk_dir (where the disk tier's file lives)"));
    }
    if w.kv_disk_mb > 0 && !w.rank_nodes.is_empty() {
        return Err(format!("{at}: a disk tier needs every rank on this node (rank_nodes is set)"));
    }
    Ok(())
}
