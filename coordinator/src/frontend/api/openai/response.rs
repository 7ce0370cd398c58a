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
use zerolayer_common::{SeqEvent, StopReason, TokenLogprob, Usage};

use super::logprobs::{self, Namer};
use super::chunks::{usage_json, Chunks};
use super::{choices, request};
use crate::frontend::api::shared::{self, failed, finish, json_body, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::auth::Caller;
use crate::clock::unix_now;
use crate::error::ApiError;
use crate::frontend::tools::{split_calls, CallParser, Calls, Piece};

fn finish_reason(r: &StopReason, calls: usize) -> &'static str {
    match r {
        StopReason::MaxTokens => "length",
        StopReason::Refused { .. } => "content_filter",
        _ if calls > 0 => "tool_calls",
        _ => "stop",
    }
}

/// One call in OpenAI's shape (the arguments a JSON string).
fn tool_call(name: &str, arguments: &Value) -> Value {
    json!({"id": new_id("call_"), "type": "function", "function": {"name": name, "arguments": arguments.to_string()}})
}

/// The message from the generated text: its `content` and `tool_calls`, and how many calls.
fn message(calls: &Calls, text: String) -> (Value, usize) {
    if calls.tools.is_empty() {
        return (json!({"role": "assistant", "content": text}), 0);
    }
    let (pieces, calls) = split_calls(calls, &text);
    let mut content = Vec::new();
    let mut tool_calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push(t),
            Piece::Call { name, arguments } => tool_calls.push(tool_call(&name, &arguments)),
        }
    }
    let content = if content.is_empty() && !tool_calls.is_empty() { Value::Null } else { json!(content.join("\n\n")) };
    let mut m = json!({"role": "assistant", "content": content});
    if !tool_calls.is_empty() {
        m["tool_calls"] = Value::Array(tool_calls);
    }
    (m, calls)
}

/// The 404 for a model this cluster does not serve, in OpenAI's words.
pub(super) fn no_such_model(model: &str) -> ApiError {
    ApiError::NotFound(format!("The model `{model}` does not exist"))
}

pub async fn chat_completions(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = shared::admit_and_start(&c, &caller, &rid.0, no_such_model, move |c| {
        let req = request::parse(&json_body(body, c.config.server.max_body_bytes)?)?;
        let extra = (req.generation.calls(), req.include_usage, (req.generation.params.logprobs.is_some(), req.token_ids), req.n);
        Ok((req.generation, extra))
    });
    let shared::Started { acc, model, stream, extra: (offered, include_usage, (with_logprobs, ids), n) } = match started.await {
        Ok(a) => a,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), None),
    };
    // The model that serves it (a fallback, if it fell back) names the tokens of its logprobs.
    let namer = Namer::of(&c, &model, with_logprobs, ids);
    let served_by = acc.served_by.clone();
    let head = Chunks { id: new_id("chatcmpl-"), object: "chat.completion.chunk", created: unix_now(), model, include_usage };
    let timing = shared::stream_timing(&acc);
    let all = match choices::follow(&c, acc, n).await {
        Ok(all) => all,
        Err(e) => return finish(&c, "chat_completions", e.into_openai(), Some(&served_by)),
    };
    if stream {
        let sse = match all.len() {
            1 => shared::sse_response(ChunkStream::new(all.into_iter().next().unwrap(), head, 0, true, &offered, namer), ChunkStream::step),
            _ => {
                let each = all.into_iter().enumerate().map(|(i, f)| ChunkStream::new(f, head.clone(), i, false, &offered, namer.clone())).collect();
                shared::sse_response(choices::Merged::new(each, head), choices::Merged::step)
            }
        };
        return finish(&c, "chat_completions", shared::server_timing(sse, &timing), Some(&served_by));
    }
    let resp = match choices::collect(all).await {
        Ok(whole) => {
            let mut out = Vec::with_capacity(whole.len());
            for (i, w) in whole.iter().enumerate() {
                let (message, calls) = message(&offered, w.text.clone());
                let lps = namer.as_ref().map_or(Value::Null, |n| logprobs::chat_choice(n, &w.logprobs));
                out.push(json!({"index": i, "message": message, "finish_reason": finish_reason(&w.reason, calls), "logprobs": lps}));
            }
            let usage = choices::total_usage(whole.iter().map(|w| &w.usage));
            let body = json!({"id": head.id, "object": "chat.completion", "created": head.created, "model": head.model, "choices": out, "usage": usage_json(&usage)});
            shared::outcome_headers(Json(body).into_response(), &whole[0].split, &whole[0].reason)
        }
        Err(e) => e.into_openai(),
    };
    finish(&c, "chat_completions", resp, Some(&served_by))
}

