//! The OpenAI Chat Completions handler and what it sends back: the `chat.completion` JSON, or
//! `chat.completion.chunk` events ending in `data: [DONE]`, with the usage chunk when
//! `stream_options.include_usage` asks for it. Errors use OpenAI's shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use zerolayer_common::{SeqEvent, StopReason, Usage};

use super::request::{self, ChatRequest};
use crate::api::shared::{self, collect, failed, finish, json_body, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::auth::Caller;
use crate::clock::unix_now;
use crate::coordinator::{Accepted, Coordinator};
use crate::error::ApiError;

fn finish_reason(r: &StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens => "length",
        _ => "stop",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens(), "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens() + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.prompt_tokens_cached},
    })
}

fn parse(c: &Coordinator, body: Result<Bytes, BytesRejection>) -> Result<ChatRequest, ApiError> {
    let v = json_body(body, c.config.server.max_body_bytes)?;
    let req = request::parse(&v)?;
    if !c.model.matches(&req.generation.model) {
        return Err(ApiError::NotFound(format!("The model `{}` does not exist", req.generation.model)));
    }
    Ok(req)
}

pub async fn chat_completions(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match parse(&c, body) {
        Ok(r) => r,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), None),
    };
    let model = req.generation.model.clone();
    let stream = req.generation.stream;
    let acc = match c.start(&caller, req.generation, &rid.0).await {
        Ok(a) => a,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), None),
    };
    let served_by = acc.served_by.clone();
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if stream {
        let s = ChunkStream::new(c.clone(), acc, id, model, created, req.include_usage);
        return finish(&c, "chat_completions", shared::sse_response(s, ChunkStream::step), Some(&served_by));
    }
    let resp = match collect(&c, acc).await {
        Ok((text, reason, usage)) => Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(&reason), "logprobs": null}],
            "usage": usage_json(&usage),
        }))
        .into_response(),
        Err(e) => e.into_openai(),
    };
    finish(&c, "chat_completions", resp, Some(&served_by))
}

/// The chunks of one streamed completion, one step at a time.
struct ChunkStream {
    seq: Following,
    id: String,
    model: String,
    created: i64,
    include_usage: bool,
    opened: bool,
}

impl ChunkStream {
    fn new(c: AppState, acc: Accepted, id: String, model: String, created: i64, include_usage: bool) -> Self {
        ChunkStream { seq: Following::new(c, acc), id, model, created, include_usage, opened: false }
    }

    fn chunk(&self, delta: Value, finish: Value) -> Event {
        Event::default().data(
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
            .to_string(),
        )
    }

    fn error(e: ApiError) -> Event {
        Event::default().data(e.openai_body().to_string())
    }

    async fn step(mut self) -> SseStep<Self> {
        if !self.opened {
            self.opened = true;
            let first = self.chunk(json!({"role": "assistant", "content": ""}), Value::Null);
            return (vec![first], Some(self));
        }
        loop {
            let ev = match self.seq.next(None).await {
                Next::Event(ev) => ev,
                Next::Idle => continue,
                Next::ShutDown => return (vec![Self::error(shut_down())], None),
                Next::Lost => return (Vec::new(), None),
            };
            match ev {
                SeqEvent::Started { .. } => {}
                SeqEvent::Delta { text, .. } => {
                    if !text.is_empty() {
                        let e = self.chunk(json!({"content": text}), Value::Null);
                        return (vec![e], Some(self));
                    }
                }
                SeqEvent::Finished { reason: StopReason::Error(e), .. } => return (vec![Self::error(failed(Some(&e)))], None),
                SeqEvent::Finished { reason, usage } => {
                    let mut out = vec![self.chunk(json!({}), json!(finish_reason(&reason)))];
                    if self.include_usage {
                        out.push(Event::default().data(
                            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                                   "choices": [], "usage": usage_json(&usage)})
                            .to_string(),
                        ));
                    }
                    out.push(Event::default().data("[DONE]"));
                    return (out, None);
                }
            }
        }
    }
}
