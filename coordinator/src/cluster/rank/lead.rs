//! The leading node's side of a tensor-parallel group across nodes (see [`super`]): rank 0 runs
//! here with the engine; [`RemoteRank`] stands for each rank a peer hosts.

use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::{Duration, Instant};

use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::{RankItem, RankJoin, RankMsg};
use zerolayer_common::wire::{self, Open};
use zerolayer_common::ClusterConfig;
use zerolayer_worker::backend::{self, Backend, Cpu, KvGeometry, TensorParallel};
use zerolayer_worker::error::{Result as WResult, WorkerError};
use zerolayer_worker::model::shard::ShardPlan;
use zerolayer_worker::model::{ForwardItem, KvCache, Model, ModelConfig};

use super::{Connections, Link, StarLead};
use crate::cluster::tls;

/// One rank of the group that a peer hosts, as the group's [`TensorParallel`] drives it: each
/// call sends a frame and waits for the rank's answer (module docs of [`super`]).
pub struct RemoteRank {
    cfg: ModelConfig,
    node: String,
    rank: usize,
    out: SyncSender<RankMsg>,
    control: Receiver<RankMsg>,
    geometry: KvGeometry,
    weight_bytes: usize,
    conns: Connections,
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
            self.conns.close("a rank answered out of turn");
            e
        })
    }
}

impl Backend for RemoteRank {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
    fn kv(&self) -> KvGeometry {
        self.geometry
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], _logits: &mut Vec<f32>) -> WResult<usize> {
        let (mut tokens, mut tables) = (Vec::new(), Vec::new());
        let items: Vec<RankItem> = items
            .iter()
            .map(|it| {
                tokens.extend_from_slice(it.tokens);
                tables.extend_from_slice(it.block_table);
                RankItem { tokens: it.tokens.len() as u32, table: it.block_table.len() as u32, start_pos: it.start_pos as u32, want_logits: it.want_logits }
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
        self.conns.close("the group's leader stopped");
    }
}

/// A peer's QUIC address from the config (a `host:port` is resolved).
async fn address_of(config: &ClusterConfig, node: &str) -> anyhow::Result<SocketAddr> {
    let n = config.node(node).ok_or_else(|| anyhow::anyhow!("node {node:?} is not in the config"))?;
    let q = n.quic.as_deref().ok_or_else(|| anyhow::anyhow!("node {node:?} has no quic address"))?;
    if let Ok(a) = q.parse::<SocketAddr>() {
        return Ok(a);
    }
    tokio::net::lookup_host(q).await?.next().ok_or_else(|| anyhow::anyhow!("quic address {q:?} of node {node:?} did not resolve"))
}

/// Opens the stream of rank `j.rank` on `node` and sends its join: connects, retrying until
/// `deadline` (the peer may still be starting).
async fn open_rank(endpoint: &quinn::Endpoint, config: &ClusterConfig, node: &str, j: RankJoin, deadline: Instant, conns: &Connections) -> anyhow::Result<Link> {
    let addr = address_of(config, node).await?;
    let rank = j.rank;
    let conn = loop {
        let attempt = async { anyhow::Ok(endpoint.connect(addr, tls::SERVER_NAME)?.await?) };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(c)) => break c,
            Ok(Err(e)) if Instant::now() < deadline => tracing::debug!(node, error = %e, "waiting for the node that hosts a rank"),
            Err(_) if Instant::now() < deadline => {}
            Ok(Err(e)) => anyhow::bail!("node {node} ({addr}) for rank {rank}: {e}"),
            Err(_) => anyhow::bail!("node {node} ({addr}) for rank {rank}: connecting timed out"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    conns.add(conn.clone());
    let (mut send, recv) = conn.open_bi().await?;
    send.write_all(&wire::encode_open(&Open::Rank(j))?).await?;
    Link::start(&format!("lead-{rank}"), send, recv)
}

/// A rank on its way: where its frames go and come from, until it is a [`RemoteRank`].
struct Pending {
    node: String,
    rank: usize,
    out: SyncSender<RankMsg>,
    sums: Option<Receiver<RankMsg>>,
    control: Receiver<RankMsg>,
}

impl Pending {
    /// The rank's next answer to its join, by `deadline`: `Joining`, then `Ready`.
    async fn answer(self, deadline: Instant) -> anyhow::Result<(Pending, RankMsg)> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        let (p, a) = tokio::task::spawn_blocking(move || {
            let a = self.control.recv_timeout(left);
            (self, a)
        })
        .await?;
        match a {
            Ok(RankMsg::Failed { message }) => anyhow::bail!("node {} could not host rank {}: {message}", p.node, p.rank),
            Ok(m) => Ok((p, m)),
            Err(_) => anyhow::bail!("node {} did not build rank {} in time (or closed the stream)", p.node, p.rank),
        }
    }
}

/// The backend of worker `wc` of node `me`, whose ranks `wc.rank_nodes` spread over nodes:
/// rank 0 here (a shard of `model`), the others joined on their nodes. Fails, saying which,
/// if a rank's node cannot be reached or refuses within `[cluster] rank_join_timeout_ms`.
///
/// The order matters on GPUs: every host has checked the join and loaded the model
/// (`Joining`) before rank 0 joins the NCCL group, so that a refusal cannot leave rank 0
/// waiting in NCCL for a rank that will never come; then the hosts' joins complete with rank
/// 0's, and each answers `Ready`.
pub async fn open_group(config: &ClusterConfig, me: &str, wc: &WorkerConfig, model: Model) -> anyhow::Result<Box<dyn Backend>> {
    let size = wc.rank_nodes.len();
    let cfg = model.cfg.clone();
    let plans = ShardPlan::for_group(&cfg, size)?;
    let num_blocks = KvCache::blocks_for(&cfg, wc.block_size, wc.kv_dtype, wc.kv_cache_mb << 20)?;
    let gpu = super::host::gpu_of(wc, 0, me);
    let nccl_id = match gpu {
        Some(ordinal) => Some(backend::gpu_group_id(ordinal)?),
        None => None,
    };
    let cc = &config.cluster;
    let dir = cc.tls_dir.clone().ok_or_else(|| anyhow::anyhow!("[cluster] tls_dir is required for a group across nodes"))?;
    let mat = tls::TlsMaterial::load(&dir, me)?;
    let idle = Duration::from_millis(cc.idle_timeout_ms);
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([0, 0, 0, 0], 0)))?;
    endpoint.set_default_client_config(tls::client_config(&mat, idle)?);
    let deadline = Instant::now() + Duration::from_millis(cc.rank_join_timeout_ms);
    // The connections hold the endpoint: it lives as long as a rank of the group does.
    let conns = Connections::on(endpoint.clone());
    let formed = form(&endpoint, config, me, wc, model, &plans, num_blocks, gpu.zip(nccl_id), deadline, &conns).await;
    let shards = match formed {
        Ok(s) => s,
        Err(e) => {
            conns.close("the group could not be formed");
            return Err(e);
        }
    };
    Ok(Box::new(TensorParallel::from_shards(cfg, &plans, shards)?))
}

