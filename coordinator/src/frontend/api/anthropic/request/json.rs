//! The Messages request's error vocabulary: a refusal in the API's shape, and how a JSON value
//! is named in one.

use serde_json::Value;

use crate::error::ApiError;

/// A 400 `invalid_request_error` with `msg`.
pub(super) fn bad<T>(msg: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(msg))
}

/// A JSON value's type, as the official API names it in errors.
pub(super) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A value named for an error about a number: the number itself, or its type.
pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::Number(n) => format!("number {n}"),
        other => type_name(other).to_string(),
    }
}
