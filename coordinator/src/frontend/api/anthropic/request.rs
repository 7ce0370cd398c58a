//! The Anthropic Messages API request: parsing and validation into a [`GenerationRequest`].
//!
//! Parsing works on a `serde_json::Value` so that every error names the field and the rule,
//! as the official API does. Fields the current SDKs send that do not apply to our models are
//! accepted and ignored; unknown fields are refused.

use serde_json::Value;

use json::{bad, describe, type_name};
use messages::{cache_control, cached_text_block, parse_messages};
use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::frontend::request::{Breakpoint, GenerationRequest, MAX_BREAKPOINTS, MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_BYTES};
use crate::frontend::tools::{valid_name, Tool, ToolChoice, MAX_TOOLS};

/// A validated Messages API request: the neutral generation request, and what only this API
/// has.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagesRequest {
    pub generation: GenerationRequest,
    /// `diagnostics` was sent: `Some(previous_message_id)` (which may be null).
    pub diagnostics: Option<Option<String>>,
    /// The request carried `context_management`: the response reports the edits applied
    /// (none: the edits Claude Code sends clear thinking blocks, which our models never make).
    pub context_management: bool,
}

/// Which endpoint the body is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Messages,
    CountTokens,
}

const IGNORED: &[&str] = &["service_tier", "speed", "inference_geo", "container", "user_profile_id", "workspace_id", "mcp_servers"];

/// Parses and validates a request body.
pub fn parse(body: &Value, endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return bad(format!("request body must be a JSON object, not {}", type_name(body)));
    };
    check_fields(obj)?;

    let model = parse_model(obj.get("model"))?;

    let max_tokens = parse_max_tokens(obj.get("max_tokens"), endpoint)?;

    let mut breakpoints = vec![];
    let system = parse_system(obj.get("system"), &mut breakpoints)?;

    let turns = parse_messages(obj.get("messages"), &mut breakpoints)?;
    if let Some(cc) = obj.get("cache_control") {
        // Automatic caching: a breakpoint at the end of the last message.
        let ttl = cache_control(cc, "cache_control")?;
        if let Some(last) = turns.last() {
            breakpoints.push(Breakpoint { turn: Some(turns.len() - 1), end: last.text.len(), ttl });
        }
    }
    if breakpoints.len() > MAX_BREAKPOINTS {
        return bad(format!("A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {}.", breakpoints.len()));
    }

    let stop_sequences = parse_stop_sequences(obj.get("stop_sequences"))?;

    let (temperature, top_p, top_k) = parse_sampling(obj)?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return bad(format!("stream: expected a boolean, got {}", type_name(v))),
    };

    let tools = parse_tools(obj.get("tools"))?;
    let (tool_choice, parallel_tool_calls) = parse_tool_choice(obj.get("tool_choice"), &tools)?;
    each_field(obj, "metadata", |k, v| match (k, v) {
        ("user_id", Value::String(s)) if s.len() <= 256 => Ok(()),
        ("user_id", Value::Null) => Ok(()),
        ("user_id", _) => bad("metadata.user_id: expected a string of at most 256 characters"),
        (k, _) => bad(format!("metadata.{k}: Extra inputs are not permitted")),
    })?;
    check_thinking(obj.get("thinking"))?;
    let mut format = None;
    each_field(obj, "output_config", |k, v| match k {
        "effort" => Ok(()),
        "format" if v.is_null() => Ok(()),
        "format" => {
            format = Some(output_format(v)?);
            Ok(())
        }
        k => bad(format!("output_config.{k}: Extra inputs are not permitted")),
    })?;
    let diagnostics = parse_diagnostics(obj.get("diagnostics"))?;
    let cache_salt = crate::frontend::request::parse_cache_salt(obj.get("cache_salt"))?;

    let context_management = match obj.get("context_management") {
        None | Some(Value::Null) => false,
        Some(cm) => {
            context_edits(cm)?;
            true
        }
    };

    let params = SamplingParams { temperature, top_k, top_p, max_tokens: 0, stop_sequences, ..SamplingParams::default() };
    Ok(MessagesRequest {
        generation: GenerationRequest { model, system, turns, max_tokens, params, stream, tools, tool_choice, parallel_tool_calls, format, breakpoints, raw: None, cache_salt, temperature_set: obj.get("temperature").is_some_and(|v| !v.is_null()) },
        diagnostics,
        context_management,
    })
}

