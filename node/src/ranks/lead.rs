//! The leading node's side of a tensor-parallel group across nodes (see [`super`]): rank 0 runs
//! here with the engine; [`RemoteRank`] stands for each rank a peer hosts. The transport opens
//! one stream per remote rank and sends each its [`Group::join_of`]; [`Group::form`] does the
//! rest, blocking (run it off the async runtime).
//!
//! The order matters on GPUs: every host has checked the join and loaded the model (`Joining`)
//! before rank 0 joins the NCCL group, so that a refusal cannot leave rank 0 waiting in NCCL for
//! a rank that will never come; then the hosts' joins complete with rank 0's, and each answers
//! `Ready`.

use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::{RankItem, RankJoin, RankMsg};

use super::{host, RankChannels, RankLink, StarLead};
use crate::backend::{self, Backend, Cpu, KvGeometry, Shape, TensorParallel};
use crate::error::{Result as WResult, WorkerError};
use crate::model::shard::ShardPlan;
use crate::model::{ForwardItem, KvCache, Model, ModelConfig};

/// One rank of the group that a peer hosts, as the group's [`TensorParallel`] drives it: each
/// call sends a frame and waits for the rank's answer.
pub struct RemoteRank {
    cfg: ModelConfig,
    node: String,
    rank: usize,
    out: SyncSender<RankMsg>,
    control: Receiver<RankMsg>,
    geometry: KvGeometry,
    weight_bytes: usize,
    link: Arc<dyn RankLink>,
}

impl RemoteRank {
    fn gone(&self) -> WorkerError {
        WorkerError::Unavailable(format!("tensor-parallel group: rank {} on node {} is gone", self.rank, self.node))
    }

    /// Sends `m` and waits for the answer, which `pick` takes apart.
    fn ask<T>(&self, m: RankMsg, pick: impl FnOnce(RankMsg) -> Option<T>) -> WResult<T> {
        self.out.send(m).map_err(|_| self.gone())?;
        let answer = self.control.recv().map_err(|_| self.gone())?;
        pick(answer).ok_or_else(|| {
            let e = WorkerError::Unavailable(format!("tensor-parallel group: rank {} on node {} answered out of turn", self.rank, self.node));
            self.link.close("a rank answered out of turn");
            e
        })
    }
}

impl Backend for RemoteRank {
    fn shape(&self) -> Shape<'_> {
        Shape { config: &self.cfg, weight_bytes: self.weight_bytes, kv: self.geometry }
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], _logits: &mut Vec<f32>) -> WResult<usize> {
        let (mut tokens, mut tables) = (Vec::new(), Vec::new());
        let items: Vec<RankItem> = items
            .iter()
            .map(|it| {
                tokens.extend_from_slice(it.tokens);
                tables.extend_from_slice(it.block_table);
                RankItem { tokens: it.tokens.len() as u32, table: it.block_table.len() as u32, start_pos: it.start_pos as u32, logits: it.logits as u32 }
            })
            .collect();
        let error = self.ask(RankMsg::Forward { tokens, tables, items }, |a| match a {
            RankMsg::Done { error } => Some(error),
            _ => None,
        })?;
        match error {
            None => Ok(0),
            Some(e) => Err(WorkerError::Model(format!("rank {} on node {}: {e}", self.rank, self.node))),
        }
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> WResult<()> {
        let (bytes, error) = self.ask(RankMsg::Read { block: b }, |a| match a {
            RankMsg::Block { bytes, error } => Some((bytes, error)),
            _ => None,
        })?;
        if let Some(e) = error {
            return Err(WorkerError::Invalid(format!("rank {} on node {}: {e}", self.rank, self.node)));
        }
        out.extend_from_slice(&bytes);
        Ok(())
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> WResult<()> {
        let error = self.ask(RankMsg::Write { block: b, bytes: bytes.to_vec() }, |a| match a {
            RankMsg::Written { error } => Some(error),
            _ => None,
        })?;
        error.map_or(Ok(()), |e| Err(WorkerError::Invalid(format!("rank {} on node {}: {e}", self.rank, self.node))))
    }
    fn describe(&self) -> String {
        format!("node {}", self.node)
    }
}

impl Drop for RemoteRank {
    fn drop(&mut self) {
        // The group is going: the hosts' streams end with it.
        self.link.close("the group's leader stopped");
    }
}

/// A remote rank's stream, opened and joined, until it is a [`RemoteRank`].
pub struct PendingRank {
    pub node: String,
    pub rank: usize,
    pub channels: RankChannels,
}

impl PendingRank {
    /// The rank's next answer to its join, by `deadline`: `Joining`, then `Ready`.
    fn answer(&self, deadline: Instant) -> anyhow::Result<RankMsg> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        match self.channels.control.recv_timeout(left) {
            Ok(RankMsg::Failed { message }) => bail!("node {} could not host rank {}: {message}", self.node, self.rank),
            Ok(m) => Ok(m),
            Err(_) => bail!("node {} did not build rank {} in time (or closed the stream)", self.node, self.rank),
        }
    }
}

/// A group to form: worker `wc`'s ranks over `wc.rank_nodes`, rank 0 on this node.
pub struct Group {
    wc: WorkerConfig,
    cfg: ModelConfig,
    plans: Vec<ShardPlan>,
    num_blocks: usize,
    /// On GPUs: rank 0's device and the group's NCCL id.
    gpu: Option<(usize, [u8; 128])>,
    deadline: Instant,
}

