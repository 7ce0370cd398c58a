//! Tool use, whichever API it came from: the functions a request offers, the calls a model
//! makes, and finding those calls in the text it writes.
//!
//! Models taught the Hermes format (Qwen2.5 among them) write a call as
//! `<tool_call>\n{"name": "…", "arguments": {…}}\n</tool_call>`: their chat templates say so in
//! the system turn they build from `tools`, and render earlier calls the same way.
//! [`CallParser`] splits generated text into plain text and calls as it arrives, so a stream
//! sends text at once and each call when it is complete. A call that does not parse, or names a
//! function the request did not offer, stays text: the client sees what the model wrote.
//!
//! Small models often write the call's JSON without the tags (Qwen2.5-Coder-0.5B does, and
//! llama.cpp gives the same tokens): a reply that is nothing but
//! `{"name": <an offered function>, "arguments": {…}}` is a call too, and so is one in a
//! fenced code block (as llama.cpp's Hermes parser accepts both). A reply that starts with `{`
//! or a backtick is therefore held back until it ends.
//!
//! Pure: no I/O. The API layers turn [`Piece`]s into content blocks or `tool_calls`.

use serde_json::{json, Value};

/// Most tools one request may offer.
pub const MAX_TOOLS: usize = 128;

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema for the arguments.
    pub parameters: Value,
    /// Anthropic's `defer_loading`: kept out of the prompt until a tool search finds it. We have
    /// no tool search, so the model never sees it (a call to it is still a call).
    pub deferred: bool,
}

impl Tool {
    /// The Hugging Face shape chat templates read from `tools`.
    pub fn to_template(&self) -> Value {
        let mut f = json!({"name": self.name});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        f["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": f})
    }
}

/// A call: one the model made, or one in the conversation's history.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

impl ToolCall {
    /// The Hugging Face shape chat templates read from a message's `tool_calls`.
    pub fn to_template(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// Whether the model may, or must, call the offered tools.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No calls: the tools are not shown to the model.
    None,
    /// A call to one of the tools is forced (Anthropic `any`, OpenAI `required`).
    Any,
    /// A call to this tool is forced.
    Tool(String),
}

/// Checks a function name: `^[a-zA-Z0-9_-]{1,64}$`, as both APIs require.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A stretch of generated text: plain text, or a complete call.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    Call { name: String, arguments: Value },
}

/// The text that opens and closes a call in the Hermes format (what [`CallParser`] finds and
/// what `constrain` writes grammars for).
pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";
/// A call longer than this is not a call (the text is passed on as it is).
const MAX_CALL_BYTES: usize = 256 << 10;

/// Finds calls in generated text, incrementally.
#[derive(Debug)]
pub struct CallParser {
    /// The offered functions' names.
    names: Vec<String>,
    /// Text not yet passed on: a possible start of [`OPEN`], or a call's body so far.
    buf: String,
    in_call: bool,
    /// Before the first visible character: undecided; then whether the reply may be a bare
    /// call (it starts with `{`) and is being held back.
    bare: Option<bool>,
    /// Calls found so far.
    pub calls: usize,
}

impl CallParser {
    pub fn new(tools: &[Tool]) -> Self {
        CallParser { names: tools.iter().map(|t| t.name.clone()).collect(), buf: String::new(), in_call: false, bare: None, calls: 0 }
    }

    /// A parser that only takes tagged calls: a reply that is JSON stays text (the reply's text
    /// is held to an output format, and its JSON is the answer).
    pub fn tagged_only(mut self) -> Self {
        self.bare = Some(false);
        self
    }

