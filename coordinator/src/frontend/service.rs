//! The coordinator: what every HTTP handler calls. It admits a request before any work on its
//! body (the key's limits, the node's in-flight cap), prepares it off the async runtime on a
//! bounded pool (parsing, the length check, the template and tokenizer), charges the prompt to
//! the key, and hands the sequence to
//! the [`Dispatcher`] (placement anywhere in the cluster, then one in-process message or one
//! QUIC hop). The client follows it through a [`LiveSequence`], which continues it elsewhere
//! if its worker is lost or drained.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ractor::ActorRef;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use zerolayer_common::{scope_root, CachePin, ClusterConfig, Job, Share, WorkerSignals};

use crate::auth::{Caller, Guard};
use crate::quota::Ticket;
use crate::cluster::{Cluster, LocalWorker};
use crate::frontend::diagnostics::{self, Diagnosis, Fingerprint, Recent};
use crate::routing::dispatch::Dispatcher;
use crate::routing::orchestrator::{OrchestratorMsg, DrainReport};
use crate::error::ApiError;
use crate::frontend::pipeline::{Prepared, Served};
use crate::frontend::request::{resolve_max_tokens, CacheTtl};
use crate::frontend::timing::Timing;
use crate::frontend::audit::{self, AuditLog, Record};
use crate::frontend::policy::{Match, OutputGuard, Policy};
use crate::frontend::request::{GenerationRequest, RawPrompt};
use crate::routing::resume::LiveSequence;
use crate::view::NodeState;

/// Who serves a request, as its response's headers say.
#[derive(Clone, Debug)]
pub struct Serving {
    /// `NODE_ID/WORKER_ID` of the first worker (`zerolayer-worker`).
    pub worker: String,
    /// The model the request named, when its fallback serves it (`zerolayer-fallback-from`).
    pub fallback_from: Option<String>,
}

/// A sequence accepted by a worker.
pub struct Accepted {
    pub stream: LiveSequence,
    pub prompt_tokens: usize,
    /// Who serves it, for the response's headers.
    pub served_by: Serving,
    pub started_at: Instant,
    /// Where its time goes, phase by phase (`server-timing`).
    pub timing: Timing,
    /// The output rules that watch its answer (`None`: none covers its key).
    pub guard: Option<OutputGuard>,
    /// Its key's name, its request id and model id, for an audit record.
    pub tenant: String,
    pub request_id: String,
    pub model: String,
    /// What the prompt was made of, for `diagnostics.previous_message_id` later.
    pub fingerprint: Arc<Fingerprint>,
    /// The key's concurrency slot and the handle its output tokens are charged through (shared
    /// by the choices of one request).
    pub ticket: Arc<Ticket>,
    /// Where the request's cache breakpoints fall in its prompt (tokens), for `usage`.
    pub breakpoints: Vec<(usize, CacheTtl)>,
    /// Released when the response is done (the node's in-flight cap; shared by its choices).
    pub _permit: Arc<OwnedSemaphorePermit>,
}

/// A request let in: its key's slot (and, for a generation, one request charged) and the node's
/// in-flight slot. Taken before the body is parsed or the prompt rendered.
pub struct Admitted {
    pub ticket: Ticket,
    permit: OwnedSemaphorePermit,
    /// When it was let in: where its `server-timing` begins.
    arrived: Instant,
}

pub struct Frontend {
    pub node_id: String,
    pub config: ClusterConfig,
    /// Every model of the cluster, `[model]` (the default) first.
    pub models: Vec<Served>,
    pub workers: Vec<LocalWorker>,
    pub guard: Guard,
    pub cluster: Arc<Cluster>,
    /// Flips to true when the shutdown grace period is over: open streams end with an error.
    pub hard_stop: watch::Receiver<bool>,
    /// What changes as requests come and go.
    pub admission: Admission,
    /// Placement and submission (shared with the sequences it placed, which may move).
    pub dispatch: Arc<Dispatcher>,
    /// This node's coordinator actor: drain and undrain (see [`crate::routing::orchestrator`]).
    pub orchestrator: ActorRef<OrchestratorMsg>,
    /// Recent responses' prompt fingerprints, for cache-miss diagnostics (bounded).
    pub recent: Mutex<Recent>,
    /// The cluster's secret for cache scope roots (`zerolayer_common::scope_root`): derived from
    /// the cluster CA's certificate, so every node agrees; a random one on a node without TLS.
    pub cache_secret: [u8; 32],
    /// The responses this node stored (the Responses API's `store`; bounded).
    pub responses: crate::frontend::stored::ResponseStore,
    /// `[[policy.rules]]`, compiled.
    pub policy: Policy,
    /// The policy matches of the requests this node served (bounded).
    pub audit: AuditLog,
}

