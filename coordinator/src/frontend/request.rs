//! The neutral generation request: what the Anthropic and OpenAI parsers both return, and what
//! the [`crate::frontend::service::Frontend`] runs (rendered through the chat template by
//! `prompt`), and the `max_tokens` rule against the context (clamped to the room left).
//!
//! API-specific fields stay with their parser (`api::anthropic`, `api::openai`); everything that
//! decides what the worker generates is here, once.

use zerolayer_common::SamplingParams;

use crate::error::ApiError;
use crate::frontend::tools::{Tool, ToolCall, ToolChoice};

/// `max_tokens` when a request does not set one (OpenAI's default is "as many as fit").
pub const DEFAULT_MAX_TOKENS: usize = 4096;

/// Most stop sequences per request, and the longest one (bytes), for both APIs.
pub const MAX_STOP_SEQUENCES: usize = zerolayer_common::SamplingParams::MAX_STOP_SEQUENCES;
pub const MAX_STOP_SEQUENCE_BYTES: usize = zerolayer_common::SamplingParams::MAX_STOP_SEQUENCE_BYTES;

/// A role in the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
    /// A system message in the middle of the conversation (Anthropic's mid-conversation system
    /// messages, OpenAI's system messages after the first turn): rendered as a system turn.
    System,
    /// A function's result, answering the call `Turn::tool_call_id`.
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::System => "system",
            Role::Tool => "tool",
        }
    }
}

/// One turn after combining consecutive same-role messages (tool results are never combined).
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    pub role: Role,
    pub text: String,
    /// An assistant turn's calls.
    pub tool_calls: Vec<ToolCall>,
    /// A tool turn: the call it answers.
    pub tool_call_id: Option<String>,
}

impl Turn {
    pub fn new(role: Role, text: impl Into<String>) -> Self {
        Turn { role, text: text.into(), tool_calls: Vec::new(), tool_call_id: None }
    }

    /// A function's result.
    pub fn tool_result(call_id: impl Into<String>, text: impl Into<String>) -> Self {
        Turn { role: Role::Tool, text: text.into(), tool_calls: Vec::new(), tool_call_id: Some(call_id.into()) }
    }
}

/// Appends `turn`, combining it with the last one when both are the same role (tool results
/// excepted), as the official APIs do. Returns the index of the turn that now holds its text,
/// and where in that turn's text it begins (bytes).
pub fn push_turn(turns: &mut Vec<Turn>, turn: Turn) -> (usize, usize) {
    let n = turns.len();
    match turns.last_mut() {
        Some(last) if last.role == turn.role && turn.role != Role::Tool => {
            let mut begins = last.text.len();
            if !turn.text.is_empty() {
                if !last.text.is_empty() {
                    last.text.push_str("\n\n");
                    begins += 2;
                }
                last.text.push_str(&turn.text);
            }
            last.tool_calls.extend(turn.tool_calls);
            (n - 1, begins)
        }
        _ => {
            turns.push(turn);
            (n, 0)
        }
    }
}

/// How long a `cache_control` breakpoint asks for its prefix to stay cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheTtl {
    FiveMinutes,
    OneHour,
}

impl CacheTtl {
    pub fn secs(self) -> u32 {
        match self {
            CacheTtl::FiveMinutes => 300,
            CacheTtl::OneHour => 3600,
        }
    }
}

/// A `cache_control` breakpoint: the end of the system text (`turn: None`) or of a turn's text,
/// as a byte offset into that text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Breakpoint {
    pub turn: Option<usize>,
    pub end: usize,
    pub ttl: CacheTtl,
}

/// Most `cache_control` breakpoints in one request (the official API's limit).
pub const MAX_BREAKPOINTS: usize = 4;

/// A validated request to generate, whichever API it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    /// The model name the client sent (an id or an alias).
    pub model: String,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
    /// None: as many as fit in the context (capped at [`DEFAULT_MAX_TOKENS`]).
    pub max_tokens: Option<u32>,
    /// Sampling and stopping. `params.max_tokens` is set by [`resolve_max_tokens`] once the
    /// prompt's length is known.
    pub params: SamplingParams,
    pub stream: bool,
    /// The functions the model may call, and whether it may.
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    /// Whether one reply may make several calls (Anthropic's `disable_parallel_tool_use`
    /// inverted, OpenAI's `parallel_tool_calls`).
    pub parallel_tool_calls: bool,
    /// A JSON schema the reply's text must match (Anthropic `output_config.format`, OpenAI
    /// `response_format`), enforced by constrained decoding.
    pub format: Option<serde_json::Value>,
    /// Where the client put `cache_control` breakpoints (Anthropic only): usage reports the
    /// prompt up to the last of them that was not read from the cache as written to it.
    pub breakpoints: Vec<Breakpoint>,
    /// A raw prompt (`/v1/completions`), tokenized as the client wrote it, with no chat
    /// template: how base models are used. `system` and `turns` are then empty.
    pub raw: Option<RawPrompt>,
    /// vLLM's `cache_salt`: the request sees only cached prefixes computed under the same salt
    /// (within its key's cache scope).
    pub cache_salt: Option<String>,
    /// Whether the request set `temperature`; if not, the model's `default_temperature`
    /// applies.
    pub temperature_set: bool,
}

