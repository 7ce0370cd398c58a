//! The Responses API request: `input` (a string, or items: messages, `function_call`,
//! `function_call_output`, and `reasoning`, which is skipped), `instructions`, function `tools`
//! and `tool_choice`, `text.format`, the sampling fields, `store`, `metadata` and
//! `previous_response_id` (the stored conversation it continues comes in already found) into
//! the neutral [`GenerationRequest`], and the fields the response object echoes.
//!
//! Like every route, it refuses a field it does not know ([`RESPONSES_FIELDS`]); it accepts
//! those that only tune what we do not do (`prompt_cache_key`, `service_tier`, `reasoning`,
//! Codex's `client_metadata`), and is strict about the ones we would get wrong. `include`
//! and `top_logprobs` ask for output logprobs (`logprobs::responses`). Built-in tools (`web_search`, `file_search`,
//! `namespace`, `custom`, …) are not offered to the model: only functions are.

use serde_json::{json, Map, Value};

use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::frontend::api::openai::fields::{known_only, unsupported, EXTENSIONS};
use crate::frontend::api::openai::logprobs;
use crate::frontend::api::openai::request::{bad, content_parts, flag, function_tool, message_role, model_name};
use crate::frontend::request::{push_turn, GenerationRequest, Role, Turn};
use crate::frontend::tools::{valid_name, Tool, ToolCall, ToolChoice, MAX_TOOLS};

/// The Responses API's fields, as OpenAI documents them, and Codex's `client_metadata`. Those
/// that only tune what we do not do (`prompt_cache_key`, `prompt_cache_retention`,
/// `service_tier`, `reasoning`, `safety_identifier`, `user`, `truncation`, `max_tool_calls`,
/// `context_management`, `client_metadata`, and `include` values other than output logprobs)
/// are accepted and have no effect;
/// `background`, `conversation` and `prompt` (a stored prompt template) are refused by name.
const RESPONSES_FIELDS: &[&str] = &[
    "background", "client_metadata", "context_management", "conversation", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options", "temperature", "text",
    "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
];

/// Most `metadata` pairs, and their key and value lengths (the official limits).
const MAX_METADATA: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// A validated Responses request.
#[derive(Clone, Debug)]
pub struct ResponsesRequest {
    pub generation: GenerationRequest,
    /// The whole conversation as items: the continued response's (its input and output), then
    /// this request's. A stored response keeps it, for the next `previous_response_id`.
    pub input: Vec<Value>,
    /// The request's fields as the response object echoes them.
    pub echo: Map<String, Value>,
    pub store: bool,
    /// `return_tokens_as_token_ids`: logprobs name tokens by id.
    pub token_ids: bool,
}

/// `previous_response_id`, if the body names one (read before the rest, to find it first).
pub fn previous_id(body: &Value) -> Result<Option<String>, ApiError> {
    match body.get("previous_response_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(_) => bad("previous_response_id: expected a string"),
    }
}

/// Parses a body; `previous` is the stored response it continues (`{"response", "input"}`).
pub fn parse(body: &Value, previous: Option<&Value>) -> Result<ResponsesRequest, ApiError> {
    let Some(obj) = body.as_object() else { return bad("request body must be a JSON object") };
    known_only(obj, &[RESPONSES_FIELDS, EXTENSIONS])?;
    let model = model_name(obj)?;
    if obj.get("background").and_then(Value::as_bool) == Some(true) {
        return bad("background: background responses are not supported; stream instead");
    }
    unsupported(obj, "conversation", "conversations are not supported; continue with previous_response_id")?;
    unsupported(obj, "prompt", "stored prompt templates are not supported; send instructions and input")?;
    let mut input = previous.map(continued_items).unwrap_or_default();
    input.extend(input_items(obj.get("input"))?);
    let instructions = match obj.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return bad("instructions: expected a string"),
    };
    let (mut system, turns) = conversation(&input)?;
    if let Some(i) = &instructions {
        system.insert(0, i.clone());
    }
    let tools = parse_tools(obj.get("tools"))?;
    let tool_choice = parse_tool_choice(obj.get("tool_choice"), &tools)?;
    let format = text_format(obj.get("text"))?;
    let (params, max_tokens) = sampling(obj)?;
    let mut g = GenerationRequest::chat(&model, None, turns);
    g.temperature_set = obj.get("temperature").is_some_and(|v| !v.is_null());
    g.system = (!system.is_empty()).then(|| system.join("\n\n"));
    g.max_tokens = max_tokens;
    g.params = params;
    g.params.logprobs = logprobs::responses(obj)?;
    g.stream = flag(obj, "stream", false)?;
    g.parallel_tool_calls = flag(obj, "parallel_tool_calls", true)?;
    g.tools = tools;
    g.tool_choice = tool_choice;
    g.format = format;
    g.cache_salt = crate::frontend::request::parse_cache_salt(obj.get("cache_salt"))?;
    let store = flag(obj, "store", true)?;
    let echo = echo(obj, &g, store)?;
    Ok(ResponsesRequest { generation: g, input, echo, store, token_ids: logprobs::as_token_ids(obj)? })
}

