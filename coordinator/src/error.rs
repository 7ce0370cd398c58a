//! API errors, and the one place where they become HTTP responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use zerolayer_worker::WorkerError;

/// An error an API client sees.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    Authentication(String),
    #[error("{0}")]
    Permission(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    RequestTooLarge(String),
    #[error("{message}")]
    RateLimited { message: String, retry_after_secs: u64 },
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Unavailable(String),
    /// A policy rule refused the request's input (400; the audit id in a header).
    #[error("the request was refused by policy rule \"{rule}\" (audit id {audit_id})")]
    PolicyRefused { rule: String, audit_id: String },
}

impl ApiError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        ApiError::InvalidRequest(msg.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_) | ApiError::PolicyRefused { .. } => StatusCode::BAD_REQUEST,
            ApiError::Authentication(_) => StatusCode::UNAUTHORIZED,
            ApiError::Permission(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::RequestTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Overloaded(_) => StatusCode::from_u16(529).unwrap(),
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The Anthropic error `type`; stable, also used as a metric label.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest(_) | ApiError::PolicyRefused { .. } => "invalid_request_error",
            ApiError::Authentication(_) => "authentication_error",
            ApiError::Permission(_) => "permission_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::RequestTooLarge(_) => "request_too_large",
            ApiError::RateLimited { .. } => "rate_limit_error",
            ApiError::Internal(_) => "api_error",
            ApiError::Overloaded(_) => "overloaded_error",
            ApiError::Unavailable(_) => "api_error",
        }
    }

    /// `{"type":"error","error":{...},"request_id":...}`.
    pub fn anthropic_body(&self, request_id: &str) -> serde_json::Value {
        json!({"type": "error", "error": {"type": self.error_type(), "message": self.to_string()}, "request_id": request_id})
    }

    /// The inner `error` object, for SSE `error` events.
    pub fn anthropic_event(&self) -> serde_json::Value {
        json!({"type": "error", "error": {"type": self.error_type(), "message": self.to_string()}})
    }

    /// OpenAI's error body.
    pub fn openai_body(&self) -> serde_json::Value {
        let t = match self {
            ApiError::InvalidRequest(_) | ApiError::PolicyRefused { .. } | ApiError::NotFound(_) | ApiError::RequestTooLarge(_) => "invalid_request_error",
            ApiError::Authentication(_) => "authentication_error",
            ApiError::Permission(_) => "permission_error",
            ApiError::RateLimited { .. } => "rate_limit_exceeded",
            ApiError::Overloaded(_) => "overloaded_error",
            ApiError::Internal(_) | ApiError::Unavailable(_) => "server_error",
        };
        json!({"error": {"message": self.to_string(), "type": t, "param": null, "code": self.error_type()}})
    }

    /// Anthropic-shaped response.
    pub fn into_anthropic(self, request_id: &str) -> Response {
        self.log();
        let mut r = (self.status(), axum::Json(self.anthropic_body(request_id))).into_response();
        self.add_headers(&mut r);
        r
    }

    /// OpenAI-shaped response.
    pub fn into_openai(self) -> Response {
        self.log();
        let mut r = (self.status(), axum::Json(self.openai_body())).into_response();
        self.add_headers(&mut r);
        r
    }

    /// One line per refused request, so an operator (or a test) can see why a client failed.
    fn log(&self) {
        let status = self.status().as_u16();
        if status >= 500 {
            tracing::warn!(target: "zerolayer_coordinator::frontend::api", status, error = %self, "request failed");
        } else {
            tracing::info!(target: "zerolayer_coordinator::frontend::api", status, error = %self, "request refused");
        }
    }

    fn add_headers(&self, r: &mut Response) {
        if let ApiError::RateLimited { retry_after_secs, .. } = self {
            r.headers_mut().insert("retry-after", (*retry_after_secs).into());
        }
        if let ApiError::PolicyRefused { audit_id, .. } = self {
            if let Ok(v) = axum::http::HeaderValue::from_str(audit_id) {
                r.headers_mut().insert("zerolayer-policy-audit-id", v);
            }
        }
    }
}

impl From<WorkerError> for ApiError {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::TooLong { needed, limit } => {
                ApiError::invalid(format!("prompt tokens + max_tokens = {needed}, which exceeds the model's limit of {limit} tokens"))
            }
            WorkerError::QueueFull(_) => ApiError::Overloaded("Overloaded: the worker's queue is full; retry later".into()),
            WorkerError::ShuttingDown => ApiError::Overloaded("Overloaded: the server is shutting down".into()),
            // Placement skips such a worker once its signals say so; until then, the next one.
            WorkerError::Unavailable(m) => ApiError::Overloaded(format!("Overloaded: the worker is unavailable ({m})")),
            WorkerError::Invalid(m) => ApiError::invalid(m),
            WorkerError::Grammar(m) => ApiError::invalid(m),
            WorkerError::Template(m) => ApiError::invalid(format!("chat template: {m}")),
            other => ApiError::Internal(other.to_string()),
        }
    }
}
