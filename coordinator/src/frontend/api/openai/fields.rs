//! What every OpenAI route's parsing shares: the 400 for a bad field, and optional booleans.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// A 400 `invalid_request_error` saying `m`.
pub(super) fn bad<T>(m: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(m))
}

/// An optional boolean field (`default` when absent or null).
pub(super) fn flag(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => bad(format!("{key}: expected a boolean")),
    }
}
