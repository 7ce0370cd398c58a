//! What every OpenAI route's parsing shares: the 400 for a bad field, optional booleans, and
//! the rule for fields a route does not know (refused, as OpenAI refuses them).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A 400 `invalid_request_error` saying `m`.
pub(crate) fn bad<T>(m: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(m))
}

/// An optional boolean field (`default` when absent or null).
pub(crate) fn flag(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => bad(format!("{key}: expected a boolean")),
    }
}

/// The fields every OpenAI route takes beyond OpenAI's own: the sampling extensions as vLLM
/// names them, `seed` (which Responses lacks), and vLLM's `cache_salt`.
pub(crate) const EXTENSIONS: &[&str] = &["top_k", "min_p", "repetition_penalty", "ignore_eos", "cache_salt", "return_tokens_as_token_ids", "seed"];

/// Refuses the first field of `obj` in none of the `known` lists, as OpenAI does (and in its
/// words): a misspelt or unsupported field is a 400 that names it, never silently dropped.
pub(crate) fn known_only(obj: &Map<String, Value>, known: &[&[&str]]) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.iter().any(|list| list.contains(&k.as_str()))) {
        Some(k) => bad(format!("Unrecognized request argument supplied: {k}")),
        None => Ok(()),
    }
}

/// Refuses `key` when it is set (not absent or null): a field OpenAI has that we cannot honour.
pub(crate) fn unsupported(obj: &Map<String, Value>, key: &str, why: &str) -> Result<(), ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(_) => bad(format!("{key}: {why}")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Every OpenAI route refuses a field it does not know, naming it; the Anthropic route
    /// refuses one too (in its own words).
    #[test]
    fn an_unknown_field_is_a_400_that_names_it() {
        let chat = |extra: Value| {
            let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            super::super::request::parse(&b).map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(chat(json!({"temprature": 0})).unwrap_err(), "Unrecognized request argument supplied: temprature");
        chat(json!({"user": "u", "store": false, "metadata": {}, "prompt_cache_key": "k", "top_k": 5, "reasoning_effort": "low", "modalities": ["text"]})).unwrap();
        for (extra, field) in [
            (json!({"audio": {"voice": "alloy"}}), "audio"),
            (json!({"functions": []}), "functions"),
            (json!({"web_search_options": {}}), "web_search_options"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
        ] {
            assert!(chat(extra.clone()).unwrap_err().starts_with(field), "{extra}");
        }
        let completion = super::super::completions::parse(&json!({"model": "m", "prompt": "a", "echo_prompt": true})).unwrap_err().to_string();
        assert_eq!(completion, "Unrecognized request argument supplied: echo_prompt");
        let codex = json!({"model": "m", "input": "hi", "stream": true, "tool_choice": "auto", "parallel_tool_calls": true, "reasoning": {"summary": "auto"},
                           "store": false, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "client_metadata": {"thread_id": "t"}});
        super::super::responses::request::parse(&codex, None).expect("what Codex sends");
        let mut typo = codex.clone();
        typo["max_tokens"] = json!(5);
        let e = super::super::responses::request::parse(&typo, None).unwrap_err().to_string();
        assert_eq!(e, "Unrecognized request argument supplied: max_tokens");
        let mut conv = codex;
        conv["conversation"] = json!("conv_1");
        assert!(super::super::responses::request::parse(&conv, None).unwrap_err().to_string().starts_with("conversation"));
        let anthropic = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temprature": 0});
        let e = crate::frontend::api::anthropic::request::parse(&anthropic, crate::frontend::api::anthropic::request::Endpoint::Messages).unwrap_err().to_string();
        assert!(e.contains("temprature"), "{e}");
    }
}
