//! Stored responses across the cluster: a node asks the node a response id names for it
//! ([`Open::Lookup`], one bi-stream, one `Reply::Found`). The store itself belongs to the front
//! end (`crate::frontend::stored`); it answers through the [`PeerCalls`](super::handle::PeerCalls) it registers with
//! [`Cluster::serve_peers`], so this layer knows nothing of what is stored.

use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::wire::{self, Lookup, Open, Reply};

use super::frames::{read_reply, write_reply};
use super::handle::Cluster;

/// How long a lookup may take, dial included.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `open` to `node` (a dial that must reach that node) and reads its one reply, within
/// `within`, dial included. Lookups and admin calls are such exchanges.
pub async fn exchange(cluster: &Cluster, node: &str, open: &Open, within: Duration) -> anyhow::Result<Reply> {
    let net = cluster.net.as_ref().ok_or_else(|| anyhow::anyhow!("this node is not in a cluster"))?;
    let addr = cluster.peer_addr(node).ok_or_else(|| anyhow::anyhow!("node {node} is not a live member of the cluster"))?;
    let frame = wire::encode_open(open)?;
    let exchange = async {
        let conn = net.peers.connect_node(addr, node).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&frame).await?;
        let _ = send.finish();
        read_reply(&mut recv).await
    };
    match tokio::time::timeout(within, exchange).await {
        Ok(Ok(Reply::Refused { message, .. })) => Err(anyhow::anyhow!("node {node} refused: {message}")),
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(e)) => Err(anyhow::anyhow!("node {node} at {addr}: {e}")),
        Err(_) => Err(anyhow::anyhow!("node {node} at {addr}: no answer within {within:?}")),
    }
}

/// Asks `node` for `lookup`'s response: its body (`Some`, empty for a delete) or `None` when
/// that node keeps no such response for the tenant. An error when the node cannot be reached.
pub async fn ask(cluster: &Cluster, node: &str, lookup: Lookup) -> anyhow::Result<Option<Vec<u8>>> {
    match exchange(cluster, node, &Open::Lookup(lookup), LOOKUP_TIMEOUT).await? {
        Reply::Found { found: true, body } => Ok(Some(body)),
        Reply::Found { found: false, .. } => Ok(None),
        other => Err(anyhow::anyhow!("node {node}: unexpected reply {other:?}")),
    }
}

/// Answers one lookup (its `Open::Lookup` frame already read, its sender checked).
pub async fn serve(cluster: Arc<Cluster>, lookup: Lookup, mut send: quinn::SendStream, peer: std::net::SocketAddr) {
    let reply = match cluster.peer_calls.get() {
        Some(calls) => {
            let (found, body) = calls.lookup(&lookup);
            Reply::Found { found, body }
        }
        None => Reply::Refused { overloaded: true, message: format!("node {} is still starting", cluster.node_id) },
    };
    if let Err(e) = write_reply(&mut send, &reply).await {
        tracing::debug!(%peer, error = %e, "a lookup's answer was not delivered");
    }
    let _ = send.finish();
}