/// A coordinator's admission state: the in-flight cap, and the preparation pool's slots.
pub struct Admission {
    inflight: Arc<Semaphore>,
    max_inflight: usize,
    prepare: Semaphore,
}

impl Admission {
    /// `prepare_threads` 0: one per CPU core.
    pub fn new(max_inflight: usize, prepare_threads: usize) -> Self {
        let threads = match prepare_threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        Admission { inflight: Arc::new(Semaphore::new(max_inflight)), max_inflight, prepare: Semaphore::new(threads) }
    }
}

impl Frontend {
    /// Requests holding an in-flight slot (generations being served).
    pub fn in_flight(&self) -> usize {
        self.admission.max_inflight - self.admission.inflight.available_permits()
    }

    /// Placement marks this coordinator holds (pending, done): they must drain to zero pending
    /// once no request is in flight (leak checks).
    pub fn placement_marks(&self) -> (usize, usize) {
        self.dispatch.placement_marks()
    }

    /// Ready for new work: not draining, not shutting down (`/ready`).
    pub fn is_ready(&self) -> bool {
        self.cluster.state() == NodeState::Ready && !*self.hard_stop.borrow()
    }

    /// Starts draining this node (idempotent): `/ready` turns 503, peers stop placing here, and
    /// every sequence on its workers moves to other workers. Returns the drain's report so far.
    pub async fn drain(&self) -> Result<DrainReport, ApiError> {
        ractor::call_t!(self.orchestrator, OrchestratorMsg::Drain, 10_000).map_err(|e| ApiError::Internal(format!("drain: {e}")))
    }

    /// Lets traffic back in after a drain.
    pub async fn undrain(&self) -> Result<DrainReport, ApiError> {
        ractor::call_t!(self.orchestrator, OrchestratorMsg::Undrain, 10_000).map_err(|e| ApiError::Internal(format!("undrain: {e}")))
    }

    /// The drain's progress (sequences still on this node's workers, what moved).
    pub async fn drain_report(&self) -> Result<DrainReport, ApiError> {
        ractor::call_t!(self.orchestrator, OrchestratorMsg::Report, 10_000).map_err(|e| ApiError::Internal(format!("drain report: {e}")))
    }

    /// Sequences still running because of this node: its own requests plus those it serves
    /// for other coordinators.
    pub fn busy(&self) -> usize {
        self.in_flight() + self.cluster.serving_remote.load(Ordering::Acquire)
    }

    pub fn worker_signals(&self) -> Vec<(String, WorkerSignals)> {
        self.workers.iter().map(|w| (w.id.clone(), w.handle.signals())).collect()
    }

    /// The model a request names (its id or an alias), if the cluster serves it.
    pub fn served(&self, name: &str) -> Option<&Served> {
        self.models.iter().find(|m| m.info.matches(name))
    }

    /// The default model (`[model]`).
    pub fn default_model(&self) -> &Served {
        &self.models[0]
    }

