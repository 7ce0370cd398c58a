//! The coordinator: what every HTTP handler calls. It turns a validated request into a prompt,
//! places it on a worker anywhere in the cluster ([`crate::placement`] over the
//! [`Cluster`] view) and hands the sequence to that worker: one in-process message when the
//! worker is local (no serialization), exactly one QUIC hop when it is remote.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use zerolayer_common::wire::Submit;
use zerolayer_common::{block_hashes, ClusterConfig, SamplingParams, SeqEvent, WorkerSignals};
use zerolayer_node::chat::{ChatMessage, ChatTemplate};
use zerolayer_node::tokenizer::Tokenizer;
use zerolayer_node::{SeqStream, SubmitRequest, WorkerHandle};

use crate::anthropic::{Role, Turn};
use crate::auth::{Caller, Guard};
use crate::cluster::forward::{ForwardError, RemoteStream};
use crate::cluster::Cluster;
use crate::error::ApiError;
use crate::placement::{self, Decision, NodeState, RequestSummary};

/// `max_tokens` when a request does not set one.
pub const DEFAULT_MAX_TOKENS: usize = 4096;

/// Renders a conversation with a chat template. A final assistant turn is a prefill: the prompt
/// ends with its text, so generation continues it.
pub fn render_prompt(template: &ChatTemplate, system: Option<&str>, turns: &[Turn]) -> Result<String, ApiError> {
    let mut msgs = Vec::with_capacity(turns.len() + 1);
    if let Some(s) = system {
        msgs.push(ChatMessage::new("system", s));
    }
    msgs.extend(turns.iter().map(|t| ChatMessage::new(t.role.as_str(), t.text.clone())));
    let prompt = if turns.last().is_some_and(|t| t.role == Role::Assistant) {
        template.render_for_generation(&msgs)
    } else {
        template.render(&msgs, true)
    };
    prompt.map_err(|e| ApiError::invalid(e.to_string()))
}

/// A worker on this node.
#[derive(Clone)]
pub struct LocalWorker {
    pub id: String,
    pub handle: WorkerHandle,
    pub max_waiting: usize,
}

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

/// What a generation needs, whichever API it came from.
pub struct Generation {
    /// Who asked (for the token rate limit).
    pub caller: Caller,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
    /// None: as many as fit in the context.
    pub max_tokens: Option<u32>,
    pub params: SamplingParams,
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
    inflight: Arc<Semaphore>,
    /// Set on SIGTERM / drain: `/ready` turns 503 and new work is refused.
    pub draining: AtomicBool,
    /// Flips to true when the shutdown grace period is over: open streams end with an error.
    pub hard_stop: watch::Receiver<bool>,
    rr: AtomicUsize,
    /// This coordinator's own recent placements and completions (see [`Tracker`]).
    tracker: Arc<Tracker>,
}

/// Corrects the view for signal staleness with what this coordinator itself knows.
///
/// Worker signals are up to ~100 ms old locally and a few hundred more after gossip. Without a
/// correction, a burst arriving within one interval would all see the same idle worker, and a
/// request sent right after another finished would still see that one's load. So placements
/// count as waiting work on their worker, and completions are taken off it, until the
/// worker's signals can reflect them. Bounded: the oldest entries go first.
struct Tracker {
    inner: std::sync::Mutex<TrackerInner>,
}

#[derive(Default)]
struct TrackerInner {
    next_id: u64,
    pending: std::collections::VecDeque<Mark>,
    done: std::collections::VecDeque<Mark>,
}

struct Mark {
    id: u64,
    at: Instant,
    node: String,
    worker: String,
    uncached_tokens: u64,
    blocks: u32,
}

/// Marks remembered per kind (a burst larger than this forgets the oldest).
const TRACKER_CAPACITY: usize = 4096;

