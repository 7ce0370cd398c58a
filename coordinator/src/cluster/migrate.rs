//! Both ends of a KV transfer over QUIC: a sequence leaving a draining node takes its computed
//! blocks to the target worker's prefix cache (see `zerolayer_worker::migrate`).
//!
//! One bi-stream per sequence: an [`ImportHeader`] frame (tokens, chain hashes, a checksum per
//! block, which blocks follow), then the raw bytes of the blocks the target does not cache
//! (as the source's view of the target's prefix index says), `block_bytes` each. The target
//! checks everything before it uses anything: the hashes against the tokens, the sizes against
//! its own cache, each block's checksum as it arrives. It imports the chain up to the first
//! block that fails and answers how many blocks of the chain it now caches.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::wire::{self, BlockHeader, ImportHeader, Open, Reply};
use zerolayer_common::{block_hashes_from, checksum};
use zerolayer_worker::migrate::{Export, KvImport};

use super::frames::{read_frame, write_reply};
use super::handle::Cluster;
use crate::view::NodeState;

/// How long one transfer may take, end to end (a 1,400-token sequence is ~64 MB of f32 KV).
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(60);

/// What a transfer achieved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Transferred {
    /// Blocks of the sequence's chain now in the target's cache.
    pub blocks: u32,
    /// Bytes sent.
    pub bytes: u64,
}

/// The header for `export`'s blocks; blocks whose hash is in `target_cached` are not sent.
pub fn header(request_id: &str, origin_node: &str, worker: &str, export: &Export, target_cached: &HashSet<u64>) -> ImportHeader {
    let tokens = export.block_tokens();
    let blocks = export
        .block_hashes
        .iter()
        .enumerate()
        .map(|(i, &hash)| BlockHeader { hash, checksum: checksum(export.block(i)), sent: !target_cached.contains(&hash) })
        .collect();
    ImportHeader {
        request_id: request_id.to_string(),
        origin_node: origin_node.to_string(),
        worker: worker.to_string(),
        block_size: export.block_size as u32,
        block_bytes: export.block_bytes as u64,
        tokens,
        cache_root: export.cache_root,
        blocks,
    }
}

/// Sends `export`'s blocks (those `header` marks as sent) to `node` at `addr`.
pub async fn send(cluster: &Cluster, node: &str, addr: SocketAddr, header: ImportHeader, export: &Export) -> anyhow::Result<Transferred> {
    let net = cluster.net.as_ref().ok_or_else(|| anyhow::anyhow!("this node is not in a cluster"))?;
    let work = async {
        let conn = net.peers.connect_node(addr, node).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&wire::encode_open(&Open::Import(header.clone()))?).await?;
        let mut bytes = 0u64;
        for (i, b) in header.blocks.iter().enumerate() {
            if b.sent {
                send.write_all(export.block(i)).await?;
                bytes += export.block_bytes as u64;
            }
        }
        send.finish()?;
        let sent_at = std::time::Instant::now();
        let body = read_frame(&mut recv).await?.ok_or_else(|| anyhow::anyhow!("node {node} closed the stream without an answer"))?;
        tracing::debug!(node, bytes, answer_ms = sent_at.elapsed().as_secs_f64() * 1e3, path = ?conn.stats().path, "KV sent; the target answered");
        match wire::decode_reply(&body)? {
            Reply::Imported { blocks } => anyhow::Ok(Transferred { blocks, bytes }),
            Reply::Refused { message, .. } => anyhow::bail!("node {node} refused the KV: {message}"),
            other => anyhow::bail!("node {node}: unexpected answer {other:?}"),
        }
    };
    tokio::time::timeout(TRANSFER_TIMEOUT, work).await.map_err(|_| anyhow::anyhow!("KV transfer to {node} took over {TRANSFER_TIMEOUT:?}"))?
}

/// Checks a header against this node's worker before any byte is read: the worker exists, the
/// geometry is its cache's exactly (block size, bytes per block), the blocks fit in its cache,
/// and the hashes are the tokens' chain.
pub(super) fn check(cluster: &Cluster, h: &ImportHeader) -> Result<(), String> {
    let Some(w) = cluster.local_worker(&h.worker) else { return Err(format!("node {} has no worker {:?}", cluster.node_id, h.worker)) };
    let g = w.handle.kv_geometry();
    if h.block_size as usize != g.block_size {
        return Err(format!("block size {} here, {} sent", g.block_size, h.block_size));
    }
    if h.block_bytes != g.block_bytes as u64 {
        return Err(format!("blocks of {} bytes here, {} sent", g.block_bytes, h.block_bytes));
    }
    if h.blocks.len() > g.num_blocks {
        return Err(format!("{} blocks for a cache of {}", h.blocks.len(), g.num_blocks));
    }
    let bs = h.block_size as usize;
    if h.tokens.len() < h.blocks.len() * bs {
        return Err(format!("{} tokens for {} blocks of {bs}", h.tokens.len(), h.blocks.len()));
    }
    let chain = block_hashes_from(h.cache_root, &h.tokens[..h.blocks.len() * bs], bs);
    if chain.iter().zip(&h.blocks).any(|(a, b)| *a != b.hash) {
        return Err("the block hashes are not the chain of the tokens sent".into());
    }
    Ok(())
}

