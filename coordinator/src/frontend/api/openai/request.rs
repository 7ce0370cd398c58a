//! The OpenAI Chat Completions request: parsing and validation into a [`GenerationRequest`] (lenient about fields that
//! only tune things we do not do, strict about the ones we would get wrong).

use serde_json::Value;

use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::frontend::request::{push_turn, GenerationRequest, Role, Turn, MAX_STOP_SEQUENCES, MAX_STOP_SEQUENCE_BYTES};
use crate::frontend::tools::{valid_name, Tool, ToolCall, ToolChoice, MAX_TOOLS};

/// A validated Chat Completions request: the neutral generation request, and what only this
/// API has.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub generation: GenerationRequest,
    /// `stream_options.include_usage`: a last chunk carries the usage.
    pub include_usage: bool,
    /// `return_tokens_as_token_ids`: logprobs name tokens by id.
    pub token_ids: bool,
    /// `n`: how many choices.
    pub n: u32,
}

pub(super) use super::fields::{bad, flag};
use super::fields::{known_only, unsupported, EXTENSIONS};

/// Chat Completions' fields, as OpenAI documents them. Those that only tune what we do not do
/// (`metadata`, `store`, `user`, `service_tier`, `prompt_cache_key`, `prompt_cache_retention`,
/// `safety_identifier`, `reasoning_effort`, `verbosity`, `prediction`) are accepted and have no
/// effect; `audio`, `web_search_options` and the deprecated `functions`/`function_call` are
/// refused by name, and `modalities` may only be `["text"]`.
const CHAT_FIELDS: &[&str] = &[
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
];

/// The Chat Completions fields we know but cannot honour.
fn refused_chat_fields(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    unsupported(obj, "audio", "audio output is not supported")?;
    unsupported(obj, "web_search_options", "web search is not supported")?;
    unsupported(obj, "functions", "the deprecated functions API is not supported; send tools")?;
    unsupported(obj, "function_call", "the deprecated functions API is not supported; send tool_choice")?;
    match obj.get("modalities") {
        None | Some(Value::Null) => Ok(()),
        Some(m) if *m == serde_json::json!(["text"]) => Ok(()),
        Some(_) => bad("modalities: only [\"text\"] is supported"),
    }
}

fn content_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) => content_parts(v, at, |ty| (ty == "text").then_some("text")),
    }
}

/// Content parts (`[{type, <field>: "…"}]`) joined by blank lines: `field_of` names the text
/// field of each part type this route reads (None: a 400 naming the type).
pub(super) fn content_parts(v: &Value, at: &str, field_of: fn(&str) -> Option<&'static str>) -> Result<String, ApiError> {
    let Some(parts) = v.as_array() else { return bad(format!("{at}.content: expected a string or an array of content parts")) };
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let field = match p.get("type").and_then(Value::as_str) {
            Some(ty) => field_of(ty).ok_or_else(|| ApiError::invalid(format!("{at}.content[{j}]: content part type \"{ty}\" is not supported by this model")))?,
            None => return bad(format!("{at}.content[{j}].type: Field required")),
        };
        match p.get(field) {
            Some(Value::String(t)) => out.push(t.clone()),
            _ => return bad(format!("{at}.content[{j}].{field}: expected a string")),
        }
    }
    Ok(out.join("\n\n"))
}

/// `tools: [{type: "function", function: {name, description?, parameters?, strict?}}]`.
fn parse_tools(v: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let arr = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(_) => return bad("tools: expected an array"),
    };
    if arr.len() > MAX_TOOLS {
        return bad(format!("tools: at most {MAX_TOOLS} tools, got {}", arr.len()));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return bad(format!("{at}.type: only \"function\" tools are supported"));
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else { return bad(format!("{at}.function: expected an object")) };
        let tool = function_tool(f, &format!("{at}.function"), &tools)?;
        tools.push(tool);
    }
    Ok(tools)
}

/// A function tool's `name`, `description` and `parameters` (at `at`), its name not among
/// `tools` already.
pub(super) fn function_tool(f: &serde_json::Map<String, Value>, at: &str, tools: &[Tool]) -> Result<Tool, ApiError> {
    let name = match f.get("name").and_then(Value::as_str) {
        Some(n) if valid_name(n) => n.to_string(),
        _ => return bad(format!("{at}.name: must match ^[a-zA-Z0-9_-]{{1,64}}$")),
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return bad(format!("{at}.description: expected a string")),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return bad(format!("{at}.parameters: expected a JSON schema object")),
    };
    if tools.iter().any(|t| t.name == name) {
        return bad(format!("{at}.name: tool names must be unique, {name:?} is repeated"));
    }
    Ok(Tool { name, description, parameters, deferred: false })
}

