//! What a response holds: its output items (an assistant `message` with `output_text`, and a
//! `function_call` per call the model made), its status, usage, and the response object that
//! wraps them. Pure: the handler and the stream both build their objects here.

use serde_json::{json, Map, Value};
use zerolayer_common::{StopReason, Usage};

use crate::frontend::api::shared::new_id;
use crate::frontend::tools::{split_calls, Calls, Piece};

/// What every form of one response repeats: its id, creation time, model, and the request's
/// fields (see `request::echo`).
#[derive(Clone, Debug)]
pub struct Head {
    pub id: String,
    pub created_at: i64,
    pub model: String,
    pub echo: Map<String, Value>,
}

/// An assistant message item with one `output_text` part.
pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
        "content": [output_text(text)]})
}

/// An `output_text` content part.
pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A `function_call` item (the arguments a JSON string).
pub fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// A fresh call item for a call the model made.
pub fn new_call(name: &str, arguments: &Value) -> Value {
    call_item(&new_id("fc_"), &new_id("call_"), name, &arguments.to_string(), "completed")
}

/// The output items of a finished generation: its text as one message (when there is any),
/// then its calls, in the order the model wrote them. `logprobs` (the entries of every output
/// token, when asked for) go on the message's text when it is the only item: tokens that
/// became a call have no text part to go on.
pub fn items(calls: &Calls, text: &str, logprobs: Vec<Value>) -> Vec<Value> {
    let (pieces, _) = split_calls(calls, text);
    let mut out = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => texts.push(t),
            Piece::Call { name, arguments } => {
                if !texts.is_empty() {
                    out.push(message_item(&new_id("msg_"), &texts.join("\n\n"), "completed"));
                    texts.clear();
                }
                out.push(new_call(&name, &arguments));
            }
        }
    }
    if !texts.is_empty() || out.is_empty() {
        out.push(message_item(&new_id("msg_"), &texts.join("\n\n"), "completed"));
    }
    if let [only] = out.as_mut_slice() {
        if only["type"] == "message" {
            only["content"][0]["logprobs"] = Value::Array(logprobs);
        }
    }
    out
}

/// The response's status and `incomplete_details` for how the generation ended.
pub fn status(reason: &StopReason) -> (&'static str, Value) {
    match reason {
        StopReason::MaxTokens => ("incomplete", json!({"reason": "max_output_tokens"})),
        StopReason::Refused { .. } => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens(),
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_cached},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens() + u.output_tokens,
    })
}

impl Head {
    /// The response object: `status` (`in_progress`, `completed`, `incomplete`, `failed`),
    /// its output items, and usage once known.
    pub fn object(&self, status: &str, incomplete: Value, output: Vec<Value>, usage: Option<&Usage>) -> Value {
        let mut o = Map::new();
        o.insert("id".into(), json!(self.id));
        o.insert("object".into(), json!("response"));
        o.insert("created_at".into(), json!(self.created_at));
        o.insert("status".into(), json!(status));
        o.insert("background".into(), json!(false));
        o.insert("error".into(), Value::Null);
        o.insert("incomplete_details".into(), incomplete);
        o.insert("model".into(), json!(self.model));
        o.insert("output".into(), Value::Array(output));
        o.insert("usage".into(), usage.map_or(Value::Null, usage_json));
        o.extend(self.echo.clone());
        Value::Object(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::tools::Tool;

    #[test]
    fn text_and_calls_become_items_in_order() {
        let calls = Calls { tools: vec![Tool { name: "f".into(), description: None, parameters: json!({"type": "object"}), deferred: false }], bare: true };
        let lp = vec![json!({"token": "Let", "logprob": -0.5})];
        let out = items(&calls, "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>", lp.clone());
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["content"][0]["text"], "Let me look.");
        assert_eq!(out[1]["type"], "function_call");
        assert_eq!(out[1]["arguments"], "{\"x\":1}");
        assert!(out[1]["call_id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(out[0]["content"][0]["logprobs"], json!([]), "a call's tokens are not the message's");
        let plain = items(&Calls::default(), "Hi", lp.clone());
        assert_eq!(plain[0]["content"][0]["text"], "Hi");
        assert_eq!(plain[0]["content"][0]["logprobs"], json!(lp));
        assert_eq!(status(&StopReason::MaxTokens).0, "incomplete");
    }
}
