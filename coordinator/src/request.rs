//! The neutral generation request: what the Anthropic and OpenAI parsers both return, and what
//! the [`crate::coordinator::Coordinator`] runs. Also the rendering of a conversation through the
//! model's chat template, and the `max_tokens` rule against the context.
//!
//! API-specific fields stay with their parser (`api::anthropic`, `api::openai`); everything that
//! decides what the worker generates is here, once.

use zerolayer_common::SamplingParams;
use zerolayer_worker::chat::{ChatMessage, ChatTemplate};

use crate::error::ApiError;

/// `max_tokens` when a request does not set one (OpenAI's default is "as many as fit").
pub const DEFAULT_MAX_TOKENS: usize = 4096;

/// Most stop sequences per request, and the longest one (bytes), for both APIs.
pub const MAX_STOP_SEQUENCES: usize = 16;
pub const MAX_STOP_SEQUENCE_BYTES: usize = 256;

/// A role in the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One turn after combining consecutive same-role messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    pub role: Role,
    pub text: String,
}

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
}

impl GenerationRequest {
    /// Renders the conversation with a chat template. A final assistant turn is a prefill: the
    /// prompt ends with its text, so generation continues it.
    pub fn render(&self, template: &ChatTemplate) -> Result<String, ApiError> {
        let mut msgs = Vec::with_capacity(self.turns.len() + 1);
        if let Some(s) = &self.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.extend(self.turns.iter().map(|t| ChatMessage::new(t.role.as_str(), t.text.clone())));
        let prompt = if self.turns.last().is_some_and(|t| t.role == Role::Assistant) {
            template.render_for_generation(&msgs)
        } else {
            template.render(&msgs, true)
        };
        prompt.map_err(|e| ApiError::invalid(e.to_string()))
    }
}

/// The `max_tokens` a prompt of `prompt_tokens` may generate in a context of `context` tokens:
/// the request's own (refused if it does not fit), or what fits, capped at
/// [`DEFAULT_MAX_TOKENS`].
pub fn resolve_max_tokens(requested: Option<u32>, prompt_tokens: usize, context: usize) -> Result<u32, ApiError> {
    if prompt_tokens >= context {
        return Err(ApiError::invalid(format!("prompt is too long: {prompt_tokens} tokens > {} maximum", context.saturating_sub(1))));
    }
    match requested {
        Some(m) if prompt_tokens + m as usize > context => Err(ApiError::invalid(format!(
            "max_tokens: prompt ({prompt_tokens} tokens) + max_tokens ({m}) exceeds the model's context of {context} tokens"
        ))),
        Some(m) => Ok(m),
        None => Ok((context - prompt_tokens).min(DEFAULT_MAX_TOKENS) as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_against_the_context() {
        assert_eq!(resolve_max_tokens(Some(10), 90, 100).unwrap(), 10);
        assert_eq!(resolve_max_tokens(Some(11), 90, 100).unwrap_err().status(), 400);
        assert_eq!(resolve_max_tokens(None, 90, 100).unwrap(), 10);
        assert_eq!(resolve_max_tokens(None, 10, 10_000).unwrap(), DEFAULT_MAX_TOKENS as u32);
        assert_eq!(resolve_max_tokens(Some(0), 100, 100).unwrap_err().status(), 400, "a prompt filling the context is refused");
    }
}
