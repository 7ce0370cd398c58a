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
use crate::api::shared::{self, collect, failed, finish, json_body, named_event, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::auth::Caller;
use crate::coordinator::{Accepted, Coordinator};
use crate::error::ApiError;

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

/// Headers, body and model checked; the validated request.
fn parse(c: &Coordinator, headers: &HeaderMap, body: Result<Bytes, BytesRejection>, endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
    check_headers(headers)?;
    let v = json_body(body, c.config.server.max_body_bytes)?;
    let req = request::parse(&v, endpoint)?;
    if !c.model.matches(&req.generation.model) {
        return Err(ApiError::NotFound(format!("model: {}", req.generation.model)));
    }
    Ok(req)
}

pub async fn count_tokens(State(c): State<AppState>, Extension(rid): Extension<RequestId>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let resp = match parse(&c, &headers, body, Endpoint::CountTokens).and_then(|req| c.prompt_ids(&req.generation)) {
        Ok(ids) => Json(json!({"input_tokens": ids.len()})).into_response(),
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

pub async fn messages(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match parse(&c, &headers, body, Endpoint::Messages) {
        Ok(r) => r,
        Err(e) => return finish(&c, "messages", e.into_anthropic(&rid.0), None),
    };
    let model = req.generation.model.clone();
    let stream = req.generation.stream;
    let acc = match c.start(&caller, req.generation, &rid.0).await {
        Ok(a) => a,
        Err(e) => return finish(&c, "messages", e.into_anthropic(&rid.0), None),
    };
    let served_by = acc.served_by.clone();
    let msg_id = new_id("msg_");
    if stream {
        let s = MessageStream::new(c.clone(), acc, msg_id, model);
        return finish(&c, "messages", shared::sse_response(s, MessageStream::step), Some(&served_by));
    }
    let resp = match collect(&c, acc).await {
        Ok((text, reason, usage)) => {
            let (stop_reason, stop_sequence) = stop_fields(&reason);
            let content = if text.is_empty() { json!([]) } else { json!([{"type": "text", "text": text}]) };
            let mut body = json!({
                "id": msg_id, "type": "message", "role": "assistant", "content": content, "model": model,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_json(&usage),
            });
            if req.wants_diagnostics {
                body["diagnostics"] = json!({"cache_miss_reason": {"type": "unavailable"}});
            }
            Json(body).into_response()
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
    block_open: bool,
    output_tokens: u32,
}

impl MessageStream {
    fn new(c: AppState, acc: Accepted, msg_id: String, model: String) -> Self {
        let ping_every = Duration::from_millis(c.config.server.ping_interval_ms.max(100));
        MessageStream { seq: Following::new(c, acc), msg_id, model, ping_every, started: false, block_open: false, output_tokens: 0 }
    }

    fn message_start(&self, usage: &Usage) -> Event {
        named_event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.msg_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                "stop_reason": null, "stop_sequence": null, "usage": usage_json(usage)}}),
        )
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
                SeqEvent::Started { prompt_tokens, cached_tokens } => {
                    self.started = true;
                    let u = Usage { prompt_tokens_uncached: prompt_tokens - cached_tokens, prompt_tokens_cached: cached_tokens, output_tokens: 0 };
                    return (vec![self.message_start(&u), Self::ping()], Some(self));
                }
                SeqEvent::Delta { tokens, text } => {
                    self.output_tokens += tokens.len() as u32;
                    if text.is_empty() {
                        continue;
                    }
                    let mut out = Vec::with_capacity(2);
                    if !self.block_open {
                        self.block_open = true;
                        out.push(named_event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                    }
                    out.push(named_event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})));
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
                    if self.block_open {
                        out.push(named_event("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                    }
                    let (stop_reason, stop_sequence) = stop_fields(&reason);
                    out.push(named_event(
                        "message_delta",
                        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                               "usage": {"output_tokens": usage.output_tokens.max(self.output_tokens)}}),
                    ));
                    out.push(named_event("message_stop", json!({"type": "message_stop"})));
                    return (out, None);
                }
            }
        }
    }
}
