//! `GET /admin/policy/audit/{id}` and `GET /admin/policy/audit?since=` (the admin key): policy
//! audit records from any node. An id names the node that keeps its record, so a read for
//! another node's record is passed on to it over the cluster link; `since` asks every live node
//! and merges their records, oldest first.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::admin::{local_record, local_since, pass_on};
use super::shared::{AppState, RequestId};
use crate::error::ApiError;
use crate::frontend::audit::{self, MAX_PAGE};
use crate::view::NodeState;

/// `GET /admin/policy/audit/{id}`.
pub async fn record(State(c): State<AppState>, axum::Extension(rid): axum::Extension<RequestId>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let r = async {
        let node = audit::node_of(&id).ok_or_else(|| ApiError::NotFound(format!("policy audit record {id} not found")))?;
        if node == c.node_id {
            return Ok(Json(local_record(&c, &id)?).into_response());
        }
        pass_on(&c, &node, "audit", &id, &headers).await
    };
    r.await.unwrap_or_else(|e: ApiError| e.into_anthropic(&rid.0))
}

#[derive(serde::Deserialize)]
pub struct Since {
    since: Option<u64>,
}

/// `GET /admin/policy/audit?since=MS`: every live node's records, merged oldest first (at most
/// 1000), and which nodes answered.
pub async fn since(State(c): State<AppState>, axum::Extension(rid): axum::Extension<RequestId>, headers: HeaderMap, Query(q): Query<Since>) -> Response {
    let since = q.since.unwrap_or(0).to_string();
    let mut records: Vec<Value> = match local_since(&c, &since) {
        Ok(Value::Array(a)) => a,
        Ok(_) => Vec::new(),
        Err(e) => return e.into_anthropic(&rid.0),
    };
    let mut nodes = serde_json::Map::new();
    nodes.insert(c.node_id.clone(), json!("ok"));
    let peers: Vec<String> = c.cluster.nodes().into_iter().filter(|n| n.id != c.node_id && n.state != NodeState::Dead).map(|n| n.id).collect();
    let asks = peers.iter().map(|p| pass_on(&c, p, "audit_since", &since, &headers));
    for (peer, answer) in peers.iter().zip(futures::future::join_all(asks).await) {
        let outcome = match answer {
            Ok(resp) if resp.status().is_success() => match axum::body::to_bytes(resp.into_body(), 64 << 20).await.ok().and_then(|b| serde_json::from_slice::<Vec<Value>>(&b).ok()) {
                Some(theirs) => {
                    records.extend(theirs);
                    json!("ok")
                }
                None => json!("error: an unreadable answer"),
            },
            Ok(resp) => json!(format!("error: status {}", resp.status())),
            Err(e) => json!(format!("error: {e}")),
        };
        nodes.insert(peer.clone(), outcome);
    }
    records.sort_by_key(|r| r["time_ms"].as_u64().unwrap_or(0));
    records.truncate(MAX_PAGE);
    Json(json!({"records": records, "nodes": nodes})).into_response()
}
