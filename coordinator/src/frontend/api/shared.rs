//! What every API handler shares: the request id, reading a JSON body, recording the outcome,
//! token timing, collecting a whole sequence, and turning a producer of SSE events into a
//! response body without a task or a channel in between.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use zerolayer_common::{SeqEvent, StopReason, TokenLogprob, Usage};

use crate::auth::Caller;
use crate::frontend::pipeline::{Prepared, Purpose};
use crate::frontend::request::GenerationRequest;
use crate::frontend::service::{Accepted, Frontend, Serving};
use crate::frontend::policy::{Match, OutputGuard, Verdict};
use crate::frontend::timing::Split;
use crate::error::ApiError;
use crate::metrics;

pub type AppState = Arc<Frontend>;

/// The id of the request being served (set by middleware, echoed in `request-id`).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// A fresh id with `prefix` (`req_`, `msg_`, `chatcmpl-`).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

/// Reads the body as JSON, mapping every failure to a precise 400 or 413.
pub fn json_body(body: Result<Bytes, BytesRejection>, max: usize) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::RequestTooLarge(format!("request body exceeds the {max}-byte limit"))
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })?;
    if bytes.is_empty() {
        return Err(ApiError::invalid("request body is empty; expected a JSON object"));
    }
    if std::str::from_utf8(&bytes).is_err() {
        return Err(ApiError::invalid("request body is not valid UTF-8"));
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// Counts the response in the metrics, names the worker that served it, and the model the
/// request named when a fallback served it.
pub fn finish(c: &Frontend, endpoint: &'static str, mut resp: Response, served_by: Option<&Serving>) -> Response {
    metrics::request_done(&c.node_id, endpoint, resp.status().as_u16());
    let Some(s) = served_by else { return resp };
    if let Ok(v) = HeaderValue::from_str(&s.worker) {
        resp.headers_mut().insert("zerolayer-worker", v);
    }
    if let Some(v) = s.fallback_from.as_deref().and_then(|m| HeaderValue::from_str(m).ok()) {
        resp.headers_mut().insert("zerolayer-fallback-from", v);
    }
    resp
}

/// Records time to first token and inter-token latency as deltas arrive.
pub struct TokenTimer {
    node: String,
    started: Instant,
    last: Option<Instant>,
}

impl TokenTimer {
    pub fn new(node: &str, started: Instant) -> Self {
        TokenTimer { node: node.to_string(), started, last: None }
    }

    pub fn on_tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last {
            None => metrics::ttft(&self.node, now.duration_since(self.started).as_secs_f64()),
            Some(prev) => metrics::inter_token(&self.node, now.duration_since(prev).as_secs_f64() / n as f64),
        }
        self.last = Some(now);
    }
}

/// The error a client sees when the shutdown grace period ends its request.
pub fn shut_down() -> ApiError {
    ApiError::Overloaded("Overloaded: the server shut down before the response finished".into())
}

/// The error for a sequence the worker failed, or ended without a result.
pub fn failed(reason: Option<&str>) -> ApiError {
    match reason {
        Some(e) => ApiError::Internal(format!("generation failed: {e}")),
        None => ApiError::Internal("the worker ended the sequence without a result".into()),
    }
}

/// A generation request started at a worker: its sequence, the model name and `stream` the
/// client sent, and what the API kept of its request (`extra`).
pub struct Started<T> {
    pub acc: Accepted,
    pub model: String,
    pub stream: bool,
    pub extra: T,
}

/// Off the runtime, on the preparation pool: `parse` the body (the request, and what the API
/// keeps of it), find its model (`not_found` words the 404 in the API's terms), and run the
/// pipeline ([`crate::frontend::pipeline`]) for `purpose`.
pub async fn prepare<T: Send + 'static>(
    c: &AppState,
    purpose: Purpose,
    not_found: fn(&str) -> ApiError,
    parse: impl FnOnce(&Frontend) -> Result<(GenerationRequest, T), ApiError> + Send + 'static,
) -> Result<(Prepared, T), ApiError> {
    let c2 = c.clone();
    c.prepare(move || {
        let (req, extra) = parse(&c2)?;
        let served = c2.served(&req.model).ok_or_else(|| not_found(&req.model))?;
        Ok((served.prepare(req, purpose)?, extra))
    })
    .await?
}

