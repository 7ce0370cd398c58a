//! OpenAI's legacy Completions API (`POST /v1/completions`): a raw prompt, no chat template.
//! It is how base models are served. `prompt` is a string or token ids (or a list of one of
//! either); the reply is a `text_completion`, or its chunks ending in `data: [DONE]`. Sampling,
//! `stop`, `seed`, `max_tokens` (16 when absent, as OpenAI's), `stream` and
//! `stream_options.include_usage` are Chat Completions'. `logprobs: k` returns each token's
//! log-probability and its k likeliest alternatives; `echo` puts the prompt before the output,
//! and with `logprobs` its tokens' too (the first has none): with `max_tokens: 0`, the
//! log-likelihood of a text, as lm-evaluation-harness asks it. Errors use OpenAI's shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use zerolayer_common::{SeqEvent, StopReason, TokenLogprob, Usage};
use zerolayer_worker::tokenizer::Tokenizer;

use super::logprobs::{self, Namer};
use super::choices;
use super::request::{bad, model_name, sampling, Sampling};
use super::chunks::{usage_json, Chunks};
use super::response::no_such_model;
use crate::auth::Caller;
use crate::clock::unix_now;
use crate::error::ApiError;
use crate::frontend::api::shared::{self, failed, finish, json_body, new_id, shut_down, AppState, Following, Next, RequestId, SseStep};
use crate::frontend::request::{GenerationRequest, RawPrompt};
use crate::frontend::tools::ToolChoice;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_COMPLETION_TOKENS: u32 = 16;

/// A validated Completions request.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub generation: GenerationRequest,
    pub include_usage: bool,
    /// `echo`: the choice's text (and logprobs) begin with the prompt's.
    pub echo: bool,
    /// `return_tokens_as_token_ids`: logprobs name tokens by id.
    pub token_ids: bool,
    /// `n`: how many choices.
    pub n: u32,
}

/// Completions' fields, as OpenAI documents them (`user` is accepted and has no effect;
/// `suffix` is refused by name).
const COMPLETION_FIELDS: &[&str] = &[
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "stop",
    "stream", "stream_options", "suffix", "temperature", "top_p", "user",
];

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
    super::fields::known_only(obj, &[COMPLETION_FIELDS, super::fields::EXTENSIONS])?;
    let model = model_name(obj)?;
    let raw = parse_prompt(obj.get("prompt"))?;
    let Sampling { max_tokens, mut params, stream, include_usage, n } = sampling(obj)?;
    params.logprobs = super::logprobs::completion(obj)?;
    let echo = super::fields::flag(obj, "echo", false)?;
    params.prompt_logprobs = echo && params.logprobs.is_some();
    if obj.get("suffix").is_some_and(|s| !s.is_null()) {
        return bad("suffix: not supported");
    }
    if obj.get("best_of").is_some_and(|b| !b.is_null() && b.as_u64() != Some(n as u64)) {
        return bad("best_of: only best_of = n is supported (every choice is returned)");
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
        temperature_set: obj.get("temperature").is_some_and(|v| !v.is_null()),
    };
    Ok(CompletionRequest { generation, include_usage, echo, token_ids: logprobs::as_token_ids(obj)?, n })
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
        let names = (req.generation.params.logprobs.is_some(), req.token_ids);
        let echo = req.echo.then(|| req.generation.raw.clone()).flatten();
        Ok((req.generation, (req.include_usage, names, echo, req.n)))
    });
    let shared::Started { acc, model, stream, extra: (include_usage, (with_logprobs, ids), echo, n) } = match started.await {
        Ok(a) => a,
        Err(e) => return finish(&c, "completions", e.into_openai(), None),
    };
    let namer = Namer::of(&c, &model, with_logprobs, ids);
    let echo = echo.map(|raw| Echo::of(raw, acc.stream.prompt(), c.served(&model).map(|s| &*s.tokenizer)));
    let served_by = acc.served_by.clone();
    let head = Chunks { id: new_id("cmpl-"), object: "text_completion", created: unix_now(), model, include_usage };
    let timing = shared::stream_timing(&acc);
    let all = match choices::follow(&c, acc, n).await {
        Ok(all) => all,
        Err(e) => return finish(&c, "completions", e.into_openai(), Some(&served_by)),
    };
    if stream {
        let each: Vec<TextStream> = all.into_iter().enumerate().map(|(i, f)| TextStream::new(f, head.clone(), i, n == 1, namer.clone(), echo.clone())).collect();
        let sse = match n {
            1 => shared::sse_response(each.into_iter().next().unwrap(), TextStream::step),
            _ => shared::sse_response(choices::Merged::new(each, head), choices::Merged::step),
        };
        return finish(&c, "completions", shared::server_timing(sse, &timing), Some(&served_by));
    }
    let resp = match choices::collect(all).await {
        Ok(whole) => {
            let out: Vec<Value> =
                whole.iter().enumerate().map(|(i, w)| whole_choice(i, namer.as_ref(), echo.clone(), w.text.clone(), &w.prompt_logprobs, &w.logprobs, &w.reason)).collect();
            let usage = choices::total_usage(whole.iter().map(|w| &w.usage));
            let body = json!({"id": head.id, "object": "text_completion", "created": head.created, "model": head.model, "choices": out, "usage": usage_json(&usage)});
            shared::outcome_headers(Json(body).into_response(), &whole[0].split, &whole[0].reason)
        }
        Err(e) => e.into_openai(),
    };
    finish(&c, "completions", resp, Some(&served_by))
}

