//! The operator's endpoints: `/admin/status`, `/admin/cluster` and
//! `/admin/nodes/{node}/{drain,undrain}` (admin key), `/health`, `/ready` (503 while draining
//! or shutting down) and `/metrics` (Prometheus text).
//!
//! Drain and undrain work through any node: a call for another node is passed on over the
//! cluster link (mutual TLS, to the node the certificate names; `cluster::admin`) with the
//! caller's key, and that node checks the key against its own admin key ([`serve_peer`]).

use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::shared::{AppState, RequestId};
use crate::frontend::service::Frontend;
use crate::error::ApiError;
use crate::metrics;

pub async fn status(State(c): State<AppState>) -> Json<Value> {
    let workers: Vec<Value> = c.worker_signals().into_iter().map(|(id, s)| json!({"id": id, "signals": s})).collect();
    // Per key (tenant): this node's totals, requests open here and cluster-wide, and what is left
    // of each limit as this node knows it (every node's charges included).
    let keys = c.guard.quota.usage();
    Json(json!({"node": c.node_id, "ready": c.is_ready(), "model": c.default_model().info.id, "models": c.models.iter().map(|m| &m.info.id).collect::<Vec<_>>(), "in_flight": c.in_flight(), "workers": workers, "keys": keys}))
}

/// The cluster as this node sees it: every node's state and every worker's signals.
pub async fn cluster(State(c): State<AppState>) -> Json<Value> {
    Json(cluster_json(&c))
}

pub fn cluster_json(c: &Frontend) -> Value {
    let view = c.cluster.view();
    let nodes = c.cluster.nodes();
    let (mut hits, mut queries, mut restored, mut imported) = (0u64, 0u64, 0u64, 0u64);
    let workers: Vec<Value> = view
        .workers
        .iter()
        .map(|w| {
            let s = &w.signals;
            hits = hits.saturating_add(s.prefix_cache_hits_total);
            queries = queries.saturating_add(s.prefix_cache_queries_total);
            restored = restored.saturating_add(s.kv_disk.restored_total.saturating_mul(s.block_size as u64));
            imported = imported.saturating_add(s.kv_blocks_imported_total.saturating_mul(s.block_size as u64));
            json!({
                "node": w.node,
                "worker": w.worker,
                "state": w.state,
                "local": w.local,
                "device": w.device,
                "model": w.model,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_blocks_total": s.kv_blocks_total,
                "kv_blocks_cached": s.kv_blocks_cached,
                "kv_blocks_pinned": s.kv_blocks_pinned,
                "indexed_blocks": w.cached.len(),
                "kv_fragmentation_ratio": s.kv_fragmentation_ratio,
                "prefix_hit_ratio": s.prefix_hit_ratio,
                "running": s.running,
                "waiting": s.waiting,
                "tokens_per_second": s.tokens_per_second,
                "draft_tokens_total": s.draft_tokens_total,
                "draft_accepted_total": s.draft_accepted_total,
                "kv_blocks_imported_total": s.kv_blocks_imported_total,
                "kv_blocks_served_total": s.kv_blocks_served_total,
                "kv_disk_blocks": s.kv_disk.blocks,
                "kv_disk_capacity_blocks": s.kv_disk.capacity_blocks,
                "kv_disk_restored_total": s.kv_disk.restored_total,
                "unavailable": s.unavailable,
                "signals": s,
            })
        })
        .collect();
    json!({
        "node": c.node_id,
        "policy": c.config.placement.policy,
        "nodes": nodes,
        "workers": workers,
        "models": c.models.iter().map(|m| json!({"id": m.info.id, "aliases": m.info.aliases, "max_model_len": m.info.context_length})).collect::<Vec<_>>(),
        "hosted_ranks": c.cluster.hosted_ranks(),
        "prefix_cache_hits_total": hits,
        "prefix_cache_queries_total": queries,
        "prefix_hit_ratio": if queries == 0 { 0.0 } else { hits as f64 / queries as f64 },
        // Of the tokens looked up: those read back from disk tiers, and those other workers'
        // KV brought (fetches, drains, warm-ups), each a share of the hits above at most.
        "restored_tokens_total": restored,
        "imported_tokens_total": imported,
        "restored_ratio": if queries == 0 { 0.0 } else { restored.min(hits) as f64 / queries as f64 },
        "imported_ratio": if queries == 0 { 0.0 } else { imported.min(hits) as f64 / queries as f64 },
    })
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn ready(State(c): State<AppState>) -> Response {
    if c.is_ready() {
        Json(json!({"status": "ready", "node": c.node_id})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "draining", "node": c.node_id}))).into_response()
    }
}

