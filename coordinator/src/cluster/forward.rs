//! Request forwarding: one QUIC bi-stream per request placed on another node's worker.
//!
//! The origin writes one [`Submit`] frame; the owner answers `Accepted` or `Refused`, then
//! streams `Event` frames until `Finished`. Cancellation travels with the stream: dropping a
//! [`RemoteStream`] before the end stops and resets it, and the owner, which watches
//! `SendStream::stopped`, cancels the sequence at once (freeing its KV blocks). A lost peer
//! surfaces as a read error within the QUIC idle timeout, and the stream ends with a `Lost`
//! event (the origin then continues the sequence elsewhere), never a hang.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::wire::{self, Open, Reply, Submit};
use zerolayer_common::{SeqEvent, StopReason};
use zerolayer_worker::WorkerError;

use super::frames::{read_frame, read_reply, write_reply};
use super::handle::Cluster;
use crate::view::NodeState;

/// How long the owner may take to accept or refuse a submission.
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a forward failed before any event.
#[derive(Debug)]
pub enum ForwardError {
    /// The peer could not be reached (try another worker).
    Unreachable(String),
    /// The peer's worker refused (its queue is full, or it is draining).
    Refused { overloaded: bool, message: String },
}

/// A sequence running on another node.
pub struct RemoteStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    node: String,
    finished: bool,
}

impl RemoteStream {
    /// The next event; after a transport failure, a `Finished` with an error. `None` once over.
    pub async fn recv(&mut self) -> Option<SeqEvent> {
        if self.finished {
            return None;
        }
        let ev = match read_frame(&mut self.recv).await {
            Ok(Some(body)) => match wire::decode_reply(&body) {
                Ok(Reply::Event(ev)) => ev,
                Ok(other) => SeqEvent::Finished { reason: StopReason::Error(format!("node {}: unexpected frame {other:?}", self.node)), usage: Default::default() },
                Err(e) => SeqEvent::Finished { reason: StopReason::Error(format!("node {}: {e}", self.node)), usage: Default::default() },
            },
            Ok(None) => SeqEvent::Finished { reason: StopReason::Lost(format!("node {} ended the stream early", self.node)), usage: Default::default() },
            Err(e) => SeqEvent::Finished { reason: StopReason::Lost(format!("lost node {}: {e}", self.node)), usage: Default::default() },
        };
        if matches!(ev, SeqEvent::Finished { .. }) {
            self.finished = true;
        }
        Some(ev)
    }
}

impl Drop for RemoteStream {
    fn drop(&mut self) {
        if !self.finished {
            // Tell the owner at once: it cancels the sequence when it sees the stop.
            let _ = self.recv.stop(1u32.into());
            let _ = self.send.reset(1u32.into());
        }
    }
}

/// Sends `submit` to `node` at `addr` and waits for the owner to accept it.
pub async fn submit(cluster: &Cluster, node: &str, addr: std::net::SocketAddr, submit: &Submit) -> Result<RemoteStream, ForwardError> {
    let net = cluster.net.as_ref().ok_or_else(|| ForwardError::Unreachable("this node is not in a cluster".into()))?;
    let frame = wire::encode_open(&Open::Submit(submit.clone())).map_err(|e| ForwardError::Refused { overloaded: false, message: e.to_string() })?;
    let setup = async {
        let conn = net.peers.connect_node(addr, node).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&frame).await?;
        let first = read_reply(&mut recv).await?;
        anyhow::Ok((send, recv, first))
    };
    match tokio::time::timeout(ACCEPT_TIMEOUT, setup).await {
        Ok(Ok((send, recv, Reply::Accepted))) => Ok(RemoteStream { send, recv, node: node.to_string(), finished: false }),
        Ok(Ok((_, _, Reply::Refused { overloaded, message }))) => Err(ForwardError::Refused { overloaded, message }),
        Ok(Ok((_, _, other))) => Err(ForwardError::Unreachable(format!("node {node}: unexpected first frame {other:?}"))),
        Ok(Err(e)) => {
            net.peers.forget(addr);
            Err(ForwardError::Unreachable(format!("node {node} at {addr}: {e}")))
        }
        Err(_) => Err(ForwardError::Unreachable(format!("node {node} at {addr}: no answer within {ACCEPT_TIMEOUT:?}"))),
    }
}

/// The owner's side of one forwarded request (its `Submit` frame already read).
pub async fn serve(cluster: Arc<Cluster>, sub: Submit, mut send: quinn::SendStream, recv: quinn::RecvStream, peer: std::net::SocketAddr) {
    let _recv = recv; // kept open: the origin stops it to cancel
    let r = async {
        let refuse = |overloaded: bool, message: String| Reply::Refused { overloaded, message };
        if cluster.state() != NodeState::Ready {
            return write_reply(&mut send, &refuse(true, format!("node {} is not accepting work", cluster.node_id))).await;
        }
        let Some(w) = cluster.local_worker(&sub.worker) else {
            return write_reply(&mut send, &refuse(false, format!("node {} has no worker {:?}", cluster.node_id, sub.worker))).await;
        };
        // The tenant's terms are this node's: the sender's share, root and options are not
        // taken as sent.
        let Some(calls) = cluster.peer_calls.get() else {
            return write_reply(&mut send, &refuse(true, format!("node {} is still starting", cluster.node_id))).await;
        };
        let job = match calls.rederive(sub.job) {
            Ok(job) => job,
            Err(why) => return write_reply(&mut send, &refuse(false, format!("node {}: {why}", cluster.node_id))).await,
        };
        if !job.share.is_valid() {
            return write_reply(&mut send, &refuse(false, format!("share weight {} is outside (0, 1000]", job.share.weight))).await;
        }
        tracing::debug!(request_id = %job.request_id, origin = %sub.origin_node, worker = %sub.worker, prompt_tokens = job.prompt.len(), "serving a forwarded request");
        if !zerolayer_common::CachePin::all_valid(&job.pins, job.prompt.len()) {
            return write_reply(&mut send, &refuse(false, format!("cache pins {:?} are outside the limits", job.pins))).await;
        }
        let request_id = job.request_id.clone();
        if let Some(from) = sub.fetch {
            cluster.fetch_first(&sub.worker, &job, from).await;
        }
        let mut stream = match w.handle.submit(job).await {
            Ok(s) => s,
            Err(e) => {
                let overloaded = matches!(e, WorkerError::QueueFull(_) | WorkerError::ShuttingDown | WorkerError::Unavailable(_));
                return write_reply(&mut send, &refuse(overloaded, e.to_string())).await;
            }
        };
        cluster.serving_remote.fetch_add(1, Ordering::AcqRel);
        let _guard = Decrement(&cluster.serving_remote);
        write_reply(&mut send, &Reply::Accepted).await?;
        let stopped = send.stopped();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                ev = stream.recv() => {
                    let Some(ev) = ev else { break };
                    let fin = matches!(ev, SeqEvent::Finished { .. });
                    write_reply(&mut send, &Reply::Event(ev)).await?;
                    if fin {
                        let _ = send.finish();
                        break;
                    }
                }
                _ = &mut stopped => {
                    // The origin went away (client disconnect): dropping `stream` cancels.
                    tracing::debug!(%request_id, "forwarded request cancelled by its origin");
                    break;
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = r {
        tracing::debug!(%peer, error = %e, "forwarded stream ended with an error");
    }
}

struct Decrement<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Decrement<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
