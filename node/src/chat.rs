//! Chat templates: the model's own Jinja template (`tokenizer.chat_template` in GGUF metadata or
//! `tokenizer_config.json`), rendered with minijinja and its Python-compatibility layer; ChatML
//! when the model has none.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::{WorkerError, Result};

/// The template used when a model ships none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// One turn of a conversation.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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
        let src = source.unwrap_or(CHATML_TEMPLATE).to_string();
        env.add_template_owned("chat", src).map_err(|e| WorkerError::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// Renders `messages`. With `add_generation_prompt`, the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let t = self.env.get_template("chat").map_err(|e| WorkerError::Template(e.to_string()))?;
        t.render(context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| WorkerError::Template(e.to_string()))
    }

    /// Renders a conversation for generation. When the last message is from the assistant it
    /// is a *prefill*: the prompt ends with its text (no end-of-turn), so generation continues it.
    pub fn render_for_generation(&self, messages: &[ChatMessage]) -> Result<String> {
        match messages.last() {
            Some(last) if last.role == "assistant" => {
                let mut s = self.render(&messages[..messages.len() - 1], true)?;
                s.push_str(&last.content);
                Ok(s)
            }
            _ => self.render(messages, true),
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
    fn python_methods_work() {
        let src = "{% for m in messages %}{{ m['content'].strip() | upper }}{% endfor %}";
        let t = ChatTemplate::new(Some(src), "", "").unwrap();
        assert_eq!(t.render(&[ChatMessage::new("user", "  hi ")], false).unwrap(), "HI");
    }
}
