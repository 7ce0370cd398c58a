//! The HTTP API (axum): Anthropic Messages, OpenAI Chat Completions, models, health, metrics.
//!
//! Every response carries `request-id`; every error is in the API's own shape (mapped in one
//! place, `error.rs`); streams end with an SSE `error` event if anything fails after the 200.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use zerolayer_common::{SamplingParams, SeqEvent, StopReason, Usage};

use crate::anthropic::{self, Endpoint};
use crate::auth::Caller;
use crate::coordinator::{Accepted, Coordinator, Generation};
use crate::error::ApiError;
use crate::metrics;
use crate::openai;

/// The id of the request being served (set by middleware, echoed in `request-id`).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

type AppState = Arc<Coordinator>;

pub fn router(state: AppState) -> Router {
    let limit = state.config.server.max_body_bytes;
    let api = Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), api_guard));
    let admin = Router::new()
        .route("/admin/status", get(admin_status))
        .route("/admin/cluster", get(admin_cluster))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_guard));
    Router::new()
        .merge(api)
        .merge(admin)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_handler))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(request_id_layer))
        .with_state(state)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

async fn request_id_layer(mut req: Request, next: Next) -> Response {
    let id = new_id("req_");
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("request-id", v);
    }
    resp
}

fn is_openai(req: &Request) -> bool {
    req.uri().path().starts_with("/v1/chat/")
}

/// Authenticates API calls and applies the per-key request limit; adds rate-limit headers.
async fn api_guard(State(c): State<AppState>, mut req: Request, next: Next) -> Response {
    let rid = req.extensions().get::<RequestId>().map(|r| r.0.clone()).unwrap_or_default();
    let openai = is_openai(&req);
    let shape = |e: ApiError| if openai { e.into_openai() } else { e.into_anthropic(&rid) };
    let caller = match c.guard.authorize_api(req.headers()) {
        Ok(caller) => caller,
        Err(e) => return finish(&c, "auth", shape(e), None),
    };
    if let Err(e) = c.guard.take_request(&caller) {
        let mut r = finish(&c, "rate_limit", shape(e), None);
        c.guard.add_headers(&caller, r.headers_mut());
        return r;
    }
    req.extensions_mut().insert(caller.clone());
    let mut resp = next.run(req).await;
    c.guard.add_headers(&caller, resp.headers_mut());
    resp
}

async fn admin_guard(State(c): State<AppState>, req: Request, next: Next) -> Response {
    let rid = req.extensions().get::<RequestId>().map(|r| r.0.clone()).unwrap_or_default();
    match c.guard.authorize_admin(req.headers()) {
        Ok(_) => next.run(req).await,
        Err(e) => finish(&c, "admin", e.into_anthropic(&rid), None),
    }
}

async fn admin_status(State(c): State<AppState>) -> Json<Value> {
    let workers: Vec<Value> = c.worker_signals().into_iter().map(|(id, s)| json!({"id": id, "signals": s})).collect();
    Json(json!({"node": c.node_id, "ready": c.is_ready(), "model": c.model.id, "in_flight": c.in_flight(), "workers": workers}))
}

/// The cluster as this node sees it: every node's state and every worker's signals.
async fn admin_cluster(State(c): State<AppState>) -> Json<Value> {
    Json(cluster_json(&c))
}

pub fn cluster_json(c: &Coordinator) -> Value {
    let view = c.cluster.view();
    let nodes = c.cluster.nodes();
    let (mut hits, mut queries) = (0u64, 0u64);
    let workers: Vec<Value> = view
        .workers
        .iter()
        .map(|w| {
            let s = &w.signals;
            hits += s.prefix_cache_hits_total;
            queries += s.prefix_cache_queries_total;
            json!({
                "node": w.node,
                "worker": w.worker,
                "state": w.state,
                "local": w.local,
                "device": w.device,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_blocks_total": s.kv_blocks_total,
                "kv_blocks_cached": s.kv_blocks_cached,
                "indexed_blocks": w.cached.len(),
                "kv_fragmentation_ratio": s.kv_fragmentation_ratio,
                "prefix_hit_ratio": s.prefix_hit_ratio,
                "running": s.running,
                "waiting": s.waiting,
                "tokens_per_second": s.tokens_per_second,
                "signals": s,
            })
        })
        .collect();
    json!({
        "node": c.node_id,
        "policy": c.config.placement.policy,
        "nodes": nodes,
        "workers": workers,
        "prefix_cache_hits_total": hits,
        "prefix_cache_queries_total": queries,
        "prefix_hit_ratio": if queries == 0 { 0.0 } else { hits as f64 / queries as f64 },
    })
}

