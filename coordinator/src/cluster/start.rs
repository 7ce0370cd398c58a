//! Starting a node's cluster link: binds QUIC (mutual TLS), joins chitchat over it, and spawns
//! the publisher and the accept loop, which [`Cluster`] then owns.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chitchat::{ChitchatConfig, ChitchatId, FailureDetectorConfig};
use zerolayer_common::ClusterConfig;

use super::gossip::{KEY_HTTP, KEY_STATE};
use super::handle::{Cluster, LocalWorker, Net};
use super::transport::{Peers, QuicTransport};
use super::identity::Signer;
use super::{accept, publisher, tls};
use crate::quota::Quota;
use crate::view::NodeState;

impl Cluster {
    /// Starts the link for `node_id`. With a `quic` address in the config, binds it (or uses
    /// `socket`, already bound, as tests do) and joins the other nodes of the config.
    pub async fn start(
        config: &ClusterConfig,
        node_id: &str,
        workers: &[LocalWorker],
        socket: Option<std::net::UdpSocket>,
        quota: Arc<Quota>,
    ) -> anyhow::Result<Arc<Cluster>> {
        let me = config.node(node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the config"))?;
        let net = match (&me.quic, socket) {
            (None, None) => None,
            (addr, socket) => Some(join(config, node_id, addr.as_deref(), socket).await?),
        };
        let cluster = Arc::new(Cluster::new(node_id, config, workers, me.http.clone(), net, quota));
        let kv_rx = cluster.local.iter().map(|l| l.worker.handle.kv_events()).collect();
        let mut tasks = vec![tokio::spawn(publisher::run(Arc::downgrade(&cluster), kv_rx))];
        if cluster.net.is_some() {
            tasks.push(tokio::spawn(accept::run(cluster.clone())));
        }
        *cluster.tasks.lock().unwrap_or_else(|e| e.into_inner()) = tasks;
        Ok(cluster)
    }
}

/// A node's own `quic` address: an IP address is bound as it is; a `host:port` (a Kubernetes
/// pod's DNS name) binds every interface on that port and is resolved for peers to dial (retried
/// for a while: a pod's DNS record appears shortly after the pod).
async fn quic_addresses(addr: &str) -> anyhow::Result<(SocketAddr, SocketAddr)> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok((a, a));
    }
    let (_, port) = addr.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("quic address {addr:?}: expected host:port"))?;
    let port: u16 = port.parse().map_err(|e| anyhow::anyhow!("quic address {addr:?}: port: {e}"))?;
    let mut last = None;
    for _ in 0..60 {
        match tokio::net::lookup_host(addr).await {
            Ok(mut found) => {
                if let Some(a) = found.next() {
                    return Ok((SocketAddr::from(([0, 0, 0, 0], port)), a));
                }
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    anyhow::bail!("quic address {addr:?} did not resolve: {last:?}")
}

/// Binds the endpoint and starts chitchat on it.
async fn join(config: &ClusterConfig, node_id: &str, addr: Option<&str>, socket: Option<std::net::UdpSocket>) -> anyhow::Result<Net> {
    let cc = &config.cluster;
    let me = config.node(node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the config"))?;
    let (socket, advertise) = match socket {
        Some(s) => (s, None),
        None => {
            let (bind, advertise) = quic_addresses(addr.unwrap_or_default()).await?;
            (std::net::UdpSocket::bind(bind).map_err(|e| anyhow::anyhow!("binding QUIC on {bind}: {e}"))?, Some(advertise))
        }
    };
    let dir = cc.tls_dir.clone().ok_or_else(|| anyhow::anyhow!("[cluster] tls_dir is required for QUIC"))?;
    let mat = tls::TlsMaterial::load(&dir, node_id)?;
    let idle = Duration::from_millis(cc.idle_timeout_ms);
    let endpoint = tls::endpoint(socket, &mat, idle)?;
    // What peers dial: the configured address (resolved), or the bound one (port 0 in tests).
    let addr = match advertise {
        Some(a) if a.port() != 0 => a,
        _ => endpoint.local_addr()?,
    };
    let peers = Arc::new(Peers::new(endpoint.clone(), idle));
    let generation = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let policy = super::screen::Policy {
        me: node_id.to_string(),
        generation,
        configured: config.nodes.iter().map(|n| n.id.clone()).collect(),
        allow_join: cc.allow_join,
    };
    let (transport, relays) = QuicTransport::new(peers.clone(), addr, policy).await?;
    let gossip = Duration::from_millis(cc.gossip_interval_ms);
    // Peers whose address is still port 0 (started later, port picked by the OS) are learned
    // through gossip when they contact a seed.
    let seeds: Vec<String> =
        config.nodes.iter().filter(|n| n.id != node_id).filter_map(|n| n.quic.clone()).filter(|a| !a.ends_with(":0")).collect();
    let cfg = ChitchatConfig {
        chitchat_id: ChitchatId::new(node_id.to_string(), generation, addr),
        cluster_id: cc.id.clone(),
        gossip_interval: gossip,
        listen_addr: addr,
        seed_nodes: seeds,
        failure_detector_config: FailureDetectorConfig {
            phi_threshold: cc.phi_threshold,
            sampling_window_size: 1000,
            max_interval: Duration::from_secs(10),
            initial_interval: gossip * 2,
            dead_node_grace_period: Duration::from_secs(cc.dead_node_grace_secs.max(1)),
        },
        marked_for_deletion_grace_period: Duration::from_secs(cc.dead_node_grace_secs.max(1)),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: chitchat::ProtocolVersion::V0,
    };
    let initial = vec![(KEY_STATE.to_string(), NodeState::Joining.as_str().to_string()), (KEY_HTTP.to_string(), me.http.clone())];
    let chitchat = chitchat::spawn_chitchat(cfg, initial, &transport).await?;
    relays.screen.attach(chitchat.chitchat());
    let leaf = mat.chain.first().ok_or_else(|| anyhow::anyhow!("{node_id}.pem holds no certificate"))?;
    let signer = Signer::new(node_id, generation, addr, leaf, &mat.key)?;
    Ok(Net { generation, endpoint, peers, addr, chitchat, relays, signer, ca: mat.ca.clone() })
}
