//! Where a sequence runs: placement over the cluster view (corrected by this coordinator's own
//! recent placements, [`Tracker`]) and submission to the chosen worker, one in-process message
//! when it is local and one QUIC stream when it is remote. An unreachable owner means the next
//! candidate is tried. Used for a new request and, with `resume` tokens, for a sequence that
//! continues after its worker was lost or drained ([`crate::routing::resume`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerolayer_common::wire::{FetchFrom, Submit};
use zerolayer_common::{block_hashes_from, ClusterConfig, Job, PlacementConfig, SeqEvent};
use zerolayer_worker::SeqStream;

use crate::cluster::forward::{self, ForwardError, RemoteStream};
use crate::cluster::Cluster;
use crate::error::ApiError;
use crate::routing::fetching::FetchCost;
use crate::routing::placement::{self, Decision, FetchPlan, RequestSummary};
use crate::routing::tracker::{PlacementMark, Tracker};
use crate::view::ClusterView;

/// Candidates tried per submission when forwarding fails.
pub const MAX_PLACEMENT_TRIES: usize = 3;

/// The events of a sequence on one worker, local or over QUIC.
pub enum EventStream {
    Local(SeqStream),
    Remote(RemoteStream),
}

impl EventStream {
    /// The next event, or `None` once the sequence is over. A lost worker or node ends the
    /// stream with a `Lost` `Finished`.
    pub async fn recv(&mut self) -> Option<SeqEvent> {
        match self {
            EventStream::Local(s) => s.recv().await,
            EventStream::Remote(s) => s.recv().await,
        }
    }
}

/// A submission that a worker accepted.
pub struct Placed {
    pub stream: EventStream,
    /// `NODE/WORKER`.
    pub node: String,
    pub worker: String,
    /// Takes the request's load off the placement view when it is dropped.
    pub mark: PlacementMark,
}

impl Placed {
    pub fn served_by(&self) -> String {
        format!("{}/{}", self.node, self.worker)
    }
}

/// A worker a sequence can move to, with the prefix blocks it caches (those need not travel).
#[derive(Clone)]
pub struct Target {
    pub node: String,
    pub worker: String,
    pub local: bool,
    pub cached: Arc<std::collections::HashSet<u64>>,
}

/// Placement and submission for one node's coordinator.
pub struct Dispatcher {
    pub node_id: String,
    pub cluster: Arc<Cluster>,
    config: ClusterConfig,
    rr: AtomicUsize,
    tracker: Arc<Tracker>,
    block_size: usize,
    /// What this node's fetches have cost (the orchestrator measures, placement reads).
    pub fetch_cost: Arc<FetchCost>,
}

impl Dispatcher {
    pub fn new(node_id: &str, cluster: Arc<Cluster>, config: ClusterConfig, block_size: usize) -> Self {
        // Coordinators start their round-robin at different points, so independent
        // coordinators do not move through the workers in lockstep.
        let rr_start = zerolayer_common::chain_hash(0, &node_id.bytes().map(u32::from).collect::<Vec<_>>()) as usize % 1024;
        Dispatcher { node_id: node_id.to_string(), cluster, config, rr: AtomicUsize::new(rr_start), tracker: Arc::new(Tracker::default()), block_size, fetch_cost: Arc::default() }
    }

    /// Placement marks held now (pending, done), for leak checks.
    pub fn placement_marks(&self) -> (usize, usize) {
        self.tracker.len()
    }

    /// How many times a sequence may continue elsewhere before its request fails.
    pub fn migration_limit(&self) -> u32 {
        self.config.cluster.migration_limit
    }

    /// Cached chains a drain's warm-up copies per worker (at most 1,024).
    pub fn drain_warm_chains(&self) -> u32 {
        self.config.cluster.drain_warm_chains.min(1024)
    }