/// Reads the blocks `h` marks as sent from `recv` (every one of them, so the stream is drained)
/// and checks each against its checksum: the import of the chain up to the first block that
/// fails, and that block's index if one did.
pub(super) async fn read_blocks<R: tokio::io::AsyncRead + Unpin>(h: &ImportHeader, recv: &mut R) -> std::io::Result<(KvImport, Option<usize>)> {
    use tokio::io::AsyncReadExt;
    let bs = h.block_size as usize;
    let tokens = h.tokens[..(h.blocks.len() * bs).min(h.tokens.len())].to_vec();
    let mut import = KvImport { block_size: bs, block_bytes: h.block_bytes as usize, cache_root: h.cache_root, tokens, blocks: Vec::with_capacity(h.blocks.len()) };
    let mut bad = None;
    for (i, b) in h.blocks.iter().enumerate() {
        if !b.sent {
            import.blocks.push((b.hash, None));
            continue;
        }
        let mut bytes = vec![0u8; h.block_bytes as usize];
        recv.read_exact(&mut bytes).await?;
        if bad.is_some() {
            continue; // drained, not used: the chain stops at the first bad block
        }
        if checksum(&bytes) != b.checksum {
            bad = Some(i);
            continue;
        }
        import.blocks.push((b.hash, Some(bytes)));
    }
    if let Some(i) = bad {
        import.blocks.truncate(i);
    }
    Ok((import, bad))
}

/// KV bytes reserved for one peer's transfer, given back when it ends.
pub(super) struct Reserved<'a> {
    cluster: &'a Cluster,
    peer: String,
    bytes: u64,
}