/// The chunks of one streamed choice, one step at a time.
struct ChunkStream {
    seq: Following,
    head: Chunks,
    /// The choice's `index`; `solo`: the request's only choice, whose end is the stream's (else
    /// its usage waits in `end` for [`choices::Merged`]).
    index: usize,
    solo: bool,
    end: Option<(Usage, Value)>,
    opened: bool,
    /// Finds calls in the text when the request offered tools.
    parser: Option<CallParser>,
    /// Names logprobs' tokens when the request asked for them; those not yet sent (their text
    /// still held back) wait in `logprobs` for the next chunk.
    namer: Option<Namer>,
    logprobs: Vec<TokenLogprob>,
}

impl ChunkStream {
    fn new(seq: Following, head: Chunks, index: usize, solo: bool, calls: &Calls, namer: Option<Namer>) -> Self {
        let parser = calls.parser();
        ChunkStream { seq, head, index, solo, end: None, opened: false, parser, namer, logprobs: Vec::new() }
    }

    /// The next chunk's `logprobs`: the tokens not sent yet (null when the request asked none).
    fn take_logprobs(&mut self) -> Value {
        let lps = std::mem::take(&mut self.logprobs);
        self.namer.as_ref().map_or(Value::Null, |n| logprobs::chat_choice(n, &lps))
    }

    /// Chunks for generated text: content deltas, and each complete call as one `tool_calls`
    /// delta (id, name and the whole arguments).
    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Event>) {
        let done = self.parser.as_ref().map_or(0, |p| p.calls);
        let first_call = done - pieces.iter().filter(|p| matches!(p, Piece::Call { .. })).count();
        let mut index = first_call;
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() || (self.parser.is_some() && t.trim().is_empty()) => {}
                Piece::Text(t) => {
                    let lps = self.take_logprobs();
                    out.push(self.chunk(json!({"content": t}), Value::Null, lps));
                }
                Piece::Call { name, arguments } => {
                    let mut call = tool_call(&name, &arguments);
                    call["index"] = json!(index);
                    index += 1;
                    let lps = self.take_logprobs();
                    out.push(self.chunk(json!({"tool_calls": [call]}), Value::Null, lps));
                }
            }
        }
    }

    fn chunk(&self, delta: Value, finish: Value, logprobs: Value) -> Event {
        self.head.event(json!([{"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]))
    }

    fn error(e: ApiError) -> Event {
        Event::default().data(e.openai_body().to_string())
    }

    async fn step(mut self) -> SseStep<Self> {
        if !self.opened {
            self.opened = true;
            let first = self.chunk(json!({"role": "assistant", "content": ""}), Value::Null, Value::Null);
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
                SeqEvent::Started { .. } | SeqEvent::PromptLogprobs { .. } => {}
                SeqEvent::Delta { text, logprobs, .. } => {
                    if self.namer.is_some() {
                        self.logprobs.extend(logprobs);
                    }
                    if text.is_empty() {
                        continue;
                    }
                    let pieces = match &mut self.parser {
                        Some(p) => p.push(&text),
                        None => vec![Piece::Text(text)],
                    };
                    let mut out = Vec::new();
                    self.pieces(pieces, &mut out);
                    if !out.is_empty() {
                        return (out, Some(self));
                    }
                }
                SeqEvent::Finished { reason: StopReason::Error(e), .. } => return (vec![Self::error(failed(Some(&e)))], None),
                SeqEvent::Finished { reason, usage } => {
                    let rest = self.parser.as_mut().map(CallParser::finish).unwrap_or_default();
                    let mut out = Vec::new();
                    self.pieces(rest, &mut out);
                    let calls = self.parser.as_ref().map_or(0, |p| p.calls);
                    let lps = if self.logprobs.is_empty() { Value::Null } else { self.take_logprobs() };
                    out.push(self.head.finish_event(json!([{"index": self.index, "delta": {}, "finish_reason": finish_reason(&reason, calls), "logprobs": lps}]), &reason));
                    if !self.solo {
                        self.end = Some((usage, self.seq.split().json()));
                        return (out, Some(self));
                    }
                    self.head.end(&usage, self.seq.split().json(), &mut out);
                    return (out, None);
                }
            }
        }
    }
}

impl choices::ChoiceStream for ChunkStream {
    fn step(self) -> impl std::future::Future<Output = SseStep<Self>> + Send {
        ChunkStream::step(self)
    }

    fn take_end(&mut self) -> Option<(Usage, Value)> {
        self.end.take()
    }
}
