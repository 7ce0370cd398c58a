//! Hosting one rank of another node's tensor-parallel group (see [`super`]): checking a join
//! against the cluster config, building the rank's shard with the group's KV blocks, and
//! serving the leader's commands (a step's batch, KV block reads and writes) until the leader
//! goes. Every block index a command names is checked against this rank's own cache by the
//! backend before any kernel reads it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::{item_ranges, RankJoin, RankMsg};
use zerolayer_common::ClusterConfig;

use super::{RankChannels, StarMember};
use crate::backend::{self, Backend, Cpu};
use crate::model::shard::ShardPlan;
use crate::model::{ForwardItem, KvCache};

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
    let want_id = if matches!(wc.gpu(), Ok(Some(_))) { 128 } else { 0 };
    if j.nccl_id.len() != want_id {
        return Err(format!("an NCCL id of {} bytes for {} ranks", j.nccl_id.len(), wc.device));
    }
    Ok(wc.clone())
}

/// The GPU that rank `rank` of `wc`'s group takes on `node`: the worker's `cuda:N`, plus the
/// number of the group's earlier ranks on that node.
pub fn gpu_of(wc: &WorkerConfig, rank: usize, node: &str) -> Option<usize> {
    let n = wc.gpu().ok().flatten()?;
    Some(n + wc.rank_nodes[..rank].iter().filter(|r| *r == node).count())
}

/// Builds rank `j.rank` of the group the join names (this node is `me`, `wc` the worker config
/// [`check`] returned) and serves the leader's commands on `channels` until the stream ends or
/// `stop` is set. Blocks: run it on a thread of its own.
pub fn serve(config: &ClusterConfig, wc: &WorkerConfig, j: &RankJoin, me: &str, channels: RankChannels, stop: &AtomicBool) {
    let RankChannels { out, sums, control } = channels;
    let broken = Arc::new(AtomicBool::new(false));
    let member = StarMember { rank: j.rank as usize, size: j.size as usize, out: out.clone(), sums, broken: broken.clone() };
    let mut rank = match build(config, wc, j, me, member, &out) {
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
    tracing::info!(origin = %j.origin_node, worker = %j.worker, rank = j.rank, backend = %rank.describe(), "hosting a tensor-parallel rank");
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
                    .map(|(it, (t, b))| ForwardItem { tokens: &tokens[t], start_pos: it.start_pos as usize, block_table: &tables[b], logits: it.logits as usize })
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

/// The rank's shard of the worker's model with the group's KV blocks: on the CPU summing
/// through the star (`member`), on a GPU through the NCCL group the join names. `Joining` goes
/// out once the join is checked and the model loaded, before the (on GPUs, blocking) build.
fn build(config: &ClusterConfig, wc: &WorkerConfig, j: &RankJoin, me: &str, member: StarMember, out: &std::sync::mpsc::SyncSender<RankMsg>) -> Result<Box<dyn Backend>, String> {
    let mc = config.model_of(wc);
    let model = crate::loader::load_model(&mc.path, wc.threads, |_, _| {}).map_err(|e| e.to_string())?;
    let cfg = model.cfg.clone();
    let plans = ShardPlan::for_group(&cfg, j.size as usize).map_err(|e| e.to_string())?;
    let plan = &plans[j.rank as usize];
    let num_blocks = KvCache::blocks_for(&cfg, wc.block_size, wc.kv_dtype, wc.kv_cache_mb << 20).map_err(|e| e.to_string())?;
    if num_blocks != j.num_blocks as usize {
        return Err(format!("the leader's cache has {} blocks, this rank's config gives {num_blocks}", j.num_blocks));
    }
    out.send(RankMsg::Joining).map_err(|_| "the leader is gone".to_string())?;
    if let Some(ordinal) = gpu_of(wc, j.rank as usize, me) {
        let id: [u8; 128] = j.nccl_id.as_slice().try_into().map_err(|_| "an NCCL id of the wrong size".to_string())?;
        return backend::gpu_rank(&model, plan, ordinal, &id, wc.block_size, num_blocks).map_err(|e| e.to_string());
    }
    let mut shard = model.shard(plan, wc.threads).map_err(|e| e.to_string())?;
    drop(model);
    shard.join(Box::new(member)).map_err(|e| e.to_string())?;
    Ok(Box::new(Cpu::with_blocks(shard, wc.block_size, wc.kv_dtype, num_blocks)))
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
        let good = RankJoin { origin_node: "a".into(), worker: w.id.clone(), rank: 1, size: 2, block_size: w.block_size as u32, num_blocks: 10, nccl_id: Vec::new() };
        assert_eq!(check(&c, "b", &good).unwrap().id, w.id);
        for (j, me, why) in [
            (good.clone(), "c", "the config puts rank 1 on b"),
            (RankJoin { rank: 0, ..good.clone() }, "b", "rank 0 is the leader's"),
            (RankJoin { rank: 2, ..good.clone() }, "b", "no rank 2"),
            (RankJoin { size: 3, ..good.clone() }, "b", "another size"),
            (RankJoin { block_size: 99, ..good.clone() }, "b", "other blocks"),
            (RankJoin { worker: "nope".into(), ..good.clone() }, "b", "no such worker"),
            (RankJoin { origin_node: "c".into(), ..good.clone() }, "b", "c's worker has no group"),
            (RankJoin { nccl_id: vec![0; 128], ..good.clone() }, "b", "an NCCL id for CPU ranks"),
        ] {
            assert!(check(&c, me, &j).is_err(), "{why}");
        }
        // GPU ranks: the join carries the group's NCCL id, and each node's ranks take its GPUs
        // from the worker's cuda:N in rank order.
        c.nodes[0].workers[0].device = "cuda:2".into();
        assert!(check(&c, "b", &good).is_err(), "GPU ranks without an NCCL id");
        assert!(check(&c, "b", &RankJoin { nccl_id: vec![1; 128], ..good.clone() }).is_ok());
        c.nodes[0].workers[0].rank_nodes = vec!["a".into(), "b".into(), "c".into(), "b".into()];
        let w = &c.nodes[0].workers[0];
        assert_eq!([gpu_of(w, 0, "a"), gpu_of(w, 1, "b"), gpu_of(w, 2, "c"), gpu_of(w, 3, "b")], [Some(2), Some(2), Some(2), Some(3)]);
    }
}
