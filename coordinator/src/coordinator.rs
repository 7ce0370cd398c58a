//! The coordinator: what every HTTP handler calls. It turns a validated
//! [`GenerationRequest`] into a prompt, places it on a worker anywhere in the cluster
//! ([`crate::placement`] over the [`Cluster`] view, corrected by the [`Tracker`]) and hands the
//! sequence to that worker: one in-process message when the worker is local (no
//! serialization), exactly one QUIC hop when it is remote.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use zerolayer_common::wire::Submit;
use zerolayer_common::{block_hashes, ClusterConfig, SamplingParams, SeqEvent, WorkerSignals};
use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;
use zerolayer_worker::{SeqStream, SubmitRequest};

use crate::auth::{Caller, Guard};
use crate::cluster::forward::{ForwardError, RemoteStream};
use crate::cluster::{Cluster, LocalWorker};
use crate::error::ApiError;
use crate::placement::{self, Decision, RequestSummary};
use crate::request::{resolve_max_tokens, GenerationRequest};
use crate::tracker::{PlacementMark, Tracker};
use crate::view::NodeState;

/// The model this node serves.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub id: String,
    pub aliases: Vec<String>,
    pub display_name: String,
    pub created_unix: i64,
    pub context_length: usize,
}

impl ModelInfo {
    pub fn matches(&self, name: &str) -> bool {
        self.id == name || self.aliases.iter().any(|a| a == name)
    }
}

/// The events of an accepted sequence, from a local worker or over QUIC.
pub enum EventStream {
    Local(SeqStream),
    Remote(RemoteStream),
}

impl EventStream {
    /// The next event, or `None` once the sequence is over. A lost remote node ends the
    /// stream with an error `Finished`.
    pub async fn recv(&mut self) -> Option<SeqEvent> {
        match self {
            EventStream::Local(s) => s.recv().await,
            EventStream::Remote(s) => s.recv().await,
        }
    }
}

/// A sequence accepted by a worker.
pub struct Accepted {
    pub stream: EventStream,
    pub prompt_tokens: usize,
    /// `NODE_ID/WORKER_ID`, for the `zerolayer-worker` header.
    pub served_by: String,
    pub started_at: Instant,
    /// Released when the response is done (the node's in-flight cap).
    pub _permit: OwnedSemaphorePermit,
    /// Takes this request's load off the placement view when the response is done.
    pub _mark: PlacementMark,
}

pub struct Coordinator {
    pub node_id: String,
    pub config: ClusterConfig,
    pub model: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub workers: Vec<LocalWorker>,
    pub guard: Guard,
    pub cluster: Arc<Cluster>,
    /// Flips to true when the shutdown grace period is over: open streams end with an error.
    pub hard_stop: watch::Receiver<bool>,
    /// What changes as requests come and go.
    pub admission: Admission,
}

/// A coordinator's admission state: the in-flight cap, draining, its round-robin counter and
/// its own recent placements.
pub struct Admission {
    inflight: Arc<Semaphore>,
    max_inflight: usize,
    /// Set on SIGTERM / drain: `/ready` turns 503 and new work is refused.
    draining: AtomicBool,
    rr: AtomicUsize,
    tracker: Arc<Tracker>,
}

impl Admission {
    pub fn new(node_id: &str, max_inflight: usize) -> Self {
        // Coordinators start their round-robin at different points, so independent
        // coordinators do not move through the workers in lockstep.
        let rr_start = zerolayer_common::chain_hash(0, &node_id.bytes().map(u32::from).collect::<Vec<_>>()) as usize % 1024;
        Admission {
            inflight: Arc::new(Semaphore::new(max_inflight)),
            max_inflight,
            draining: AtomicBool::new(false),
            rr: AtomicUsize::new(rr_start),
            tracker: Arc::new(Tracker::default()),
        }
    }
}

impl Coordinator {
    /// Requests holding an in-flight slot (generations being served).
    pub fn in_flight(&self) -> usize {
        self.admission.max_inflight - self.admission.inflight.available_permits()
    }

    /// Placement marks this coordinator holds (pending, done): they must drain to zero pending
    /// once no request is in flight (leak checks).
    pub fn placement_marks(&self) -> (usize, usize) {
        self.admission.tracker.len()
    }

    pub fn is_ready(&self) -> bool {
        !self.admission.draining.load(Ordering::Acquire) && !*self.hard_stop.borrow()
    }

    /// Stops taking new work: `/ready` turns 503 and peers stop placing here.
    pub fn set_draining(&self) {
        self.admission.draining.store(true, Ordering::Release);
        self.cluster.set_state(NodeState::Draining);
    }

    /// Sequences still running because of this node: its own requests plus those it serves
    /// for other coordinators.
    pub fn busy(&self) -> usize {
        self.in_flight() + self.cluster.serving_remote.load(Ordering::Acquire)
    }

    pub fn worker_signals(&self) -> Vec<(String, WorkerSignals)> {
        self.workers.iter().map(|w| (w.id.clone(), w.handle.signals())).collect()
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer.encode(text).map_err(|e| ApiError::Internal(e.to_string()))
    }

    /// The prompt's token ids, rendered through the model's chat template.
    pub fn prompt_ids(&self, req: &GenerationRequest) -> Result<Vec<u32>, ApiError> {
        self.tokenize(&req.render(&self.template)?)
    }

