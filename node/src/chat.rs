//! Chat templates: the model's own Jinja template (`tokenizer.chat_template` in GGUF metadata or
//! `tokenizer_config.json`), rendered with minijinja and its Python-compatibility layer; ChatML
//! when the model has none.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::{WorkerError, Result};

/// The template used when a model ships none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// One turn of a conversation, in the shape Hugging Face chat templates read: an assistant
/// turn may carry `tool_calls` (`[{"id", "type": "function", "function": {"name",
/// "arguments": {...}}}]`), and a `tool` turn answers one by `tool_call_id`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None }
    }
}

/// Python's `json.dumps(v, ensure_ascii=False)`, as Hugging Face's templates get it from their
/// `tojson` (minijinja's own escapes `<`, `>`, `&` and `'` for HTML, which the models never saw).
fn py_json(v: &minijinja::Value, out: &mut String) {
    use minijinja::value::ValueKind;
    use std::fmt::Write;
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (i64::try_from(v.clone()), f64::try_from(v.clone())) {
            (Ok(i), _) if v.is_integer() => {
                let _ = write!(out, "{i}");
            }
            (_, Ok(f)) if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 => {
                let _ = write!(out, "{f:.1}");
            }
            (_, Ok(f)) => {
                let _ = write!(out, "{f}");
            }
            _ => out.push_str("null"),
        },
        ValueKind::String => {
            out.push('"');
            for c in v.as_str().unwrap_or_default().chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if (c as u32) < 0x20 => {
                        let _ = write!(out, "\\u{:04x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(&minijinja::Value::from(k.to_string()), out);
                out.push_str(": ");
                py_json(&v.get_item(&k).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => py_json(&minijinja::Value::from(v.to_string()), out),
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    supports_tools: bool,
    /// Whether the model brought its own template (a base model has none; ChatML stands in
    /// only where a caller renders anyway).
    own: bool,
}

fn src_mentions_tools(source: Option<&str>) -> bool {
    source.is_some_and(|s| s.contains("tools") && s.contains("tool_call"))
}

impl ChatTemplate {
    pub fn new(source: Option<&str>, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        // Hugging Face renders chat templates with trim_blocks and lstrip_blocks.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| WorkerError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.add_filter("tojson", |v: minijinja::Value| -> String {
            let mut out = String::new();
            py_json(&v, &mut out);
            out
        });
        let src = source.unwrap_or(CHATML_TEMPLATE).to_string();
        env.add_template_owned("chat", src).map_err(|e| WorkerError::Template(e.to_string()))?;
        let supports_tools = src_mentions_tools(source);
        Ok(ChatTemplate { env, bos_token: bos_token.into(), eos_token: eos_token.into(), supports_tools, own: source.is_some() })
    }

    /// Whether the model's file holds a chat template (an instruct model). Chat requests to a
    /// model without one are refused: it was never taught turns.
    pub fn is_own(&self) -> bool {
        self.own
    }

    /// Whether the template renders a `tools` list (the model was taught to call functions).
    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// Renders `messages`. With `add_generation_prompt`, the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// As [`ChatTemplate::render`], with the functions the model may call (`tools`: Hugging
    /// Face's `[{"type": "function", "function": {"name", "description", "parameters"}}]`).
    pub fn render_with_tools(&self, messages: &[ChatMessage], tools: Option<&[serde_json::Value]>, add_generation_prompt: bool) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| WorkerError::Template(e.to_string()))?;
        t.render(context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| WorkerError::Template(e.to_string()))
    }

    /// Renders a conversation for generation. When the last message is from the assistant it
    /// is a *prefill*: the prompt ends with its text (no end-of-turn), so generation continues it.
    pub fn render_for_generation(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_for_generation_with_tools(messages, None)
    }

    /// As [`ChatTemplate::render_for_generation`], with `tools` (see [`ChatTemplate::render_with_tools`]).
    pub fn render_for_generation_with_tools(&self, messages: &[ChatMessage], tools: Option<&[serde_json::Value]>) -> Result<String> {
        match messages.last() {
            Some(last) if last.role == "assistant" && last.tool_calls.is_none() => {
                let mut s = self.render_with_tools(&messages[..messages.len() - 1], tools, true)?;
                s.push_str(&last.content);
                Ok(s)
            }
            _ => self.render_with_tools(messages, tools, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback_and_prefill() {
        let t = ChatTemplate::new(None, "", "<|im_end|>").unwrap();
        let msgs = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let mut with_prefill = msgs.clone();
        with_prefill.push(ChatMessage::new("assistant", "Hello"));
        assert!(t.render_for_generation(&with_prefill).unwrap().ends_with("<|im_start|>assistant\nHello"));
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(Some("{{ messages[0].tool_calls[0] | tojson }}"), "", "").unwrap();
        let mut m = ChatMessage::new("assistant", "");
        m.tool_calls = Some(vec![serde_json::json!({"name": "f<x>", "arguments": {"n": 3, "x": 1.0, "s": "a\"b\né", "l": [true, null]}})]);
        // Keys in order, Python's separators, nothing HTML-escaped, non-ASCII kept.
        let out = t.render(&[m], false).unwrap();
        assert!(out.starts_with("{\"arguments\": {") || out.starts_with("{\"name\": "), "{out}");
        assert!(out.contains("\"name\": \"f<x>\""), "{out}");
        assert!(out.contains("\"s\": \"a\\\"b\\né\""), "{out}");
        assert!(out.contains("\"n\": 3") && out.contains("\"x\": 1.0") && out.contains("\"l\": [true, null]"), "{out}");
    }

    #[test]
    fn python_methods_work() {
        let src = "{% for m in messages %}{{ m['content'].strip() | upper }}{% endfor %}";
        let t = ChatTemplate::new(Some(src), "", "").unwrap();
        assert_eq!(t.render(&[ChatMessage::new("user", "  hi ")], false).unwrap(), "HI");
    }
}
