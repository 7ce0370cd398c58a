//! The conversation of a Messages request: `messages` and their content blocks (text, tool
//! calls, tool results), and the `cache_control` breakpoints they carry.

use serde_json::Value;

use super::json::{bad, type_name};
use crate::error::ApiError;
use crate::frontend::request::{push_turn, Breakpoint, CacheTtl, Role, Turn};
use crate::frontend::tools::{valid_name, ToolCall};

/// A `tool_use` block of an assistant message.
fn tool_use_block(o: &serde_json::Map<String, Value>, at: &str) -> Result<ToolCall, ApiError> {
    let mut call = ToolCall { id: String::new(), name: String::new(), arguments: Value::Null };
    for (k, v) in o {
        match (k.as_str(), v) {
            ("type", _) => {}
            ("id", Value::String(id)) if !id.is_empty() && id.len() <= 256 => call.id = id.clone(),
            ("name", Value::String(n)) if valid_name(n) => call.name = n.clone(),
            ("input", Value::Object(_)) => call.arguments = v.clone(),
            ("cache_control", v) => {
                cache_control(v, &format!("{at}.cache_control"))?;
            }
            ("id" | "name" | "input", _) => return bad(format!("{at}.{k}: invalid value")),
            (k, _) => return bad(format!("{at}.{k}: Extra inputs are not permitted")),
        }
    }
    if call.id.is_empty() || call.name.is_empty() || call.arguments.is_null() {
        return bad(format!("{at}: a tool_use block needs id, name and input"));
    }
    Ok(call)
}

/// A `tool_result` block of a user message: the call it answers, and its text.
fn tool_result_block(o: &serde_json::Map<String, Value>, at: &str) -> Result<Turn, ApiError> {
    let (mut id, mut text, mut is_error) = (None, String::new(), false);
    for (k, v) in o {
        match (k.as_str(), v) {
            ("type", _) => {}
            ("tool_use_id", Value::String(s)) if !s.is_empty() => id = Some(s.clone()),
            ("content", Value::String(s)) => text = s.clone(),
            ("content", Value::Array(parts)) => {
                let mut out = vec![];
                for (j, p) in parts.iter().enumerate() {
                    out.push(text_block(p, &format!("{at}.content[{j}]"), true)?);
                }
                text = out.join("\n\n");
            }
            ("content", Value::Null) => {}
            ("is_error", Value::Bool(b)) => is_error = *b,
            ("cache_control", v) => {
                cache_control(v, &format!("{at}.cache_control"))?;
            }
            ("tool_use_id" | "content" | "is_error", _) => return bad(format!("{at}.{k}: invalid value")),
            (k, _) => return bad(format!("{at}.{k}: Extra inputs are not permitted")),
        }
    }
    let Some(id) = id else { return bad(format!("{at}.tool_use_id: Field required")) };
    if is_error {
        text = format!("Error: {text}");
    }
    Ok(Turn::tool_result(id, text))
}

pub(super) fn cache_control(v: &Value, at: &str) -> Result<CacheTtl, ApiError> {
    let Some(o) = v.as_object() else { return bad(format!("{at}: expected an object")) };
    if o.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return bad(format!("{at}.type: must be \"ephemeral\""));
    }
    match o.get("ttl") {
        None | Some(Value::Null) => Ok(CacheTtl::FiveMinutes),
        Some(Value::String(t)) if t == "5m" => Ok(CacheTtl::FiveMinutes),
        Some(Value::String(t)) if t == "1h" => Ok(CacheTtl::OneHour),
        Some(_) => bad(format!("{at}.ttl: must be \"5m\" or \"1h\"")),
    }
}

