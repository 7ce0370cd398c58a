//! The accept loop: takes peer connections (mutual TLS is enforced by the endpoint's config)
//! and dispatches their streams: uni = a gossip message for chitchat, bi = a forwarded request.
//! Each connection's task ends when the connection closes, which `Cluster::kill` forces.

use std::sync::Arc;

use super::forward;
use super::link::Cluster;
use super::transport::MAX_GOSSIP_BYTES;

pub async fn run(cluster: Arc<Cluster>) {
    let Some(net) = &cluster.net else { return };
    while let Some(incoming) = net.endpoint.accept().await {
        let c = cluster.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(%remote, error = %e, "refused a peer connection (TLS handshake failed)");
                    return;
                }
            };
            let Some(relays) = c.net.as_ref().map(|n| n.relays.clone()) else { return };
            loop {
                tokio::select! {
                    uni = conn.accept_uni() => {
                        let Ok(mut s) = uni else { break };
                        let relays = relays.clone();
                        tokio::spawn(async move {
                            if let Ok(bytes) = s.read_to_end(MAX_GOSSIP_BYTES).await {
                                relays.deliver(remote, &bytes).await;
                            }
                        });
                    }
                    bi = conn.accept_bi() => {
                        let Ok((send, recv)) = bi else { break };
                        tokio::spawn(forward::serve(c.clone(), send, recv, remote));
                    }
                }
            }
        });
    }
}