    /// Takes the next generated text; returns what is now known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if self.bare.is_none() {
            match self.buf.trim_start().chars().next() {
                None => return out,
                Some(c) => self.bare = Some(c == '{' || c == '`'),
            }
        }
        if self.bare == Some(true) {
            if self.buf.len() <= MAX_CALL_BYTES {
                return out;
            }
            self.bare = Some(false);
        }
        loop {
            if self.in_call {
                match self.buf.find(CLOSE) {
                    Some(i) => {
                        let body: String = self.buf.drain(..i + CLOSE.len()).collect();
                        self.in_call = false;
                        out.push(self.call(&body[..i]));
                    }
                    None if self.buf.len() > MAX_CALL_BYTES => {
                        self.in_call = false;
                        out.push(Piece::Text(format!("{OPEN}{}", std::mem::take(&mut self.buf))));
                    }
                    None => break,
                }
            } else {
                match self.buf.find(OPEN) {
                    Some(i) => {
                        let before: String = self.buf.drain(..i + OPEN.len()).collect();
                        push_text(&mut out, &before[..i]);
                        self.in_call = true;
                    }
                    None => {
                        // Hold back a tail that may be the start of OPEN.
                        let keep = (1..OPEN.len().min(self.buf.len() + 1))
                            .rev()
                            .find(|&n| self.buf.is_char_boundary(self.buf.len() - n) && OPEN.starts_with(&self.buf[self.buf.len() - n..]))
                            .unwrap_or(0);
                        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                        push_text(&mut out, &text);
                        break;
                    }
                }
            }
        }
        out
    }

    /// Generation ended: what is left. A call the model did not close (it stopped at its end
    /// token right after the JSON) still counts if its body parses.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.bare == Some(true) {
            self.bare = Some(false);
            if let Some((name, arguments)) = self.parse_call(unfence(&self.buf)) {
                self.buf.clear();
                self.calls += 1;
                return vec![Piece::Call { name, arguments }];
            }
            out = self.push("");
        }
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            match self.call(&rest) {
                Piece::Text(_) => push_text(&mut out, &format!("{OPEN}{rest}")),
                call => out.push(call),
            }
        } else {
            push_text(&mut out, &rest);
        }
        out
    }

    /// A call's body (the JSON between the tags), or the whole call as text if it is not a
    /// call to an offered function.
    fn call(&mut self, body: &str) -> Piece {
        match self.parse_call(body) {
            Some((name, arguments)) => {
                self.calls += 1;
                Piece::Call { name, arguments }
            }
            None => Piece::Text(format!("{OPEN}{body}{CLOSE}")),
        }
    }

    /// `{"name": <an offered function>, "arguments": {…}}` (the arguments may be a JSON string).
    fn parse_call(&self, body: &str) -> Option<(String, Value)> {
        let v = serde_json::from_str::<Value>(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        if !self.names.contains(&name) {
            return None;
        }
        let arguments = match v.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::Object(_)) => v["arguments"].clone(),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
            Some(_) => return None,
        };
        Some((name, arguments))
    }
}

/// The inside of a fenced code block (```` ```json ````), or the text itself.
fn unfence(text: &str) -> &str {
    let t = text.trim();
    match t.strip_prefix("```").and_then(|r| r.strip_suffix("```")) {
        Some(inner) => inner.split_once('\n').map_or(inner, |(lang, body)| if lang.trim().chars().all(|c| c.is_ascii_alphanumeric()) { body } else { inner }),
        None => t,
    }
}

fn push_text(out: &mut Vec<Piece>, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Piece::Text(t)) => t.push_str(text),
        _ => out.push(Piece::Text(text.to_string())),
    }
}

/// The calls a reply may hold: the tools offered, and whether a reply that is nothing but a
/// call's JSON counts as a call (not when the reply's text is held to an output format).
#[derive(Clone, Debug, Default)]
pub struct Calls {
    pub tools: Vec<Tool>,
    pub bare: bool,
}

impl Calls {
    /// The parser for a reply, or None when no tools were offered.
    pub fn parser(&self) -> Option<CallParser> {
        if self.tools.is_empty() {
            return None;
        }
        let p = CallParser::new(&self.tools);
        Some(if self.bare { p } else { p.tagged_only() })
    }
}