/// Every top-level field is one this API knows (or one it accepts and ignores).
fn check_fields(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for k in obj.keys() {
        let known = matches!(
            k.as_str(),
            "model" | "max_tokens" | "messages" | "system" | "stop_sequences" | "temperature" | "top_p" | "top_k" | "stream"
                | "tools" | "tool_choice" | "metadata" | "cache_control" | "output_config" | "diagnostics" | "thinking"
                | "context_management" | "cache_salt"
        ) || IGNORED.contains(&k.as_str());
        if !known {
            return bad(format!("{k}: Extra inputs are not permitted"));
        }
    }
    Ok(())
}

/// `model`: a non-empty string.
fn parse_model(v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => bad("model: must not be empty"),
        Some(v) => bad(format!("model: expected a string, got {}", type_name(v))),
        None => bad("model: Field required"),
    }
}

/// `max_tokens`: required for a generation, optional when counting tokens.
fn parse_max_tokens(v: Option<&Value>, endpoint: Endpoint) -> Result<Option<u32>, ApiError> {
    Ok(match (v, endpoint) {
        (None, Endpoint::Messages) => return bad("max_tokens: Field required"),
        (None, Endpoint::CountTokens) => None,
        (Some(v), _) => match v.as_i64() {
            Some(n) if n < 0 => return bad(format!("max_tokens: must be greater than or equal to 0, got {n}")),
            Some(n) if n > u32::MAX as i64 => return bad(format!("max_tokens: {n} is too large")),
            Some(n) => Some(n as u32),
            None if v.as_u64().is_some() => return bad("max_tokens: value is too large"),
            None => return bad(format!("max_tokens: expected an integer, got {}", describe(v))),
        },
    })
}

/// How newer Claude Code versions open the system prompt: a text block naming their version and
/// a checksum of the request (`x-anthropic-billing-header: cc_version=…; cc_entrypoint=cli;
/// cch=…;`), different in every request. It is metadata, not instructions: a block that starts
/// with it (and marks no cache breakpoint) is left out of the prompt, so that it does not make
/// every request's prefix new to the cache.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// `system`: a string, or text blocks (joined by blank lines), whose `cache_control`s become
/// breakpoints. Claude Code's billing header block is left out ([`BILLING_HEADER`]).
fn parse_system(v: Option<&Value>, breakpoints: &mut Vec<Breakpoint>) -> Result<Option<String>, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut parts: Vec<String> = vec![];
            for (i, b) in blocks.iter().enumerate() {
                let (text, ttl) = cached_text_block(b, &format!("system[{i}]"), true)?;
                if ttl.is_none() && text.starts_with(BILLING_HEADER) {
                    continue;
                }
                parts.push(text);
                if let Some(ttl) = ttl {
                    let end = parts.iter().map(String::len).sum::<usize>() + 2 * (parts.len() - 1);
                    breakpoints.push(Breakpoint { turn: None, end, ttl });
                }
            }
            Some(parts.join("\n\n"))
        }
        Some(v) => return bad(format!("system: expected a string or an array of text blocks, got {}", type_name(v))),
    })
}

/// `stop_sequences`: at most [`MAX_STOP_SEQUENCES`] non-blank strings.
fn parse_stop_sequences(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    Ok(match v {
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
    })
}

