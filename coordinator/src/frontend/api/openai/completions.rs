//! OpenAI's legacy Completions API (`POST /v1/completions`): a raw prompt, no chat template.
//! It is how base models are served. `prompt` is a string or token ids (or a list of one of
//! either); the reply is a `text_completion`, or its chunks ending in `data: [DONE]`. Sampling,
//! `stop`, `seed`, `max_tokens` (16 when absent, as OpenAI's), `stream` and
//! `stream_options.include_usage` are Chat Completions'. Errors use OpenAI's shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use zerolayer_common::{SeqEvent, StopReason};

use super::request::{bad, model_name, sampling, Sampling};
use super::response::{no_such_model, usage_json, Chunks};
use crate::auth::Caller;
use crate::clock::unix_now;
use crate::error::ApiError;
use crate::frontend::api::shared::{self, collect, failed, finish, json_body, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::frontend::request::{GenerationRequest, RawPrompt};
use crate::frontend::tools::ToolChoice;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_COMPLETION_TOKENS: u32 = 16;

/// A validated Completions request.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub generation: GenerationRequest,
    pub include_usage: bool,
}

/// `prompt`: a string, token ids, or a list holding one of either (one prompt per request).
fn parse_prompt(v: Option<&Value>) -> Result<RawPrompt, ApiError> {
    let ids = |a: &[Value]| -> Result<RawPrompt, ApiError> {
        a.iter()
            .map(|t| t.as_u64().filter(|&t| t <= u32::MAX as u64).map(|t| t as u32).ok_or_else(|| ApiError::invalid("prompt: token ids must be non-negative integers")))
            .collect::<Result<_, _>>()
            .map(RawPrompt::Ids)
    };
    match v {
        None | Some(Value::Null) => bad("prompt: Field required"),
        Some(Value::String(s)) => Ok(RawPrompt::Text(s.clone())),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => ids(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(RawPrompt::Text(s.clone())),
            Value::Array(inner) => ids(inner),
            _ => bad("prompt: expected a string, token ids, or a list of one of them"),
        },
        Some(Value::Array(_)) => bad("prompt: one prompt per request (a list of several is not supported)"),
        Some(_) => bad("prompt: expected a string, token ids, or a list of one of them"),
    }
}

/// Parses and validates a Completions request body.
pub fn parse(body: &Value) -> Result<CompletionRequest, ApiError> {
    let Some(obj) = body.as_object() else { return bad("request body must be a JSON object") };
    let model = model_name(obj)?;
    let raw = parse_prompt(obj.get("prompt"))?;
    let Sampling { max_tokens, params, stream, include_usage } = sampling(obj)?;
    if obj.get("echo").and_then(Value::as_bool) == Some(true) {
        return bad("echo: not supported");
    }
    if obj.get("suffix").is_some_and(|s| !s.is_null()) {
        return bad("suffix: not supported");
    }
    if obj.get("best_of").is_some_and(|b| !b.is_null() && b.as_u64() != Some(1)) {
        return bad("best_of: only best_of = 1 is supported");
    }
    if obj.get("logprobs").is_some_and(|l| !l.is_null() && l.as_u64() != Some(0)) {
        return bad("logprobs: not supported yet");
    }
    let generation = GenerationRequest {
        model,
        system: None,
        turns: vec![],
        max_tokens: Some(max_tokens.unwrap_or(DEFAULT_COMPLETION_TOKENS)),
        params,
        stream,
        tools: vec![],
        tool_choice: ToolChoice::None,
        parallel_tool_calls: false,
        format: None,
        breakpoints: vec![],
        raw: Some(raw),
        cache_salt: crate::frontend::request::parse_cache_salt(obj.get("cache_salt"))?,
    };
    Ok(CompletionRequest { generation, include_usage })
}

fn finish_reason(r: &StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens => "length",
        StopReason::Refused { .. } => "content_filter",
        _ => "stop",
    }
}

