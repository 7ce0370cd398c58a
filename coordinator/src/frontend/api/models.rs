//! `/v1/models`: one list shape that both the Anthropic and the OpenAI SDKs parse.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::shared::{AppState, RequestId};
use crate::clock::rfc3339;
use crate::frontend::pipeline::ModelInfo;
use crate::error::ApiError;

fn model_json(m: &ModelInfo) -> Value {
    json!({
        "id": m.id, "type": "model", "display_name": m.display_name,
        "created_at": rfc3339(m.created_unix),
        "object": "model", "created": m.created_unix, "owned_by": "zerolayer",
        // vLLM's field: the most tokens (prompt and output) one request may hold.
        "max_model_len": m.context_length,
    })
}

/// Every model of the cluster, the default first.
pub async fn list(State(c): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = c.models.iter().map(|m| model_json(&m.info)).collect();
    let (first, last) = (&c.models[0].info.id, &c.models[c.models.len() - 1].info.id);
    Json(json!({"data": data, "has_more": false, "first_id": first, "last_id": last, "object": "list"}))
}

pub async fn get(State(c): State<AppState>, Extension(rid): Extension<RequestId>, Path(id): Path<String>) -> Response {
    match c.served(&id) {
        Some(m) => Json(model_json(&m.info)).into_response(),
        None => ApiError::NotFound(format!("model: {id}")).into_anthropic(&rid.0),
    }
}
