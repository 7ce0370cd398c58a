//! The leading node's side of a tensor-parallel group across nodes (see [`super`]): rank 0 runs
//! here with the engine; [`RemoteRank`] stands for each rank a peer hosts.

use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, SyncSender};
use std::time::{Duration, Instant};

use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::{RankItem, RankJoin, RankMsg};
use zerolayer_common::wire::{self, Open};
use zerolayer_common::ClusterConfig;
use zerolayer_worker::backend::{Backend, Cpu, KvGeometry, TensorParallel};
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
        format!("rank {} on node {}", self.rank, self.node)
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

/// Joins rank `rank` on `node`: connects (retrying until `deadline`: the peer may still be
/// starting), opens the stream, sends the join and waits for the rank to be built.
async fn join(endpoint: &quinn::Endpoint, config: &ClusterConfig, node: &str, j: RankJoin, deadline: Instant, conns: &Connections) -> anyhow::Result<(Link, u32, u64)> {
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
    let link = Link::start(&format!("lead-{rank}"), send, recv)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
    let (link, answer) = tokio::task::spawn_blocking(move || {
        let a = link.control.recv_timeout(left);
        (link, a)
    })
    .await?;
    match answer {
        Ok(RankMsg::Ready { num_blocks, weight_bytes }) => Ok((link, num_blocks, weight_bytes)),
        Ok(RankMsg::Failed { message }) => anyhow::bail!("node {node} could not host rank {rank}: {message}"),
        Ok(_) => anyhow::bail!("node {node} answered the join of rank {rank} out of turn"),
        Err(_) => anyhow::bail!("node {node} did not build rank {rank} in time (or closed the stream)"),
    }
}

/// The backend of worker `wc` of node `me`, whose ranks `wc.rank_nodes` spread over nodes:
/// rank 0 here (a shard of `model`), the others joined on their nodes. Fails, saying which,
/// if a rank's node cannot be reached or refuses within `[cluster] rank_join_timeout_ms`.
pub async fn open_group(config: &ClusterConfig, me: &str, wc: &WorkerConfig, model: Model) -> anyhow::Result<Box<dyn Backend>> {
    let size = wc.rank_nodes.len();
    let cfg = model.cfg.clone();
    let plans = ShardPlan::for_group(&cfg, size)?;
    let num_blocks = KvCache::blocks_for(&cfg, wc.block_size, wc.kv_cache_mb << 20)?;
    let cc = &config.cluster;
    let dir = cc.tls_dir.clone().ok_or_else(|| anyhow::anyhow!("[cluster] tls_dir is required for a group across nodes"))?;
    let mat = tls::TlsMaterial::load(&dir, me)?;
    let idle = Duration::from_millis(cc.idle_timeout_ms);
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([0, 0, 0, 0], 0)))?;
    endpoint.set_default_client_config(tls::client_config(&mat, idle)?);
    let deadline = Instant::now() + Duration::from_millis(cc.rank_join_timeout_ms);
    let conns = Connections::default();
    let mut links = Vec::with_capacity(size - 1);
    for (rank, node) in wc.rank_nodes.iter().enumerate().skip(1) {
        let j = RankJoin { origin_node: me.into(), worker: wc.id.clone(), rank: rank as u32, size: size as u32, block_size: wc.block_size as u32, num_blocks: num_blocks as u32 };
        match join(&endpoint, config, node, j, deadline, &conns).await {
            Ok((link, blocks, weight_bytes)) if blocks as usize == num_blocks => links.push((node.clone(), rank, link, weight_bytes)),
            Ok((_, blocks, _)) => {
                conns.close("the ranks disagree on the KV blocks");
                anyhow::bail!("rank {rank} on node {node} has {blocks} KV blocks, rank 0 {num_blocks}");
            }
            Err(e) => {
                conns.close("the group could not be formed");
                return Err(e);
            }
        }
    }
    let mut shard = model.shard(&plans[0], wc.threads)?;
    drop(model);
    let mut star = Vec::with_capacity(links.len());
    let mut shards: Vec<Box<dyn Backend>> = Vec::with_capacity(size);
    let mut remotes = Vec::with_capacity(links.len());
    for (node, rank, link, weight_bytes) in links {
        let Link { out, sums, control } = link;
        star.push((out.clone(), sums));
        let part = plans[rank].kv_heads.len() * cfg.head_dim * wc.block_size * std::mem::size_of::<f32>() * 2 * cfg.n_layers;
        let geometry = KvGeometry { block_size: wc.block_size, num_blocks, block_bytes: part, bytes: part * num_blocks };
        remotes.push(RemoteRank { cfg: plans[rank].shard_cfg(&cfg), node, rank, out, control, geometry, weight_bytes: weight_bytes as usize, conns: conns.clone() });
    }
    shard.join(Box::new(StarLead::new(star, conns.clone())))?;
    shards.push(Box::new(Cpu::with_blocks(shard, wc.block_size, num_blocks)));
    shards.extend(remotes.into_iter().map(|r| Box::new(r) as Box<dyn Backend>));
    // The endpoint must outlive the connections: it drives them.
    let group = TensorParallel::from_shards(cfg, &plans, shards)?;
    Ok(Box::new(Grouped { group, _endpoint: endpoint }))
}

/// The group, holding the endpoint its remote ranks' connections run on.
struct Grouped {
    group: TensorParallel,
    _endpoint: quinn::Endpoint,
}

impl Backend for Grouped {
    fn config(&self) -> &ModelConfig {
        self.group.config()
    }
    fn weight_bytes(&self) -> usize {
        self.group.weight_bytes()
    }
    fn kv(&self) -> KvGeometry {
        self.group.kv()
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> WResult<usize> {
        self.group.forward_into(items, logits)
    }
    fn forward_pick(&mut self, items: &[ForwardItem<'_>], picks: &[zerolayer_worker::sampler::Pick], logits: &mut Vec<f32>, picked: &mut zerolayer_worker::sampler::Picked) -> WResult<usize> {
        self.group.forward_pick(items, picks, logits, picked)
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> WResult<()> {
        self.group.read_block(b, out)
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> WResult<()> {
        self.group.write_block(b, bytes)
    }
    fn describe(&self) -> String {
        format!("{} (ranks across nodes)", self.group.describe())
    }
}