impl<'a> Reserved<'a> {
    /// Reserves `bytes` for `peer` if its transfers in flight stay within `cap`.
    pub(super) fn take(cluster: &'a Cluster, peer: &str, bytes: u64, cap: u64) -> Option<Self> {
        let mut m = cluster.imports_in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let now = m.get(peer).copied().unwrap_or(0);
        if now + bytes > cap {
            return None;
        }
        m.insert(peer.to_string(), now + bytes);
        Some(Reserved { cluster, peer: peer.to_string(), bytes })
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut m = self.cluster.imports_in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= self.bytes.min(*n);
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

/// How long a transfer waits for gossip to show its sender draining (a drain starts sending
/// as soon as it starts, and its `draining` state reaches the target a gossip round later).
pub const DRAIN_SEEN_WITHIN: Duration = Duration::from_secs(3);

/// Whether `node` is draining in this node's view (the only time a node sends KV), waiting up
/// to [`DRAIN_SEEN_WITHIN`] for gossip to say so.
async fn sender_drains(cluster: &Cluster, node: &str) -> bool {
    let deadline = tokio::time::Instant::now() + DRAIN_SEEN_WITHIN;
    loop {
        if cluster.nodes().iter().any(|n| n.id == node && n.state == NodeState::Draining) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The receiving end of one transfer (its header frame already read). It takes KV only from a
/// node that is draining (the one case where a node sends it). Before it buffers a byte
/// it checks the header ([`check`]) and reserves the bytes the header announces against the
/// sending peer's share: at most one cache's worth of KV in flight per peer (a drain moves at
/// most what the target can hold), so a peer cannot make this node buffer more; past it, the
/// transfer is refused as overloaded and the sequence is recomputed instead.
pub async fn serve(cluster: Arc<Cluster>, h: ImportHeader, mut send: quinn::SendStream, mut recv: quinn::RecvStream, peer: SocketAddr) {
    let r = async {
        let refuse = |message: String| Reply::Refused { overloaded: false, message };
        if cluster.state() != NodeState::Ready {
            return write_reply(&mut send, &refuse(format!("node {} is not ready", cluster.node_id))).await;
        }
        if !sender_drains(&cluster, &h.origin_node).await {
            tracing::warn!(%peer, from = %h.origin_node, request_id = %h.request_id, "refused a KV transfer from a node that is not draining");
            return write_reply(&mut send, &refuse(format!("node {} takes KV only from a draining node; {} is not draining", cluster.node_id, h.origin_node))).await;
        }
        if let Err(e) = check(&cluster, &h) {
            tracing::warn!(%peer, request_id = %h.request_id, error = %e, "refused a KV transfer");
            return write_reply(&mut send, &refuse(e)).await;
        }
        let Some(w) = cluster.local_worker(&h.worker) else { return Ok(()) };
        let g = w.handle.kv_geometry();
        let announced = h.blocks.iter().filter(|b| b.sent).count() as u64 * h.block_bytes;
        let Some(_reserved) = Reserved::take(&cluster, &h.origin_node, announced, g.bytes as u64) else {
            tracing::warn!(%peer, request_id = %h.request_id, bytes = announced, "refused a KV transfer: the peer's transfers in flight would pass one cache");
            let refused = Reply::Refused { overloaded: true, message: format!("node {}: too much KV in flight from {}", cluster.node_id, h.origin_node) };
            return write_reply(&mut send, &refused).await;
        };
        let (import, bad) = read_blocks(&h, &mut recv).await?;
        let received = std::time::Instant::now();
        if let Some(i) = bad {
            tracing::warn!(%peer, request_id = %h.request_id, block = i, "a KV block failed its checksum; importing the chain before it");
        }
        let report = w.handle.import(import).await?;
        tracing::debug!(
            request_id = %h.request_id, from = %h.origin_node, imported = report.imported, cached = report.already_cached,
            import_ms = received.elapsed().as_secs_f64() * 1e3, "KV imported"
        );
        write_reply(&mut send, &Reply::Imported { blocks: report.usable() as u32 }).await?;
        let _ = send.finish();
        anyhow::Ok(())
    };
    if let Err(e) = tokio::time::timeout(TRANSFER_TIMEOUT, r).await.unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))) {
        tracing::debug!(%peer, error = %e, "KV transfer stream ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three blocks, the middle one damaged in transit: only the chain before it is imported,
    /// and the stream is read to its end.
    #[tokio::test]
    async fn a_block_that_fails_its_checksum_ends_the_chain_there() {
        let block_bytes = 8;
        let tokens: Vec<u32> = (0..12).collect();
        let root = 0x77;
        let export = Export { prompt: tokens.clone(), generated: vec![], seed: 1, cache_root: root, block_hashes: block_hashes_from(root, &tokens, 4), kv: (0..24u8).collect(), block_bytes, block_size: 4 };
        let h = header("r", "a", "cpu0", &export, &HashSet::new());
        let (import, bad) = read_blocks(&h, &mut &export.kv[..]).await.unwrap();
        assert_eq!((import.blocks.len(), bad), (3, None), "intact blocks all arrive");
        assert_eq!(import.blocks[1], (h.blocks[1].hash, Some(export.kv[8..16].to_vec())));
        assert_eq!((import.cache_root, import.tokens.len()), (root, 12), "the chain's root and tokens travel with it");
        let mut damaged = export.kv.clone();
        damaged[9] ^= 1;
        let mut stream = &damaged[..];
        let (import, bad) = read_blocks(&h, &mut stream).await.unwrap();
        assert_eq!((import.blocks.len(), bad), (1, Some(1)), "the chain stops before the damaged block");
        assert!(stream.is_empty(), "the rest is drained");
        // A block the target already caches is not sent, and takes no bytes.
        let cached: HashSet<u64> = [h.blocks[0].hash].into();
        let h = header("r", "a", "cpu0", &export, &cached);
        let (import, bad) = read_blocks(&h, &mut &export.kv[8..]).await.unwrap();
        assert_eq!((import.blocks[0].1.is_none(), import.blocks.len(), bad), (true, 3, None));
    }

    /// A peer's transfers in flight are held to one cache's worth: a transfer past it is refused
    /// before anything is buffered; another peer has its own share; an ended transfer gives its
    /// bytes back, and no entry stays behind.
    #[test]
    fn each_peer_has_one_cache_of_kv_in_flight_at_most() {
        let config = zerolayer_common::ClusterConfig::default();
        let cluster = Cluster::new("n", &config, &[], String::new(), None, crate::quota::Quota::new(vec![]));
        let a = Reserved::take(&cluster, "a", 600, 1000).expect("within the cap");
        assert!(Reserved::take(&cluster, "a", 500, 1000).is_none(), "past one cache");
        let b = Reserved::take(&cluster, "b", 1000, 1000).expect("another peer has its own share");
        let a2 = Reserved::take(&cluster, "a", 400, 1000).expect("up to the cap");
        drop(a);
        let a3 = Reserved::take(&cluster, "a", 600, 1000).expect("an ended transfer gives its bytes back");
        drop((a2, a3, b));
        assert!(cluster.imports_in_flight.lock().unwrap().is_empty());
    }
}
