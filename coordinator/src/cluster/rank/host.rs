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

use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::{item_ranges, RankJoin, RankMsg};
use zerolayer_common::ClusterConfig;
use zerolayer_worker::backend::{Backend, Cpu};
use zerolayer_worker::model::shard::ShardPlan;
use zerolayer_worker::model::{ForwardItem, KvCache};

use super::{Link, StarMember};
use crate::cluster::link::Cluster;
use crate::view::NodeState;

/// The worker config a join refers to, if this node is to host that rank.
pub fn check(config: &ClusterConfig, me: &str, j: &RankJoin) -> Result<WorkerConfig, String> {
    let wc = config
        .node(&j.origin_node)
        .and_then(|n| n.workers.iter().find(|w| w.id == j.worker))
        .ok_or_else(|| format!("node {:?} has no worker {:?} in this node's config", j.origin_node, j.worker))?;
    if j.rank == 0 || wc.rank_nodes.get(j.rank as usize).map(String::as_str) != Some(me) {
        return Err(format!("the config does not put rank {} of {}/{} on node {me}", j.rank, j.origin_node, j.worker));
    }
    if j.size as usize != wc.rank_nodes.len() || j.block_size as usize != wc.block_size {
        return Err(format!("a group of {} with {}-token blocks, where the config says {} and {}", j.size, j.block_size, wc.rank_nodes.len(), wc.block_size));
    }
    Ok(wc.clone())
}

/// Serves one rank stream (its `Open::Rank` frame already read).
pub async fn serve(cluster: Arc<Cluster>, j: RankJoin, send: quinn::SendStream, recv: quinn::RecvStream, peer: SocketAddr) {
    let slot = format!("{}/{}/{}", j.origin_node, j.worker, j.rank);
    let link = match Link::start(&format!("{}-{}", j.worker, j.rank), send, recv) {
        Ok(l) => l,
        Err(e) => return tracing::warn!(%peer, error = %e, "could not start a rank stream"),
    };
    let checked = match cluster.state() {
        NodeState::Draining | NodeState::Dead => Err(format!("node {} is leaving the cluster", cluster.node_id)),
        _ => check(&cluster.config, &cluster.node_id, &j),
    };
    let wc = match checked {
        Ok(wc) => wc,
        Err(message) => {
            tracing::warn!(%peer, slot, error = %message, "refused to host a tensor-parallel rank");
            let _ = link.out.send(RankMsg::Failed { message });
            return;
        }
    };
    // A second join for this rank (its leader restarted) replaces the first.
    let stop = Arc::new(AtomicBool::new(false));
    if let Some(old) = cluster.hosted_ranks.lock().unwrap_or_else(|e| e.into_inner()).insert(slot.clone(), stop.clone()) {
        old.store(true, Ordering::Release);
    }
    let config = cluster.config.clone();
    let c = cluster.clone();
    let name = slot.clone();
    let done = tokio::task::spawn_blocking(move || {
        host(&config, &wc, &j, link, &stop);
        let mut hosted = c.hosted_ranks.lock().unwrap_or_else(|e| e.into_inner());
        if hosted.get(&name).is_some_and(|s| Arc::ptr_eq(s, &stop)) {
            hosted.remove(&name);
        }
    });
    let _ = done.await;
    tracing::info!(%peer, slot, "a hosted tensor-parallel rank ended");
}

