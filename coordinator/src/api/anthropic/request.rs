//! The Anthropic Messages API request: parsing and validation into a [`GenerationRequest`].
//!
//! Parsing works on a `serde_json::Value` so that every error names the field and the rule,
//! as the official API does. Fields the current SDKs send that do not apply to our models are
//! accepted and ignored; unknown fields are refused.

use serde_json::Value;
use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::request::{GenerationRequest, Role, Turn, MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_BYTES};

/// A validated Messages API request: the neutral generation request, and what only this API
/// has.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagesRequest {
    pub generation: GenerationRequest,
    pub wants_diagnostics: bool,
}

/// Which endpoint the body is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Messages,
    CountTokens,
}

const IGNORED: &[&str] = &["service_tier", "speed", "inference_geo", "container", "user_profile_id", "workspace_id", "mcp_servers", "context_management"];

fn bad<T>(msg: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(msg))
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Parses and validates a request body.
pub fn parse(body: &Value, endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return bad(format!("request body must be a JSON object, not {}", type_name(body)));
    };
    for k in obj.keys() {
        let known = matches!(
            k.as_str(),
            "model" | "max_tokens" | "messages" | "system" | "stop_sequences" | "temperature" | "top_p" | "top_k" | "stream"
                | "tools" | "tool_choice" | "metadata" | "cache_control" | "output_config" | "diagnostics" | "thinking"
        ) || IGNORED.contains(&k.as_str());
        if !known {
            return bad(format!("{k}: Extra inputs are not permitted"));
        }
    }

    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return bad("model: must not be empty"),
        Some(v) => return bad(format!("model: expected a string, got {}", type_name(v))),
        None => return bad("model: Field required"),
    };

    let max_tokens = match (obj.get("max_tokens"), endpoint) {
        (None, Endpoint::Messages) => return bad("max_tokens: Field required"),
        (None, Endpoint::CountTokens) => None,
        (Some(v), _) => match v.as_i64() {
            Some(n) if n < 0 => return bad(format!("max_tokens: must be greater than or equal to 0, got {n}")),
            Some(n) if n > u32::MAX as i64 => return bad(format!("max_tokens: {n} is too large")),
            Some(n) => Some(n as u32),
            None if v.as_u64().is_some() => return bad("max_tokens: value is too large"),
            None => return bad(format!("max_tokens: expected an integer, got {}", describe(v))),
        },
    };

    let system = match obj.get("system") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts = vec![];
            for (i, b) in blocks.iter().enumerate() {
                parts.push(text_block(b, &format!("system[{i}]"), true)?);
            }
            Some(parts.join("\n\n"))
        }
        Some(v) => return bad(format!("system: expected a string or an array of text blocks, got {}", type_name(v))),
    };

    let turns = parse_messages(obj.get("messages"))?;

    let stop_sequences = match obj.get("stop_sequences") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP_SEQUENCES {
                return bad(format!("stop_sequences: at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {}", a.len()));
            }
            let mut out = vec![];
            for (i, s) in a.iter().enumerate() {
                match s {
                    Value::String(s) if s.is_empty() => return bad(format!("stop_sequences[{i}]: must not be empty")),
                    Value::String(s) if s.len() > MAX_STOP_SEQUENCE_BYTES => {
                        return bad(format!("stop_sequences[{i}]: longer than {MAX_STOP_SEQUENCE_BYTES} bytes"))
                    }
                    Value::String(s) if s.trim().is_empty() => {
                        return bad(format!("stop_sequences[{i}]: stop sequences must contain non-whitespace"))
                    }
                    Value::String(s) => out.push(s.clone()),
                    v => return bad(format!("stop_sequences[{i}]: expected a string, got {}", type_name(v))),
                }
            }
            out
        }
        Some(v) => return bad(format!("stop_sequences: expected an array of strings, got {}", type_name(v))),
    };

    let temperature = match obj.get("temperature") {
        None | Some(Value::Null) => 1.0,
        Some(v) => match v.as_f64() {
            Some(t) if (0.0..=1.0).contains(&t) => t as f32,
            Some(t) => return bad(format!("temperature: must be between 0 and 1, got {t}")),
            None => return bad(format!("temperature: expected a number, got {}", type_name(v))),
        },
    };
    let top_p = match obj.get("top_p") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64() {
            Some(p) if p > 0.0 && p <= 1.0 => Some(p as f32),
            Some(p) => return bad(format!("top_p: must be in (0, 1], got {p}")),
            None => return bad(format!("top_p: expected a number, got {}", type_name(v))),
        },
    };
    let top_k = match obj.get("top_k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(k) if k >= 1 && k <= u32::MAX as i64 => Some(k as u32),
            Some(k) => return bad(format!("top_k: must be an integer >= 1, got {k}")),
            None => return bad(format!("top_k: expected an integer, got {}", describe(v))),
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return bad(format!("stream: expected a boolean, got {}", type_name(v))),
    };

    match obj.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(Value::Array(_)) => return bad("tools: tool use is not supported by this server yet"),
        Some(v) => return bad(format!("tools: expected an array, got {}", type_name(v))),
    }
    if let Some(tc) = obj.get("tool_choice") {
        match tc.get("type").and_then(Value::as_str) {
            Some("auto") | Some("none") => {}
            Some("any") | Some("tool") => return bad("tool_choice: tool use is not supported by this server yet"),
            _ => return bad("tool_choice: expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}"),
        }
    }
    each_field(obj, "metadata", |k, v| match (k, v) {
        ("user_id", Value::String(s)) if s.len() <= 256 => Ok(()),
        ("user_id", Value::Null) => Ok(()),
        ("user_id", _) => bad("metadata.user_id: expected a string of at most 256 characters"),
        (k, _) => bad(format!("metadata.{k}: Extra inputs are not permitted")),
    })?;
    if let Some(cc) = obj.get("cache_control") {
        cache_control(cc, "cache_control")?;
    }
    match obj.get("thinking") {
        None | Some(Value::Null) => {}
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("disabled") => {}
            Some("enabled") | Some("adaptive") => return bad("thinking: this model cannot think; extended thinking is not supported"),
            _ => return bad("thinking: expected {\"type\": \"enabled\" | \"disabled\"}"),
        },
    }
    each_field(obj, "output_config", |k, v| match k {
        "effort" => Ok(()),
        "format" if v.is_null() => Ok(()),
        "format" => bad("output_config.format: structured output is not supported by this server yet"),
        k => bad(format!("output_config.{k}: Extra inputs are not permitted")),
    })?;
    let wants_diagnostics = match obj.get("diagnostics") {
        None | Some(Value::Null) => false,
        Some(Value::Object(d)) => match d.get("previous_message_id") {
            None | Some(Value::Null) | Some(Value::String(_)) => true,
            Some(_) => return bad("diagnostics.previous_message_id: expected a string or null"),
        },
        Some(v) => return bad(format!("diagnostics: expected an object, got {}", type_name(v))),
    };

    let params = SamplingParams { temperature, top_k, top_p, seed: None, max_tokens: 0, stop_sequences, ignore_eos: false };
    Ok(MessagesRequest { generation: GenerationRequest { model, system, turns, max_tokens, params, stream }, wants_diagnostics })
}