/// `temperature` (0 to 1), `top_p` (in (0, 1]) and `top_k` (at least 1).
fn parse_sampling(obj: &serde_json::Map<String, Value>) -> Result<(f32, Option<f32>, Option<u32>), ApiError> {
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
    Ok((temperature, top_p, top_k))
}

/// `tool_choice`, checked against the tools offered, and whether parallel calls are allowed.
fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<(ToolChoice, bool), ApiError> {
    let Some(tc) = v.filter(|v| !v.is_null()) else { return Ok((ToolChoice::Auto, true)) };
    let Some(o) = tc.as_object() else { return bad("tool_choice: expected an object") };
    for (k, v) in o {
        match (k.as_str(), v) {
            ("type", Value::String(_)) | ("name", Value::String(_)) | ("disable_parallel_tool_use", Value::Bool(_)) => {}
            (k, _) => return bad(format!("tool_choice.{k}: unexpected field or type")),
        }
    }
    let parallel = o.get("disable_parallel_tool_use") != Some(&Value::Bool(true));
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Any,
        Some("tool") => match o.get("name").and_then(Value::as_str) {
            Some(name) if tools.iter().any(|t| t.name == name) => ToolChoice::Tool(name.to_string()),
            Some(name) => return bad(format!("tool_choice.name: no tool named {name:?} is in tools")),
            None => return bad("tool_choice.name: Field required for type \"tool\""),
        },
        _ => return bad("tool_choice.type: expected \"auto\", \"any\", \"tool\" or \"none\""),
    };
    if matches!(choice, ToolChoice::Any) && tools.iter().all(|t| t.deferred) {
        return bad("tool_choice: a call is forced (\"any\"), but tools is empty");
    }
    Ok((choice, parallel))
}

/// `thinking`: our models never think; disabled or adaptive thinking is accepted.
fn check_thinking(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => {}
        Some(t) => match t.get("type").and_then(Value::as_str) {
            // Adaptive: the model decides whether to think; ours never do, and answer without
            // thinking blocks.
            Some("disabled") | Some("adaptive") => {}
            Some("enabled") => return bad("thinking: this model cannot think; extended thinking is not supported"),
            _ => return bad("thinking: expected {\"type\": \"enabled\" | \"adaptive\" | \"disabled\"}"),
        },
    }
    Ok(())
}

/// `diagnostics: {previous_message_id}` (the message to compare this prompt with).
fn parse_diagnostics(v: Option<&Value>) -> Result<Option<Option<String>>, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::Object(d)) => match d.get("previous_message_id") {
            None | Some(Value::Null) => Some(None),
            Some(Value::String(id)) if id.len() <= 256 => Some(Some(id.clone())),
            Some(_) => return bad("diagnostics.previous_message_id: expected a message id (a string) or null"),
        },
        Some(v) => return bad(format!("diagnostics: expected an object, got {}", type_name(v))),
    })
}