/// Every generation handler's path: admit the caller, [`prepare`] the request, then place and
/// start it.
pub async fn admit_and_start<T: Send + 'static>(
    c: &AppState,
    caller: &Caller,
    request_id: &str,
    not_found: fn(&str) -> ApiError,
    parse: impl FnOnce(&Frontend) -> Result<(GenerationRequest, T), ApiError> + Send + 'static,
) -> Result<Started<T>, ApiError> {
    let admitted = c.admit(caller, true)?;
    let (mut prepared, extra) = prepare(c, Purpose::Generate, not_found, parse).await?;
    c.check_input(caller, &prepared.req, request_id)?;
    let named = c.served(&prepared.req.model).map(|s| s.info.id.clone()).unwrap_or_default();
    let max_tokens = prepared.req.max_tokens.unwrap_or(0) as usize;
    let fallback = c.fallback_for(caller, &named, prepared.ids.len(), max_tokens);
    if let Some(to) = &fallback {
        // The fallback has its own template and tokenizer: the request is prepared anew for it.
        let (mut req, c2, to2) = (prepared.req, c.clone(), to.clone());
        req.model = to.clone();
        prepared = c.prepare(move || c2.served(&to2).ok_or_else(|| not_found(&to2))?.prepare(req, Purpose::Generate)).await??;
    }
    let (model, stream) = (prepared.req.model.clone(), prepared.req.stream);
    let mut acc = c.start(admitted, caller, prepared, request_id).await?;
    acc.served_by.fallback_from = fallback.map(|_| named);
    Ok(Started { acc, model, stream, extra })
}

/// What a response waits for next.
pub enum Next {
    /// An engine event (its tokens already timed).
    Event(SeqEvent),
    /// Nothing for a ping interval (only when a ping interval was given).
    Idle,
    /// The shutdown grace period is over.
    ShutDown,
    /// The stream ended without a final event.
    Lost,
}

/// An accepted sequence as a response follows it: its events, token timing, and the node's
/// shutdown switch. Shared by the non-streaming collector and both SSE producers.
pub struct Following {
    pub c: AppState,
    acc: Accepted,
    hard_stop: tokio::sync::watch::Receiver<bool>,
    timer: TokenTimer,
    /// The output rules watching the answer: text leaves only where no match can begin.
    guard: Option<OutputGuard>,
    /// An event to answer before reading the sequence again (the end after held text, or a
    /// refusal).
    pending: Option<SeqEvent>,
    /// Logprobs held while output rules watch the answer: their token pieces would tell the
    /// text the rules hold back. They leave with the rest of the text at the end, or never
    /// when a rule stops the answer.
    held_logprobs: Vec<TokenLogprob>,
    /// What [`Following::until_first_token`] read ahead, answered before anything new.
    early: std::collections::VecDeque<Next>,
}

/// Sets the `server-timing` header: a whole response's [`Split::header`], or a stream's
/// [`stream_timing`].
pub fn server_timing(mut resp: Response, value: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(value) {
        resp.headers_mut().insert("server-timing", v);
    }
    resp
}

/// A whole response's headers for how it went: `server-timing`, and the audit id when an output
/// rule stopped it.
pub fn outcome_headers(resp: Response, split: &Split, reason: &StopReason) -> Response {
    let mut resp = server_timing(resp, &split.header());
    if let StopReason::Refused { audit_id, .. } = reason {
        if let Ok(v) = HeaderValue::from_str(audit_id) {
            resp.headers_mut().insert("zerolayer-policy-audit-id", v);
        }
    }
    resp
}

/// What a stream's last event says of an output rule that stopped it: `{rule, audit_id}`.
pub fn policy_json(reason: &StopReason) -> Option<Value> {
    match reason {
        StopReason::Refused { rule, audit_id } => Some(serde_json::json!({"rule": rule, "audit_id": audit_id})),
        _ => None,
    }
}

/// A stream's `server-timing` value: only the preparation is over when its headers leave (the
/// whole split comes in its final event, from [`Following::split`]).
pub fn stream_timing(acc: &Accepted) -> String {
    acc.timing.split(Instant::now(), std::time::Duration::ZERO).stream_header()
}