/// `cache_salt` (vLLM's field): absent or null, or a string of 1 to 256 characters.
pub fn parse_cache_salt(v: Option<&serde_json::Value>) -> Result<Option<String>, crate::error::ApiError> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) if !s.is_empty() && s.chars().count() <= 256 => Ok(Some(s.clone())),
        Some(_) => Err(crate::error::ApiError::invalid("cache_salt: expected a string of 1 to 256 characters")),
    }
}

/// A `/v1/completions` prompt: text (tokenized with the model's BOS where its vocabulary asks
/// for one, special-token strings read as their tokens, as llama.cpp's server does), or token
/// ids as they are.
#[derive(Clone, Debug, PartialEq)]
pub enum RawPrompt {
    Text(String),
    Ids(Vec<u32>),
}

impl GenerationRequest {
    /// A plain chat: `system` and `turns` for `model`, default sampling, no tools, no limit of
    /// its own, not streamed.
    pub fn chat(model: &str, system: Option<&str>, turns: Vec<Turn>) -> Self {
        GenerationRequest {
            model: model.into(),
            system: system.map(Into::into),
            turns,
            max_tokens: None,
            params: SamplingParams::default(),
            stream: false,
            tools: vec![],
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            format: None,
            breakpoints: vec![],
            raw: None,
            cache_salt: None,
            temperature_set: false,
        }
    }

    /// The tools the model is shown (none when `tool_choice` is `none`).
    pub fn offered_tools(&self) -> &[Tool] {
        match self.tool_choice {
            ToolChoice::None => &[],
            ToolChoice::Auto | ToolChoice::Any | ToolChoice::Tool(_) => &self.tools,
        }
    }

    /// The calls a reply may hold (see [`crate::frontend::tools::Calls`]).
    pub fn calls(&self) -> crate::frontend::tools::Calls {
        crate::frontend::tools::Calls { tools: self.offered_tools().to_vec(), bare: self.format.is_none() }
    }

    /// The grammar constrained decoding holds the reply to, if any (see [`crate::frontend::constrain`]).
    pub fn grammar(&self) -> Result<Option<String>, ApiError> {
        crate::frontend::constrain::grammar(crate::frontend::constrain::Shape {
            tools: self.offered_tools(),
            choice: &self.tool_choice,
            format: self.format.as_ref(),
            parallel: self.parallel_tool_calls,
        })
    }

    /// Bytes of conversation text (system and turns): what any rendering of the prompt holds at
    /// least, for the length check that runs before the template.
    pub fn text_bytes(&self) -> usize {
        let raw = match &self.raw {
            Some(RawPrompt::Text(t)) => t.len(),
            _ => 0,
        };
        raw + self.system.as_ref().map_or(0, String::len) + self.turns.iter().map(|t| t.text.len()).sum::<usize>()
    }
}

/// The `max_tokens` a prompt of `prompt_tokens` may generate in a context of `context` tokens:
/// the request's own, clamped to the room the context leaves (agents such as Claude Code always
/// send 32000), or what fits, capped at [`DEFAULT_MAX_TOKENS`]. Only a prompt that leaves no
/// room at all is refused.
pub fn resolve_max_tokens(requested: Option<u32>, prompt_tokens: usize, context: usize) -> Result<u32, ApiError> {
    if prompt_tokens >= context {
        return Err(ApiError::invalid(format!("prompt is too long: {prompt_tokens} tokens > {} maximum", context.saturating_sub(1))));
    }
    let room = context - prompt_tokens;
    Ok(match requested {
        Some(m) => (m as usize).min(room) as u32,
        None => room.min(DEFAULT_MAX_TOKENS) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_against_the_context() {
        assert_eq!(resolve_max_tokens(Some(10), 90, 100).unwrap(), 10);
        assert_eq!(resolve_max_tokens(Some(11), 90, 100).unwrap(), 10, "clamped to the room left");
        assert_eq!(resolve_max_tokens(Some(32_000), 20_000, 32_768).unwrap(), 12_768);
        assert_eq!(resolve_max_tokens(None, 90, 100).unwrap(), 10);
        assert_eq!(resolve_max_tokens(None, 10, 10_000).unwrap(), DEFAULT_MAX_TOKENS as u32);
        assert_eq!(resolve_max_tokens(Some(0), 100, 100).unwrap_err().status(), 400, "a prompt filling the context is refused");
    }
}