async fn not_found(Extension(rid): Extension<RequestId>, req: Request) -> Response {
    ApiError::NotFound(format!("{} {} does not exist", req.method(), req.uri().path())).into_anthropic(&rid.0)
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn ready(State(c): State<AppState>) -> Response {
    if c.is_ready() {
        Json(json!({"status": "ready", "node": c.node_id})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "draining", "node": c.node_id}))).into_response()
    }
}

async fn metrics_handler(State(c): State<AppState>) -> Response {
    let peers: Vec<(String, &'static str)> = c.cluster.nodes().into_iter().map(|n| (n.id, n.state.as_str())).collect();
    let body = metrics::render(&c.node_id, &c.model.id, &c.worker_signals(), &peers);
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

/// RFC 3339 (UTC, seconds) for a system time.
pub fn rfc3339_system(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64 + i64::from(d.subsec_nanos() > 0)).unwrap_or(0);
    rfc3339(secs)
}

fn rfc3339(unix: i64) -> String {
    // Civil-from-days (Howard Hinnant), UTC.
    let days = unix.div_euclid(86400);
    let secs = unix.rem_euclid(86400);
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

fn model_json(c: &Coordinator) -> Value {
    json!({
        "id": c.model.id, "type": "model", "display_name": c.model.display_name,
        "created_at": rfc3339(c.model.created_unix),
        "object": "model", "created": c.model.created_unix, "owned_by": "zerolayer",
    })
}

async fn list_models(State(c): State<AppState>) -> Json<Value> {
    Json(json!({"data": [model_json(&c)], "has_more": false, "first_id": c.model.id, "last_id": c.model.id, "object": "list"}))
}

async fn get_model(State(c): State<AppState>, Extension(rid): Extension<RequestId>, Path(id): Path<String>) -> Response {
    if c.model.matches(&id) {
        Json(model_json(&c)).into_response()
    } else {
        ApiError::NotFound(format!("model: {id}")).into_anthropic(&rid.0)
    }
}

/// Reads the body as JSON, mapping every failure to a precise 400 or 413.
fn json_body(body: Result<Bytes, BytesRejection>, max: usize) -> Result<Value, ApiError> {
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

fn check_headers(h: &HeaderMap) -> Result<(), ApiError> {
    if let Some(v) = h.get("anthropic-version") {
        let s = v.to_str().unwrap_or("");
        let ok = s.len() == 10 && s.as_bytes().iter().enumerate().all(|(i, b)| if i == 4 || i == 7 { *b == b'-' } else { b.is_ascii_digit() });
        if !ok {
            return Err(ApiError::invalid(format!("anthropic-version: {s:?} is not a valid version (e.g. \"2023-06-01\")")));
        }
    }
    Ok(())
}

fn finish(c: &Coordinator, endpoint: &'static str, mut resp: Response, served_by: Option<&str>) -> Response {
    metrics::request_done(&c.node_id, endpoint, resp.status().as_u16());
    if let Some(s) = served_by.and_then(|s| HeaderValue::from_str(s).ok()) {
        resp.headers_mut().insert("zerolayer-worker", s);
    }
    resp
}

async fn count_tokens(State(c): State<AppState>, Extension(rid): Extension<RequestId>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        check_headers(&headers)?;
        let v = json_body(body, c.config.server.max_body_bytes)?;
        let req = anthropic::parse(&v, Endpoint::CountTokens)?;
        if !c.model.matches(&req.model) {
            return Err(ApiError::NotFound(format!("model: {}", req.model)));
        }
        let prompt = c.render(req.system.as_deref(), &req.turns)?;
        Ok(c.tokenize(&prompt)?.len())
    })();
    let resp = match r {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_anthropic(&rid.0),
    };
    finish(&c, "count_tokens", resp, None)
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens_uncached,
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.prompt_tokens_cached,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "service_tier": "standard",
    })
}