impl Group {
    /// The group of worker `wc` of node `me` for a model of `cfg`, to be formed by `deadline`.
    pub fn plan(wc: &WorkerConfig, cfg: &ModelConfig, me: &str, deadline: Instant) -> anyhow::Result<Group> {
        let plans = ShardPlan::for_group(cfg, wc.rank_nodes.len())?;
        let num_blocks = KvCache::blocks_for(cfg, wc.block_size, wc.kv_dtype, wc.kv_cache_mb << 20)?;
        let gpu = match host::gpu_of(wc, 0, me) {
            Some(ordinal) => Some((ordinal, backend::gpu_group_id(ordinal)?)),
            None => None,
        };
        Ok(Group { wc: wc.clone(), cfg: cfg.clone(), plans, num_blocks, gpu, deadline })
    }

    /// The join that asks a node to host `rank` (sent first on that rank's stream).
    pub fn join_of(&self, me: &str, rank: usize) -> RankJoin {
        RankJoin {
            origin_node: me.into(),
            worker: self.wc.id.clone(),
            rank: rank as u32,
            size: self.plans.len() as u32,
            block_size: self.wc.block_size as u32,
            num_blocks: self.num_blocks as u32,
            nccl_id: self.gpu.map(|(_, id)| id.to_vec()).unwrap_or_default(),
        }
    }

    /// Waits for every remote rank (`ranks`, joined, in rank order) to be built, builds rank 0
    /// from `model`, and gives the group as one backend. `link` closes every stream if it
    /// breaks. Fails, saying which, if a rank refuses or is late.
    pub fn form(self, model: Model, mut ranks: Vec<PendingRank>, link: Arc<dyn RankLink>) -> anyhow::Result<Box<dyn Backend>> {
        for p in &ranks {
            match p.answer(self.deadline)? {
                RankMsg::Joining => {}
                _ => bail!("node {} answered the join of rank {} out of turn", p.node, p.rank),
            }
        }
        let lead = self.rank_zero(model, &mut ranks, &link)?;
        let mut shards = vec![lead];
        for p in ranks {
            shards.push(Box::new(self.remote(p, &link)?));
        }
        Ok(Box::new(TensorParallel::from_shards(self.cfg.clone(), &self.plans, shards)?))
    }

    /// Rank 0: on a GPU, joined to the NCCL group by the deadline; on the CPU, a shard summing
    /// through a star over the remote ranks' streams.
    fn rank_zero(&self, model: Model, ranks: &mut [PendingRank], link: &Arc<dyn RankLink>) -> anyhow::Result<Box<dyn Backend>> {
        let (wc, num_blocks) = (&self.wc, self.num_blocks);
        if let Some((ordinal, id)) = self.gpu {
            let (plan, bs) = (self.plans[0].clone(), wc.block_size);
            let left = self.deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            // A thread of its own, waited for with a timeout: a join that never completes (a
            // host gone mid-join) must not hold up its caller.
            let (tx, built) = std::sync::mpsc::channel();
            std::thread::Builder::new().name("zl-rank-0-join".into()).spawn(move || {
                let _ = tx.send(backend::gpu_rank(&model, &plan, ordinal, &id, bs, num_blocks));
            })?;
            return Ok(built.recv_timeout(left).map_err(|_| anyhow!("rank 0 could not join its NCCL group in time"))??);
        }
        // A star's partials are taken once: the channels' `sums` move into it.
        let star = ranks.iter_mut().map(|p| (p.channels.out.clone(), std::mem::replace(&mut p.channels.sums, std::sync::mpsc::sync_channel(0).1))).collect();
        let mut shard = model.shard(&self.plans[0], wc.threads)?;
        drop(model);
        shard.join(Box::new(StarLead::new(star, link.clone())))?;
        Ok(Box::new(Cpu::with_blocks(shard, wc.block_size, wc.kv_dtype, num_blocks)))
    }

    /// A remote rank once it answers `Ready` with the group's KV geometry.
    fn remote(&self, p: PendingRank, link: &Arc<dyn RankLink>) -> anyhow::Result<RemoteRank> {
        let (wc, cfg, num_blocks) = (&self.wc, &self.cfg, self.num_blocks);
        let weight_bytes = match p.answer(self.deadline)? {
            RankMsg::Ready { num_blocks: b, weight_bytes } if b as usize == num_blocks => weight_bytes,
            RankMsg::Ready { num_blocks: b, .. } => bail!("rank {} on node {} has {b} KV blocks, rank 0 {num_blocks}", p.rank, p.node),
            _ => bail!("node {} answered the join of rank {} out of turn", p.node, p.rank),
        };
        let part = self.plans[p.rank].kv_heads.len() * cfg.head_dim * wc.block_size * wc.kv_dtype.bytes() * 2 * cfg.n_layers;
        let geometry = KvGeometry { block_size: wc.block_size, num_blocks, dtype: wc.kv_dtype, block_bytes: part, bytes: part * num_blocks };
        let RankChannels { out, control, .. } = p.channels;
        Ok(RemoteRank {
            cfg: self.plans[p.rank].shard_cfg(cfg),
            node: p.node,
            rank: p.rank,
            out,
            control,
            geometry,
            weight_bytes: weight_bytes as usize,
            link: link.clone(),
        })
    }
}