impl Following {
    pub fn new(c: AppState, acc: Accepted) -> Self {
        let timer = TokenTimer::new(&c.node_id, acc.started_at);
        let hard_stop = c.hard_stop.clone();
        let mut acc = acc;
        let guard = acc.guard.take();
        Following { c, acc, hard_stop, timer, guard, pending: None, held_logprobs: Vec::new(), early: Default::default() }
    }

    /// The sequence it follows.
    pub fn accepted(&self) -> &Accepted {
        &self.acc
    }

    /// Reads ahead until the prompt is computed: the first generated text, or the end (which
    /// [`Following::next`] then answers in order). A request's other choices start after this,
    /// so they find the prompt in the prefix cache.
    pub async fn until_first_token(&mut self) {
        loop {
            let next = self.next_fresh(None).await;
            let more = matches!(next, Next::Event(SeqEvent::Started { .. } | SeqEvent::PromptLogprobs { .. }) | Next::Idle);
            self.early.push_back(next);
            if !more {
                return;
            }
        }
    }

    /// Where the request's time went, up to now (or its end, once finished).
    pub fn split(&self) -> Split {
        self.acc.timing.split(Instant::now(), self.acc.stream.migrate_time())
    }

    /// The next thing to answer: an event, an idle `ping` interval, or the end.
    pub async fn next(&mut self, ping: Option<std::time::Duration>) -> Next {
        match self.early.pop_front() {
            Some(next) => next,
            None => self.next_fresh(ping).await,
        }
    }

    async fn next_fresh(&mut self, ping: Option<std::time::Duration>) -> Next {
        let ev = match self.pending.take() {
            Some(ev) => Some(ev),
            None => tokio::select! {
                ev = self.acc.stream.recv() => ev,
                _ = tokio::time::sleep(ping.unwrap_or_default()), if ping.is_some() => return Next::Idle,
                _ = stopped(&mut self.hard_stop) => return Next::ShutDown,
            },
        };
        match ev {
            Some(ev) => {
                let now = Instant::now();
                let mut ev = match ev {
                    SeqEvent::Finished { ref reason, .. } if self.guard.is_some() && !matches!(reason, StopReason::Error(_) | StopReason::Cancelled) => self.guard_end(ev),
                    ev => ev,
                };
                match &mut ev {
                    SeqEvent::Started { since_admitted_us, .. } => {
                        let computing = std::time::Duration::from_micros(*since_admitted_us as u64);
                        self.acc.timing.on_admitted(now.checked_sub(computing).unwrap_or(now));
                    }
                    SeqEvent::Delta { tokens, text, logprobs } => {
                        if !tokens.is_empty() {
                            self.acc.timing.on_tokens(now);
                        }
                        self.timer.on_tokens(tokens.len());
                        self.acc.ticket.charge_output(tokens.len() as u64);
                        if self.guard.is_some() {
                            self.held_logprobs.append(logprobs);
                        }
                        self.guard_delta(text);
                    }
                    SeqEvent::Finished { usage, reason } if !matches!(reason, StopReason::Error(_)) => {
                        self.acc.timing.on_finished(now);
                        self.record_finished(usage);
                    }
                    SeqEvent::Finished { .. } => self.acc.timing.on_finished(now),
                    SeqEvent::PromptLogprobs { .. } => {}
                }
                Next::Event(ev)
            }
            None => Next::Lost,
        }
    }

    /// A request that ended with a result: its phases and tokens in the metrics, and its usage
    /// line.
    fn record_finished(&self, usage: &Usage) {
        let split = self.split();
        let mut phases = split.phases().to_vec();
        if !split.migrate.is_zero() {
            phases.push(("migrate", split.migrate));
        }
        metrics::phases(&self.c.node_id, &phases, split.total);
        metrics::tokens(&self.c.node_id, usage.prompt_tokens_uncached as u64, usage.prompt_tokens_cached as u64, usage.output_tokens as u64);
        tracing::info!(
            target: "zerolayer_coordinator::usage",
            input_tokens = usage.prompt_tokens_uncached,
            cache_read_input_tokens = usage.prompt_tokens_cached,
            output_tokens = usage.output_tokens,
            "request finished"
        );
    }