impl Tracker {
    fn placed(&self, node: &str, worker: &str, uncached_tokens: u64) -> u64 {
        let mut t = self.inner.lock().unwrap();
        t.next_id += 1;
        let id = t.next_id;
        if t.pending.len() >= TRACKER_CAPACITY {
            t.pending.pop_front();
        }
        t.pending.push_back(Mark { id, at: Instant::now(), node: node.into(), worker: worker.into(), uncached_tokens, blocks: 0 });
        id
    }

    fn finished(&self, id: u64, blocks: u32) {
        let mut t = self.inner.lock().unwrap();
        let Some(pos) = t.pending.iter().position(|m| m.id == id) else {
            return;
        };
        let mut m = t.pending.remove(pos).unwrap();
        m.at = Instant::now();
        m.blocks = blocks;
        if t.done.len() >= TRACKER_CAPACITY {
            t.done.pop_front();
        }
        t.done.push_back(m);
    }

    /// Applies marks younger than the staleness window of their worker (local or remote).
    fn adjust(&self, view: &mut placement::ClusterView, local_window: std::time::Duration, remote_window: std::time::Duration) {
        let now = Instant::now();
        let mut guard = self.inner.lock().unwrap();
        let t = &mut *guard;
        for q in [&mut t.pending, &mut t.done] {
            // Pending marks of long requests stay until they finish; others expire.
            while q.front().is_some_and(|m| now.duration_since(m.at) > remote_window * 20) {
                q.pop_front();
            }
        }
        let fresh = |m: &Mark, local: bool| now.duration_since(m.at) <= if local { local_window } else { remote_window };
        for m in t.pending.iter() {
            if let Some(w) = view.workers.iter_mut().find(|w| w.node == m.node && w.worker == m.worker) {
                if fresh(m, w.local) {
                    w.signals.waiting += 1;
                    w.signals.waiting_prefill_tokens += m.uncached_tokens;
                }
            }
        }
        for m in t.done.iter() {
            if let Some(w) = view.workers.iter_mut().find(|w| w.node == m.node && w.worker == m.worker) {
                if fresh(m, w.local) {
                    let s = &mut w.signals;
                    s.running = s.running.saturating_sub(1);
                    s.waiting_prefill_tokens = s.waiting_prefill_tokens.saturating_sub(m.uncached_tokens);
                    s.active_decode_blocks = s.active_decode_blocks.saturating_sub(m.blocks);
                    s.kv_blocks_free = (s.kv_blocks_free + m.blocks).min(s.kv_blocks_total);
                }
            }
        }
    }
}

/// Takes a finished request off the tracker when its response is dropped.
pub struct PlacementMark {
    tracker: Arc<Tracker>,
    id: u64,
    blocks: u32,
}

impl Drop for PlacementMark {
    fn drop(&mut self) {
        self.tracker.finished(self.id, self.blocks);
    }
}

impl Coordinator {
    pub fn new(
        node_id: String,
        config: ClusterConfig,
        model: ModelInfo,
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        workers: Vec<LocalWorker>,
        guard: Guard,
        cluster: Arc<Cluster>,
        hard_stop: watch::Receiver<bool>,
    ) -> Self {
        let inflight = Arc::new(Semaphore::new(config.server.max_inflight));
        let rr_start = zerolayer_common::chain_hash(0, &node_id.bytes().map(u32::from).collect::<Vec<_>>()) as usize % 1024;
        Coordinator {
            node_id,
            config,
            model,
            tokenizer,
            template,
            workers,
            guard,
            cluster,
            inflight,
            draining: AtomicBool::new(false),
            hard_stop,
            // Coordinators start their round-robin at different points, so independent
            // coordinators do not move through the workers in lockstep.
            rr: AtomicUsize::new(rr_start),
            tracker: Arc::new(Tracker { inner: Default::default() }),
        }
    }

    /// Requests holding an in-flight slot (generations being served).
    pub fn in_flight(&self) -> usize {
        self.config.server.max_inflight - self.inflight.available_permits()
    }