/// Checks each field of the optional object `obj[key]` with `check`.
fn each_field(obj: &serde_json::Map<String, Value>, key: &str, mut check: impl FnMut(&str, &Value) -> Result<(), ApiError>) -> Result<(), ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(m)) => m.iter().try_for_each(|(k, v)| check(k, v)),
        Some(v) => bad(format!("{key}: expected an object, got {}", type_name(v))),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Number(n) => format!("number {n}"),
        other => type_name(other).to_string(),
    }
}

fn cache_control(v: &Value, at: &str) -> Result<(), ApiError> {
    let Some(o) = v.as_object() else { return bad(format!("{at}: expected an object")) };
    if o.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return bad(format!("{at}.type: must be \"ephemeral\""));
    }
    match o.get("ttl") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "5m" || t == "1h" => {}
        Some(_) => return bad(format!("{at}.ttl: must be \"5m\" or \"1h\"")),
    }
    Ok(())
}

/// A text block's text; refuses every other block type with a message naming it.
fn text_block(b: &Value, at: &str, allow_empty: bool) -> Result<String, ApiError> {
    let Some(o) = b.as_object() else { return bad(format!("{at}: expected a content block object, got {}", type_name(b))) };
    let ty = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(v) => return bad(format!("{at}.type: expected a string, got {}", type_name(v))),
        None => return bad(format!("{at}.type: Field required")),
    };
    match ty {
        "text" => {}
        "image" | "document" | "thinking" | "redacted_thinking" | "search_result" | "container_upload" => {
            return bad(format!("{at}: content block type \"{ty}\" is not supported by this model"))
        }
        "tool_use" | "tool_result" | "server_tool_use" | "web_search_tool_result" => {
            return bad(format!("{at}: content block type \"{ty}\" (tool use) is not supported by this server yet"))
        }
        other => return bad(format!("{at}.type: unknown content block type \"{other}\"")),
    }
    for (k, v) in o {
        match k.as_str() {
            "type" | "text" => {}
            "cache_control" => cache_control(v, &format!("{at}.cache_control"))?,
            "citations" => {}
            k => return bad(format!("{at}.{k}: Extra inputs are not permitted")),
        }
    }
    match o.get("text") {
        Some(Value::String(s)) if s.is_empty() && !allow_empty => bad(format!("{at}.text: text content blocks must be non-empty")),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) => bad(format!("{at}.text: expected a string, got {}", type_name(v))),
        None => bad(format!("{at}.text: Field required")),
    }
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<Turn>, ApiError> {
    let arr = match v {
        Some(Value::Array(a)) => a,
        Some(v) => return bad(format!("messages: expected an array, got {}", type_name(v))),
        None => return bad("messages: Field required"),
    };
    if arr.is_empty() {
        return bad("messages: at least one message is required");
    }
    let mut turns: Vec<Turn> = vec![];
    let n = arr.len();
    for (i, m) in arr.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(o) = m.as_object() else { return bad(format!("{at}: expected an object, got {}", type_name(m))) };
        for k in o.keys() {
            if k != "role" && k != "content" {
                return bad(format!("{at}.{k}: Extra inputs are not permitted"));
            }
        }
        let role = match o.get("role") {
            Some(Value::String(r)) if r == "user" => Role::User,
            Some(Value::String(r)) if r == "assistant" => Role::Assistant,
            Some(Value::String(r)) => {
                return bad(format!("{at}.role: must be \"user\" or \"assistant\", got \"{r}\" (use the top-level system parameter for system prompts)"))
            }
            Some(v) => return bad(format!("{at}.role: expected a string, got {}", type_name(v))),
            None => return bad(format!("{at}.role: Field required")),
        };
        let is_final_assistant = i + 1 == n && role == Role::Assistant;
        let text = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(blocks)) => {
                let mut parts = vec![];
                for (j, b) in blocks.iter().enumerate() {
                    parts.push(text_block(b, &format!("{at}.content[{j}]"), is_final_assistant)?);
                }
                parts.join("\n\n")
            }
            Some(v) => return bad(format!("{at}.content: expected a string or an array of content blocks, got {}", type_name(v))),
            None => return bad(format!("{at}.content: Field required")),
        };
        if text.is_empty() && !is_final_assistant {
            return bad(format!("{at}: all messages must have non-empty content except for the optional final assistant message"));
        }
        if is_final_assistant && text != text.trim_end() {
            return bad(format!("{at}: final assistant content cannot end with trailing whitespace"));
        }
        match turns.last_mut() {
            // Consecutive turns of the same role are combined, as the official API does.
            Some(last) if last.role == role => {
                if !text.is_empty() {
                    if !last.text.is_empty() {
                        last.text.push_str("\n\n");
                    }
                    last.text.push_str(&text);
                }
            }
            _ => turns.push(Turn { role, text }),
        }
    }
    Ok(turns)
}

