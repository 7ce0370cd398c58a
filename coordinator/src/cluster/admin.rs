//! Admin calls for another node ([`Open::Admin`]): an operator's drain, undrain or drain
//! report, taken by any node's admin API and passed on over the cluster link (mutual TLS, a
//! dial that must reach the named node) with the caller's key, never over plain HTTP. The
//! receiving node checks the key against its own admin key and runs the call through the hook
//! its front end registers ([`Cluster::serve_peers`]), so this layer knows nothing of drains.

use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::wire::{AdminCall, Open, Reply};

use super::frames::write_reply;
use super::handle::Cluster;
use super::lookup::exchange;

/// How long a passed-on admin call may take (a drain answers at once; it runs on afterwards).
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest key a call may carry.
pub const MAX_KEY_BYTES: usize = 1024;
/// The longest argument a call may carry.
pub const MAX_ARG_BYTES: usize = 256;
/// The actions a call may name.
pub const ACTIONS: [&str; 5] = ["drain", "undrain", "report", "audit", "audit_since"];

/// Passes `call` on to `node`: its status and body.
pub async fn ask(cluster: &Cluster, node: &str, call: AdminCall) -> anyhow::Result<(u16, Vec<u8>)> {
    match exchange(cluster, node, &Open::Admin(call), ADMIN_TIMEOUT).await? {
        Reply::Done { status, body } => Ok((status, body)),
        other => Err(anyhow::anyhow!("node {node}: unexpected reply {other:?}")),
    }
}

/// Answers one admin call (its `Open::Admin` frame already read, its sender checked).
pub async fn serve(cluster: Arc<Cluster>, call: AdminCall, mut send: quinn::SendStream, peer: std::net::SocketAddr) {
    let reply = if !ACTIONS.contains(&call.action.as_str()) || call.key.len() > MAX_KEY_BYTES || call.arg.len() > MAX_ARG_BYTES {
        Reply::Refused { overloaded: false, message: format!("not an admin call: action {:?}", call.action.chars().take(32).collect::<String>()) }
    } else {
        match cluster.peer_calls.get() {
            Some(calls) => {
                let (status, body) = calls.admin(call).await;
                Reply::Done { status, body }
            }
            None => Reply::Refused { overloaded: true, message: format!("node {} is still starting", cluster.node_id) },
        }
    };
    if let Err(e) = write_reply(&mut send, &reply).await {
        tracing::debug!(%peer, error = %e, "an admin call's answer was not delivered");
    }
    let _ = send.finish();
}
