//! Both ends of a prefix fetch: a node about to run a request on one of its workers pulls the
//! prompt's prefix blocks that another worker of the cluster caches, instead of recomputing
//! them (placement chose the fetch: `routing::placement`'s `FetchPlan`).
//!
//! The asker opens a bi-stream with [`FetchAsk`] (the chain's root, its tokens, the first block
//! it lacks). The holder reads the chain as far as it caches it (`WorkerHandle::read_cached`)
//! and answers one `Reply::Blocks` header, then the raw bytes of the blocks from the asked one
//! on: the framing and checksums of a drain's transfer ([`super::migrate`]). The asker checks
//! the header as it checks an import (the geometry against its own worker, the hashes against
//! the tokens, which must be the ones it asked for), reserves the bytes against the holder's
//! share of KV in flight, checks each block's checksum, and imports the chain up to the first
//! bad block. A holder in the same process is read in process.
//!
//! A node serves fetches while it is ready or draining (a drained node's cache stays useful
//! until it stops), [`FETCHES_SERVED_AT_ONCE`] at a time.

use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::wire::{self, BlockHeader, FetchAsk, FetchFrom, ImportHeader, Open, Reply};
use zerolayer_common::checksum;
use zerolayer_worker::actor::CachedAsk;
use zerolayer_worker::migrate::CachedChain;

use super::frames::{read_reply, write_reply};
use super::handle::{Cluster, FETCHES_SERVED_AT_ONCE};
use super::migrate::{check, read_blocks, Reserved};
use crate::view::NodeState;

/// How long one fetch may take, end to end; past it the request recomputes. Within the
/// origin's wait for a forwarded request's acceptance (`forward::ACCEPT_TIMEOUT`), which a
/// fetch precedes.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(6);

/// What a fetch achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Blocks of the chain in the worker's cache now.
    pub usable: usize,
    /// Blocks written from the bytes that came.
    pub imported: usize,
    pub bytes: u64,
}

/// Pulls into this node's worker `into` the blocks of the chain `tokens` spell from
/// `cache_root` that `from` holds beyond the `from.have` it caches.
pub async fn pull(cluster: &Cluster, into: &str, request_id: &str, cache_root: u64, tokens: &[u32], from: &FetchFrom) -> anyhow::Result<Fetched> {
    let w = cluster.local_worker(into).ok_or_else(|| anyhow::anyhow!("node {} has no worker {into:?}", cluster.node_id))?;
    let bs = w.handle.kv_geometry().block_size;
    let n = (from.blocks as usize).min(tokens.len() / bs);
    let ask = FetchAsk {
        origin_node: cluster.node_id.clone(),
        request_id: request_id.to_string(),
        worker: from.worker.clone(),
        cache_root,
        tokens: tokens[..n * bs].to_vec(),
        from_block: from.have.min(n as u32),
    };
    let work = async {
        if from.node == cluster.node_id {
            let holder = cluster.local_worker(&from.worker).ok_or_else(|| anyhow::anyhow!("node {} has no worker {:?}", cluster.node_id, from.worker))?;
            let chain = holder.handle.read_cached(cached_ask(&ask)).await?;
            let bytes = chain.kv.len() as u64;
            let report = w.handle.import(chain.to_import()).await?;
            return anyhow::Ok(Fetched { usable: report.usable(), imported: report.imported, bytes });
        }
        pull_remote(cluster, into, &from.node, ask).await
    };
    tokio::time::timeout(FETCH_TIMEOUT, work).await.map_err(|_| anyhow::anyhow!("the fetch from {} took over {FETCH_TIMEOUT:?}", from.node))?
}

fn cached_ask(ask: &FetchAsk) -> CachedAsk {
    CachedAsk { cache_root: ask.cache_root, tokens: ask.tokens.clone(), from_block: ask.from_block as usize }
}

/// Checks a holder's answer to `ask` before any byte is read: the chain is the one asked for
/// (its root, a prefix of its tokens), the blocks before the asked one are not sent and the
/// rest are, and (as for an import) the geometry is `into`'s and the hashes are the tokens'.
fn check_answer(cluster: &Cluster, into: &str, ask: &FetchAsk, h: &ImportHeader) -> Result<(), String> {
    if h.cache_root != ask.cache_root || !ask.tokens.starts_with(&h.tokens) {
        return Err("the chain sent is not the one asked for".into());
    }
    if h.blocks.iter().enumerate().any(|(i, b)| b.sent != (i >= ask.from_block as usize)) {
        return Err("the blocks sent are not the ones asked for".into());
    }
    check(cluster, &ImportHeader { worker: into.to_string(), ..h.clone() })
}