    /// New text through the output rules: what may leave now replaces it. A match ends the
    /// answer after the text before it.
    fn guard_delta(&mut self, text: &mut String) {
        let Some(g) = self.guard.as_mut() else { return };
        match g.push(text) {
            Verdict::Release(t) => *text = t,
            Verdict::Stop { release, m } => {
                *text = release;
                self.refuse(m);
            }
        }
    }

    /// The sequence ended: the text the rules still hold goes first (unless a match is in it),
    /// then the end.
    fn guard_end(&mut self, end: SeqEvent) -> SeqEvent {
        let Some(mut g) = self.guard.take() else { return end };
        let text = match g.finish() {
            Verdict::Release(t) => {
                self.pending = Some(end);
                t
            }
            Verdict::Stop { release, m } => {
                self.refuse(m);
                release
            }
        };
        let logprobs = std::mem::take(&mut self.held_logprobs);
        match self.pending.take() {
            Some(next) if text.is_empty() && logprobs.is_empty() => next,
            next => {
                self.pending = next;
                SeqEvent::Delta { tokens: Vec::new(), text, logprobs }
            }
        }
    }

    /// An output rule matched: an audit record, and the answer ends next with `Refused`.
    fn refuse(&mut self, m: Match) {
        self.guard = None;
        self.held_logprobs.clear();
        let audit_id = self.c.audit_match(&self.acc.tenant, &m, "output", &self.acc.request_id, &self.acc.model);
        let usage = self.acc.stream.usage_so_far();
        self.pending = Some(SeqEvent::Finished { reason: StopReason::Refused { rule: m.rule, audit_id }, usage });
    }
}

/// A whole sequence, as a non-streaming response answers it.
pub struct Collected {
    pub text: String,
    pub reason: StopReason,
    pub usage: Usage,
    /// Where its time went.
    pub split: Split,
    /// Each generated token's log-probabilities, when the request asked for them, and the
    /// prompt's (from its second token), when it asked for those too.
    pub logprobs: Vec<TokenLogprob>,
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// Collects a whole sequence (non-streaming responses).
pub async fn collect(c: &AppState, acc: Accepted) -> Result<Collected, ApiError> {
    collect_following(Following::new(c.clone(), acc)).await
}

/// Collects the rest of a followed sequence.
pub async fn collect_following(mut f: Following) -> Result<Collected, ApiError> {
    let (mut text, mut logprobs, mut prompt_logprobs) = (String::new(), Vec::new(), Vec::new());
    loop {
        match f.next(None).await {
            Next::Event(SeqEvent::Delta { text: t, logprobs: l, .. }) => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Next::Event(SeqEvent::PromptLogprobs { logprobs: l, .. }) => prompt_logprobs.extend(l),
            Next::Event(SeqEvent::Started { .. }) | Next::Idle => {}
            Next::Event(SeqEvent::Finished { reason: StopReason::Error(e), .. }) => return Err(failed(Some(&e))),
            Next::Event(SeqEvent::Finished { reason, usage }) => return Ok(Collected { text, reason, usage, split: f.split(), logprobs, prompt_logprobs }),
            Next::ShutDown => return Err(shut_down()),
            Next::Lost => return Err(failed(None)),
        }
    }
}

/// Resolves once the shutdown grace period is over (never holds the watch guard across awaits).
pub async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One step of an SSE producer: the events to send now, and the producer for the next step
/// (`None`: the stream ends after these events).
pub type SseStep<S> = (Vec<Event>, Option<S>);

/// An SSE response whose events come from `step`, called again each time the previous step's
/// events are written. It runs on the connection's own task, pulled by the body: there is no
/// producer task and no channel. When the client goes away the body is dropped, and with it the
/// producer's state, which cancels the sequence at its worker.
pub fn sse_response<S, F, Fut>(state: S, mut step: F) -> Response
where
    S: Send + 'static,
    F: FnMut(S) -> Fut + Send + 'static,
    Fut: Future<Output = SseStep<S>> + Send + 'static,
{
    use futures::StreamExt;
    let events = futures::stream::unfold(Some(state), move |state| {
        let next = state.map(&mut step);
        async move {
            let (events, state) = next?.await;
            Some((futures::stream::iter(events.into_iter().map(Ok::<Event, Infallible>)), state))
        }
    })
    .flatten();
    Sse::new(events).into_response()
}

/// An SSE event with a name and a JSON body (the Anthropic shape).
pub fn named_event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}