/// An assistant message's `tool_calls: [{id, type: "function", function: {name, arguments}}]`
/// (the arguments a JSON string).
fn assistant_calls(v: Option<&Value>, at: &str) -> Result<Vec<ToolCall>, ApiError> {
    let arr = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(a)) => a,
        Some(_) => return bad(format!("{at}.tool_calls: expected an array")),
    };
    arr.iter()
        .enumerate()
        .map(|(j, c)| {
            let cat = format!("{at}.tool_calls[{j}]");
            let id = c.get("id").and_then(Value::as_str).filter(|s| !s.is_empty()).ok_or_else(|| ApiError::invalid(format!("{cat}.id: Field required")))?;
            let f = c.get("function").ok_or_else(|| ApiError::invalid(format!("{cat}.function: Field required")))?;
            let name = f.get("name").and_then(Value::as_str).filter(|n| valid_name(n)).ok_or_else(|| ApiError::invalid(format!("{cat}.function.name: invalid")))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| ApiError::invalid(format!("{cat}.function.arguments: expected a JSON object in a string")))?,
                Some(o @ Value::Object(_)) => o.clone(),
                _ => return bad(format!("{cat}.function.arguments: Field required")),
            };
            Ok(ToolCall { id: id.to_string(), name: name.to_string(), arguments })
        })
        .collect()
}

/// `messages`: the leading system (and developer) messages, joined, and the conversation.
fn parse_messages(v: Option<&Value>) -> Result<(Option<String>, Vec<Turn>), ApiError> {
    let Some(msgs) = v.and_then(Value::as_array) else { return bad("messages: expected a non-empty array") };
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
            "tool" => {
                let Some(id) = m.get("tool_call_id").and_then(Value::as_str) else { return bad(format!("{at}.tool_call_id: Field required")) };
                push_turn(&mut turns, Turn::tool_result(id, text));
                continue;
            }
            "function" => return bad(format!("{at}.role: \"function\" messages are deprecated; use \"tool\"")),
            other => match message_role(other, &at, &turns)? {
                Some(role) => role,
                None => {
                    system.push(text);
                    continue;
                }
            },
        };
        let mut turn = Turn::new(role, text);
        if role == Role::Assistant {
            turn.tool_calls = assistant_calls(m.get("tool_calls"), &at)?;
        }
        push_turn(&mut turns, turn);
    }
    if turns.is_empty() {
        return bad("messages: at least one user message is required");
    }
    let system = if system.is_empty() { None } else { Some(system.join("\n\n")) };
    Ok((system, turns))
}

/// The turn a message of `role` (`system`, `developer`, `user`, `assistant`) becomes after
/// `turns`; None: the system prompt (system and developer messages before the conversation;
/// later ones stay where they are, as system turns).
pub(super) fn message_role(role: &str, at: &str, turns: &[Turn]) -> Result<Option<Role>, ApiError> {
    Ok(match role {
        "system" | "developer" if turns.is_empty() => None,
        "system" | "developer" => Some(Role::System),
        "user" => Some(Role::User),
        "assistant" => Some(Role::Assistant),
        other => return bad(format!("{at}.role: unknown role \"{other}\"")),
    })
}

/// `stop`: a string or a list of at most [`MAX_STOP_SEQUENCES`] strings.
fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let stop = match v {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid("stop: expected strings"))).collect::<Result<_, _>>()?,
        Some(_) => return bad("stop: expected a string or an array of strings"),
    };
    if stop.len() > MAX_STOP_SEQUENCES || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_SEQUENCE_BYTES) {
        return bad(format!("stop: at most {MAX_STOP_SEQUENCES} non-empty sequences of at most {MAX_STOP_SEQUENCE_BYTES} bytes"));
    }
    Ok(stop)
}

/// `tool_choice`: `auto`, `none`, `required`, or a named function that is in `tools`.
fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    Ok(match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => {
            if tools.is_empty() {
                return bad("tool_choice: \"required\" needs tools");
            }
            ToolChoice::Any
        }
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str)) {
            (Some("function"), Some(name)) if tools.iter().any(|t| t.name == name) => ToolChoice::Tool(name.to_string()),
            (Some("function"), Some(name)) => return bad(format!("tool_choice: no function named {name:?} is in tools")),
            _ => return bad("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": …}}"),
        },
        Some(_) => return bad("tool_choice: expected \"auto\", \"none\", \"required\" or a named function"),
    })
}

/// The `model` field.
pub(super) fn model_name(obj: &serde_json::Map<String, Value>) -> Result<String, ApiError> {
    match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(_) => bad("model: expected a non-empty string"),
        None => bad("model: Field required"),
    }
}

/// What Chat Completions and Completions share: sampling, stopping, the length and streaming.
pub(super) struct Sampling {
    pub max_tokens: Option<u32>,
    pub params: SamplingParams,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carries the usage.
    pub include_usage: bool,
    /// `n`: how many choices.
    pub n: u32,
}

/// The fields of [`Sampling`].
pub(super) fn sampling(obj: &serde_json::Map<String, Value>) -> Result<Sampling, ApiError> {
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
    let stop = parse_stop(obj.get("stop"))?;
    let stream = flag(obj, "stream", false)?;
    let ignore_eos = flag(obj, "ignore_eos", false)?;
    let include_usage = obj.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let n = super::choices::parse_n(obj)?;
    // `ignore_eos` is vLLM's extension: keep generating past end tokens (benchmarks).
    let mut params = SamplingParams { temperature, top_p, seed, max_tokens: 0, stop_sequences: stop, ignore_eos, ..SamplingParams::default() };
    adjustments(obj, &mut params)?;
    Ok(Sampling { max_tokens, params, stream, include_usage, n })
}