async fn pull_remote(cluster: &Cluster, into: &str, holder: &str, ask: FetchAsk) -> anyhow::Result<Fetched> {
    let net = cluster.net.as_ref().ok_or_else(|| anyhow::anyhow!("this node is not in a cluster"))?;
    let addr = cluster.peer_addr(holder).ok_or_else(|| anyhow::anyhow!("node {holder} is unreachable"))?;
    let conn = net.peers.connect_node(addr, holder).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&wire::encode_open(&Open::Fetch(ask.clone()))?).await?;
    send.finish()?;
    let h = match read_reply(&mut recv).await? {
        Reply::Blocks(h) => h,
        Reply::Refused { message, .. } => anyhow::bail!("node {holder} refused the fetch: {message}"),
        other => anyhow::bail!("node {holder}: unexpected answer {other:?}"),
    };
    check_answer(cluster, into, &ask, &h).map_err(|e| anyhow::anyhow!("node {holder}: {e}"))?;
    let w = cluster.local_worker(into).ok_or_else(|| anyhow::anyhow!("no worker {into:?}"))?;
    let cap = w.handle.kv_geometry().bytes as u64;
    let _reserved = Reserved::take(cluster, holder, h.payload_bytes(), cap).ok_or_else(|| anyhow::anyhow!("too much KV in flight from {holder}"))?;
    let (import, bad) = read_blocks(&h, &mut recv).await?;
    if let Some(i) = bad {
        tracing::warn!(from = holder, request_id = %ask.request_id, block = i, "a fetched KV block failed its checksum; importing the chain before it");
    }
    let report = w.handle.import(import).await?;
    Ok(Fetched { usable: report.usable(), imported: report.imported, bytes: h.payload_bytes() })
}

/// The header for a chain read for a fetch: blocks before `chain.from` not sent.
fn answer_header(origin: &str, ask: &FetchAsk, chain: &CachedChain) -> ImportHeader {
    let blocks = chain
        .block_hashes
        .iter()
        .enumerate()
        .map(|(i, &hash)| {
            let sent = i >= chain.from;
            BlockHeader { hash, checksum: if sent { checksum(chain.block(i)) } else { 0 }, sent }
        })
        .collect();
    ImportHeader {
        request_id: ask.request_id.clone(),
        origin_node: origin.to_string(),
        worker: ask.worker.clone(),
        block_size: chain.block_size as u32,
        block_bytes: chain.block_bytes as u64,
        tokens: chain.tokens.clone(),
        cache_root: chain.cache_root,
        blocks,
    }
}

/// Checks an ask against this node's worker: it exists, and the chain is whole blocks that
/// its cache could hold.
fn check_ask(cluster: &Cluster, ask: &FetchAsk) -> Result<(), String> {
    let Some(w) = cluster.local_worker(&ask.worker) else { return Err(format!("node {} has no worker {:?}", cluster.node_id, ask.worker)) };
    let g = w.handle.kv_geometry();
    if ask.tokens.len() % g.block_size != 0 || ask.tokens.len() / g.block_size > g.num_blocks {
        return Err(format!("{} tokens are not whole blocks of {} that a cache of {} blocks holds", ask.tokens.len(), g.block_size, g.num_blocks));
    }
    if ask.from_block as usize > ask.tokens.len() / g.block_size {
        return Err(format!("block {} is past the chain's end", ask.from_block));
    }
    Ok(())
}

/// The holder's side of one fetch (its `Open::Fetch` frame already read).
pub async fn serve(cluster: Arc<Cluster>, ask: FetchAsk, mut send: quinn::SendStream, peer: std::net::SocketAddr) {
    let r = async {
        let refuse = |overloaded: bool, message: String| Reply::Refused { overloaded, message };
        if !matches!(cluster.state(), NodeState::Ready | NodeState::Draining) {
            return write_reply(&mut send, &refuse(true, format!("node {} is not serving its cache", cluster.node_id))).await;
        }
        if let Err(e) = check_ask(&cluster, &ask) {
            tracing::warn!(%peer, request_id = %ask.request_id, error = %e, "refused a KV fetch");
            return write_reply(&mut send, &refuse(false, e)).await;
        }
        let Ok(_permit) = cluster.fetches_served.try_acquire() else {
            return write_reply(&mut send, &refuse(true, format!("node {} is serving {FETCHES_SERVED_AT_ONCE} fetches", cluster.node_id))).await;
        };
        let Some(w) = cluster.local_worker(&ask.worker) else { return Ok(()) };
        let chain = w.handle.read_cached(cached_ask(&ask)).await?;
        let header = answer_header(&cluster.node_id, &ask, &chain);
        write_reply(&mut send, &Reply::Blocks(header)).await?;
        send.write_all(&chain.kv).await?;
        let _ = send.finish();
        let labels = [("node", cluster.node_id.clone()), ("worker", ask.worker.clone()), ("direction", "out".to_string())];
        metrics::counter!("zerolayer_kv_fetch_bytes_total", &labels).increment(chain.kv.len() as u64);
        let labels = [("node", cluster.node_id.clone()), ("worker", ask.worker.clone()), ("direction", "out".to_string()), ("outcome", "ok".to_string())];
        metrics::counter!("zerolayer_kv_fetches_total", &labels).increment(1);
        tracing::debug!(%peer, request_id = %ask.request_id, blocks = chain.block_hashes.len() - chain.from, bytes = chain.kv.len(), "served a KV fetch");
        anyhow::Ok(())
    };
    if let Err(e) = tokio::time::timeout(FETCH_TIMEOUT, r).await.unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))) {
        tracing::debug!(%peer, error = %e, "KV fetch stream ended with an error");
    }
}