/// A text block's text, and its `cache_control` breakpoint if it has one.
pub(super) fn cached_text_block(b: &Value, at: &str, allow_empty: bool) -> Result<(String, Option<CacheTtl>), ApiError> {
    let text = text_block(b, at, allow_empty)?;
    let ttl = b.get("cache_control").map(|v| cache_control(v, &format!("{at}.cache_control"))).transpose()?;
    Ok((text, ttl))
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
        "tool_use" | "tool_result" => return bad(format!("{at}: a {ty} block cannot stand here")),
        "server_tool_use" | "web_search_tool_result" => return bad(format!("{at}: content block type \"{ty}\" (server tools) is not supported by this server")),
        other => return bad(format!("{at}.type: unknown content block type \"{other}\"")),
    }
    for (k, v) in o {
        match k.as_str() {
            "type" | "text" => {}
            "cache_control" => {
                cache_control(v, &format!("{at}.cache_control"))?;
            }
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

/// The turns, and each `cache_control` breakpoint in them (appended to `breakpoints`).
pub(super) fn parse_messages(v: Option<&Value>, breakpoints: &mut Vec<Breakpoint>) -> Result<Vec<Turn>, ApiError> {
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
    // The `tool_use` ids of the message before: what this message's tool results may answer.
    let mut answerable: Vec<String> = vec![];
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
            // Mid-conversation system messages: Claude Code sends them whether or not it names
            // their beta (it names it only for models it knows).
            Some(Value::String(r)) if r == "system" => Role::System,
            Some(Value::String(r)) => return bad(format!("{at}.role: must be \"user\", \"assistant\" or \"system\", got \"{r}\"")),
            Some(v) => return bad(format!("{at}.role: expected a string, got {}", type_name(v))),
            None => return bad(format!("{at}.role: Field required")),
        };
        let is_final_assistant = i + 1 == n && role == Role::Assistant;
        // One message may become several turns: a user message's tool results come first.
        let mut msg_turns: Vec<(Turn, Option<CacheTtl>)> = vec![];
        let mut text_parts: Vec<String> = vec![];
        // Breakpoints in this message's text: (end in the joined text, ttl).
        let mut text_breaks: Vec<(usize, CacheTtl)> = vec![];
        let mut calls: Vec<ToolCall> = vec![];
        match o.get("content") {
            Some(Value::String(s)) => text_parts.push(s.clone()),
            Some(Value::Array(blocks)) => {
                for (j, b) in blocks.iter().enumerate() {
                    let bat = format!("{at}.content[{j}]");
                    match (b.get("type").and_then(Value::as_str), b.as_object(), role) {
                        (Some("tool_use"), Some(bo), Role::Assistant) => calls.push(tool_use_block(bo, &bat)?),
                        (Some("tool_result"), Some(bo), Role::User) => {
                            let ttl = bo.get("cache_control").map(|v| cache_control(v, &format!("{bat}.cache_control"))).transpose()?;
                            let result = tool_result_block(bo, &bat)?;
                            let id = result.tool_call_id.as_deref().unwrap_or_default();
                            if !answerable.iter().any(|a| a == id) {
                                return bad(format!(
                                    "messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                                ));
                            }
                            msg_turns.push((result, ttl));
                        }
                        (Some(ty @ ("tool_use" | "tool_result")), _, _) => {
                            return bad(format!("{bat}: a {ty} block belongs in {} messages", if ty == "tool_use" { "assistant" } else { "user" }))
                        }
                        _ => {
                            let (text, ttl) = cached_text_block(b, &bat, is_final_assistant)?;
                            text_parts.push(text);
                            if let Some(ttl) = ttl {
                                text_breaks.push((text_parts.iter().map(String::len).sum::<usize>() + 2 * (text_parts.len() - 1), ttl));
                            }
                        }
                    }
                }
            }
            Some(v) => return bad(format!("{at}.content: expected a string or an array of content blocks, got {}", type_name(v))),
            None => return bad(format!("{at}.content: Field required")),
        };
        answerable = calls.iter().map(|c| c.id.clone()).collect();
        let text = text_parts.join("\n\n");
        if text.is_empty() && msg_turns.is_empty() && calls.is_empty() && !is_final_assistant {
            return bad(format!("{at}: all messages must have non-empty content except for the optional final assistant message"));
        }
        if is_final_assistant && calls.is_empty() && text != text.trim_end() {
            return bad(format!("{at}: final assistant content cannot end with trailing whitespace"));
        }
        let text_turn = !text.is_empty() || !calls.is_empty() || msg_turns.is_empty();
        if text_turn {
            msg_turns.push((Turn { role, text, tool_calls: calls, tool_call_id: None }, None));
        }
        let last = msg_turns.len() - 1;
        for (k, (t, ttl)) in msg_turns.into_iter().enumerate() {
            let len = t.text.len();
            // Consecutive turns of the same role are combined, as the official API does.
            let (turn, begins) = push_turn(&mut turns, t);
            if let Some(ttl) = ttl {
                breakpoints.push(Breakpoint { turn: Some(turn), end: begins + len, ttl });
            }
            if text_turn && k == last {
                breakpoints.extend(text_breaks.iter().map(|&(end, ttl)| Breakpoint { turn: Some(turn), end: begins + end, ttl }));
            }
        }
    }
    Ok(turns)
}
