//! The grammar a request's output must match, from its `tool_choice`, its tools and its output
//! format: the coordinator writes it once, in llguidance's Lark dialect (each JSON schema
//! embedded as `%json {…}`), and the worker constrains every sampled token to it.
//!
//! - A forced call (`any`, `tool`; OpenAI's `required` or a named function) is exactly one
//!   call (a small model, once it may, tends to repeat calls until `max_tokens`) in the model's own syntax, `<tool_call>\n{"name": "…", "arguments": …}\n</tool_call>`
//!   (the Hermes format Qwen's template teaches), its arguments valid against the tool's
//!   `input_schema`.
//! - `auto`: the model writes what it likes; once it opens a call (`<tool_call>`), the call is
//!   constrained as a forced one is. A reply that opens no call is free text.
//! - An output format (`output_config.format`, `response_format`): the text is JSON valid
//!   against the schema; with tools on `auto`, a reply is that JSON or calls.
//!
//! Whitespace inside JSON is fixed to the separators the template itself writes (`", "`,
//! `": "`), so a small model cannot wander off into endless indentation. Tool schemas are
//! compiled leniently (keywords the engine cannot enforce are ignored: the official API accepts
//! any schema for a tool); an output format is compiled strictly, and one that uses what the
//! engine cannot enforce is the client's 400.
//!
//! Pure: builds text. The worker's tokenizer compiles it (the coordinator checks it compiles
//! before the request is placed).

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::frontend::tools::{Tool, ToolChoice, CLOSE as CALL_CLOSE, OPEN as CALL_OPEN};

/// Most calls one reply may make when parallel calls are allowed.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// What shapes a request's output.
#[derive(Clone, Copy, Debug)]
pub struct Shape<'a> {
    /// The tools the model is shown.
    pub tools: &'a [Tool],
    pub choice: &'a ToolChoice,
    /// A JSON schema the reply's text must match.
    pub format: Option<&'a Value>,
    /// Whether a reply on `auto` may make more than one call.
    pub parallel: bool,
}

/// The grammar for `shape`, or None when the output is free.
pub fn grammar(shape: Shape<'_>) -> Result<Option<String>, ApiError> {
    let callable: Vec<&Tool> = match shape.choice {
        ToolChoice::None => vec![],
        ToolChoice::Auto | ToolChoice::Any => shape.tools.iter().filter(|t| !t.deferred).collect(),
        ToolChoice::Tool(name) => {
            let t = shape.tools.iter().find(|t| &t.name == name);
            vec![t.ok_or_else(|| ApiError::invalid(format!("tool_choice: no tool named {name:?} is offered")))?]
        }
    };
    let forced = matches!(shape.choice, ToolChoice::Any | ToolChoice::Tool(_));
    if forced && callable.is_empty() {
        return Err(ApiError::invalid("tool_choice: a call is forced, but no tools are offered"));
    }
    let mut g = String::new();
    if !callable.is_empty() {
        let alts: Vec<String> = (0..callable.len()).map(|i| format!("fn_{i}")).collect();
        g.push_str(&format!("call: {} ({}) {}\n", lit("\n"), alts.join(" | "), lit(&format!("\n{CALL_CLOSE}"))));
        for (i, t) in callable.iter().enumerate() {
            let head = format!("{{\"name\": {}, \"arguments\": ", Value::String(t.name.clone()));
            g.push_str(&format!("fn_{i}: {} %json {} {}\n", lit(&head), schema(&t.parameters, true)?, lit("}")));
        }
        if shape.parallel && !forced {
            g.push_str(&format!("more: {} call\n", lit(&format!("\n{CALL_OPEN}"))));
            g.push_str(&format!("calls: call more~0..{}\n", MAX_PARALLEL_CALLS - 1));
        } else {
            g.push_str("calls: call\n");
        }
    }
    // A forced call leaves no room for an answer: the format is still checked, not used.
    let answer = match shape.format {
        Some(f) => Some(format!("answer: %json {}\n", schema(f, false)?)).filter(|_| !forced),
        None => None,
    };
    let start = match (forced, callable.is_empty(), &answer) {
        (true, _, _) => format!("start: {} calls\n", lit(CALL_OPEN)),
        (false, true, None) => return Ok(None),
        (false, true, Some(_)) => "start: answer\n".to_string(),
        (false, false, Some(_)) => format!("start: answer | {} calls\n", lit(CALL_OPEN)),
        (false, false, None) => {
            // Free text that never opens a call, or text up to the first opening and then calls.
            let open = regex_literal(CALL_OPEN);
            g.push_str(&format!("TEXT: /(.|\\n)*/ & ~/(.|\\n)*{open}(.|\\n)*/\n"));
            g.push_str(&format!("lead[lazy]: /(.|\\n)*{open}/\n"));
            "start: TEXT | lead calls\n".to_string()
        }
    };
    Ok(Some(format!("{start}{}{g}", answer.unwrap_or_default())))
}

/// A Lark string literal (JSON string syntax).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `s` with the regex metacharacters it holds escaped.
fn regex_literal(s: &str) -> String {
    s.chars().map(|c| if "\\.+*?()|[]{}^$/".contains(c) { format!("\\{c}") } else { c.to_string() }).collect()
}