/// A stored response's conversation: its input items, then its output (reasoning left out).
fn continued_items(stored: &Value) -> Vec<Value> {
    let mut items: Vec<Value> = stored.get("input").and_then(Value::as_array).cloned().unwrap_or_default();
    let output = stored.get("response").and_then(|r| r.get("output")).and_then(Value::as_array);
    items.extend(output.into_iter().flatten().filter(|i| i.get("type").and_then(Value::as_str) != Some("reasoning")).cloned());
    items
}

/// `input`: a string (one user message) or an array of items.
fn input_items(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(vec![json!({"type": "message", "role": "user", "content": s})]),
        Some(Value::Array(items)) => Ok(items.clone()),
        None | Some(Value::Null) => bad("input: Field required"),
        Some(_) => bad("input: expected a string or an array of input items"),
    }
}

/// The items as the system prompt's parts (leading system and developer messages) and turns.
/// A `function_call_output` must answer a `function_call` made before it.
fn conversation(items: &[Value]) -> Result<(Vec<String>, Vec<Turn>), ApiError> {
    let (mut system, mut turns) = (Vec::new(), Vec::<Turn>::new());
    let mut calls: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Some(o) = item.as_object() else { return bad(format!("{at}: expected an object")) };
        let ty = o.get("type").and_then(Value::as_str).unwrap_or(if o.contains_key("role") { "message" } else { "" });
        match ty {
            "message" => {
                let role = o.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(format!("{at}.role: Field required")))?;
                let text = content_text(o.get("content"), &at)?;
                match message_role(role, &at, &turns)? {
                    Some(role) => push_turn(&mut turns, Turn::new(role, text)),
                    None => {
                        system.push(text);
                        continue;
                    }
                };
            }
            "function_call" => {
                let call = function_call(o, &at)?;
                calls.push(call.id.clone());
                let mut turn = Turn::new(Role::Assistant, "");
                turn.tool_calls.push(call);
                push_turn(&mut turns, turn);
            }
            "function_call_output" => {
                let id = o.get("call_id").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(format!("{at}.call_id: Field required")))?;
                if !calls.iter().any(|c| c == id) {
                    return bad(format!("No tool call found for function call output with call_id {id}."));
                }
                let text = match o.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(Some(v), &format!("{at}.output"))?,
                    _ => return bad(format!("{at}.output: expected a string or an array of content parts")),
                };
                push_turn(&mut turns, Turn::tool_result(id, text));
            }
            // The models do not reason; another model's reasoning is not shown to them.
            "reasoning" => {}
            "" => return bad(format!("{at}.type: Field required")),
            other => return bad(format!("{at}.type: input item type \"{other}\" is not supported by this server")),
        }
    }
    if !turns.iter().any(|t| t.role != Role::System) {
        return bad("input: at least one message or function call output is required");
    }
    Ok((system, turns))
}

/// A `function_call` item of the history: `call_id`, `name`, `arguments` (a JSON string).
fn function_call(o: &Map<String, Value>, at: &str) -> Result<ToolCall, ApiError> {
    let id = o.get("call_id").and_then(Value::as_str).filter(|s| !s.is_empty()).ok_or_else(|| ApiError::invalid(format!("{at}.call_id: Field required")))?;
    let name = o.get("name").and_then(Value::as_str).filter(|n| valid_name(n)).ok_or_else(|| ApiError::invalid(format!("{at}.name: must match ^[a-zA-Z0-9_-]{{1,64}}$")))?;
    let arguments = match o.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object),
        _ => None,
    };
    let arguments = arguments.ok_or_else(|| ApiError::invalid(format!("{at}.arguments: expected a JSON object in a string")))?;
    Ok(ToolCall { id: id.to_string(), name: name.to_string(), arguments })
}