    /// Validates length, takes an in-flight slot, places and submits.
    pub async fn start(&self, caller: &Caller, req: GenerationRequest) -> Result<Accepted, ApiError> {
        if !self.is_ready() {
            return Err(ApiError::Overloaded("Overloaded: this node is draining or shutting down".into()));
        }
        let started_at = Instant::now();
        let ids = self.prompt_ids(&req)?;
        let mut params = req.params;
        params.max_tokens = resolve_max_tokens(req.max_tokens, ids.len(), self.model.context_length)?;
        self.guard.take_tokens(caller, ids.len())?;
        let permit = self
            .admission
            .inflight
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::Overloaded("Overloaded: too many requests in flight on this node".into()))?;
        let prompt_tokens = ids.len();
        let (stream, served_by, mark) = self.place_and_submit(ids, params).await?;
        Ok(Accepted { stream, prompt_tokens, served_by, started_at, _permit: permit, _mark: mark })
    }

    /// Places the sequence and submits it. If the chosen remote node cannot be reached, the
    /// next candidates are tried (at most [`MAX_PLACEMENT_TRIES`] in all).
    async fn place_and_submit(&self, mut ids: Vec<u32>, params: SamplingParams) -> Result<(EventStream, String, PlacementMark), ApiError> {
        let summary = RequestSummary { block_hashes: block_hashes(&ids, self.block_size()), prompt_tokens: ids.len(), max_tokens: params.max_tokens as usize };
        let mut view = self.cluster.view();
        let cc = &self.config.cluster;
        let local_window = 2 * zerolayer_worker::actor::SIGNAL_INTERVAL;
        let remote_window = local_window + std::time::Duration::from_millis(2 * (cc.publish_interval_ms + cc.gossip_interval_ms));
        self.admission.tracker.adjust(&mut view, local_window, remote_window, Instant::now());
        let rr = self.admission.rr.fetch_add(1, Ordering::Relaxed);
        let pcfg = &self.config.placement;
        let (ranked, reason) = match placement::place(&view, &summary, pcfg, rr) {
            Decision::Place { ranked, reason, .. } => (ranked, reason),
            Decision::NoWorker { skipped } => {
                let why: Vec<String> =
                    skipped.iter().map(|(i, s)| format!("{}/{}: {s:?}", view.workers[*i].node, view.workers[*i].worker)).collect();
                tracing::debug!(skipped = ?why, "placement: no worker can take the request");
                return Err(ApiError::Overloaded(format!("Overloaded: no worker can take this request now ({})", why.join(", "))));
            }
        };
        if tracing::enabled!(tracing::Level::DEBUG) {
            let top: Vec<String> = ranked
                .iter()
                .take(4)
                .map(|s| format!("{}/{} cost={:.1} cached_blocks={}", view.workers[s.index].node, view.workers[s.index].worker, s.cost, s.cached_blocks))
                .collect();
            tracing::debug!(policy = ?pcfg.policy, reason, prompt_blocks = summary.block_hashes.len(), candidates = ?top, "placement decision");
        }
        let mut last_err = None;
        for s in ranked.iter().take(MAX_PLACEMENT_TRIES) {
            let w = &view.workers[s.index];
            let bs = w.signals.block_size.max(1) as usize;
            let id = self.admission.tracker.placed(&w.node, &w.worker, summary.prompt_tokens.saturating_sub(s.cached_blocks * bs) as u64, Instant::now());
            let mark = PlacementMark::new(self.admission.tracker.clone(), id, summary.prompt_tokens.div_ceil(bs) as u32);
            let served_by = format!("{}/{}", w.node, w.worker);
            let target = if w.local { "local" } else { "remote" };
            metrics::counter!("zerolayer_placements_total", "policy" => format!("{:?}", pcfg.policy), "target" => target, "reason" => reason).increment(1);
            if w.local {
                let lw = self.cluster.local_worker(&w.worker).ok_or_else(|| ApiError::Internal(format!("local worker {} vanished", w.worker)))?;
                let stream = lw.handle.submit(SubmitRequest { prompt: std::mem::take(&mut ids), params }).await?;
                return Ok((EventStream::Local(stream), served_by, mark));
            }
            let Some(addr) = self.cluster.peer_addr(&w.node) else {
                metrics::counter!("zerolayer_forward_failures_total", "node" => self.node_id.clone(), "peer" => w.node.clone()).increment(1);
                last_err = Some(ApiError::Overloaded(format!("Overloaded: node {} is unreachable", w.node)));
                continue;
            };
            let sub = Submit {
                request_id: uuid::Uuid::new_v4().simple().to_string(),
                origin_node: self.node_id.clone(),
                worker: w.worker.clone(),
                prompt: ids.clone(),
                params: params.clone(),
            };
            match crate::cluster::forward::submit(&self.cluster, &w.node, addr, &sub).await {
                Ok(rs) => return Ok((EventStream::Remote(rs), served_by, mark)),
                Err(ForwardError::Refused { overloaded: true, message }) => {
                    last_err = Some(ApiError::Overloaded(format!("Overloaded: {message}")));
                }
                Err(ForwardError::Refused { overloaded: false, message }) => return Err(ApiError::Internal(message)),
                Err(ForwardError::Unreachable(m)) => {
                    tracing::warn!(node = %w.node, error = %m, "forwarding failed; trying the next candidate");
                    metrics::counter!("zerolayer_forward_failures_total", "node" => self.node_id.clone(), "peer" => w.node.clone()).increment(1);
                    last_err = Some(ApiError::Overloaded(format!("Overloaded: {m}")));
                }
            }
        }
        Err(last_err.unwrap_or_else(|| ApiError::Overloaded("Overloaded: no worker accepted the request".into())))
    }

    /// The KV block size prompts are hashed with (uniform across the cluster).
    fn block_size(&self) -> usize {
        self.workers.first().map(|w| w.handle.signals().block_size as usize).filter(|&b| b > 0).unwrap_or(16)
    }
}

/// Candidates tried per request when forwarding fails.
pub const MAX_PLACEMENT_TRIES: usize = 3;