    pub fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire) && !*self.hard_stop.borrow()
    }

    /// Stops taking new work: `/ready` turns 503 and peers stop placing here.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
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

    /// Renders the conversation with the model's chat template.
    pub fn render(&self, system: Option<&str>, turns: &[Turn]) -> Result<String, ApiError> {
        render_prompt(&self.template, system, turns)
    }

    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer.encode(text).map_err(|e| ApiError::Internal(e.to_string()))
    }

    /// Validates length, takes an in-flight slot, places and submits.
    pub async fn start(&self, mut gen: Generation) -> Result<Accepted, ApiError> {
        if !self.is_ready() {
            return Err(ApiError::Overloaded("Overloaded: this node is draining or shutting down".into()));
        }
        let started_at = Instant::now();
        let prompt = self.render(gen.system.as_deref(), &gen.turns)?;
        let ids = self.tokenize(&prompt)?;
        let ctx = self.model.context_length;
        if ids.len() >= ctx {
            return Err(ApiError::invalid(format!("prompt is too long: {} tokens > {} maximum", ids.len(), ctx - 1)));
        }
        let max_tokens = match gen.max_tokens {
            Some(m) => {
                if ids.len() + m as usize > ctx {
                    return Err(ApiError::invalid(format!(
                        "max_tokens: prompt ({} tokens) + max_tokens ({m}) exceeds the model's context of {ctx} tokens",
                        ids.len()
                    )));
                }
                m
            }
            // No limit given (OpenAI's default): as much as the context allows, capped so a
            // default never asks for more than a long answer needs.
            None => (ctx - ids.len()).min(DEFAULT_MAX_TOKENS) as u32,
        };
        gen.params.max_tokens = max_tokens;
        self.guard.take_tokens(&gen.caller, ids.len())?;
        let permit = self
            .inflight
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::Overloaded("Overloaded: too many requests in flight on this node".into()))?;
        let prompt_tokens = ids.len();
        let (stream, served_by, mark) = self.place_and_submit(ids, gen.params).await?;
        Ok(Accepted { stream, prompt_tokens, served_by, started_at, _permit: permit, _mark: mark })
    }

    /// Places the sequence and submits it. If the chosen remote node cannot be reached, the
    /// next candidates are tried (at most [`MAX_PLACEMENT_TRIES`] in all).
    async fn place_and_submit(&self, mut ids: Vec<u32>, params: SamplingParams) -> Result<(EventStream, String, PlacementMark), ApiError> {
        let summary = RequestSummary { block_hashes: block_hashes(&ids, self.block_size()), prompt_tokens: ids.len(), max_tokens: params.max_tokens as usize };
        let mut view = self.cluster.view();
        let cc = &self.config.cluster;
        let local_window = 2 * zerolayer_node::worker::SIGNAL_INTERVAL;
        let remote_window = local_window + std::time::Duration::from_millis(2 * (cc.publish_interval_ms + cc.gossip_interval_ms));
        self.tracker.adjust(&mut view, local_window, remote_window);
        let rr = self.rr.fetch_add(1, Ordering::Relaxed);
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
            let id = self.tracker.placed(&w.node, &w.worker, summary.prompt_tokens.saturating_sub(s.cached_blocks * bs) as u64);
            let mark = PlacementMark { tracker: self.tracker.clone(), id, blocks: summary.prompt_tokens.div_ceil(bs) as u32 };
            let served_by = format!("{}/{}", w.node, w.worker);
            let target = if w.local { "local" } else { "remote" };
            metrics::counter!("zerolayer_placements_total", "policy" => format!("{:?}", pcfg.policy), "target" => target, "reason" => reason).increment(1);
            if w.local {
                let lw = self.cluster.local_worker(&w.worker).ok_or_else(|| ApiError::Internal(format!("local worker {} vanished", w.worker)))?;
                let stream = lw.handle.submit(SubmitRequest { prompt: std::mem::take(&mut ids), params }).await?;
                return Ok((EventStream::Local(stream), served_by, mark));
            }
            let Some(addr) = self.cluster.peer_addr(&w.node) else {
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
