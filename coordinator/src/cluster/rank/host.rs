//! Hosting one rank of another node's tensor-parallel group (see [`super`]).
//!
//! The join names a worker of the leading node; this node hosts its rank only if the cluster
//! config says so (`rank_nodes[rank]` is this node, the size and block geometry match), and
//! the peer's certificate names the leading node (checked by the accept loop). The rank is
//! built on a thread of its own (model load, shard, KV blocks) and serves the stream until the
//! leader closes it, the link breaks, or the leader sends what no leader sends. At most one
//! stream per (leader, worker, rank): a new join for the same rank (a restarted leader) ends
//! the old one.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use zerolayer_common::wire::rank::{encode_rank, RankJoin, RankMsg};
use zerolayer_worker::ranks::host;

use super::RankStream;
use crate::cluster::handle::Cluster;
use crate::view::NodeState;

/// Serves one rank stream (its `Open::Rank` frame already read). The join is checked before
/// anything is started for it: a refused join costs one frame, no thread and no buffer.
pub async fn serve(cluster: Arc<Cluster>, j: RankJoin, mut send: quinn::SendStream, recv: quinn::RecvStream, peer: SocketAddr) {
    let slot = format!("{}/{}/{}", j.origin_node, j.worker, j.rank);
    let checked = match cluster.state() {
        NodeState::Draining | NodeState::Dead => Err(format!("node {} is leaving the cluster", cluster.node_id)),
        _ => host::check(&cluster.config, &cluster.node_id, &j),
    };
    let wc = match checked {
        Ok(wc) => wc,
        Err(message) => {
            tracing::warn!(%peer, slot, error = %message, "refused to host a tensor-parallel rank");
            if let Ok(frame) = encode_rank(&RankMsg::Failed { message }) {
                if send.write_all(&frame).await.is_ok() {
                    let _ = send.finish();
                    // The frame is delivered before the stream goes.
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), send.stopped()).await;
                }
            }
            return;
        }
    };
    let link = match RankStream::start(&format!("{}-{}", j.worker, j.rank), send, recv) {
        Ok(l) => l,
        Err(e) => return tracing::warn!(%peer, error = %e, "could not start a rank stream"),
    };
    // A second join for this rank (its leader restarted) replaces the first.
    let stop = Arc::new(AtomicBool::new(false));
    if let Some(old) = cluster.hosted_ranks.lock().unwrap_or_else(|e| e.into_inner()).insert(slot.clone(), stop.clone()) {
        old.store(true, Ordering::Release);
    }
    let config = cluster.config.clone();
    let c = cluster.clone();
    let name = slot.clone();
    let me = cluster.node_id.clone();
    // A thread of its own, not the runtime's blocking pool: a GPU rank's NCCL join that never
    // completes (its leader gone mid-join) must not hold up the runtime's shutdown.
    let (tx, done) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new().name(format!("zl-rank-{}", j.rank)).spawn(move || {
        host::serve(&config, &wc, &j, &me, link, &stop);
        let mut hosted = c.hosted_ranks.lock().unwrap_or_else(|e| e.into_inner());
        if hosted.get(&name).is_some_and(|s| Arc::ptr_eq(s, &stop)) {
            hosted.remove(&name);
        }
        drop(tx);
    });
    if let Err(e) = spawned {
        return tracing::warn!(%peer, slot, error = %e, "could not start a rank's thread");
    }
    let _ = done.await;
    tracing::info!(%peer, slot, "a hosted tensor-parallel rank ended");
}