pub async fn completions(
    State(c): State<AppState>,
    Extension(rid): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = shared::admit_and_start(&c, &caller, &rid.0, no_such_model, move |c| {
        let req = parse(&json_body(body, c.config.server.max_body_bytes)?)?;
        Ok((req.generation, req.include_usage))
    });
    let shared::Started { acc, model, stream, extra: include_usage } = match started.await {
        Ok(a) => a,
        Err(e) => return finish(&c, "completions", e.into_openai(), None),
    };
    let served_by = acc.served_by.clone();
    let (id, created) = (new_id("cmpl-"), unix_now());
    if stream {
        let timing = shared::stream_timing(&acc);
        let s = TextStream { seq: Following::new(c.clone(), acc), head: Chunks { id, object: "text_completion", created, model, include_usage } };
        return finish(&c, "completions", shared::server_timing(shared::sse_response(s, TextStream::step), &timing), Some(&served_by));
    }
    let resp = match collect(&c, acc).await {
        Ok((text, reason, usage, split)) => shared::outcome_headers(
            Json(json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(&reason)}],
                "usage": usage_json(&usage),
            }))
            .into_response(),
            &split,
            &reason,
        ),
        Err(e) => e.into_openai(),
    };
    finish(&c, "completions", resp, Some(&served_by))
}

/// The chunks of one streamed completion.
struct TextStream {
    seq: Following,
    head: Chunks,
}

impl TextStream {
    fn chunk(&self, text: &str, finish: Value) -> Event {
        self.head.event(json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]))
    }

    async fn step(mut self) -> SseStep<Self> {
        loop {
            let ev = match self.seq.next(None).await {
                Next::Event(ev) => ev,
                Next::Idle => continue,
                Next::ShutDown => return (vec![Event::default().data(shut_down().openai_body().to_string())], None),
                Next::Lost => return (Vec::new(), None),
            };
            match ev {
                SeqEvent::Started { .. } => {}
                SeqEvent::Delta { text, .. } if text.is_empty() => {}
                SeqEvent::Delta { text, .. } => return (vec![self.chunk(&text, Value::Null)], Some(self)),
                SeqEvent::Finished { reason: StopReason::Error(e), .. } => return (vec![Event::default().data(failed(Some(&e)).openai_body().to_string())], None),
                SeqEvent::Finished { reason, usage } => {
                    let mut out = vec![self.head.finish_event(json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason(&reason)}]), &reason)];
                    self.head.end(&usage, self.seq.split().json(), &mut out);
                    return (out, None);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_text_or_ids_and_the_rest_is_refused() {
        let p = |v: Value| parse(&json!({"model": "m", "prompt": v}));
        assert_eq!(p(json!("Once")).unwrap().generation.raw, Some(RawPrompt::Text("Once".into())));
        assert_eq!(p(json!([2, 5, 7])).unwrap().generation.raw, Some(RawPrompt::Ids(vec![2, 5, 7])));
        assert_eq!(p(json!(["Once"])).unwrap().generation.raw, Some(RawPrompt::Text("Once".into())));
        assert_eq!(p(json!([[3, 4]])).unwrap().generation.raw, Some(RawPrompt::Ids(vec![3, 4])));
        let r = p(json!("x")).unwrap().generation;
        assert_eq!((r.max_tokens, r.turns.len(), r.tool_choice), (Some(16), 0, ToolChoice::None));
        for (body, field) in [
            (json!({"model": "m"}), "prompt"),
            (json!({"model": "m", "prompt": ["a", "b"]}), "prompt"),
            (json!({"model": "m", "prompt": [-1]}), "prompt"),
            (json!({"model": "m", "prompt": 5}), "prompt"),
            (json!({"model": "m", "prompt": "a", "echo": true}), "echo"),
            (json!({"model": "m", "prompt": "a", "n": 2}), "n"),
            (json!({"model": "m", "prompt": "a", "temperature": 3}), "temperature"),
            (json!({"prompt": "a"}), "model"),
        ] {
            let e = parse(&body).unwrap_err().to_string();
            assert!(e.contains(field), "{body}: {e}");
        }
        let r = parse(&json!({"model": "m", "prompt": "a", "max_tokens": 5, "seed": 7, "stop": ["\n"], "temperature": 0, "stream": true})).unwrap().generation;
        assert_eq!((r.max_tokens, r.params.seed, r.params.stop_sequences.clone(), r.params.temperature, r.stream), (Some(5), Some(7), vec!["\n".to_string()], 0.0, true));
    }
}