/// Joins every remote rank and builds rank 0 (see [`open_group`]): the group's shards in rank
/// order.
#[allow(clippy::too_many_arguments)]
async fn form(
    endpoint: &quinn::Endpoint,
    config: &ClusterConfig,
    me: &str,
    wc: &WorkerConfig,
    model: Model,
    plans: &[ShardPlan],
    num_blocks: usize,
    gpu: Option<(usize, [u8; 128])>,
    deadline: Instant,
    conns: &Connections,
) -> anyhow::Result<Vec<Box<dyn Backend>>> {
    let cfg = model.cfg.clone();
    let size = plans.len();
    let mut pending = Vec::with_capacity(size - 1);
    for (rank, node) in wc.rank_nodes.iter().enumerate().skip(1) {
        let j = RankJoin {
            origin_node: me.into(),
            worker: wc.id.clone(),
            rank: rank as u32,
            size: size as u32,
            block_size: wc.block_size as u32,
            num_blocks: num_blocks as u32,
            nccl_id: gpu.map(|(_, id)| id.to_vec()).unwrap_or_default(),
        };
        let Link { out, sums, control } = open_rank(endpoint, config, node, j, deadline, conns).await?;
        pending.push(Pending { node: node.clone(), rank, out, sums: Some(sums), control });
    }
    let mut joining = Vec::with_capacity(pending.len());
    for p in pending {
        match p.answer(deadline).await? {
            (p, RankMsg::Joining) => joining.push(p),
            (p, _) => anyhow::bail!("node {} answered the join of rank {} out of turn", p.node, p.rank),
        }
    }
    let lead: Box<dyn Backend> = match gpu {
        Some((ordinal, id)) => {
            let (plan, bs) = (plans[0].clone(), wc.block_size);
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            // A thread of its own, not the runtime's blocking pool: a join that never completes
            // (a host gone mid-join) must not hold up the runtime's shutdown.
            let (tx, built) = tokio::sync::oneshot::channel();
            std::thread::Builder::new().name("zl-rank-0-join".into()).spawn(move || {
                let _ = tx.send(backend::gpu_rank(&model, &plan, ordinal, &id, bs, num_blocks));
            })?;
            tokio::time::timeout(left, built).await.map_err(|_| anyhow::anyhow!("rank 0 could not join its NCCL group in time"))???
        }
        None => {
            let star = joining.iter_mut().map(|p| (p.out.clone(), p.sums.take().expect("a star's partials, once"))).collect();
            let mut shard = model.shard(&plans[0], wc.threads)?;
            drop(model);
            shard.join(Box::new(StarLead::new(star, conns.clone())))?;
            Box::new(Cpu::with_blocks(shard, wc.block_size, wc.kv_dtype, num_blocks))
        }
    };
    let mut shards = vec![lead];
    for p in joining {
        let (p, weight_bytes) = match p.answer(deadline).await? {
            (p, RankMsg::Ready { num_blocks: b, weight_bytes }) if b as usize == num_blocks => (p, weight_bytes),
            (p, RankMsg::Ready { num_blocks: b, .. }) => anyhow::bail!("rank {} on node {} has {b} KV blocks, rank 0 {num_blocks}", p.rank, p.node),
            (p, _) => anyhow::bail!("node {} answered the join of rank {} out of turn", p.node, p.rank),
        };
        let part = plans[p.rank].kv_heads.len() * cfg.head_dim * wc.block_size * wc.kv_dtype.bytes() * 2 * cfg.n_layers;
        let geometry = KvGeometry { block_size: wc.block_size, num_blocks, dtype: wc.kv_dtype, block_bytes: part, bytes: part * num_blocks };
        shards.push(Box::new(RemoteRank {
            cfg: plans[p.rank].shard_cfg(&cfg),
            node: p.node,
            rank: p.rank,
            out: p.out,
            control: p.control,
            geometry,
            weight_bytes: weight_bytes as usize,
            conns: conns.clone(),
        }));
    }
    Ok(shards)
}