    /// The view placement sees now, corrected for signal staleness.
    fn view(&self) -> ClusterView {
        let mut view = self.cluster.view();
        let cc = &self.config.cluster;
        let local_window = 2 * zerolayer_worker::actor::SIGNAL_INTERVAL;
        let remote_window = local_window + Duration::from_millis(2 * (cc.publish_interval_ms + cc.gossip_interval_ms));
        self.tracker.adjust(&mut view, local_window, remote_window, Instant::now());
        view
    }

    /// Where a sequence of `model` holding `tokens` (prompt and output so far; its cache names
    /// from `cache_root`) would go now, among the workers serving that model on nodes not in
    /// `exclude`: for a drain, which moves each sequence's KV there.
    pub fn target(&self, model: &str, tokens: &[u32], cache_root: u64, max_tokens: usize, exclude: &[String]) -> Option<Target> {
        // A drain's target takes the KV the drain sends; it fetches nothing.
        let summary = RequestSummary { block_hashes: block_hashes_from(cache_root, tokens, self.block_size), prompt_tokens: tokens.len(), max_tokens, fetch_secs_per_block: None, avoid_holders: Vec::new() };
        let cfg = PlacementConfig { fetch: false, ..self.config.placement.clone() };
        let mut view = self.view();
        view.workers.retain(|w| !exclude.contains(&w.node) && w.model == model);
        match placement::place(&view, &summary, &cfg, self.rr.fetch_add(1, Ordering::Relaxed)) {
            Decision::Place { index, .. } => {
                let w = &view.workers[index];
                Some(Target { node: w.node.clone(), worker: w.worker.clone(), local: w.local, cached: w.cached.clone() })
            }
            Decision::NoWorker { .. } => None,
        }
    }

    /// Whether some worker of `model` in the cluster can take a request of this size now: the
    /// placement decision over the published snapshot, without placing anything.
    pub fn can_take(&self, model: &str, prompt_tokens: usize, max_tokens: usize) -> bool {
        let mut view = self.view();
        view.workers.retain(|w| w.model == model);
        let summary = RequestSummary { block_hashes: Vec::new(), prompt_tokens, max_tokens, fetch_secs_per_block: None, avoid_holders: Vec::new() };
        matches!(placement::place(&view, &summary, &self.config.placement, 0), Decision::Place { .. })
    }

