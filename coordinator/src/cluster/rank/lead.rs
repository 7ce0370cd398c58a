//! The leading node's side of a tensor-parallel group across nodes (see [`super`]): the QUIC
//! half. It dials each rank's node with the cluster's mutual TLS, opens one stream per rank and
//! sends its join; the worker's [`Group::form`] does the rest (rank 0's shard, the star, the
//! remote ranks as backends).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerolayer_common::config::WorkerConfig;
use zerolayer_common::wire::rank::RankJoin;
use zerolayer_common::wire::{self, Open};
use zerolayer_common::ClusterConfig;
use zerolayer_worker::backend::Backend;
use zerolayer_worker::model::Model;
use zerolayer_worker::ranks::lead::{Group, PendingRank};
use zerolayer_worker::ranks::RankChannels;

use super::{Connections, RankStream};
use crate::cluster::tls;

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
async fn open_rank(endpoint: &quinn::Endpoint, config: &ClusterConfig, node: &str, j: RankJoin, deadline: Instant, conns: &Connections) -> anyhow::Result<RankChannels> {
    let addr = address_of(config, node).await?;
    let rank = j.rank;
    let conn = loop {
        let attempt = async {
            let c = endpoint.connect(addr, tls::SERVER_NAME)?.await?;
            anyhow::ensure!(super::super::transport::reaches(&c, node), "the node at {addr} is not {node}: its certificate names another node");
            anyhow::Ok(c)
        };
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
    RankStream::start(&format!("lead-{rank}"), send, recv)
}

/// The backend of worker `wc` of node `me`, whose ranks `wc.rank_nodes` spread over nodes:
/// rank 0 here (a shard of `model`), the others joined on their nodes. Fails, saying which,
/// if a rank's node cannot be reached or refuses within `[cluster] rank_join_timeout_ms`.
pub async fn open_group(config: &ClusterConfig, me: &str, wc: &WorkerConfig, model: Model) -> anyhow::Result<Box<dyn Backend>> {
    let cc = &config.cluster;
    let deadline = Instant::now() + Duration::from_millis(cc.rank_join_timeout_ms);
    let group = Group::plan(wc, &model.cfg, me, deadline)?;
    let dir = cc.tls_dir.clone().ok_or_else(|| anyhow::anyhow!("[cluster] tls_dir is required for a group across nodes"))?;
    let mat = tls::TlsMaterial::load(&dir, me)?;
    let idle = Duration::from_millis(cc.idle_timeout_ms);
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([0, 0, 0, 0], 0)))?;
    endpoint.set_default_client_config(tls::client_config(&mat, idle)?);
    // The connections hold the endpoint: it lives as long as a rank of the group does.
    let conns = Connections::on(endpoint.clone());
    let formed = async {
        let mut ranks = Vec::with_capacity(wc.rank_nodes.len() - 1);
        for (rank, node) in wc.rank_nodes.iter().enumerate().skip(1) {
            let channels = open_rank(&endpoint, config, node, group.join_of(me, rank), deadline, &conns).await?;
            ranks.push(PendingRank { node: node.clone(), rank, channels });
        }
        let link = Arc::new(conns.clone());
        tokio::task::spawn_blocking(move || group.form(model, ranks, link)).await?
    };
    match formed.await {
        Ok(b) => Ok(b),
        Err(e) => {
            conns.close("the group could not be formed");
            Err(e)
        }
    }
}
