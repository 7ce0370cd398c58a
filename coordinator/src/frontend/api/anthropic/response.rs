//! The Anthropic Messages handlers and what they send back: the message JSON, `usage`, and the
//! exact SSE event sequence (`message_start`, `ping`, `content_block_start`,
//! `content_block_delta`…, `content_block_stop`, `message_delta`, `message_stop`; an `error`
//! event for a failure after the 200).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use zerolayer_common::{SeqEvent, StopReason, Usage};

use super::request::{self, Endpoint, MessagesRequest};
use crate::frontend::api::shared::{self, collect, failed, finish, json_body, named_event, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::auth::Caller;
use crate::frontend::caching;
use crate::frontend::service::{Accepted, Frontend};
use crate::frontend::diagnostics::Diagnosis;
use crate::frontend::pipeline::Purpose;
use crate::frontend::request::{CacheTtl, GenerationRequest};
use crate::error::ApiError;
use crate::frontend::tools::{split_calls, CallParser, Calls, Piece};

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

/// The 404 for a model this cluster does not serve, in Anthropic's words.
fn no_such_model(model: &str) -> ApiError {
    ApiError::NotFound(format!("model: {model}"))
}

/// What the Messages API keeps of its request past the pipeline.
struct Kept {
    offered: Calls,
    diagnostics: Option<Option<String>>,
    context_management: bool,
}

/// Headers and body checked: the request's generation, and what this API keeps of it.
fn parse(c: &Frontend, headers: &HeaderMap, body: Result<Bytes, BytesRejection>, endpoint: Endpoint) -> Result<(GenerationRequest, Kept), ApiError> {
    check_headers(headers)?;
    let v = json_body(body, c.config.server.max_body_bytes)?;
    let MessagesRequest { generation, diagnostics, context_management } = request::parse(&v, endpoint)?;
    let offered = generation.calls();
    Ok((generation, Kept { offered, diagnostics, context_management }))
}

/// `count_tokens`: admitted like a generation (the key's concurrency, the node's in-flight cap)
/// and charged `limits.count_tokens_charge` of the tokens it counts.
pub async fn count_tokens(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = async {
        let admitted = c.admit(&caller, false)?;
        let (prepared, _) = shared::prepare(&c, Purpose::Count, no_such_model, move |c| parse(c, &headers, body, Endpoint::CountTokens)).await?;
        let n = prepared.ids.len();
        let charge = (n as f64 * c.config.limits.count_tokens_charge).ceil() as u64;
        admitted.ticket.charge_input(charge, false).map_err(crate::auth::rate_limited)?;
        Ok::<_, ApiError>(n)
    };
    let resp = match counted.await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_anthropic(&rid.0),
    };
    finish(&c, "count_tokens", resp, None)
}

/// `usage`, with the prompt split at the request's cache breakpoints (`caching`).
fn usage_json(u: &Usage, breakpoints: &[(usize, CacheTtl)]) -> Value {
    let c = caching::split(u.prompt_tokens(), u.prompt_tokens_cached, breakpoints);
    json!({
        "input_tokens": c.input,
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": c.creation(),
        "cache_read_input_tokens": c.read,
        "cache_creation": {"ephemeral_5m_input_tokens": c.creation_5m, "ephemeral_1h_input_tokens": c.creation_1h},
        "service_tier": "standard",
    })
}

/// `stop_reason` and `stop_sequence`: a generation that made calls and was not cut short by
/// `max_tokens` ends in `tool_use`.
fn stop_fields(reason: &StopReason, calls: usize) -> (Value, Value) {
    match reason {
        StopReason::MaxTokens | StopReason::Refused { .. } => (json!(reason.as_anthropic()), Value::Null),
        _ if calls > 0 => (json!("tool_use"), Value::Null),
        StopReason::StopSequence(s) => (json!("stop_sequence"), json!(s)),
        r => (json!(r.as_anthropic()), Value::Null),
    }
}

/// `diagnostics: {cache_miss_reason}` for a request that sent `diagnostics`.
fn diagnostics_json(c: &Frontend, previous: &Option<String>, acc: &Accepted) -> Value {
    let reason = match c.diagnose(previous.as_deref(), &acc.fingerprint) {
        None => json!({"type": "unavailable"}),
        Some(Diagnosis::NoMiss) => Value::Null,
        Some(Diagnosis::PreviousNotFound) => json!({"type": "previous_message_not_found"}),
        Some(Diagnosis::Miss { reason, missed_tokens, .. }) => json!({"type": reason.as_str(), "cache_missed_input_tokens": missed_tokens}),
    };
    json!({"cache_miss_reason": reason})
}

