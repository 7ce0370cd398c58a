//! Log-probabilities on the OpenAI routes: what a request asks for, and the shapes they come back
//! in. Chat Completions: `logprobs: true` and `top_logprobs` (0–20), answered as
//! `choices[].logprobs.content: [{token, logprob, bytes, top_logprobs}]`. Completions:
//! `logprobs: k` (0–20 alternatives), answered as `{tokens, token_logprobs, top_logprobs,
//! text_offset}`. Responses: `include: ["message.output_text.logprobs"]` and `top_logprobs`,
//! answered in Chat's entry shape on each `output_text` part and text delta. The values are the
//! worker's ([`TokenLogprob`]: the log-softmax of the model's raw logits, as llama.cpp reports
//! them); a token's text is its piece in the model's vocabulary, special tokens included, or
//! `token_id:<id>` with vLLM's `return_tokens_as_token_ids`.

use std::sync::Arc;

use serde_json::{json, Map, Value};
use zerolayer_common::TokenLogprob;
use zerolayer_worker::tokenizer::Tokenizer;

use super::fields::{bad, flag};
use crate::error::ApiError;
use crate::frontend::api::shared::AppState;

/// Chat Completions' `logprobs` (a boolean) and `top_logprobs` (0 to 20, only with it): the
/// alternatives to return per token, or None.
pub fn chat(obj: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let on = flag(obj, "logprobs", false)?;
    let top = match obj.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(k) if k <= TokenLogprob::MAX_TOP as u64 => Some(k as u32),
            _ => return bad(format!("top_logprobs: expected an integer between 0 and {}", TokenLogprob::MAX_TOP)),
        },
    };
    match (on, top) {
        (false, Some(_)) => bad("top_logprobs: logprobs must be set to true if this parameter is used"),
        (false, None) => Ok(None),
        (true, top) => Ok(Some(top.unwrap_or(0))),
    }
}

/// Completions' `logprobs`: the number of alternatives (0 to 20) to return with each token's
/// log-probability, or None (absent or null).
pub fn completion(obj: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    match obj.get("logprobs") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k <= TokenLogprob::MAX_TOP as u64 => Ok(Some(k as u32)),
            _ => bad(format!("logprobs: expected an integer between 0 and {}", TokenLogprob::MAX_TOP)),
        },
    }
}

/// The Responses API's `include: ["message.output_text.logprobs"]` and `top_logprobs` (0 to
/// 20): the alternatives to return per output token, or None. `top_logprobs` alone asks for
/// them too (it names how many); `include` must be a list of strings, and its other values
/// (reasoning content, tool outputs we do not make) change nothing.
pub fn responses(obj: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let included = match obj.get("include") {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a.iter().any(|v| v == RESPONSES_INCLUDE),
        Some(_) => return bad("include: expected an array of strings"),
    };
    let top = match obj.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(k) if k <= TokenLogprob::MAX_TOP as u64 => Some(k as u32),
            _ => return bad(format!("top_logprobs: expected an integer between 0 and {}", TokenLogprob::MAX_TOP)),
        },
    };
    Ok(match (included, top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(k)) if k > 0 => Some(k),
        _ => None,
    })
}

/// The `include` value that asks the Responses API for output logprobs.
pub const RESPONSES_INCLUDE: &str = "message.output_text.logprobs";

/// vLLM's `return_tokens_as_token_ids`: name tokens `token_id:<id>` (what evaluation harnesses
/// use to tell apart tokens that decode alike).
pub fn as_token_ids(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    flag(obj, "return_tokens_as_token_ids", false)
}

/// How a response names the tokens of its logprobs: by their text in the serving model's
/// vocabulary, or by id.
#[derive(Clone)]
pub struct Namer {
    pub tokenizer: Arc<Tokenizer>,
    pub ids: bool,
}

impl Namer {
    /// A token's name: its vocabulary piece (special tokens by name; lossy where a piece is
    /// part of a UTF-8 character), or `token_id:<id>`.
    fn piece(&self, token: u32) -> String {
        if self.ids {
            return format!("token_id:{token}");
        }
        self.text(token)
    }

    /// A token's text, for the offsets of Completions' logprobs.
    fn text(&self, token: u32) -> String {
        self.tokenizer.decode_with_special(&[token]).unwrap_or_default()
    }

