//! The HTTP API (axum): the router and its middleware. One folder per API, each holding its
//! request parsing and validation next to its responses and SSE: [`anthropic`] (Messages),
//! [`openai`] (Chat Completions, Completions, Responses); plus [`models`], [`admin`] (health, readiness, metrics and
//! the admin endpoints) and [`shared`] (what the handlers share).
//!
//! Every response carries `request-id`; every error is in the API's own shape (mapped in one
//! place, `crate::error`); streams end with an SSE `error` event if anything fails after the 200.

pub mod admin;
pub mod audit;
pub mod anthropic;
pub mod models;
pub mod openai;
pub mod shared;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Router};
use axum::http::HeaderValue;
use tracing::Instrument;

use crate::error::ApiError;
use shared::{finish, new_id, AppState, RequestId};

pub fn router(state: AppState) -> Router {
    let limit = state.config.server.max_body_bytes;
    let api = Router::new()
        .route("/v1/messages", post(anthropic::response::messages))
        .route("/v1/messages/count_tokens", post(anthropic::response::count_tokens))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::get))
        .route("/v1/chat/completions", post(openai::response::chat_completions))
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/responses", post(openai::responses::create))
        .route("/v1/responses/{id}", get(openai::responses::get).delete(openai::responses::delete))
        .route_layer(middleware::from_fn_with_state(state.clone(), api_guard));
    let admin = Router::new()
        .route("/admin/status", get(admin::status))
        .route("/admin/cluster", get(admin::cluster))
        .route("/admin/nodes/{node}/{action}", get(admin::drain).post(admin::drain))
        .route("/admin/policy/audit", get(audit::since))
        .route("/admin/policy/audit/{id}", get(audit::record))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin_guard));
    Router::new()
        .merge(api)
        .merge(admin)
        .route("/health", get(admin::health))
        .route("/ready", get(admin::ready))
        .route("/metrics", get(admin::prometheus))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), request_id_layer))
        .with_state(state)
}

/// Gives each request its id, runs it inside a `request` span (`request_id`, `node`: every
/// log line it causes carries them), and logs one access line when the answer starts. Probes
/// and scrapes (`/health`, `/ready`, `/metrics`) log theirs at debug.
async fn request_id_layer(State(c): State<AppState>, mut req: Request, next: Next) -> Response {
    let id = new_id("req_");
    req.extensions_mut().insert(RequestId(id.clone()));
    let span = tracing::info_span!("request", request_id = %id, node = %c.node_id);
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let started = std::time::Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    let (status, ms) = (resp.status().as_u16(), started.elapsed().as_millis() as u64);
    span.in_scope(|| match path.as_str() {
        "/health" | "/ready" | "/metrics" => tracing::debug!(%method, %path, status, ms, "served"),
        _ => tracing::info!(%method, %path, status, ms, "served"),
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("request-id", v);
    }
    resp
}

/// Whether errors take OpenAI's shape (its endpoints) rather than Anthropic's.
fn is_openai(req: &Request) -> bool {
    let path = req.uri().path();
    path.starts_with("/v1/chat/") || path == "/v1/completions" || path.starts_with("/v1/responses")
}

/// Authenticates API calls; adds the key's rate-limit headers to every answer. (Each handler
/// admits its request against the key's limits: `Frontend::admit`.)
async fn api_guard(State(c): State<AppState>, mut req: Request, next: Next) -> Response {
    let rid = req.extensions().get::<RequestId>().map(|r| r.0.clone()).unwrap_or_default();
    let openai = is_openai(&req);
    let shape = |e: ApiError| if openai { e.into_openai() } else { e.into_anthropic(&rid) };
    let caller = match c.guard.authorize_api(req.headers()) {
        Ok(caller) => caller,
        Err(e) => return finish(&c, "auth", shape(e), None),
    };
    req.extensions_mut().insert(caller.clone());
    let mut resp = next.run(req).await;
    c.guard.add_headers(&caller, resp.headers_mut());
    resp
}

async fn admin_guard(State(c): State<AppState>, req: Request, next: Next) -> Response {
    let rid = req.extensions().get::<RequestId>().map(|r| r.0.clone()).unwrap_or_default();
    match c.guard.authorize_admin(req.headers()) {
        Ok(_) => next.run(req).await,
        Err(e) => finish(&c, "admin", e.into_anthropic(&rid), None),
    }
}

async fn not_found(Extension(rid): Extension<RequestId>, req: Request) -> Response {
    ApiError::NotFound(format!("{} {} does not exist", req.method(), req.uri().path())).into_anthropic(&rid.0)
}