/// Helper for tests and fuzzing: parse raw bytes the way the handler does.
pub fn parse_bytes(bytes: &[u8], endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
    parse(&v, endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn combines_turns_and_keeps_prefill() {
        let r = parse(
            &json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}], "messages": [
                {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "The answer is"}]}),
            Endpoint::Messages,
        )
        .unwrap();
        let g = r.generation;
        assert_eq!(g.system.as_deref(), Some("sys"));
        assert_eq!(g.turns, vec![Turn { role: Role::User, text: "a\n\nb".into() }, Turn { role: Role::Assistant, text: "The answer is".into() }]);
        assert_eq!(g.params.temperature, 1.0);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}), "model"),
            (json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
            (json!({"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
            (json!({"model": "m", "max_tokens": 1, "messages": []}), "messages"),
            (json!({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
            (json!({"model": "m", "max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}), "temperature"),
            (json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "image"),
            (json!({"model": "m", "max_tokens": 1, "bogus": 1, "messages": [{"role": "user", "content": "x"}]}), "bogus"),
        ];
        for (body, needle) in cases {
            let e = parse(&body, Endpoint::Messages).unwrap_err();
            assert_eq!(e.status(), 400);
            assert!(e.to_string().contains(needle), "{e} lacks {needle}");
        }
        assert!(parse(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}), Endpoint::CountTokens).is_ok());
    }
}