    /// The namer of a response from `model` (the tokenizer of the model that served it), when
    /// the request asked for logprobs.
    pub fn of(c: &AppState, model: &str, asked: bool, ids: bool) -> Option<Namer> {
        if !asked {
            return None;
        }
        Some(Namer { tokenizer: c.served(model)?.tokenizer.clone(), ids })
    }
}

/// Chat's `{token, logprob, bytes}` for one token.
fn chat_entry(namer: &Namer, token: u32, logprob: f32) -> Value {
    let text = namer.piece(token);
    json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
}

/// Chat's `logprobs.content` entries for `tokens`.
pub fn chat_content(namer: &Namer, tokens: &[TokenLogprob]) -> Vec<Value> {
    tokens
        .iter()
        .map(|t| {
            let mut e = chat_entry(namer, t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|&(id, lp)| chat_entry(namer, id, lp)).collect();
            e
        })
        .collect()
}

/// A choice's `logprobs` in Chat's shape (`{"content": [...], "refusal": null}`).
pub fn chat_choice(namer: &Namer, tokens: &[TokenLogprob]) -> Value {
    json!({"content": chat_content(namer, tokens), "refusal": null})
}

/// Completions' logprobs object for `tokens`, whose text begins at character `offset` of the
/// choice's text: `tokens`, `token_logprobs`, `top_logprobs` (a map from piece to logprob per
/// token; pieces that decode alike keep the likelier) and `text_offset`. An echoed prompt's
/// `first` token comes before them, with null for its logprob and its alternatives.
pub fn completion_choice(namer: &Namer, first: Option<u32>, tokens: &[TokenLogprob], mut offset: usize) -> Value {
    let (mut pieces, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    if let Some(id) = first {
        offsets.push(offset);
        offset += namer.text(id).chars().count();
        pieces.push(namer.piece(id));
        lps.push(Value::Null);
        tops.push(Value::Null);
    }
    for t in tokens {
        offsets.push(offset);
        offset += namer.text(t.token).chars().count();
        pieces.push(namer.piece(t.token));
        lps.push(json!(t.logprob));
        let mut top = Map::new();
        for &(id, lp) in &t.top {
            top.entry(namer.piece(id)).or_insert(json!(lp));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// Appends Completions logprobs object `more` to `to` (an echoed prompt's, then the output's).
pub fn append(to: &mut Value, more: Value) {
    let (Some(to), Value::Object(more)) = (to.as_object_mut(), more) else { return };
    for (k, v) in more {
        if let (Some(Value::Array(a)), Value::Array(b)) = (to.get_mut(&k), v) {
            a.extend(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_name_what_they_want_and_bad_values_are_refused() {
        let o = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(chat(&o(json!({}))).unwrap(), None);
        assert_eq!(chat(&o(json!({"logprobs": true}))).unwrap(), Some(0));
        assert_eq!(chat(&o(json!({"logprobs": true, "top_logprobs": 5}))).unwrap(), Some(5));
        assert_eq!(chat(&o(json!({"logprobs": false}))).unwrap(), None);
        for bad in [json!({"top_logprobs": 2}), json!({"logprobs": true, "top_logprobs": 21}), json!({"logprobs": 3}), json!({"logprobs": true, "top_logprobs": -1})] {
            assert!(chat(&o(bad.clone())).is_err(), "{bad}");
        }
        assert_eq!(completion(&o(json!({"logprobs": 3}))).unwrap(), Some(3));
        assert_eq!(completion(&o(json!({"logprobs": null}))).unwrap(), None);
        assert!(completion(&o(json!({"logprobs": 21}))).is_err());
        assert!(completion(&o(json!({"logprobs": true}))).is_err());
        assert_eq!(responses(&o(json!({"include": ["reasoning.encrypted_content"]}))).unwrap(), None);
        assert_eq!(responses(&o(json!({"include": [RESPONSES_INCLUDE]}))).unwrap(), Some(0));
        assert_eq!(responses(&o(json!({"include": [RESPONSES_INCLUDE], "top_logprobs": 4}))).unwrap(), Some(4));
        assert_eq!(responses(&o(json!({"top_logprobs": 2}))).unwrap(), Some(2));
        assert_eq!(responses(&o(json!({"top_logprobs": 0}))).unwrap(), None);
        for bad in [json!({"include": "x"}), json!({"include": [1]}), json!({"top_logprobs": 21})] {
            assert!(responses(&o(bad.clone())).is_err(), "{bad}");
        }
    }
}