/// Builds the rank and serves its commands until the stream ends or `stop` is set.
fn host(config: &ClusterConfig, wc: &WorkerConfig, j: &RankJoin, link: Link, stop: &AtomicBool) {
    let Link { out, sums, control } = link;
    let broken = Arc::new(AtomicBool::new(false));
    let built = build(config, wc, j, StarMember { rank: j.rank as usize, size: j.size as usize, out: out.clone(), sums, broken: broken.clone() });
    let mut rank = match built {
        Ok(r) => r,
        Err(message) => {
            tracing::warn!(worker = %j.worker, rank = j.rank, error = %message, "could not build a tensor-parallel rank");
            let _ = out.send(RankMsg::Failed { message });
            return;
        }
    };
    if out.send(RankMsg::Ready { num_blocks: rank.kv().num_blocks as u32, weight_bytes: rank.weight_bytes() as u64 }).is_err() {
        return;
    }
    tracing::info!(origin = %j.origin_node, worker = %j.worker, rank = j.rank, "hosting a tensor-parallel rank");
    let mut logits = Vec::new();
    while let Ok(m) = control.recv() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let reply = match m {
            RankMsg::Forward { tokens, tables, items } => {
                let Ok(ranges) = item_ranges(tokens.len(), tables.len(), &items) else {
                    // Only a broken leader sends this; ranks 0.. may already be waiting on a sum.
                    tracing::warn!(worker = %j.worker, "a rank's batch does not add up; ending the group");
                    return;
                };
                let fi: Vec<ForwardItem<'_>> = items
                    .iter()
                    .zip(ranges)
                    .map(|(it, (t, b))| ForwardItem { tokens: &tokens[t], start_pos: it.start_pos as usize, block_table: &tables[b], want_logits: it.want_logits })
                    .collect();
                let r = rank.forward_into(&fi, &mut logits);
                if broken.load(Ordering::Acquire) {
                    return;
                }
                RankMsg::Done { error: r.err().map(|e| e.to_string()) }
            }
            RankMsg::Read { block } => {
                let mut bytes = Vec::new();
                let error = rank.read_block(block, &mut bytes).err().map(|e| e.to_string());
                RankMsg::Block { bytes, error }
            }
            RankMsg::Write { block, bytes } => RankMsg::Written { error: rank.write_block(block, &bytes).err().map(|e| e.to_string()) },
            other => {
                tracing::warn!(worker = %j.worker, frame = ?std::mem::discriminant(&other), "a leader sent a frame no leader sends; ending the group");
                return;
            }
        };
        if out.send(reply).is_err() {
            return;
        }
    }
}

/// The rank's shard of the worker's model with the group's KV blocks.
fn build(config: &ClusterConfig, wc: &WorkerConfig, j: &RankJoin, group: StarMember) -> Result<Cpu, String> {
    let mc = config.model_of(wc);
    let loaded = zerolayer_worker::loader::load(&mc.path, mc.tokenizer.as_deref(), wc.threads, |_, _| {}).map_err(|e| e.to_string())?;
    let cfg = loaded.model.cfg.clone();
    let plans = ShardPlan::for_group(&cfg, j.size as usize).map_err(|e| e.to_string())?;
    let num_blocks = KvCache::blocks_for(&cfg, wc.block_size, wc.kv_cache_mb << 20).map_err(|e| e.to_string())?;
    if num_blocks != j.num_blocks as usize {
        return Err(format!("the leader's cache has {} blocks, this rank's config gives {num_blocks}", j.num_blocks));
    }
    let mut shard = loaded.model.shard(&plans[j.rank as usize], wc.threads).map_err(|e| e.to_string())?;
    drop(loaded);
    shard.join(Box::new(group)).map_err(|e| e.to_string())?;
    Ok(Cpu::with_blocks(shard, wc.block_size, num_blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A join is hosted only where the config puts that rank, with the config's group size and
    /// blocks.
    #[test]
    fn a_join_is_checked_against_the_config() {
        let mut c = ClusterConfig::default();
        let template = c.nodes[0].clone();
        c.nodes = ["a", "b", "c"].iter().map(|id| { let mut n = template.clone(); n.id = id.to_string(); n }).collect();
        c.nodes[0].workers[0].tensor_parallel = 2;
        c.nodes[0].workers[0].rank_nodes = vec!["a".into(), "b".into()];
        let w = &c.nodes[0].workers[0];
        let good = RankJoin { origin_node: "a".into(), worker: w.id.clone(), rank: 1, size: 2, block_size: w.block_size as u32, num_blocks: 10 };
        assert_eq!(check(&c, "b", &good).unwrap().id, w.id);
        for (j, me, why) in [
            (good.clone(), "c", "the config puts rank 1 on b"),
            (RankJoin { rank: 0, ..good.clone() }, "b", "rank 0 is the leader's"),
            (RankJoin { rank: 2, ..good.clone() }, "b", "no rank 2"),
            (RankJoin { size: 3, ..good.clone() }, "b", "another size"),
            (RankJoin { block_size: 99, ..good.clone() }, "b", "other blocks"),
            (RankJoin { worker: "nope".into(), ..good.clone() }, "b", "no such worker"),
            (RankJoin { origin_node: "c".into(), ..good.clone() }, "b", "c's worker has no group"),
        ] {
            assert!(check(&c, me, &j).is_err(), "{why}");
        }
    }
}