/// A schema for `%json`, with the JSON layout fixed and the strictness chosen.
fn schema(s: &Value, lenient: bool) -> Result<String, ApiError> {
    let mut s = match s {
        Value::Object(o) => o.clone(),
        Value::Bool(true) => serde_json::Map::new(),
        _ => return Err(ApiError::invalid("a JSON schema must be an object")),
    };
    s.insert(
        "x-guidance".into(),
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": lenient}),
    );
    Ok(Value::Object(s).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool { name: name.into(), description: None, parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}), deferred: false }
    }

    #[test]
    fn free_output_needs_no_grammar() {
        let shape = Shape { tools: &[], choice: &ToolChoice::Auto, format: None, parallel: true };
        assert_eq!(grammar(shape).unwrap(), None);
        let tools = [tool("a")];
        let none = Shape { tools: &tools, choice: &ToolChoice::None, format: None, parallel: true };
        assert_eq!(grammar(none).unwrap(), None);
    }

    #[test]
    fn a_forced_tool_is_the_only_alternative() {
        let tools = [tool("get_weather"), tool("get_time")];
        let g = grammar(Shape { tools: &tools, choice: &ToolChoice::Tool("get_time".into()), format: None, parallel: false }).unwrap().unwrap();
        assert!(g.starts_with("start: \"<tool_call>\" calls\n"), "{g}");
        assert!(g.contains(r#""{\"name\": \"get_time\", \"arguments\": ""#), "{g}");
        assert!(!g.contains("get_weather"), "{g}");
        assert!(g.contains("calls: call\n"), "{g}");
        let unknown = grammar(Shape { tools: &tools, choice: &ToolChoice::Tool("nope".into()), format: None, parallel: false });
        assert!(unknown.is_err());
        let nothing = grammar(Shape { tools: &[], choice: &ToolChoice::Any, format: None, parallel: false });
        assert!(nothing.is_err());
    }

    #[test]
    fn auto_leaves_text_free_until_a_call_opens() {
        let tools = [tool("a")];
        let g = grammar(Shape { tools: &tools, choice: &ToolChoice::Auto, format: None, parallel: true }).unwrap().unwrap();
        assert!(g.starts_with("start: TEXT | lead calls\n"), "{g}");
        assert!(g.contains("lead[lazy]: /(.|\\n)*<tool_call>/"), "{g}");
        assert!(g.contains("calls: call more~0..7\n"), "{g}");
    }

    #[test]
    fn a_format_is_strict_and_tools_are_lenient() {
        let tools = [tool("a")];
        let f = json!({"type": "object", "properties": {"x": {"type": "integer"}}});
        let g = grammar(Shape { tools: &tools, choice: &ToolChoice::Auto, format: Some(&f), parallel: false }).unwrap().unwrap();
        assert!(g.starts_with("start: answer | \"<tool_call>\" calls\n"), "{g}");
        assert!(g.contains("\"lenient\":false"), "{g}");
        assert!(g.contains("\"lenient\":true"), "{g}");
        assert!(grammar(Shape { tools: &[], choice: &ToolChoice::Auto, format: Some(&json!([1])), parallel: false }).is_err());
        let forced = grammar(Shape { tools: &tools, choice: &ToolChoice::Any, format: Some(&f), parallel: false }).unwrap().unwrap();
        assert!(!forced.contains("answer"), "a forced call has no answer rule: {forced}");
    }

    /// What `auto` admits, read byte by byte through the grammar engine itself: free text that
    /// never opens a call, or text and then whole, valid calls; never `<tool_call>` left in free
    /// text, a call to an unknown tool, or arguments against the schema.
    #[test]
    fn auto_admits_free_text_or_valid_calls_and_nothing_between() {
        use zerolayer_worker::grammar::accepts_text;
        let tools = [tool("get_weather")];
        let g = grammar(Shape { tools: &tools, choice: &ToolChoice::Auto, format: None, parallel: true }).unwrap().unwrap();
        let call = |name: &str, args: &str| format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>");
        let good = call("get_weather", r#"{"city": "Paris"}"#);
        for (text, ok, why) in [
            ("It is sunny in Paris.".to_string(), true, "free text"),
            (format!("Let me check.\n{good}"), true, "text, then a call"),
            (format!("{good}\n{good}"), true, "parallel calls"),
            ("I will call <tool_call> later, maybe.".to_string(), false, "a call opened in free text"),
            (format!("Checking.\n{}", call("get_time", "{}")), false, "an unknown tool"),
            (format!("Checking.\n{}", call("get_weather", r#"{"city": 3}"#)), false, "arguments against the schema"),
            (format!("{good} and then more text"), false, "text after the calls"),
        ] {
            assert_eq!(accepts_text(&g, &text).unwrap(), ok, "{why}: {text:?}");
        }
        let forced = grammar(Shape { tools: &tools, choice: &ToolChoice::Any, format: None, parallel: false }).unwrap().unwrap();
        assert!(accepts_text(&forced, &good).unwrap());
        assert!(!accepts_text(&forced, "No call.").unwrap(), "a forced call admits no free text");
        assert!(!accepts_text(&forced, &format!("{good}\n{good}")).unwrap(), "a forced call is exactly one call");
    }
}