fn stop_fields(reason: &StopReason) -> (Value, Value) {
    match reason {
        StopReason::StopSequence(s) => (json!("stop_sequence"), json!(s)),
        r => (json!(r.as_anthropic()), Value::Null),
    }
}

async fn messages(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = (|| {
        check_headers(&headers)?;
        let v = json_body(body, c.config.server.max_body_bytes)?;
        let req = anthropic::parse(&v, Endpoint::Messages)?;
        if !c.model.matches(&req.model) {
            return Err(ApiError::NotFound(format!("model: {}", req.model)));
        }
        Ok(req)
    })();
    let req = match parsed {
        Ok(r) => r,
        Err(e) => return finish(&c, "messages", e.into_anthropic(&rid.0), None),
    };
    let gen = Generation {
        caller,
        system: req.system.clone(),
        turns: req.turns.clone(),
        max_tokens: req.max_tokens,
        params: SamplingParams {
            temperature: req.temperature,
            top_k: req.top_k,
            top_p: req.top_p,
            seed: None,
            max_tokens: 0,
            stop_sequences: req.stop_sequences.clone(),
            ignore_eos: false,
        },
    };
    let acc = match c.start(gen).await {
        Ok(a) => a,
        Err(e) => return finish(&c, "messages", e.into_anthropic(&rid.0), None),
    };
    let served_by = acc.served_by.clone();
    let msg_id = new_id("msg_");
    let diagnostics = req.wants_diagnostics.then(|| json!({"cache_miss_reason": {"type": "unavailable"}}));
    if req.stream {
        let (tx, rx) = mpsc::channel::<Event>(64);
        let c2 = c.clone();
        let model = req.model.clone();
        tokio::spawn(anthropic_stream(c2, acc, tx, msg_id, model));
        let sse = Sse::new(ReceiverStream(rx));
        return finish(&c, "messages", sse.into_response(), Some(&served_by));
    }
    let resp = match collect(&c, acc).await {
        Ok((text, reason, usage)) => {
            let (stop_reason, stop_sequence) = stop_fields(&reason);
            let content = if text.is_empty() { json!([]) } else { json!([{"type": "text", "text": text}]) };
            let mut body = json!({
                "id": msg_id, "type": "message", "role": "assistant", "content": content, "model": req.model,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_json(&usage),
            });
            if let Some(d) = diagnostics {
                body["diagnostics"] = d;
            }
            Json(body).into_response()
        }
        Err(e) => e.into_anthropic(&rid.0),
    };
    finish(&c, "messages", resp, Some(&served_by))
}

/// Records time to first token and inter-token latency as deltas arrive.
struct TokenTimer<'a> {
    node: &'a str,
    started: Instant,
    last: Option<Instant>,
}

impl<'a> TokenTimer<'a> {
    fn new(node: &'a str, started: Instant) -> Self {
        TokenTimer { node, started, last: None }
    }

    fn on_tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        match self.last {
            None => metrics::ttft(self.node, now.duration_since(self.started).as_secs_f64()),
            Some(prev) => metrics::inter_token(self.node, now.duration_since(prev).as_secs_f64() / n as f64),
        }
        self.last = Some(now);
    }
}

