//! What the chunks of one OpenAI stream share ([`Chunks`]: the id, object, model and how the
//! stream ends), and the usage object of every OpenAI answer.

use axum::response::sse::Event;
use serde_json::{json, Value};
use zerolayer_common::{StopReason, Usage};

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens(), "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens() + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.prompt_tokens_cached},
    })
}

/// What every chunk of one OpenAI stream repeats, and how the stream ends.
#[derive(Clone)]
pub struct Chunks {
    pub id: String,
    /// `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    pub created: i64,
    pub model: String,
    /// `stream_options.include_usage`: a last chunk carries the usage.
    pub include_usage: bool,
}

impl Chunks {
    /// One chunk with these `choices`.
    pub fn event(&self, choices: Value) -> Event {
        Event::default().data(json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}).to_string())
    }

    /// The chunk with `finish_reason` (and, when an output rule stopped the answer, `policy`:
    /// the rule and its audit id).
    pub fn finish_event(&self, choices: Value, reason: &StopReason) -> Event {
        let mut body = json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(p) = crate::frontend::api::shared::policy_json(reason) {
            body["policy"] = p;
        }
        Event::default().data(body.to_string())
    }

    /// The stream's end: the usage chunk when it was asked for (with where the request's time
    /// went, `usage.server_timing`), then `[DONE]`.
    pub fn end(&self, usage: &Usage, timing: Value, out: &mut Vec<Event>) {
        if self.include_usage {
            let mut usage = usage_json(usage);
            usage["server_timing"] = timing;
            let body = json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [], "usage": usage});
            out.push(Event::default().data(body.to_string()));
        }
        out.push(Event::default().data("[DONE]"));
    }
}