fn tool_use_block(name: &str, input: Value) -> Value {
    json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": input})
}

/// The message's content blocks from the generated text, and how many calls it holds.
fn content_blocks(calls: &Calls, text: String) -> (Value, usize) {
    if calls.tools.is_empty() {
        return (if text.is_empty() { json!([]) } else { json!([{"type": "text", "text": text}]) }, 0);
    }
    let (pieces, calls) = split_calls(calls, &text);
    let blocks: Vec<Value> = pieces
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => json!({"type": "text", "text": t}),
            Piece::Call { name, arguments } => tool_use_block(&name, arguments),
        })
        .collect();
    (Value::Array(blocks), calls)
}

pub async fn messages(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = shared::admit_and_start(&c, &caller, &rid.0, no_such_model, move |c| parse(c, &headers, body, Endpoint::Messages));
    let shared::Started { acc, model, stream, extra: Kept { offered, diagnostics, context_management } } = match started.await {
        Ok(a) => a,
        Err(e) => return finish(&c, "messages", e.into_anthropic(&rid.0), None),
    };
    let served_by = acc.served_by.clone();
    let msg_id = new_id("msg_");
    let diagnostics = diagnostics.as_ref().map(|previous| diagnostics_json(&c, previous, &acc));
    c.remember(&msg_id, acc.fingerprint.clone());
    if stream {
        let timing = shared::stream_timing(&acc);
        let s = MessageStream::new(c.clone(), acc, msg_id, model, context_management, &offered, diagnostics);
        return finish(&c, "messages", shared::server_timing(shared::sse_response(s, MessageStream::step), &timing), Some(&served_by));
    }
    let breakpoints = acc.breakpoints.clone();
    let resp = match collect(&c, acc).await {
        Ok(shared::Collected { text, reason, usage, split, .. }) => {
            let (content, calls) = content_blocks(&offered, text);
            let (stop_reason, stop_sequence) = stop_fields(&reason, calls);
            let mut body = json!({
                "id": msg_id, "type": "message", "role": "assistant", "content": content, "model": model,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_json(&usage, &breakpoints),
            });
            if let Some(d) = diagnostics {
                body["diagnostics"] = d;
            }
            if context_management {
                body["context_management"] = json!({"applied_edits": []});
            }
            shared::outcome_headers(Json(body).into_response(), &split, &reason)
        }
        Err(e) => e.into_anthropic(&rid.0),
    };
    finish(&c, "messages", resp, Some(&served_by))
}

/// The Anthropic event sequence of one streamed message, one step at a time.
struct MessageStream {
    seq: Following,
    msg_id: String,
    model: String,
    ping_every: Duration,
    started: bool,
    /// The index of the open text block, if one is open.
    text_open: Option<usize>,
    /// The index the next content block gets.
    next_index: usize,
    /// Finds calls in the text when the request offered tools.
    parser: Option<CallParser>,
    output_tokens: u32,
    /// Report `context_management.applied_edits` in `message_delta`.
    context_management: bool,
    /// `diagnostics`, sent in `message_start`.
    diagnostics: Option<Value>,
    /// The cache breakpoints' token positions, for `usage`.
    breakpoints: Vec<(usize, CacheTtl)>,
}

impl MessageStream {
    fn new(c: AppState, acc: Accepted, msg_id: String, model: String, context_management: bool, calls: &Calls, diagnostics: Option<Value>) -> Self {
        let ping_every = Duration::from_millis(c.config.server.ping_interval_ms.max(100));
        let parser = calls.parser();
        MessageStream {
            breakpoints: acc.breakpoints.clone(),
            seq: Following::new(c, acc),
            msg_id,
            model,
            ping_every,
            started: false,
            text_open: None,
            next_index: 0,
            parser,
            output_tokens: 0,
            context_management,
            diagnostics,
        }
    }