/// Collects a whole sequence (non-streaming responses).
async fn collect(c: &Coordinator, mut acc: Accepted) -> Result<(String, StopReason, Usage), ApiError> {
    let mut text = String::new();
    let mut hard_stop = c.hard_stop.clone();
    let mut timer = TokenTimer::new(&c.node_id, acc.started_at);
    loop {
        let ev = tokio::select! {
            ev = acc.stream.recv() => ev,
            _ = stopped(&mut hard_stop) => return Err(ApiError::Overloaded("Overloaded: the server shut down before the response finished".into())),
        };
        match ev {
            Some(SeqEvent::Delta { text: t, tokens }) => {
                timer.on_tokens(tokens.len());
                text.push_str(&t);
            }
            Some(SeqEvent::Started { .. }) => {}
            Some(SeqEvent::Finished { reason: StopReason::Error(e), .. }) => return Err(ApiError::Internal(format!("generation failed: {e}"))),
            Some(SeqEvent::Finished { reason, usage }) => {
                metrics::tokens(&c.node_id, usage.prompt_tokens_uncached as u64, usage.prompt_tokens_cached as u64, usage.output_tokens as u64);
                return Ok((text, reason, usage));
            }
            None => return Err(ApiError::Internal("the worker ended the sequence without a result".into())),
        }
    }
}

/// A stream over an mpsc receiver (the SSE body). Dropping it (client gone) closes the channel,
/// which ends the producer task and cancels the sequence at the worker.
struct ReceiverStream(mpsc::Receiver<Event>);

impl Stream for ReceiverStream {
    type Item = Result<Event, Infallible>;
    fn poll_next(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|o| o.map(Ok))
    }
}

fn sse(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Produces the Anthropic event sequence for one streamed message.
async fn anthropic_stream(c: Arc<Coordinator>, mut acc: Accepted, tx: mpsc::Sender<Event>, msg_id: String, model: String) {
    let ping_every = Duration::from_millis(c.config.server.ping_interval_ms.max(100));
    let mut hard_stop = c.hard_stop.clone();
    let mut block_open = false;
    let mut started = false;
    let mut output_tokens = 0u32;
    let mut timer = TokenTimer::new(&c.node_id, acc.started_at);
    let message_start = |usage: Usage| {
        sse(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "content": [], "model": model,
                "stop_reason": null, "stop_sequence": null, "usage": usage_json(&usage)}}),
        )
    };
    macro_rules! send {
        ($e:expr) => {
            if tx.send($e).await.is_err() {
                return; // client gone: dropping `acc` cancels the sequence
            }
        };
    }
    loop {
        let ev = tokio::select! {
            ev = acc.stream.recv() => ev,
            // Pings keep idle streams alive, but only after message_start, which comes first.
            _ = tokio::time::sleep(ping_every), if started => { send!(sse("ping", json!({"type": "ping"}))); continue; }
            _ = stopped(&mut hard_stop) => {
                let e = ApiError::Overloaded("Overloaded: the server shut down before the response finished".into());
                let _ = tx.send(sse("error", e.anthropic_event())).await;
                return;
            }
        };
        match ev {
            Some(SeqEvent::Started { prompt_tokens, cached_tokens }) => {
                started = true;
                let u = Usage { prompt_tokens_uncached: prompt_tokens - cached_tokens, prompt_tokens_cached: cached_tokens, output_tokens: 0 };
                send!(message_start(u));
                send!(sse("ping", json!({"type": "ping"})));
            }
            Some(SeqEvent::Delta { tokens, text }) => {
                output_tokens += tokens.len() as u32;
                timer.on_tokens(tokens.len());
                if text.is_empty() {
                    continue;
                }
                if !block_open {
                    block_open = true;
                    send!(sse("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                }
                send!(sse("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})));
            }
            Some(SeqEvent::Finished { reason: StopReason::Error(e), usage }) => {
                if !started {
                    send!(message_start(usage));
                }
                let err = ApiError::Internal(format!("generation failed: {e}"));
                let _ = tx.send(sse("error", err.anthropic_event())).await;
                return;
            }
            Some(SeqEvent::Finished { reason, usage }) => {
                if !started {
                    send!(message_start(usage));
                }
                metrics::tokens(&c.node_id, usage.prompt_tokens_uncached as u64, usage.prompt_tokens_cached as u64, usage.output_tokens as u64);
                if block_open {
                    send!(sse("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                }
                let (stop_reason, stop_sequence) = stop_fields(&reason);
                send!(sse(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": {"output_tokens": usage.output_tokens.max(output_tokens)}})
                ));
                send!(sse("message_stop", json!({"type": "message_stop"})));
                return;
            }
            None => {
                let err = ApiError::Internal("the worker ended the sequence without a result".into());
                let _ = tx.send(sse("error", err.anthropic_event())).await;
                return;
            }
        }
    }
}

/// Resolves once the shutdown grace period is over (never holds the watch guard across awaits).
async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn finish_reason(r: &StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens => "length",
        _ => "stop",
    }
}

async fn chat_completions(State(c): State<AppState>, Extension(caller): Extension<Caller>, body: Result<Bytes, BytesRejection>) -> Response {
    let parsed = (|| {
        let v = json_body(body, c.config.server.max_body_bytes)?;
        let req = openai::parse(&v)?;
        if !c.model.matches(&req.model) {
            return Err(ApiError::NotFound(format!("The model `{}` does not exist", req.model)));
        }
        Ok(req)
    })();
    let req = match parsed {
        Ok(r) => r,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), None),
    };
    let gen = Generation {
        caller,
        system: req.system.clone(),
        turns: req.turns.clone(),
        max_tokens: req.max_tokens,
        params: SamplingParams { temperature: req.temperature, top_k: None, top_p: req.top_p, seed: req.seed, max_tokens: 0, stop_sequences: req.stop.clone(), ignore_eos: req.ignore_eos },
    };
    let acc = match c.start(gen).await {
        Ok(a) => a,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), None),
    };
    let served_by = acc.served_by.clone();
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if req.stream {
        let (tx, rx) = mpsc::channel::<Event>(64);
        tokio::spawn(openai_stream(c.clone(), acc, tx, id, req.model.clone(), created, req.include_usage));
        return finish(&c, "chat_completions", Sse::new(ReceiverStream(rx)).into_response(), Some(&served_by));
    }
    let resp = match collect(&c, acc).await {
        Ok((text, reason, usage)) => Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(&reason), "logprobs": null}],
            "usage": openai_usage(&usage),
        }))
        .into_response(),
        Err(e) => e.into_openai(),
    };
    finish(&c, "chat_completions", resp, Some(&served_by))
}

