//! The OpenAI Chat Completions request: parsing and validation into a [`GenerationRequest`] (lenient about fields that
//! only tune things we do not do, strict about the ones we would get wrong).

use serde_json::Value;

use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::request::{GenerationRequest, Role, Turn, MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_BYTES};

/// A validated Chat Completions request: the neutral generation request, and what only this
/// API has.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub generation: GenerationRequest,
    /// `stream_options.include_usage`: a last chunk carries the usage.
    pub include_usage: bool,
}

fn bad<T>(m: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(m))
}

fn content_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = vec![];
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => match p.get("text") {
                        Some(Value::String(t)) => out.push(t.clone()),
                        _ => return bad(format!("{at}.content[{j}].text: expected a string")),
                    },
                    Some(other) => return bad(format!("{at}.content[{j}]: content part type \"{other}\" is not supported by this model")),
                    None => return bad(format!("{at}.content[{j}].type: Field required")),
                }
            }
            Ok(out.join("\n\n"))
        }
        Some(_) => bad(format!("{at}.content: expected a string or an array of content parts")),
    }
}

pub fn parse(body: &Value) -> Result<ChatRequest, ApiError> {
    let Some(obj) = body.as_object() else { return bad("request body must be a JSON object") };
    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => return bad("model: expected a non-empty string"),
        None => return bad("model: Field required"),
    };
    let Some(msgs) = obj.get("messages").and_then(Value::as_array) else { return bad("messages: expected a non-empty array") };
    if msgs.is_empty() {
        return bad("messages: expected a non-empty array");
    }
    let mut system: Vec<String> = vec![];
    let mut turns: Vec<Turn> = vec![];
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(format!("{at}.role: Field required")))?;
        let text = content_text(m.get("content"), &at)?;
        let role = match role {
            "system" | "developer" => {
                system.push(text);
                continue;
            }
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" | "function" => return bad(format!("{at}.role: tool messages are not supported by this server yet")),
            other => return bad(format!("{at}.role: unknown role \"{other}\"")),
        };
        match turns.last_mut() {
            Some(last) if last.role == role => {
                last.text.push_str("\n\n");
                last.text.push_str(&text);
            }
            _ => turns.push(Turn { role, text }),
        }
    }
    if turns.is_empty() {
        return bad("messages: at least one user message is required");
    }
    let int = |k: &str| -> Result<Option<u64>, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| ApiError::invalid(format!("{k}: expected a non-negative integer"))),
        }
    };
    let max_tokens = int("max_completion_tokens")?.or(int("max_tokens")?).map(|v| v.min(u32::MAX as u64) as u32);
    let temperature = match obj.get("temperature") {
        None | Some(Value::Null) => 1.0,
        Some(v) => match v.as_f64() {
            Some(t) if (0.0..=2.0).contains(&t) => t as f32,
            _ => return bad("temperature: must be a number between 0 and 2"),
        },
    };
    let top_p = match obj.get("top_p") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64() {
            Some(p) if p > 0.0 && p <= 1.0 => Some(p as f32),
            _ => return bad("top_p: must be a number in (0, 1]"),
        },
    };
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| ApiError::invalid("seed: expected an integer"))? as u64),
    };
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid("stop: expected strings"))).collect::<Result<_, _>>()?,
        Some(_) => return bad("stop: expected a string or an array of strings"),
    };
    if stop.len() > MAX_STOP_SEQUENCES || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_SEQUENCE_BYTES) {
        return bad(format!("stop: at most {MAX_STOP_SEQUENCES} non-empty sequences of at most {MAX_STOP_SEQUENCE_BYTES} bytes"));
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return bad("stream: expected a boolean"),
    };
    let ignore_eos = match obj.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return bad("ignore_eos: expected a boolean"),
    };
    let include_usage = obj.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    if let Some(n) = int("n")? {
        if n != 1 {
            return bad("n: only n = 1 is supported");
        }
    }
    if obj.get("tools").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return bad("tools: tool use is not supported by this server yet");
    }
    if let Some(rf) = obj.get("response_format") {
        if rf.get("type").and_then(Value::as_str).is_some_and(|t| t != "text") {
            return bad("response_format: structured output is not supported by this server yet");
        }
    }
    let system = if system.is_empty() { None } else { Some(system.join("\n\n")) };
    // `ignore_eos` is vLLM's extension: keep generating past end tokens (benchmarks).
    let params = SamplingParams { temperature, top_k: None, top_p, seed, max_tokens: 0, stop_sequences: stop, ignore_eos };
    Ok(ChatRequest { generation: GenerationRequest { model, system, turns, max_tokens, params, stream }, include_usage })
}