    /// The events for generated text: text deltas in an open text block; each complete call as
    /// a `tool_use` block of its own (start, one `input_json_delta`, stop).
    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Event>) {
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => {
                    let index = match self.text_open {
                        Some(i) => i,
                        // With tools, whitespace between calls opens no block.
                        None if self.parser.is_some() && t.trim().is_empty() => continue,
                        None => {
                            let i = self.next_index;
                            self.next_index += 1;
                            self.text_open = Some(i);
                            out.push(named_event("content_block_start", json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})));
                            i
                        }
                    };
                    out.push(named_event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}})));
                }
                Piece::Call { name, arguments } => {
                    self.close_text(out);
                    let i = self.next_index;
                    self.next_index += 1;
                    let mut block = tool_use_block(&name, json!({}));
                    out.push(named_event("content_block_start", json!({"type": "content_block_start", "index": i, "content_block": block.take()})));
                    out.push(named_event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": arguments.to_string()}}),
                    ));
                    out.push(named_event("content_block_stop", json!({"type": "content_block_stop", "index": i})));
                }
            }
        }
    }

    fn close_text(&mut self, out: &mut Vec<Event>) {
        if let Some(i) = self.text_open.take() {
            out.push(named_event("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
    }

    fn message_start(&self, usage: &Usage) -> Event {
        let mut message = json!({
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": null, "stop_sequence": null, "usage": usage_json(usage, &self.breakpoints)});
        if let Some(d) = &self.diagnostics {
            message["diagnostics"] = d.clone();
        }
        named_event("message_start", json!({"type": "message_start", "message": message}))
    }

    fn ping() -> Event {
        named_event("ping", json!({"type": "ping"}))
    }

    fn error(e: ApiError) -> Event {
        named_event("error", e.anthropic_event())
    }

    /// Waits for the next engine event and returns the SSE events it makes.
    async fn step(mut self) -> SseStep<Self> {
        loop {
            // Pings keep idle streams alive, but only after message_start, which comes first.
            let ping = self.started.then_some(self.ping_every);
            let ev = match self.seq.next(ping).await {
                Next::Event(ev) => ev,
                Next::Idle => return (vec![Self::ping()], Some(self)),
                Next::ShutDown => return (vec![Self::error(shut_down())], None),
                Next::Lost => return (vec![Self::error(failed(None))], None),
            };
            match ev {
                SeqEvent::Started { prompt_tokens, cached_tokens, .. } => {
                    self.started = true;
                    let u = Usage { prompt_tokens_uncached: prompt_tokens - cached_tokens, prompt_tokens_cached: cached_tokens, output_tokens: 0 };
                    return (vec![self.message_start(&u), Self::ping()], Some(self));
                }
                SeqEvent::PromptLogprobs { .. } => continue,
                SeqEvent::Delta { tokens, text, .. } => {
                    self.output_tokens += tokens.len() as u32;
                    if text.is_empty() {
                        continue;
                    }
                    let pieces = match &mut self.parser {
                        Some(p) => p.push(&text),
                        None => vec![Piece::Text(text)],
                    };
                    let mut out = Vec::with_capacity(2);
                    self.pieces(pieces, &mut out);
                    if out.is_empty() {
                        continue;
                    }
                    return (out, Some(self));
                }
                SeqEvent::Finished { reason, usage } => {
                    let mut out = Vec::with_capacity(4);
                    if !self.started {
                        out.push(self.message_start(&usage));
                    }
                    if let StopReason::Error(e) = &reason {
                        out.push(Self::error(failed(Some(e))));
                        return (out, None);
                    }
                    let rest = self.parser.as_mut().map(CallParser::finish).unwrap_or_default();
                    self.pieces(rest, &mut out);
                    self.close_text(&mut out);
                    let calls = self.parser.as_ref().map_or(0, |p| p.calls);
                    let (stop_reason, stop_sequence) = stop_fields(&reason, calls);
                    let mut delta = json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                               "usage": {"output_tokens": usage.output_tokens.max(self.output_tokens), "server_timing": self.seq.split().json()}});
                    if self.context_management {
                        delta["context_management"] = json!({"applied_edits": []});
                    }
                    if let Some(p) = shared::policy_json(&reason) {
                        delta["policy"] = p;
                    }
                    out.push(named_event("message_delta", delta));
                    out.push(named_event("message_stop", json!({"type": "message_stop"})));
                    return (out, None);
                }
            }
        }
    }
}
