//! The accept loop: takes peer connections (mutual TLS is enforced by the endpoint's config)
//! and dispatches their streams: uni = a gossip message for chitchat; bi = whatever its first
//! frame opens (a forwarded request, or KV blocks to import). Each connection's task ends when
//! the connection closes, which `Cluster::kill` forces.

use std::sync::Arc;

use std::net::SocketAddr;

use rustls::pki_types::CertificateDer;
use zerolayer_common::wire::{self, Open, Reply};

use super::frames::{read_opening, write_reply};
use super::identity::cert_names;
use super::handle::Cluster;
use super::{admin, fetch, forward, lookup, migrate, rank};
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
            // Who the peer is: the node its certificate names (the handshake already checked
            // that it chains to the cluster CA).
            let cert = conn.peer_identity().and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok()).and_then(|v| v.first().cloned());
            let Some(cert) = cert else {
                conn.close(1u32.into(), b"no certificate");
                return;
            };
            let node = c.configured_nodes().find(|n| cert_names(&cert, n)).map(str::to_string);
            if node.is_none() && !c.joining_allowed() {
                tracing::warn!(%remote, "refused a peer whose certificate names no node of the config");
                conn.close(1u32.into(), b"not a node of this cluster");
                return;
            }
            let opening = c.openings.of(&node);
            let peer = Arc::new(Peer { addr: remote, cert, node, opening });
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
                        tokio::spawn(serve_bi(c.clone(), send, recv, peer.clone()));
                    }
                }
            }
        });
    }
}

/// The node at the other end of a connection.
pub struct Peer {
    pub addr: SocketAddr,
    pub cert: CertificateDer<'static>,
    /// The configured node its certificate names (`None` only when joining is allowed).
    pub node: Option<String>,
    /// Its budget for opening frames being read ([`super::frames::OpeningBudgets`]).
    opening: Arc<tokio::sync::Semaphore>,
}

impl Peer {
    /// Whether this peer may speak as `node`: its certificate names it.
    pub fn is(&self, node: &str) -> bool {
        self.node.as_deref() == Some(node) || cert_names(&self.cert, node)
    }
}

/// Reads a bi-stream's opening frame (within [`forward::ACCEPT_TIMEOUT`] and the peer's budget
/// of opening bytes) and hands the stream to the side that serves it, after checking that the
/// peer is the node the frame says it comes from.
async fn serve_bi(cluster: Arc<Cluster>, send: quinn::SendStream, mut recv: quinn::RecvStream, peer: Arc<Peer>) {
    let first = tokio::time::timeout(forward::ACCEPT_TIMEOUT, read_opening(&mut recv, &peer.opening)).await;
    let open = match first {
        Ok(Ok(Some((body, _held)))) => wire::decode_open(&body).map_err(anyhow::Error::from),
        Ok(Ok(None)) => Err(anyhow::anyhow!("stream closed before its first frame")),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(anyhow::anyhow!("no first frame within {:?}", forward::ACCEPT_TIMEOUT)),
    };
    let claimed = match &open {
        Ok(Open::Submit(s)) => s.origin_node.as_str(),
        Ok(Open::Import(h)) => h.origin_node.as_str(),
        Ok(Open::Rank(j)) => j.origin_node.as_str(),
        Ok(Open::Lookup(l)) => l.origin_node.as_str(),
        Ok(Open::Admin(a)) => a.origin_node.as_str(),
        Ok(Open::Fetch(f)) => f.origin_node.as_str(),
        Err(_) => "",
    };
    if open.is_ok() && !peer.is(claimed) {
        tracing::warn!(peer = %peer.addr, node = ?peer.node, claimed, "refused a frame that claims another node's id");
        metrics::counter!("zerolayer_forged_frames_total", "node" => cluster.node_id.clone()).increment(1);
        let mut send = send;
        let reply = Reply::Refused { overloaded: false, message: format!("this connection's certificate does not name node {claimed:?}") };
        let _ = write_reply(&mut send, &reply).await;
        let _ = send.finish();
        return;
    }
    match open {
        Ok(Open::Submit(sub)) => forward::serve(cluster, sub, send, recv, peer.addr).await,
        Ok(Open::Import(header)) => migrate::serve(cluster, header, send, recv, peer.addr).await,
        Ok(Open::Rank(join)) => rank::host::serve(cluster, join, send, recv, peer.addr).await,
        Ok(Open::Lookup(l)) => lookup::serve(cluster, l, send, peer.addr).await,
        Ok(Open::Admin(a)) => admin::serve(cluster, a, send, peer.addr).await,
        Ok(Open::Fetch(f)) => fetch::serve(cluster, f, send, peer.addr).await,
        Err(e) => tracing::debug!(peer = %peer.addr, error = %e, "refused a stream"),
    }
}
