//! The OpenAI Responses API: `POST /v1/responses` (JSON, or the event stream of [`stream`]),
//! `GET` and `DELETE /v1/responses/{id}`. [`request`] parses a body into the neutral
//! generation request, which takes the same path as every other API's; [`output`] builds the
//! response object.
//!
//! `store: true` (the default) keeps the response, with the conversation it ended, in this
//! node's [`ResponseStore`](crate::frontend::stored::ResponseStore) for its tenant. A
//! `previous_response_id` is found on whichever node its id names (over the cluster link when
//! that is another node), and its conversation is the start of the new request's.

pub mod kept;
pub mod output;
pub mod request;
pub mod stream;

pub use kept::{serve_lookup, stored, Keep};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::logprobs::{chat_content, Namer};
use super::response::no_such_model;
use crate::auth::Caller;
use crate::clock::unix_now;
use crate::error::ApiError;
use crate::frontend::api::shared::{self, collect, finish, json_body, AppState, RequestId};
use crate::frontend::service::Serving;
use crate::frontend::stored::ResponseId;
use output::Head;

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound(format!("Response with id '{id}' not found."))
}

/// The continued response named by the body's `previous_response_id`, if any.
async fn previous(c: &AppState, body: &Value, tenant: &str) -> Result<Option<Value>, ApiError> {
    let Some(id) = request::previous_id(body)? else { return Ok(None) };
    let found = stored(c, &id, tenant, false).await?;
    let found = found.ok_or_else(|| ApiError::NotFound(format!("Previous response with id '{id}' not found.")))?;
    serde_json::from_slice(&found).map(Some).map_err(|e| ApiError::Internal(format!("stored response {id}: {e}")))
}

pub async fn create(State(c): State<AppState>, Extension(rid): Extension<RequestId>, Extension(caller): Extension<Caller>, body: Result<Bytes, BytesRejection>) -> Response {
    match respond(&c, &rid, &caller, body).await {
        Ok((resp, served_by)) => finish(&c, "responses", resp, Some(&served_by)),
        Err(e) => finish(&c, "responses", e.into_openai(), None),
    }
}

/// The response, and the worker that served it.
async fn respond(c: &AppState, rid: &RequestId, caller: &Caller, body: Result<Bytes, BytesRejection>) -> Result<(Response, Serving), ApiError> {
    let tenant = c.guard.tenant(caller).name.clone();
    let max = c.config.server.max_body_bytes;
    let body = c.prepare(move || json_body(body, max)).await??;
    let previous = previous(c, &body, &tenant).await?;
    let started = shared::admit_and_start(c, caller, &rid.0, no_such_model, move |_| {
        let r = request::parse(&body, previous.as_ref())?;
        let names = (r.generation.params.logprobs.is_some(), r.token_ids);
        let extra = (r.generation.calls(), r.echo, Keep { tenant, store: r.store, input: r.input }, names);
        Ok((r.generation, extra))
    });
    let shared::Started { acc, model, stream, extra: (offered, echo, keep, (asked, ids)) } = started.await?;
    let served_by = acc.served_by.clone();
    let namer = Namer::of(c, &model, asked, ids);
    let head = Head { id: ResponseId::new(&c.node_id).id, created_at: unix_now(), model, echo };
    if stream {
        let timing = shared::stream_timing(&acc);
        let s = stream::ResponseStream::new(c.clone(), acc, head, keep, &offered, namer);
        return Ok((shared::server_timing(shared::sse_response(s, stream::ResponseStream::step), &timing), served_by));
    }
    let shared::Collected { text, reason, usage, split, logprobs, .. } = collect(c, acc).await?;
    let (state, incomplete) = output::status(&reason);
    let logprobs = namer.map(|n| chat_content(&n, &logprobs)).unwrap_or_default();
    let mut response = head.object(state, incomplete, output::items(&offered, &text, logprobs), Some(&usage));
    if let Some(p) = shared::policy_json(&reason) {
        response["policy"] = p;
    }
    keep.keep(c, &response);
    Ok((shared::outcome_headers(Json(response).into_response(), &split, &reason), served_by))
}

/// `GET /v1/responses/{id}`: a stored response of the caller's tenant.
pub async fn get(State(c): State<AppState>, Extension(caller): Extension<Caller>, Path(id): Path<String>) -> Response {
    let tenant = c.guard.tenant(&caller).name.clone();
    let resp = match stored(&c, &id, &tenant, false).await {
        Ok(Some(body)) => match serde_json::from_slice::<Value>(&body) {
            Ok(v) => Json(v["response"].clone()).into_response(),
            Err(e) => ApiError::Internal(format!("stored response {id}: {e}")).into_openai(),
        },
        Ok(None) => not_found(&id).into_openai(),
        Err(e) => e.into_openai(),
    };
    finish(&c, "responses", resp, None)
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(State(c): State<AppState>, Extension(caller): Extension<Caller>, Path(id): Path<String>) -> Response {
    let tenant = c.guard.tenant(&caller).name.clone();
    let resp = match stored(&c, &id, &tenant, true).await {
        Ok(Some(_)) => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Ok(None) => not_found(&id).into_openai(),
        Err(e) => e.into_openai(),
    };
    finish(&c, "responses", resp, None)
}
