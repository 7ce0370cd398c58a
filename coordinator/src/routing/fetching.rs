//! A prefix fetch as the node's orchestrator runs it: the pull (`cluster::fetch`), its figures
//! (metrics, the log), and what it teaches placement: [`FetchCost`], the measured seconds per
//! fetched block, which placement weighs against the worker's measured prefill speed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use zerolayer_common::wire::FetchFrom;
use zerolayer_common::Job;

use crate::cluster::{fetch, Cluster};

/// What this node's fetches have cost: seconds per fetched block, an exponentially weighted
/// mean over the recent ones (written by the orchestrator, read by placement), and the nodes a
/// fetch recently failed from.
#[derive(Debug)]
pub struct FetchCost {
    started: Instant,
    /// f64 bits; 0 until a fetch has been measured.
    secs_per_block: AtomicU64,
    /// Milliseconds since `started` of the last measurement.
    measured_at_ms: AtomicU64,
    /// Node → milliseconds since `started` of its last failed fetch (at most
    /// [`MAX_FAILED_NODES`]).
    failed: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

/// The weight of the newest fetch in [`FetchCost`]'s mean.
const NEWEST_WEIGHT: f64 = 0.3;
/// A measurement this old no longer counts: placement goes back to the prior, so one slow
/// fetch cannot stop fetching for good (nothing would measure it again).
pub const MEASUREMENT_TTL_MS: u64 = 60_000;
/// A node a fetch failed from is not asked again for this long.
pub const FAILED_NODE_MS: u64 = 10_000;
const MAX_FAILED_NODES: usize = 64;

impl Default for FetchCost {
    fn default() -> Self {
        FetchCost { started: Instant::now(), secs_per_block: AtomicU64::new(0), measured_at_ms: AtomicU64::new(0), failed: Default::default() }
    }
}

impl FetchCost {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The measured seconds per fetched block, unless there is no recent measurement.
    pub fn secs_per_block(&self) -> Option<f64> {
        let v = f64::from_bits(self.secs_per_block.load(Ordering::Relaxed));
        let fresh = self.now_ms().saturating_sub(self.measured_at_ms.load(Ordering::Relaxed)) <= MEASUREMENT_TTL_MS;
        (v > 0.0 && fresh).then_some(v)
    }

    /// Takes in one fetch of `blocks` blocks that took `secs`.
    pub fn observe(&self, blocks: usize, secs: f64) {
        if blocks == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let x = secs / blocks as f64;
        let v = self.secs_per_block().map_or(x, |m| m + NEWEST_WEIGHT * (x - m));
        self.secs_per_block.store(v.to_bits(), Ordering::Relaxed);
        self.measured_at_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// A fetch from `node` failed: it is not asked again for [`FAILED_NODE_MS`]. (A failure
    /// says nothing of what a fetch costs, so the mean does not change.)
    pub fn failed(&self, node: &str) {
        let now = self.now_ms();
        let mut m = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, at| now.saturating_sub(*at) <= FAILED_NODE_MS);
        if m.len() < MAX_FAILED_NODES || m.contains_key(node) {
            m.insert(node.to_string(), now);
        }
    }

    /// The nodes a fetch failed from recently.
    pub fn avoid(&self) -> Vec<String> {
        let now = self.now_ms();
        let m = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().filter(|(_, &at)| now.saturating_sub(at) <= FAILED_NODE_MS).map(|(n, _)| n.clone()).collect()
    }
}

/// Pulls `job`'s prefix blocks that `from` holds into local worker `into`, and records how it
/// went. A failure is logged and counted; the job then recomputes what did not come.
pub async fn run(cluster: &Cluster, cost: &FetchCost, into: &str, job: &Job, from: FetchFrom) {
    let t = Instant::now();
    let tokens = job.tokens();
    let r = fetch::pull(cluster, into, &job.request_id, job.cache_root, &tokens, &from).await;
    let secs = t.elapsed().as_secs_f64();
    let node = cluster.node_id.clone();
    let labels = |outcome: &'static str| [("node", node.clone()), ("worker", into.to_string()), ("direction", "in".to_string()), ("outcome", outcome.to_string())];
    match r {
        Ok(f) => {
            cost.observe(f.imported, secs);
            metrics::counter!("zerolayer_kv_fetches_total", &labels("ok")).increment(1);
            let labels = [("node", node.clone()), ("worker", into.to_string()), ("direction", "in".to_string())];
            metrics::counter!("zerolayer_kv_fetch_bytes_total", &labels).increment(f.bytes);
            metrics::histogram!("zerolayer_kv_fetch_seconds", &labels).record(secs);
            let bs = block_size(cluster, into);
            metrics::counter!("zerolayer_kv_fetched_tokens_total", "node" => node.clone(), "worker" => into.to_string()).increment((f.imported * bs) as u64);
            tracing::debug!(request_id = %job.request_id, from = %from.node, imported = f.imported, usable = f.usable, bytes = f.bytes, ms = secs * 1e3, "fetched prefix blocks");
        }
        Err(e) => {
            cost.failed(&from.node);
            metrics::counter!("zerolayer_kv_fetches_total", &labels("failed")).increment(1);
            tracing::warn!(request_id = %job.request_id, from = %from.node, error = %e, "a prefix fetch failed; the request recomputes its prefix");
        }
    }
}

fn block_size(cluster: &Cluster, worker: &str) -> usize {
    cluster.local_worker(worker).map_or(0, |w| w.handle.kv_geometry().block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cost_is_a_recent_weighted_mean_per_block_and_a_failed_node_is_avoided() {
        let c = FetchCost::default();
        assert_eq!(c.secs_per_block(), None);
        c.observe(0, 1.0);
        assert_eq!(c.secs_per_block(), None, "an empty fetch teaches nothing");
        c.observe(100, 0.1);
        assert!((c.secs_per_block().unwrap() - 1e-3).abs() < 1e-12);
        c.observe(10, 0.1); // 1e-2 per block
        assert!((c.secs_per_block().unwrap() - (1e-3 + 0.3 * 9e-3)).abs() < 1e-12);
        // A stale measurement no longer counts.
        c.measured_at_ms.store(0, Ordering::Relaxed);
        let old = FetchCost { started: Instant::now() - std::time::Duration::from_millis(MEASUREMENT_TTL_MS + 1_000), ..FetchCost::default() };
        old.observe(10, 0.1);
        old.measured_at_ms.store(0, Ordering::Relaxed);
        assert_eq!(old.secs_per_block(), None);
        // A failure changes no cost; its node is avoided.
        let before = c.secs_per_block();
        c.failed("b");
        assert_eq!((c.secs_per_block(), c.avoid()), (before, vec!["b".to_string()]));
    }
}
