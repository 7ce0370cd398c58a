//! Stored responses from the handlers' side: what a finished response is kept with
//! ([`Keep`]), finding one by id here or on the node its id names ([`stored`]), and answering
//! a peer's lookup ([`serve_lookup`]).

use serde_json::{json, Value};
use zerolayer_common::wire::Lookup;

use crate::error::ApiError;
use crate::frontend::service::Frontend;
use crate::frontend::stored::ResponseId;

/// What a finished response is kept with: its tenant, whether to keep it, and the conversation
/// it answered.
pub struct Keep {
    pub tenant: String,
    pub store: bool,
    pub input: Vec<Value>,
}

impl Keep {
    /// Stores `response` (a no-op for `store: false`).
    pub fn keep(&self, c: &Frontend, response: &Value) {
        if !self.store {
            return;
        }
        let id = response["id"].as_str().unwrap_or_default();
        let body = json!({"response": response, "input": self.input}).to_string().into_bytes();
        if !c.responses.put(id, &self.tenant, body) {
            tracing::warn!(%id, "a response too large to store was not kept: previous_response_id will not find it");
        }
    }
}

/// The stored entry `id` of `tenant`: from this node's store, or asked of the node the id names
/// (`delete`: forgotten there; the answer is then an empty body). `None`: no such response.
pub async fn stored(c: &Frontend, id: &str, tenant: &str, delete: bool) -> Result<Option<Vec<u8>>, ApiError> {
    let Some(rid) = ResponseId::parse(id) else { return Ok(None) };
    if rid.node == c.node_id {
        return Ok(match delete {
            true => c.responses.delete(id, tenant).then(Vec::new),
            false => c.responses.get(id, tenant).map(|b| b.to_vec()),
        });
    }
    let lookup = Lookup { origin_node: c.node_id.clone(), id: id.to_string(), tenant: tenant.to_string(), delete };
    crate::cluster::lookup::ask(&c.cluster, &rid.node, lookup)
        .await
        .map_err(|e| ApiError::Unavailable(format!("response {id} is kept by node {}, which did not answer: {e}", rid.node)))
}

/// Answers a peer's lookup from this node's store.
pub fn serve_lookup(c: &Frontend, l: &Lookup) -> (bool, Vec<u8>) {
    match l.delete {
        true => (c.responses.delete(&l.id, &l.tenant), Vec::new()),
        false => c.responses.get(&l.id, &l.tenant).map_or((false, Vec::new()), |b| (true, b.to_vec())),
    }
}
