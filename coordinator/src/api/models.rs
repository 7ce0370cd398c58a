//! `/v1/models`: one list shape that both the Anthropic and the OpenAI SDKs parse.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::shared::{AppState, RequestId};
use crate::clock::rfc3339;
use crate::coordinator::Coordinator;
use crate::error::ApiError;

fn model_json(c: &Coordinator) -> Value {
    json!({
        "id": c.model.id, "type": "model", "display_name": c.model.display_name,
        "created_at": rfc3339(c.model.created_unix),
        "object": "model", "created": c.model.created_unix, "owned_by": "zerolayer",
    })
}

pub async fn list(State(c): State<AppState>) -> Json<Value> {
    Json(json!({"data": [model_json(&c)], "has_more": false, "first_id": c.model.id, "last_id": c.model.id, "object": "list"}))
}

pub async fn get(State(c): State<AppState>, Extension(rid): Extension<RequestId>, Path(id): Path<String>) -> Response {
    if c.model.matches(&id) {
        Json(model_json(&c)).into_response()
    } else {
        ApiError::NotFound(format!("model: {id}")).into_anthropic(&rid.0)
    }
}