/// Most `logit_bias` entries in one request.
pub const MAX_LOGIT_BIAS: usize = SamplingParams::MAX_LOGIT_BIAS;

/// The sampling fields beyond OpenAI's core, as vLLM names them: `top_k` (0 or -1: off),
/// `min_p` in [0, 1], `presence_penalty` and `frequency_penalty` in [-2, 2],
/// `repetition_penalty` in (0, 2], and `logit_bias` (token id → bias in [-100, 100]).
fn adjustments(obj: &serde_json::Map<String, Value>, p: &mut SamplingParams) -> Result<(), ApiError> {
    let number = |k: &str, ok: fn(f64) -> bool, rule: &str| -> Result<Option<f32>, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().filter(|x| ok(*x)).map(|x| Some(x as f32)).ok_or_else(|| ApiError::invalid(format!("{k}: {rule}"))),
        }
    };
    p.top_k = match obj.get("top_k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(-1 | 0) => None,
            Some(k) if k > 0 => Some(k.min(u32::MAX as i64) as u32),
            _ => return bad("top_k: expected a positive integer (or 0 or -1 for none)"),
        },
    };
    p.min_p = number("min_p", |x| (0.0..=1.0).contains(&x), "must be a number between 0 and 1")?;
    p.presence_penalty = number("presence_penalty", |x| (-2.0..=2.0).contains(&x), "must be a number between -2 and 2")?.unwrap_or(0.0);
    p.frequency_penalty = number("frequency_penalty", |x| (-2.0..=2.0).contains(&x), "must be a number between -2 and 2")?.unwrap_or(0.0);
    p.repetition_penalty = number("repetition_penalty", |x| x > 0.0 && x <= 2.0, "must be a number in (0, 2]")?;
    p.logit_bias = logit_bias(obj.get("logit_bias"))?;
    Ok(())
}

/// `logit_bias`: `{"<token id>": bias}`, at most [`MAX_LOGIT_BIAS`] entries (the ids are checked
/// against the model's vocabulary where it runs).
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(_) => return bad("logit_bias: expected an object mapping token ids to numbers"),
    };
    if m.len() > MAX_LOGIT_BIAS {
        return bad(format!("logit_bias: at most {MAX_LOGIT_BIAS} tokens"));
    }
    let mut out: Vec<(u32, f32)> = m
        .iter()
        .map(|(k, b)| match (k.parse::<u32>(), b.as_f64()) {
            (Ok(t), Some(b)) if (-100.0..=100.0).contains(&b) => Ok((t, b as f32)),
            _ => bad(format!("logit_bias.{k}: keys are token ids, values numbers between -100 and 100")),
        })
        .collect::<Result<_, _>>()?;
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// Parses and validates a Chat Completions request body.
pub fn parse(body: &Value) -> Result<ChatRequest, ApiError> {
    let Some(obj) = body.as_object() else { return bad("request body must be a JSON object") };
    known_only(obj, &[CHAT_FIELDS, EXTENSIONS])?;
    refused_chat_fields(obj)?;
    let model = model_name(obj)?;
    let (system, turns) = parse_messages(obj.get("messages"))?;
    let Sampling { max_tokens, mut params, stream, include_usage, n } = sampling(obj)?;
    params.logprobs = super::logprobs::chat(obj)?;
    let tools = parse_tools(obj.get("tools"))?;
    let tool_choice = parse_tool_choice(obj.get("tool_choice"), &tools)?;
    let parallel_tool_calls = flag(obj, "parallel_tool_calls", true)?;
    let format = match obj.get("response_format") {
        None | Some(Value::Null) => None,
        Some(rf) => response_format(rf)?,
    };
    let cache_salt = crate::frontend::request::parse_cache_salt(obj.get("cache_salt"))?;
    Ok(ChatRequest {
        generation: GenerationRequest { model, system, turns, max_tokens, params, stream, tools, tool_choice, parallel_tool_calls, format, breakpoints: vec![], raw: None, cache_salt, temperature_set: obj.get("temperature").is_some_and(|v| !v.is_null()) },
        include_usage,
        token_ids: super::logprobs::as_token_ids(obj)?,
        n,
    })
}

/// `response_format`: `text` (free), `json_object` (any JSON object), or `json_schema`
/// (`{"json_schema": {"name": …, "schema": {…}, "strict": …}}`); the schema to enforce.
fn response_format(rf: &Value) -> Result<Option<Value>, ApiError> {
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(serde_json::json!({"type": "object"}))),
        Some("json_schema") => match rf.get("json_schema").and_then(|j| j.get("schema")) {
            Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
            Some(_) => bad("response_format.json_schema.schema: expected a JSON schema (an object)"),
            None => bad("response_format.json_schema.schema: required"),
        },
        _ => bad("response_format.type: expected \"text\", \"json_object\" or \"json_schema\""),
    }
}