fn openai_usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens(), "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens() + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.prompt_tokens_cached},
    })
}

async fn openai_stream(c: Arc<Coordinator>, mut acc: Accepted, tx: mpsc::Sender<Event>, id: String, model: String, created: i64, include_usage: bool) {
    let chunk = |delta: Value, finish: Value| {
        Event::default().data(
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
            .to_string(),
        )
    };
    let mut hard_stop = c.hard_stop.clone();
    let mut timer = TokenTimer::new(&c.node_id, acc.started_at);
    if tx.send(chunk(json!({"role": "assistant", "content": ""}), Value::Null)).await.is_err() {
        return;
    }
    loop {
        let ev = tokio::select! {
            ev = acc.stream.recv() => ev,
            _ = stopped(&mut hard_stop) => {
                let e = ApiError::Overloaded("the server shut down before the response finished".into());
                let _ = tx.send(Event::default().data(e.openai_body().to_string())).await;
                return;
            }
        };
        match ev {
            Some(SeqEvent::Started { .. }) => {}
            Some(SeqEvent::Delta { text, tokens }) => {
                timer.on_tokens(tokens.len());
                if !text.is_empty() && tx.send(chunk(json!({"content": text}), Value::Null)).await.is_err() {
                    return;
                }
            }
            Some(SeqEvent::Finished { reason: StopReason::Error(e), .. }) => {
                let err = ApiError::Internal(format!("generation failed: {e}"));
                let _ = tx.send(Event::default().data(err.openai_body().to_string())).await;
                return;
            }
            Some(SeqEvent::Finished { reason, usage }) => {
                metrics::tokens(&c.node_id, usage.prompt_tokens_uncached as u64, usage.prompt_tokens_cached as u64, usage.output_tokens as u64);
                let _ = tx.send(chunk(json!({}), json!(finish_reason(&reason)))).await;
                if include_usage {
                    let _ = tx
                        .send(Event::default().data(
                            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": openai_usage(&usage)})
                                .to_string(),
                        ))
                        .await;
                }
                let _ = tx.send(Event::default().data("[DONE]")).await;
                return;
            }
            None => return,
        }
    }
}
