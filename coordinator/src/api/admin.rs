//! The operator's endpoints: `/admin/status` and `/admin/cluster` (admin key), `/health`,
//! `/ready` (503 while draining or shutting down) and `/metrics` (Prometheus text).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::shared::AppState;
use crate::coordinator::Coordinator;
use crate::metrics;

pub async fn status(State(c): State<AppState>) -> Json<Value> {
    let workers: Vec<Value> = c.worker_signals().into_iter().map(|(id, s)| json!({"id": id, "signals": s})).collect();
    Json(json!({"node": c.node_id, "ready": c.is_ready(), "model": c.model.id, "in_flight": c.in_flight(), "workers": workers}))
}

/// The cluster as this node sees it: every node's state and every worker's signals.
pub async fn cluster(State(c): State<AppState>) -> Json<Value> {
    Json(cluster_json(&c))
}

pub fn cluster_json(c: &Coordinator) -> Value {
    let view = c.cluster.view();
    let nodes = c.cluster.nodes();
    let (mut hits, mut queries) = (0u64, 0u64);
    let workers: Vec<Value> = view
        .workers
        .iter()
        .map(|w| {
            let s = &w.signals;
            hits = hits.saturating_add(s.prefix_cache_hits_total);
            queries = queries.saturating_add(s.prefix_cache_queries_total);
            json!({
                "node": w.node,
                "worker": w.worker,
                "state": w.state,
                "local": w.local,
                "device": w.device,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_blocks_total": s.kv_blocks_total,
                "kv_blocks_cached": s.kv_blocks_cached,
                "indexed_blocks": w.cached.len(),
                "kv_fragmentation_ratio": s.kv_fragmentation_ratio,
                "prefix_hit_ratio": s.prefix_hit_ratio,
                "running": s.running,
                "waiting": s.waiting,
                "tokens_per_second": s.tokens_per_second,
                "signals": s,
            })
        })
        .collect();
    json!({
        "node": c.node_id,
        "policy": c.config.placement.policy,
        "nodes": nodes,
        "workers": workers,
        "prefix_cache_hits_total": hits,
        "prefix_cache_queries_total": queries,
        "prefix_hit_ratio": if queries == 0 { 0.0 } else { hits as f64 / queries as f64 },
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
    let body = metrics::render(&c.node_id, &c.model.id, &c.worker_signals(), &peers);
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}