/// A choice's `logprobs` (null when the request asked none, so no tokenizer names them).
fn choice_logprobs(namer: Option<&Namer>, lps: &[TokenLogprob], offset: usize) -> Value {
    namer.map_or(Value::Null, |n| logprobs::completion_choice(n, None, lps, offset))
}

/// What `echo` puts before the completion: the prompt's text (as sent, or its token ids
/// decoded), and its first token (which has no logprob: nothing comes before it).
#[derive(Clone)]
struct Echo {
    text: String,
    first: Option<u32>,
}

impl Echo {
    fn of(raw: RawPrompt, prompt: &[u32], tokenizer: Option<&Tokenizer>) -> Echo {
        let text = match raw {
            RawPrompt::Text(t) => t,
            RawPrompt::Ids(ids) => tokenizer.and_then(|t| t.decode_with_special(&ids).ok()).unwrap_or_default(),
        };
        Echo { text, first: prompt.first().copied() }
    }

    /// The echoed prompt's logprobs: its first token (with none), then the rest's.
    fn logprobs(&self, namer: Option<&Namer>, prompt: &[TokenLogprob]) -> Value {
        namer.map_or(Value::Null, |n| logprobs::completion_choice(n, self.first, prompt, 0))
    }
}

/// Choice `index` of a whole (non-streamed) completion, the prompt first when echoed.
fn whole_choice(index: usize, namer: Option<&Namer>, echo: Option<Echo>, text: String, prompt: &[TokenLogprob], generated: &[TokenLogprob], reason: &StopReason) -> Value {
    let (text, lps) = match echo {
        None => (text, choice_logprobs(namer, generated, 0)),
        Some(e) => {
            let mut lps = e.logprobs(namer, prompt);
            let more = choice_logprobs(namer, generated, e.text.chars().count());
            logprobs::append(&mut lps, more);
            (e.text + &text, lps)
        }
    };
    json!({"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason(reason)})
}

/// The chunks of one streamed choice.
struct TextStream {
    seq: Following,
    head: Chunks,
    /// The choice's `index`; `solo`: the request's only choice, whose end is the stream's (else
    /// its usage waits in `end` for [`choices::Merged`]).
    index: usize,
    solo: bool,
    end: Option<(Usage, Value)>,
    /// Names logprobs' tokens when the request asked for them; those whose text is still held
    /// back wait in `logprobs`; `offset` is where the next chunk's text begins (characters).
    namer: Option<Namer>,
    logprobs: Vec<TokenLogprob>,
    offset: usize,
    /// The prompt to send first (`echo`), until it is sent; its logprobs gather in
    /// `logprobs` until then.
    echo: Option<Echo>,
}

impl TextStream {
    fn new(seq: Following, head: Chunks, index: usize, solo: bool, namer: Option<Namer>, echo: Option<Echo>) -> Self {
        TextStream { seq, head, index, solo, end: None, namer, logprobs: Vec::new(), offset: 0, echo }
    }

    fn chunk(&mut self, text: &str, finish: Value) -> Event {
        let lps = std::mem::take(&mut self.logprobs);
        let lps = choice_logprobs(self.namer.as_ref(), &lps, self.offset);
        self.offset += text.chars().count();
        self.head.event(json!([{"index": self.index, "text": text, "logprobs": lps, "finish_reason": finish}]))
    }

    /// The echoed prompt's chunk, once: before the first generated text, or the end.
    fn echoed(&mut self, out: &mut Vec<Event>) {
        let Some(e) = self.echo.take() else { return };
        let prompt = std::mem::take(&mut self.logprobs);
        let lps = e.logprobs(self.namer.as_ref(), &prompt);
        self.offset = e.text.chars().count();
        out.push(self.head.event(json!([{"index": self.index, "text": e.text, "logprobs": lps, "finish_reason": null}])));
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
                SeqEvent::PromptLogprobs { logprobs, .. } => self.logprobs.extend(logprobs),
                SeqEvent::Delta { text, logprobs, .. } => {
                    let mut out = Vec::new();
                    self.echoed(&mut out);
                    if self.namer.is_some() {
                        self.logprobs.extend(logprobs);
                    }
                    if !text.is_empty() {
                        out.push(self.chunk(&text, Value::Null));
                    }
                    if !out.is_empty() {
                        return (out, Some(self));
                    }
                }
                SeqEvent::Finished { reason: StopReason::Error(e), .. } => return (vec![Event::default().data(failed(Some(&e)).openai_body().to_string())], None),
                SeqEvent::Finished { reason, usage } => {
                    let mut out = Vec::new();
                    self.echoed(&mut out);
                    let lps = std::mem::take(&mut self.logprobs);
                    let lps = if lps.is_empty() { Value::Null } else { choice_logprobs(self.namer.as_ref(), &lps, self.offset) };
                    out.push(self.head.finish_event(json!([{"index": self.index, "text": "", "logprobs": lps, "finish_reason": finish_reason(&reason)}]), &reason));
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

impl choices::ChoiceStream for TextStream {
    fn step(self) -> impl std::future::Future<Output = SseStep<Self>> + Send {
        TextStream::step(self)
    }

    fn take_end(&mut self) -> Option<(Usage, Value)> {
        self.end.take()
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
            (json!({"model": "m", "prompt": "a", "n": 9}), "n"),
            (json!({"model": "m", "prompt": "a", "n": 0}), "n"),
            (json!({"model": "m", "prompt": "a", "n": 2, "best_of": 3}), "best_of"),
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