    /// Lets a request in, before any work on its body: not shutting down, the key's limits
    /// (concurrency, and one request for a `generation`), then the node's in-flight cap.
    pub fn admit(&self, caller: &Caller, generation: bool) -> Result<Admitted, ApiError> {
        if *self.hard_stop.borrow() {
            return Err(ApiError::Overloaded("Overloaded: this node is shutting down".into()));
        }
        let ticket = self.guard.admit(caller, generation)?;
        let permit = self
            .admission
            .inflight
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::Overloaded("Overloaded: too many requests in flight on this node".into()))?;
        Ok(Admitted { ticket, permit, arrived: Instant::now() })
    }

    /// Runs `f` (parsing a body, rendering and tokenizing a prompt) on the preparation pool, off
    /// the async runtime. At most `prepare_threads` run at once; an admitted request waits here.
    pub async fn prepare<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        let _slot = self.admission.prepare.acquire().await.map_err(|_| ApiError::Internal("the preparation pool is closed".into()))?;
        tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::Internal(format!("preparing the request: {e}")))
    }

    /// Charges the prompt to the key, then places and submits it. A draining node still accepts
    /// requests (its workers are out of placement; other nodes' are not); only a node past its
    /// shutdown grace period refuses.
    /// The prepared request's `breakpoints` are its `cache_control` positions in tokens: the
    /// worker pins each prefix for its TTL, and usage is split at them.
    pub async fn start(&self, admitted: Admitted, caller: &Caller, prepared: Prepared, request_id: &str) -> Result<Accepted, ApiError> {
        let Admitted { ticket, permit, arrived } = admitted;
        let Prepared { req, ids, breakpoints } = prepared;
        if req.params.ignore_eos && !self.guard.tenant(caller).allow_ignore_eos {
            return Err(ApiError::Permission("ignore_eos is not enabled for this API key (an operator option: allow_ignore_eos in [[auth.keys]])".into()));
        }
        let started_at = Instant::now();
        let model = self.served(&req.model).ok_or_else(|| ApiError::NotFound(format!("model: {}", req.model)))?.info.clone();
        let tenant = self.guard.tenant(caller);
        let scope = tenant.cache_scope_name(req.cache_salt.as_deref());
        let fingerprint = Arc::new(Fingerprint::of(&req, &model.id, &ids).in_scope(&scope));
        let mut params = req.params;
        self.config.apply_sampling_defaults(&model.id, &mut params, req.temperature_set);
        params.max_tokens = resolve_max_tokens(req.max_tokens, ids.len(), model.context_length)?;
        if params.temperature > 0.0 {
            // Fixed here, so that a continuation on another worker samples what this one would.
            params.seed.get_or_insert_with(rand::random);
        }
        ticket.charge_input(ids.len() as u64, true).map_err(crate::auth::rate_limited)?;
        let prompt_tokens = ids.len();
        let pins = breakpoints.iter().map(|&(tokens, ttl)| CachePin { tokens: tokens as u32, ttl_secs: ttl.secs() }).collect();
        let job = Job { request_id: request_id.to_string(), model: model.id, prompt: ids, params, share: Share::of(&tenant.name, tenant.weight), pins, resume: Vec::new(), cache_root: scope_root(&self.cache_secret, &scope), claim: zerolayer_common::TenantClaim { tenant: tenant.name.clone(), cache_salt: req.cache_salt.clone() } };
        let placed = self.dispatch.submit(&job, &[], None).await?;
        let served_by = Serving { worker: placed.served_by(), fallback_from: None };
        let timing = Timing::new(arrived, Instant::now());
        let guard = self.policy.output(&tenant.name);
        let model = job.model.clone();
        Ok(Accepted {
            stream: LiveSequence::new(self.dispatch.clone(), job, placed),
            prompt_tokens,
            served_by,
            started_at,
            timing,
            guard,
            tenant: tenant.name.clone(),
            request_id: request_id.to_string(),
            model,
            fingerprint,
            ticket: Arc::new(ticket),
            breakpoints,
            _permit: Arc::new(permit),
        })
    }

    /// Choice `index` (from 1) of the request `first` started: the same prompt and parameters
    /// under the choice's own seed ([`choice_seed`]), submitted to the worker serving `first`
    /// first, so that once `first` has computed the prompt this one reads it from the prefix
    /// cache. It shares `first`'s key slot, in-flight slot and quota charge: the prompt is
    /// charged once, each choice's output as it comes.
    pub async fn fork(&self, first: &Accepted, index: u32) -> Result<Accepted, ApiError> {
        let mut job = first.stream.request();
        job.params.seed = job.params.seed.map(|s| choice_seed(s, index));
        let (node, worker) = first.stream.at();
        let placed = self.dispatch.submit(&job, &[], Some((node, worker))).await?;
        let served_by = Serving { worker: placed.served_by(), fallback_from: first.served_by.fallback_from.clone() };
        let now = Instant::now();
        Ok(Accepted {
            stream: LiveSequence::new(self.dispatch.clone(), job, placed),
            prompt_tokens: first.prompt_tokens,
            served_by,
            started_at: now,
            timing: Timing::new(now, now),
            guard: self.policy.output(&first.tenant),
            tenant: first.tenant.clone(),
            request_id: first.request_id.clone(),
            model: first.model.clone(),
            fingerprint: first.fingerprint.clone(),
            ticket: first.ticket.clone(),
            breakpoints: first.breakpoints.clone(),
            _permit: first._permit.clone(),
        })
    }

    /// The model that serves a request for `model` (an id) with this prompt when no worker of
    /// the cluster can take it now: the first of its fallbacks that some worker can take, by
    /// the same placement decision over the published snapshot. `None`: the model itself can
    /// (or the key opted out, or no fallback can either): the request goes on as it is.
    pub fn fallback_for(&self, caller: &Caller, model: &str, prompt_tokens: usize, max_tokens: usize) -> Option<String> {
        // Most models have no fallback: their requests skip the extra placement decision.
        let fallbacks = self.config.fallbacks(model);
        if fallbacks.is_empty() || self.dispatch.can_take(model, prompt_tokens, max_tokens) || !self.guard.tenant(caller).allow_fallback {
            return None;
        }
        let to = fallbacks.into_iter().find(|m| self.dispatch.can_take(&m.id, prompt_tokens, max_tokens))?.id.clone();
        metrics::counter!("zerolayer_fallbacks_total", "node" => self.node_id.clone(), "from" => model.to_string(), "to" => to.clone()).increment(1);
        tracing::info!(from = model, to = %to, "no worker can take the model now: its fallback serves the request");
        Some(to)
    }

    /// Refuses a request whose client text (system prompt, messages, a raw prompt) an input rule
    /// for the caller's key matches: 400, with an audit record.
    pub fn check_input(&self, caller: &Caller, req: &GenerationRequest, request_id: &str) -> Result<(), ApiError> {
        if self.policy.is_empty() {
            return Ok(());
        }
        let tenant = self.guard.tenant(caller).name.clone();
        let raw = match &req.raw {
            Some(RawPrompt::Text(t)) => Some(t.as_str()),
            _ => None,
        };
        let texts = req.system.as_deref().into_iter().chain(req.turns.iter().map(|t| t.text.as_str())).chain(raw);
        let Some(m) = self.policy.check_input(&tenant, texts) else { return Ok(()) };
        let audit_id = self.audit_match(&tenant, &m, "input", request_id, &req.model);
        Err(ApiError::PolicyRefused { rule: m.rule, audit_id })
    }

    /// Keeps the audit record of a policy match, counts it, and returns its id.
    pub fn audit_match(&self, tenant: &str, m: &Match, direction: &'static str, request_id: &str, model: &str) -> String {
        let now = std::time::SystemTime::now();
        let time_ms = now.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let id = audit::new_id(&self.node_id);
        let record = Record {
            id: id.clone(),
            time_ms,
            time: crate::clock::rfc3339_system(now),
            key: tenant.to_string(),
            rule: m.rule.clone(),
            direction: direction.to_string(),
            span: m.redacted.clone(),
            request_id: request_id.to_string(),
            model: model.to_string(),
        };
        self.audit.push(record, time_ms);
        metrics::counter!("zerolayer_policy_matches_total", "node" => self.node_id.clone(), "rule" => m.rule.clone(), "direction" => direction).increment(1);
        tracing::info!(rule = %m.rule, direction, audit_id = %id, key = tenant, "a policy rule matched");
        id
    }

    /// Keeps a response's prompt fingerprint under its message id.
    pub fn remember(&self, message_id: &str, fp: Arc<Fingerprint>) {
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).insert(message_id.to_string(), fp);
    }

    /// Why this prompt missed the cache, against the earlier message `previous` (None: no
    /// earlier message named). Counted by reason, and logged at debug with where they part.
    pub fn diagnose(&self, previous: Option<&str>, fp: &Fingerprint) -> Option<Diagnosis> {
        let prev = self.recent.lock().unwrap_or_else(|e| e.into_inner()).get(previous?);
        // Only the same cache scope's messages are found: one tenant learns nothing of another's.
        let d = match prev {
            Some(prev) if prev.scope() == fp.scope() => diagnostics::diagnose(&prev, fp),
            _ => Diagnosis::PreviousNotFound,
        };
        let reason = match d {
            Diagnosis::NoMiss => "none",
            Diagnosis::PreviousNotFound => "previous_message_not_found",
            Diagnosis::Miss { reason, missed_tokens, first_difference } => {
                tracing::debug!(target: "zerolayer_coordinator::frontend::diagnostics", reason = reason.as_str(), missed_tokens, first_difference, "prompt cache miss");
                reason.as_str()
            }
        };
        metrics::counter!("zerolayer_cache_miss_diagnoses_total", "node" => self.node_id.clone(), "reason" => reason).increment(1);
        Some(d)
    }
}

/// The seed of choice `index` of a request sampled at `seed`: choice 0 keeps it (one choice is
/// what it always was); the others get distinct, fixed seeds (a SplitMix64 step of the seed and
/// the index), so `n` choices at a seed are `n` different samples, the same ones on every run,
/// and each stays exact when it moves.
pub fn choice_seed(seed: u64, index: u32) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