/// A message's content: a string, or parts (`input_text`, `output_text`, `refusal`) joined.
fn content_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v @ Value::Array(_)) => content_parts(v, at, |ty| match ty {
            "input_text" | "output_text" | "text" => Some("text"),
            "refusal" => Some("refusal"),
            _ => None,
        }),
        None | Some(Value::Null) => bad(format!("{at}.content: Field required")),
        Some(_) => bad(format!("{at}.content: expected a string or an array of content parts")),
    }
}

/// `tools`: function tools, `{type: "function", name, description?, parameters?, strict?}`.
/// Built-in tool types are not offered (module docs).
fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let arr = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(_) => return bad("tools: expected an array"),
    };
    let mut tools: Vec<Tool> = Vec::new();
    for (i, t) in arr.iter().enumerate() {
        let at = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(_) => continue,
            None => return bad(format!("{at}.type: Field required")),
        }
        let Some(f) = t.as_object() else { return bad(format!("{at}: expected an object")) };
        let tool = function_tool(f, &at, &tools)?;
        tools.push(tool);
    }
    if tools.len() > MAX_TOOLS {
        return bad(format!("tools: at most {MAX_TOOLS} function tools, got {}", tools.len()));
    }
    Ok(tools)
}

/// `tool_choice`: `auto`, `none`, `required`, or `{type: "function", name}` naming a function
/// in `tools`.
fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" && tools.is_empty() => return bad("tool_choice: \"required\" needs function tools"),
        Some(Value::String(s)) if s == "required" => ToolChoice::Any,
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) if tools.iter().any(|t| t.name == name) => ToolChoice::Tool(name.to_string()),
            (Some("function"), Some(name)) => return bad(format!("tool_choice: no function named {name:?} is in tools")),
            _ => return bad("tool_choice: expected {\"type\": \"function\", \"name\": …}"),
        },
        Some(_) => return bad("tool_choice: expected \"auto\", \"none\", \"required\" or a named function"),
    })
}

/// `text.format`: `text`, `json_object`, or `json_schema` (`{type, name, schema, strict}`).
fn text_format(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(f) = v.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => match f.get("schema") {
            Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
            Some(_) => bad("text.format.schema: expected a JSON schema (an object)"),
            None => bad("text.format.schema: Field required"),
        },
        _ => bad("text.format.type: expected \"text\", \"json_object\" or \"json_schema\""),
    }
}

/// `temperature`, `top_p`, `seed` (an extension), and `max_output_tokens`.
fn sampling(obj: &Map<String, Value>) -> Result<(SamplingParams, Option<u32>), ApiError> {
    let number = |k: &str, ok: fn(f64) -> bool, what: &str| -> Result<Option<f32>, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().filter(|x| ok(*x)).map(|x| Some(x as f32)).ok_or_else(|| ApiError::invalid(format!("{k}: {what}"))),
        }
    };
    let temperature = number("temperature", |t| (0.0..=2.0).contains(&t), "must be a number between 0 and 2")?.unwrap_or(1.0);
    let top_p = number("top_p", |p| p > 0.0 && p <= 1.0, "must be a number in (0, 1]")?;
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| ApiError::invalid("seed: expected an integer"))? as u64),
    };
    let max = match obj.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|m| *m >= 1).ok_or_else(|| ApiError::invalid("max_output_tokens: expected a positive integer"))?.min(u32::MAX as u64) as u32),
    };
    let params = SamplingParams { temperature, top_p, seed, ..SamplingParams::default() };
    Ok((params, max))
}

/// `metadata`: at most 16 string pairs (keys up to 64 characters, values up to 512).
fn metadata(v: Option<&Value>) -> Result<Value, ApiError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(json!({})),
        Some(Value::Object(m)) => m,
        Some(_) => return bad("metadata: expected an object of strings"),
    };
    if m.len() > MAX_METADATA {
        return bad(format!("metadata: at most {MAX_METADATA} pairs"));
    }
    for (k, v) in m {
        match v.as_str() {
            Some(s) if k.chars().count() <= MAX_METADATA_KEY && s.chars().count() <= MAX_METADATA_VALUE => {}
            _ => return bad(format!("metadata.{k}: keys are at most {MAX_METADATA_KEY} characters, values strings of at most {MAX_METADATA_VALUE}")),
        }
    }
    Ok(Value::Object(m.clone()))
}

