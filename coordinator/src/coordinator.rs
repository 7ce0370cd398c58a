//! The coordinator: what every HTTP handler calls. It turns a validated request into a prompt,
//! places it on a worker and hands the sequence straight to that worker — one in-process
//! message, no extra hop or serialization.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use zerolayer_common::{ClusterConfig, SamplingParams, WorkerSignals};
use zerolayer_node::chat::{ChatMessage, ChatTemplate};
use zerolayer_node::tokenizer::Tokenizer;
use zerolayer_node::{SeqStream, SubmitRequest, WorkerHandle};

use crate::anthropic::{Role, Turn};
use crate::auth::{Caller, Guard};
use crate::error::ApiError;

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

/// A sequence accepted by a worker.
pub struct Accepted {
    pub stream: SeqStream,
    pub prompt_tokens: usize,
    /// `NODE_ID/WORKER_ID`, for the `zerolayer-worker` header.
    pub served_by: String,
    pub started_at: Instant,
    /// Released when the response is done (the node's in-flight cap).
    pub _permit: OwnedSemaphorePermit,
}

pub struct Coordinator {
    pub node_id: String,
    pub config: ClusterConfig,
    pub model: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub workers: Vec<LocalWorker>,
    pub guard: Guard,
    inflight: Arc<Semaphore>,
    /// Set on SIGTERM / drain: `/ready` turns 503 and new work is refused.
    pub draining: AtomicBool,
    /// Flips to true when the shutdown grace period is over: open streams end with an error.
    pub hard_stop: watch::Receiver<bool>,
    rr: AtomicUsize,
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
        hard_stop: watch::Receiver<bool>,
    ) -> Self {
        let inflight = Arc::new(Semaphore::new(config.server.max_inflight));
        Coordinator {
            node_id,
            config,
            model,
            tokenizer,
            template,
            workers,
            guard,
            inflight,
            draining: AtomicBool::new(false),
            hard_stop,
            rr: AtomicUsize::new(0),
        }
    }

    /// Requests holding an in-flight slot (generations being served).
    pub fn in_flight(&self) -> usize {
        self.config.server.max_inflight - self.inflight.available_permits()
    }

    pub fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire) && !*self.hard_stop.borrow()
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
        let w = self.place()?;
        let prompt_tokens = ids.len();
        let stream = w.handle.submit(SubmitRequest { prompt: ids, params: gen.params }).await?;
        Ok(Accepted { stream, prompt_tokens, served_by: format!("{}/{}", self.node_id, w.id), started_at, _permit: permit })
    }

    /// Local placement: the least loaded worker whose queue has room; round-robin on ties.
    fn place(&self) -> Result<&LocalWorker, ApiError> {
        let n = self.workers.len();
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(&LocalWorker, u64)> = None;
        for k in 0..n {
            let w = &self.workers[(start + k) % n];
            let s = w.handle.signals();
            if s.waiting as usize >= w.max_waiting {
                continue;
            }
            let load = s.running as u64 + s.waiting as u64 * 4 + s.waiting_prefill_tokens / 256;
            if best.is_none_or(|(_, l)| load < l) {
                best = Some((w, load));
            }
        }
        best.map(|b| b.0).ok_or_else(|| ApiError::Overloaded("Overloaded: every worker's queue is full".into()))
    }
}
