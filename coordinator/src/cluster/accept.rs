//! The accept loop: takes peer connections (mutual TLS is enforced by the endpoint's config)
//! and dispatches their streams: uni = a gossip message for chitchat; bi = whatever its first
//! frame opens (a forwarded request, or KV blocks to import). Each connection's task ends when
//! the connection closes, which `Cluster::kill` forces.

use std::sync::Arc;

use std::net::SocketAddr;

use zerolayer_common::wire::{self, Open};

use super::frames::read_frame;
use super::link::Cluster;
use super::{forward, migrate};
use super::transport::MAX_GOSSIP_BYTES;

pub async fn run(cluster: Arc<Cluster>) {
    let Some(net) = &cluster.net else { return };
    while let Some(incoming) = net.endpoint.accept().await {
        let c = cluster.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(conn) => conn,
                // A peer that stops (a node being replaced) abandons its handshakes: not a refusal.
                Err(e @ (quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::ConnectionClosed(_) | quinn::ConnectionError::TimedOut | quinn::ConnectionError::Reset)) => {
                    tracing::debug!(%remote, error = %e, "a peer abandoned its connection during the handshake");
                    return;
                }
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
                        tokio::spawn(serve_bi(c.clone(), send, recv, remote));
                    }
                }
            }
        });
    }
}

/// Reads a bi-stream's opening frame (within [`forward::ACCEPT_TIMEOUT`]) and hands the stream
/// to the side that serves it.
async fn serve_bi(cluster: Arc<Cluster>, send: quinn::SendStream, mut recv: quinn::RecvStream, peer: SocketAddr) {
    let first = tokio::time::timeout(forward::ACCEPT_TIMEOUT, read_frame(&mut recv)).await;
    let open = match first {
        Ok(Ok(Some(body))) => wire::decode_open(&body).map_err(anyhow::Error::from),
        Ok(Ok(None)) => Err(anyhow::anyhow!("stream closed before its first frame")),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(anyhow::anyhow!("no first frame within {:?}", forward::ACCEPT_TIMEOUT)),
    };
    match open {
        Ok(Open::Submit(sub)) => forward::serve(cluster, sub, send, recv, peer).await,
        Ok(Open::Import(header)) => migrate::serve(cluster, header, send, recv, peer).await,
        Err(e) => tracing::debug!(%peer, error = %e, "refused a stream"),
    }
}