/// The request's fields as the response object shows them.
fn echo(obj: &Map<String, Value>, g: &GenerationRequest, store: bool) -> Result<Map<String, Value>, ApiError> {
    let get = |k: &str| obj.get(k).cloned().unwrap_or(Value::Null);
    let format = obj.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()).cloned().unwrap_or(json!({"type": "text"}));
    let tools: Vec<Value> = g.tools.iter().map(|t| json!({"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": false})).collect();
    let tool_choice = match &g.tool_choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Any => json!("required"),
        ToolChoice::Tool(name) => json!({"type": "function", "name": name}),
    };
    let mut e = Map::new();
    e.insert("instructions".into(), get("instructions"));
    e.insert("max_output_tokens".into(), get("max_output_tokens"));
    e.insert("metadata".into(), metadata(obj.get("metadata"))?);
    e.insert("parallel_tool_calls".into(), json!(g.parallel_tool_calls));
    e.insert("previous_response_id".into(), get("previous_response_id"));
    e.insert("reasoning".into(), json!({"effort": null, "summary": null}));
    e.insert("store".into(), json!(store));
    e.insert("temperature".into(), json!(g.params.temperature));
    e.insert("text".into(), json!({"format": format}));
    e.insert("tool_choice".into(), tool_choice);
    e.insert("tools".into(), Value::Array(tools));
    e.insert("top_p".into(), json!(g.params.top_p.unwrap_or(1.0)));
    e.insert("top_logprobs".into(), json!(g.params.logprobs.unwrap_or(0)));
    e.insert("truncation".into(), json!("disabled"));
    e.insert("user".into(), get("user"));
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_turns_and_outputs_must_answer_calls() {
        let call = json!({"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{\"path\": \"a\"}"});
        let body = json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read a."}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "hello"}]});
        let r = parse(&body, None).unwrap();
        let g = &r.generation;
        assert_eq!(g.system.as_deref(), Some("Be brief.\n\nUse tools."));
        assert_eq!(g.turns.len(), 3);
        assert_eq!(g.turns[1].tool_calls[0].arguments, json!({"path": "a"}));
        assert_eq!(g.turns[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.input.len(), 5);
        let orphan = json!({"model": "m", "input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c9", "output": "y"}]});
        let e = parse(&orphan, None).unwrap_err();
        assert_eq!(e.to_string(), "No tool call found for function call output with call_id c9.");
    }

    #[test]
    fn a_continued_response_brings_its_conversation_but_not_its_instructions() {
        let stored = json!({"input": [{"type": "message", "role": "user", "content": "Hi"}],
            "response": {"instructions": "Old.", "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}});
        let body = json!({"model": "m", "previous_response_id": "resp_x", "input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]});
        let r = parse(&body, Some(&stored)).unwrap();
        let roles: Vec<Role> = r.generation.turns.iter().map(|t| t.role).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool]);
        assert_eq!(r.generation.turns[1].text, "Hello!");
        assert_eq!(r.generation.system, None);
        assert_eq!(r.input.len(), 4);
    }

    #[test]
    fn tools_formats_and_bad_fields() {
        let body = json!({"model": "m", "input": "x", "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "f"}, "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "max_output_tokens": 20, "store": false, "metadata": {"k": "v"}});
        let r = parse(&body, None).unwrap();
        assert_eq!(r.generation.tools.len(), 1, "only functions are offered");
        assert_eq!(r.generation.tool_choice, ToolChoice::Tool("f".into()));
        assert_eq!(r.generation.max_tokens, Some(20));
        assert!(!r.store);
        assert_eq!(r.echo["metadata"], json!({"k": "v"}));
        for (bad_body, says) in [
            (json!({"model": "m"}), "input: Field required"),
            (json!({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "g"}}), "no function named"),
            (json!({"model": "m", "input": [{"type": "input_image", "image_url": "x"}]}), "not supported"),
            (json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "not supported by this model"),
            (json!({"model": "m", "input": "x", "temperature": 3}), "temperature"),
            (json!({"model": "m", "input": "x", "metadata": {"k": 1}}), "metadata.k"),
            (json!({"model": "m", "input": "x", "background": true}), "background"),
        ] {
            let e = parse(&bad_body, None).unwrap_err();
            assert!(e.to_string().contains(says), "{bad_body}: {e}");
        }
    }
}
