//! A prefix fetch as the node's orchestrator runs it: the pull (`cluster::fetch`), its figures
//! (metrics, the log), and what it teaches placement: [`FetchCost`], the measured seconds per
//! fetched block, which placement weighs against the worker's measured prefill speed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use zerolayer_common::wire::FetchFrom;
use zerolayer_common::Job;

use crate::cluster::{fetch, Cluster};

/// Seconds per fetched block, an exponentially weighted mean over this node's fetches
/// (written by the orchestrator, read by placement without a lock).
#[derive(Debug, Default)]
pub struct FetchCost {
    /// f64 bits; 0 until a fetch has been measured.
    secs_per_block: AtomicU64,
}

/// The weight of the newest fetch in [`FetchCost`]'s mean.
const NEWEST_WEIGHT: f64 = 0.3;

impl FetchCost {
    pub fn secs_per_block(&self) -> Option<f64> {
        let v = f64::from_bits(self.secs_per_block.load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    /// Takes in one fetch of `blocks` blocks that took `secs`.
    pub fn observe(&self, blocks: usize, secs: f64) {
        if blocks == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let x = secs / blocks as f64;
        let v = self.secs_per_block().map_or(x, |m| m + NEWEST_WEIGHT * (x - m));
        self.secs_per_block.store(v.to_bits(), Ordering::Relaxed);
    }

    /// A fetch that failed: placement prices the next ones as if it had taken `secs` for
    /// nothing more than one block (so repeated failures make fetching look dear).
    pub fn failed(&self, secs: f64) {
        self.observe(1, secs.max(1e-3));
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
            cost.failed(secs);
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
    fn the_cost_is_a_weighted_mean_per_block_and_failures_make_it_dear() {
        let c = FetchCost::default();
        assert_eq!(c.secs_per_block(), None);
        c.observe(0, 1.0);
        assert_eq!(c.secs_per_block(), None, "an empty fetch teaches nothing");
        c.observe(100, 0.1);
        assert!((c.secs_per_block().unwrap() - 1e-3).abs() < 1e-12);
        c.observe(10, 0.1); // 1e-2 per block
        assert!((c.secs_per_block().unwrap() - (1e-3 + 0.3 * 9e-3)).abs() < 1e-12);
        let before = c.secs_per_block().unwrap();
        c.failed(2.0);
        assert!(c.secs_per_block().unwrap() > before * 10.0);
    }
}