/// `tools: [{name, description?, input_schema, cache_control?, type?: "custom"}]`.
fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let arr = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(v) => return bad(format!("tools: expected an array, got {}", type_name(v))),
    };
    if arr.len() > MAX_TOOLS {
        return bad(format!("tools: at most {MAX_TOOLS} tools, got {}", arr.len()));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(o) = t.as_object() else { return bad(format!("{at}: expected an object, got {}", type_name(t))) };
        match o.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(ty) => return bad(format!("{at}.type: server tool \"{ty}\" is not supported by this server")),
        }
        let mut tool = Tool { name: String::new(), description: None, parameters: Value::Null, deferred: false };
        for (k, v) in o {
            match (k.as_str(), v) {
                ("name", Value::String(n)) if valid_name(n) => tool.name = n.clone(),
                ("name", _) => return bad(format!("{at}.name: must match ^[a-zA-Z0-9_-]{{1,64}}$")),
                ("description", Value::String(d)) => tool.description = Some(d.clone()),
                ("description", Value::Null) => {}
                ("input_schema", Value::Object(schema)) if schema.get("type").and_then(Value::as_str) == Some("object") => tool.parameters = v.clone(),
                ("input_schema", _) => return bad(format!("{at}.input_schema: expected a JSON schema object with \"type\": \"object\"")),
                ("cache_control", v) => {
                    cache_control(v, &format!("{at}.cache_control"))?;
                }
                ("defer_loading", Value::Bool(b)) => tool.deferred = *b,
                ("type", _) | ("eager_input_streaming", Value::Bool(_)) | ("strict", Value::Bool(_)) => {}
                ("input_examples", Value::Array(_)) => {}
                (k, _) => return bad(format!("{at}.{k}: Extra inputs are not permitted")),
            }
        }
        if tool.name.is_empty() {
            return bad(format!("{at}.name: Field required"));
        }
        if tool.parameters.is_null() {
            return bad(format!("{at}.input_schema: Field required"));
        }
        if tools.iter().any(|t| t.name == tool.name) {
            return bad(format!("{at}.name: tool names must be unique, {:?} is repeated", tool.name));
        }
        tools.push(tool);
    }
    Ok(tools)
}

/// `output_config.format`: `{"type": "json_schema", "schema": {…}}`; the schema.
fn output_format(v: &Value) -> Result<Value, ApiError> {
    let Some(o) = v.as_object() else { return bad("output_config.format: expected an object") };
    for k in o.keys() {
        if k != "type" && k != "schema" {
            return bad(format!("output_config.format.{k}: Extra inputs are not permitted"));
        }
    }
    match o.get("type").and_then(Value::as_str) {
        Some("json_schema") => {}
        _ => return bad("output_config.format.type: expected \"json_schema\""),
    }
    match o.get("schema") {
        Some(s @ Value::Object(_)) => Ok(s.clone()),
        Some(_) => bad("output_config.format.schema: expected a JSON schema (an object)"),
        None => bad("output_config.format.schema: Field required"),
    }
}

/// Checks each field of the optional object `obj[key]` with `check`.
fn each_field(obj: &serde_json::Map<String, Value>, key: &str, mut check: impl FnMut(&str, &Value) -> Result<(), ApiError>) -> Result<(), ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(m)) => m.iter().try_for_each(|(k, v)| check(k, v)),
        Some(v) => bad(format!("{key}: expected an object, got {}", type_name(v))),
    }
}

/// `context_management: {edits: [{type: "clear_thinking_20251015" | "clear_tool_uses_20250919", ...}]}`.
/// The edits are checked and none is applied: thinking blocks never reach our models, and tool
/// results are kept whole (the prompt cache makes them cheap to keep).
fn context_edits(cm: &Value) -> Result<(), ApiError> {
    let Some(o) = cm.as_object() else { return bad(format!("context_management: expected an object, got {}", type_name(cm))) };
    for (k, v) in o {
        match (k.as_str(), v) {
            ("edits", Value::Array(edits)) => {
                for (i, e) in edits.iter().enumerate() {
                    match e.get("type").and_then(Value::as_str) {
                        Some(t) if t.starts_with("clear_thinking_") || t.starts_with("clear_tool_uses_") => {}
                        Some(t) => return bad(format!("context_management.edits[{i}].type: unknown edit type \"{t}\"")),
                        None => return bad(format!("context_management.edits[{i}].type: Field required")),
                    }
                }
            }
            ("edits", v) => return bad(format!("context_management.edits: expected an array, got {}", type_name(v))),
            (k, _) => return bad(format!("context_management.{k}: Extra inputs are not permitted")),
        }
    }
    Ok(())
}

/// Helper for tests and fuzzing: parse raw bytes the way the handler does.
pub fn parse_bytes(bytes: &[u8], endpoint: Endpoint) -> Result<MessagesRequest, ApiError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
    parse(&v, endpoint)
}

mod json;
mod messages;
#[cfg(test)]
mod tests;