/// All of a finished generation's pieces, with the whitespace around calls dropped (the model
/// puts newlines between calls).
pub fn split_calls(calls: &Calls, text: &str) -> (Vec<Piece>, usize) {
    let Some(mut p) = calls.parser() else { return (vec![Piece::Text(text.to_string())], 0) };
    let mut pieces = Vec::new();
    for piece in p.push(text).into_iter().chain(p.finish()) {
        match piece {
            Piece::Text(t) => push_text(&mut pieces, &t),
            call => pieces.push(call),
        }
    }
    let pieces = pieces
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Text(t) if t.trim().is_empty() => None,
            Piece::Text(t) => Some(Piece::Text(t.trim().to_string())),
            call => Some(call),
        })
        .collect();
    (pieces, p.calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        ["get_weather", "read_file"].iter().map(|n| Tool { name: n.to_string(), description: None, parameters: json!({"type": "object"}), deferred: false }).collect()
    }

    fn calls() -> Calls {
        Calls { tools: tools(), bare: true }
    }

    #[test]
    fn json_held_to_an_output_format_is_an_answer_not_a_call() {
        let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
        let answer = Calls { tools: tools(), bare: false };
        assert_eq!(split_calls(&answer, bare), (vec![Piece::Text(bare.into())], 0));
        let tagged = format!("<tool_call>\n{bare}\n</tool_call>");
        assert_eq!(split_calls(&answer, &tagged).1, 1);
        assert_eq!(split_calls(&Calls::default(), bare), (vec![Piece::Text(bare.into())], 0));
    }

    #[test]
    fn calls_are_found_whole_or_split_anywhere() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": \"{\\\"path\\\": \\\"a.txt\\\"}\"}\n</tool_call>";
        let (pieces, calls) = split_calls(&calls(), text);
        assert_eq!(calls, 2);
        assert_eq!(
            pieces,
            vec![
                Piece::Text("Let me check.".into()),
                Piece::Call { name: "get_weather".into(), arguments: json!({"city": "Paris"}) },
                Piece::Call { name: "read_file".into(), arguments: json!({"path": "a.txt"}) },
            ]
        );
        // Fed one character at a time (and in chunks that split the tags), the same pieces.
        for chunk in [1usize, 2, 3, 5, 7, 11] {
            let mut p = CallParser::new(&tools());
            let mut got = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for c in chars.chunks(chunk) {
                got.extend(p.push(&c.iter().collect::<String>()));
            }
            got.extend(p.finish());
            let calls: Vec<&Piece> = got.iter().filter(|p| matches!(p, Piece::Call { .. })).collect();
            assert_eq!(calls.len(), 2, "chunk {chunk}");
            let text: String = got.iter().filter_map(|p| if let Piece::Text(t) = p { Some(t.as_str()) } else { None }).collect();
            assert_eq!(text.trim(), "Let me check.", "chunk {chunk}");
        }
    }

    #[test]
    fn what_is_not_a_call_stays_text() {
        for text in [
            "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>", // not offered
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>", // bad JSON
            "a < b and <tool_ and <tool_call",
        ] {
            let (pieces, calls) = split_calls(&calls(), text);
            assert_eq!(calls, 0, "{text}");
            assert_eq!(pieces, vec![Piece::Text(text.trim().to_string())], "{text}");
        }
        // An unclosed call that parses counts (the model stopped at its end token).
        let (pieces, calls) = split_calls(&calls(), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}");
        assert_eq!(calls, 1);
        assert_eq!(pieces, vec![Piece::Call { name: "get_weather".into(), arguments: json!({"city": "Oslo"}) }]);
    }

    /// A reply that is only the call's JSON, without the tags, is a call; JSON that is not a
    /// call stays text, streamed or not.
    #[test]
    fn bare_calls_count_and_other_json_stays_text() {
        let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
        assert_eq!(split_calls(&calls(), bare), (vec![Piece::Call { name: "get_weather".into(), arguments: json!({"city": "Paris"}) }], 1));
        let mut p = CallParser::new(&tools());
        assert!(bare.chars().all(|c| p.push(&c.to_string()).is_empty()), "held back until the end");
        assert_eq!(p.finish(), vec![Piece::Call { name: "get_weather".into(), arguments: json!({"city": "Paris"}) }]);
        let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        assert_eq!(split_calls(&calls(), fenced).1, 1);
        for text in ["{\"a\": 1}", "{\"name\": \"rm_rf\", \"arguments\": {}}", "{ not json", "Plain {\"name\": \"get_weather\"}", "```\nls -la\n```"] {
            assert_eq!(split_calls(&calls(), text), (vec![Piece::Text(text.into())], 0), "{text}");
        }
    }

    #[test]
    fn names_follow_the_rule() {
        assert!(valid_name("get_weather-2"));
        assert!(!valid_name("") && !valid_name("a b") && !valid_name(&"x".repeat(65)) && !valid_name("é"));
    }
}