    /// Places `job` (continuing after its `resume` tokens, if any) on a worker of a node not in
    /// `exclude` and submits it. With `prefer`, that worker is tried first (the target a drain
    /// moved the sequence's KV to, or the worker holding a sibling choice's prompt).
    pub async fn submit(&self, job: &Job, exclude: &[String], prefer: Option<(&str, &str)>) -> Result<Placed, ApiError> {
        let tokens = job.tokens();
        let summary = RequestSummary {
            block_hashes: block_hashes_from(job.cache_root, &tokens, self.block_size),
            prompt_tokens: tokens.len(),
            max_tokens: job.remaining_tokens(),
            fetch_secs_per_block: self.fetch_cost.secs_per_block(),
            avoid_holders: self.fetch_cost.avoid(),
        };
        let mut view = self.view();
        view.workers.retain(|w| !exclude.contains(&w.node) && w.model == job.model);
        let mut order: Vec<(usize, usize, Option<FetchPlan>)> = Vec::new(); // (view index, cached blocks, fetch)
        if let Some((node, worker)) = prefer {
            if let Some(i) = view.workers.iter().position(|w| w.node == node && w.worker == worker) {
                order.push((i, placement::cached_prefix_blocks(&view.workers[i], &summary.block_hashes), None));
            }
        }
        let pcfg = &self.config.placement;
        let reason = match placement::place(&view, &summary, pcfg, self.rr.fetch_add(1, Ordering::Relaxed)) {
            Decision::Place { ranked, reason, .. } => {
                if tracing::enabled!(tracing::Level::DEBUG) {
                    let top: Vec<String> = ranked
                        .iter()
                        .take(4)
                        .map(|s| format!("{}/{} cost={:.1} cached_blocks={}", view.workers[s.index].node, view.workers[s.index].worker, s.cost, s.cached_blocks))
                        .collect();
                    tracing::debug!(request_id = %job.request_id, policy = ?pcfg.policy, reason, prompt_blocks = summary.block_hashes.len(), candidates = ?top, "placement decision");
                }
                for s in &ranked {
                    if !order.iter().any(|&(i, _, _)| i == s.index) {
                        order.push((s.index, s.cached_blocks, s.fetch));
                    }
                }
                reason
            }
            Decision::NoWorker { skipped } if order.is_empty() => {
                let why: Vec<String> = skipped.iter().map(|(i, s)| format!("{}/{}: {s:?}", view.workers[*i].node, view.workers[*i].worker)).collect();
                tracing::debug!(request_id = %job.request_id, skipped = ?why, "placement: no worker can take the request");
                return Err(ApiError::Overloaded(format!("Overloaded: no worker can take this request now ({})", why.join(", "))));
            }
            Decision::NoWorker { .. } => "moved",
        };
        let mut last_err = None;
        for &(i, cached_blocks, fetch) in order.iter().take(MAX_PLACEMENT_TRIES) {
            let w = &view.workers[i];
            let fetch = fetch.map(|f| {
                let h = &view.workers[f.holder];
                FetchFrom { node: h.node.clone(), worker: h.worker.clone(), have: f.have as u32, blocks: f.blocks as u32 }
            });
            let bs = w.signals.block_size.max(1) as usize;
            let id = self.tracker.placed(&w.node, &w.worker, summary.prompt_tokens.saturating_sub(cached_blocks * bs) as u64, Instant::now());
            let mark = PlacementMark::new(self.tracker.clone(), id, summary.prompt_tokens.div_ceil(bs) as u32);
            let target = if w.local { "local" } else { "remote" };
            let why = if prefer.is_some() && i == order[0].0 { "moved" } else { reason };
            metrics::counter!("zerolayer_placements_total", "policy" => format!("{:?}", pcfg.policy), "target" => target, "reason" => why).increment(1);
            let placed = |stream| Placed { stream, node: w.node.clone(), worker: w.worker.clone(), mark };
            if w.local {
                let Some(lw) = self.cluster.local_worker(&w.worker) else {
                    last_err = Some(ApiError::Internal(format!("local worker {} vanished", w.worker)));
                    continue;
                };
                if let Some(from) = fetch {
                    self.cluster.fetch_first(&w.worker, job, from).await;
                }
                match lw.handle.submit(job.clone()).await.map_err(ApiError::from) {
                    Ok(stream) => return Ok(placed(EventStream::Local(stream))),
                    Err(e @ ApiError::Overloaded(_)) => {
                        last_err = Some(e);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let Some(addr) = self.cluster.peer_addr(&w.node) else {
                metrics::counter!("zerolayer_forward_failures_total", "node" => self.node_id.clone(), "peer" => w.node.clone()).increment(1);
                last_err = Some(ApiError::Overloaded(format!("Overloaded: node {} is unreachable", w.node)));
                continue;
            };
            let sub = Submit { origin_node: self.node_id.clone(), worker: w.worker.clone(), job: job.clone(), fetch };
            match forward::submit(&self.cluster, &w.node, addr, &sub).await {
                Ok(rs) => return Ok(placed(EventStream::Remote(rs))),
                Err(ForwardError::Refused { overloaded: true, message }) => {
                    last_err = Some(ApiError::Overloaded(format!("Overloaded: {message}")));
                }
                Err(ForwardError::Refused { overloaded: false, message }) => return Err(ApiError::Internal(message)),
                Err(ForwardError::Unreachable(m)) => {
                    tracing::warn!(request_id = %job.request_id, node = %w.node, error = %m, "forwarding failed; trying the next candidate");
                    metrics::counter!("zerolayer_forward_failures_total", "node" => self.node_id.clone(), "peer" => w.node.clone()).increment(1);
                    last_err = Some(ApiError::Overloaded(format!("Overloaded: {m}")));
                }
            }
        }
        Err(last_err.unwrap_or_else(|| ApiError::Overloaded("Overloaded: no worker accepted the request".into())))
    }
}