pub async fn prometheus(State(c): State<AppState>) -> Response {
    let peers: Vec<(String, &'static str)> = c.cluster.nodes().into_iter().map(|n| (n.id, n.state.as_str())).collect();
    let body = metrics::render(&c.node_id, &c.default_model().info.id, &c.worker_signals(), &peers);
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

/// The action a method and path segment name: `drain`, `undrain` or `report`.
fn action_of(method: &Method, action: &str) -> Option<&'static str> {
    match (method.as_str(), action) {
        ("POST", "drain") => Some("drain"),
        ("POST", "undrain") => Some("undrain"),
        ("GET", "drain") => Some("report"),
        _ => None,
    }
}

/// Runs an admin action on this node (`arg`: an audit id, or milliseconds since the epoch).
async fn run(c: &Frontend, action: &str, arg: &str) -> Result<Value, ApiError> {
    let report = match action {
        "drain" => c.drain().await?,
        "undrain" => c.undrain().await?,
        "audit" => return local_record(c, arg),
        "audit_since" => return local_since(c, arg),
        _ => c.drain_report().await?,
    };
    Ok(json!(report))
}

/// `POST /admin/nodes/{node}/drain`, `POST …/undrain`, and `GET …/drain` (the report). `node` may
/// be `self`, this node's id, or another node's id (passed on to that node).
pub async fn drain(
    State(c): State<AppState>,
    axum::Extension(rid): axum::Extension<RequestId>,
    method: Method,
    headers: HeaderMap,
    Path((node, action)): Path<(String, String)>,
) -> Response {
    let r = async {
        let act = action_of(&method, &action).ok_or_else(|| ApiError::NotFound(format!("{method} /admin/nodes/{node}/{action} does not exist")))?;
        if node != "self" && node != c.node_id {
            return pass_on(&c, &node, act, "", &headers).await;
        }
        Ok(Json(run(&c, act, "").await?).into_response())
    };
    r.await.unwrap_or_else(|e: ApiError| e.into_anthropic(&rid.0))
}

/// Passes an admin call on to `node` over the cluster link, with the caller's key.
pub(super) async fn pass_on(c: &Frontend, node: &str, action: &str, arg: &str, headers: &HeaderMap) -> Result<Response, ApiError> {
    if !c.cluster.nodes().iter().any(|n| n.id == node) {
        return Err(ApiError::NotFound(format!("node {node} is not in the cluster")));
    }
    let key = crate::auth::Guard::presented(headers).map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
    let call = zerolayer_common::wire::AdminCall { origin_node: c.node_id.clone(), action: action.into(), key, arg: arg.into() };
    let (status, body) = crate::cluster::admin::ask(&c.cluster, node, call).await.map_err(|e| ApiError::Unavailable(format!("{e:#}")))?;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    Ok((status, [("content-type", "application/json")], body).into_response())
}

/// Runs an admin call a peer passed on: the key must be this node's admin key (as on its own
/// admin API); the answer is the status and JSON body that API would send.
pub async fn serve_peer(c: std::sync::Arc<Frontend>, call: zerolayer_common::wire::AdminCall) -> (u16, Vec<u8>) {
    let mut headers = HeaderMap::new();
    if let Ok(v) = axum::http::HeaderValue::from_str(&call.key) {
        if !call.key.is_empty() {
            headers.insert("x-api-key", v);
        }
    }
    let rid = format!("req_admin_{}", call.origin_node);
    let outcome = match c.guard.authorize_admin(&headers) {
        Ok(_) => run(&c, &call.action, &call.arg).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(v) => (200, v.to_string().into_bytes()),
        Err(e) => {
            let resp = e.into_anthropic(&rid);
            let status = resp.status().as_u16();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.map(|b| b.to_vec()).unwrap_or_default();
            (status, body)
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// This node's record `id`.
pub fn local_record(c: &Frontend, id: &str) -> Result<Value, ApiError> {
    let r = c.audit.get(id, now_ms()).ok_or_else(|| ApiError::NotFound(format!("policy audit record {id} not found")))?;
    Ok(json!(r))
}

/// This node's records at or after `since` (milliseconds since the epoch; empty: all).
pub fn local_since(c: &Frontend, since: &str) -> Result<Value, ApiError> {
    let since = if since.is_empty() { 0 } else { since.parse::<u64>().map_err(|_| ApiError::invalid("since: expected milliseconds since the Unix epoch"))? };
    Ok(json!(c.audit.since(since, now_ms())))
}
