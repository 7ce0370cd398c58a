//! The cluster link of one node: membership, signal and prefix-cache gossip, the
//! [`ClusterView`] placement reads, and forwarding over QUIC.
//!
//! - **Transport.** One quinn endpoint per node, mutual TLS against the cluster CA
//!   ([`tls`]). It carries chitchat gossip (uni streams, [`transport`]) and forwarded requests
//!   (bi streams, [`forward`]).
//! - **Membership.** chitchat (scuttlebutt + phi-accrual failure detection). Each node publishes
//!   `state` (joining / ready / draining), `http`, and per worker `w:<id>` (device, queue
//!   limit), `sig:<id>` (its [`WorkerSignals`], JSON) and `kv:<id>:<shard>` (its cached block
//!   hashes, 16 shards by the hash's top 4 bits, so one stored block rewrites 1/16 of the digest).
//!   A node the failure detector gives up on is `dead`.
//! - **Publisher.** One task per node, every `publish_interval_ms`: it applies the local
//!   workers' KV events to exact per-worker hash sets (resyncing from a snapshot if it lagged),
//!   writes signals and changed shards into chitchat, and rebuilds the remote part of the view
//!   from gossip (re-parsing only the keys whose version changed).
//! - **View.** [`Cluster::view`] joins fresh local signals with the latest remote snapshot. A
//!   single node (no `quic` address) runs the same code with no network: the view is local.
//!
//! Every task is owned here and stops in [`Cluster::stop`] (graceful) or [`Cluster::kill`].

pub mod forward;
pub mod tls;
pub mod transport;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chitchat::{ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig};
use serde::Serialize;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use zerolayer_common::{ClusterConfig, KvEvent, WorkerSignals};

use crate::coordinator::LocalWorker;
use crate::placement::{ClusterView, NodeState, WorkerView};
use transport::{Peers, QuicTransport, Relays, MAX_GOSSIP_BYTES};

/// The shortest silence after which a peer the failure detector gives up on counts as dead.
const MIN_DEAD_SILENCE: Duration = Duration::from_millis(1500);

/// Shards of a worker's published prefix digest.
const KV_SHARDS: usize = 16;

fn shard_of(h: u64) -> usize {
    (h >> 60) as usize
}

/// A node as seen through membership (for `/admin/cluster` and forwarding).
#[derive(Clone, Debug, Serialize)]
pub struct NodeInfo {
    pub id: String,
    pub state: NodeState,
    pub http: String,
    pub quic: Option<SocketAddr>,
    pub generation: u64,
    pub local: bool,
}

struct LocalState {
    worker: LocalWorker,
    device: String,
    cached: RwLock<Arc<HashSet<u64>>>,
}

/// The network half: present when the node has a `quic` address.
pub struct Net {
    pub endpoint: quinn::Endpoint,
    pub peers: Arc<Peers>,
    pub addr: SocketAddr,
    chitchat: ChitchatHandle,
    relays: Arc<Relays>,
}

pub struct Cluster {
    pub node_id: String,
    config: ClusterConfig,
    local: Vec<LocalState>,
    remote: RwLock<Arc<Vec<WorkerView>>>,
    nodes: RwLock<Arc<Vec<NodeInfo>>>,
    state: AtomicU8,
    http: Mutex<String>,
    pub net: Option<Net>,
    /// Forwarded sequences this node is running for other coordinators.
    pub serving_remote: AtomicUsize,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

fn state_code(s: NodeState) -> u8 {
    match s {
        NodeState::Joining => 0,
        NodeState::Ready => 1,
        NodeState::Draining => 2,
        NodeState::Dead => 3,
    }
}

fn code_state(c: u8) -> NodeState {
    match c {
        1 => NodeState::Ready,
        2 => NodeState::Draining,
        3 => NodeState::Dead,
        _ => NodeState::Joining,
    }
}

#[derive(Serialize, serde::Deserialize)]
struct WorkerDesc {
    device: String,
    max_waiting: u32,
}

impl Cluster {
    /// Starts the link for `node_id`. With a `quic` address in the config, binds it (or uses
    /// `socket`, already bound, as tests do) and joins the other nodes of the config.
    pub async fn start(
        config: &ClusterConfig,
        node_id: &str,
        workers: &[LocalWorker],
        socket: Option<std::net::UdpSocket>,
    ) -> anyhow::Result<Arc<Cluster>> {
        let me = config.node(node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the config"))?;
        let local = workers
            .iter()
            .map(|w| LocalState {
                worker: w.clone(),
                device: me.workers.iter().find(|c| c.id == w.id).map(|c| c.device.clone()).unwrap_or_else(|| "cpu".into()),
                cached: RwLock::new(Arc::new(HashSet::new())),
            })
            .collect();
        let cc = &config.cluster;
        let net = match (&me.quic, socket) {
            (None, None) => None,
            (addr, socket) => {
                let socket = match socket {
                    Some(s) => s,
                    None => {
                        let a: SocketAddr = addr.as_deref().unwrap_or_default().parse().map_err(|e| anyhow::anyhow!("quic address {addr:?}: {e}"))?;
                        std::net::UdpSocket::bind(a).map_err(|e| anyhow::anyhow!("binding QUIC on {a}: {e}"))?
                    }
                };
                let dir = cc.tls_dir.clone().ok_or_else(|| anyhow::anyhow!("[cluster] tls_dir is required for QUIC"))?;
                let mat = tls::TlsMaterial::load(&dir, node_id)?;
                let idle = Duration::from_millis(cc.idle_timeout_ms);
                let endpoint = tls::endpoint(socket, &mat, idle)?;
                let addr = endpoint.local_addr()?;
                let peers = Arc::new(Peers::new(endpoint.clone(), idle));
                let (transport, relays) = QuicTransport::new(peers.clone(), addr).await?;
                let generation = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
                let gossip = Duration::from_millis(cc.gossip_interval_ms);
                // Peers whose address is still port 0 (started later, port picked by the OS) are
                // learned through gossip when they contact a seed.
                let seeds: Vec<String> = config
                    .nodes
                    .iter()
                    .filter(|n| n.id != node_id)
                    .filter_map(|n| n.quic.clone())
                    .filter(|a| !a.ends_with(":0"))
                    .collect();
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
                        dead_node_grace_period: Duration::from_secs(3600),
                    },
                    marked_for_deletion_grace_period: Duration::from_secs(3600),
                    catchup_callback: None,
                    extra_liveness_predicate: None,
                    protocol_version: chitchat::ProtocolVersion::V0,
                };
                let initial = vec![("state".to_string(), "joining".to_string()), ("http".to_string(), me.http.clone())];
                let chitchat = chitchat::spawn_chitchat(cfg, initial, &transport).await?;
                Some(Net { endpoint, peers, addr, chitchat, relays })
            }
        };
        let cluster = Arc::new(Cluster {
            node_id: node_id.to_string(),
            config: config.clone(),
            local,
            remote: RwLock::new(Arc::new(Vec::new())),
            nodes: RwLock::new(Arc::new(Vec::new())),
            state: AtomicU8::new(state_code(NodeState::Joining)),
            http: Mutex::new(me.http.clone()),
            net,
            serving_remote: AtomicUsize::new(0),
            tasks: Mutex::new(Vec::new()),
        });
        let mut tasks = Vec::new();
        let kv_rx: Vec<broadcast::Receiver<KvEvent>> = cluster.local.iter().map(|l| l.worker.handle.kv_events()).collect();
        tasks.push(tokio::spawn(publisher(Arc::downgrade(&cluster), kv_rx)));
        if cluster.net.is_some() {
            tasks.push(tokio::spawn(accept_loop(cluster.clone())));
        }
        *cluster.tasks.lock().unwrap() = tasks;
        Ok(cluster)
    }

    /// This node's membership state.
    pub fn state(&self) -> NodeState {
        code_state(self.state.load(Ordering::Acquire))
    }

    pub fn set_state(&self, s: NodeState) {
        self.state.store(state_code(s), Ordering::Release);
    }

    /// The HTTP address peers and `zerolayer status` should use for this node.
    pub fn set_http_addr(&self, addr: String) {
        *self.http.lock().unwrap() = addr;
    }

    pub fn local_worker(&self, id: &str) -> Option<&LocalWorker> {
        self.local.iter().find(|l| l.worker.id == id).map(|l| &l.worker)
    }

    /// The QUIC address of this node, if it is in a cluster.
    pub fn quic_addr(&self) -> Option<SocketAddr> {
        self.net.as_ref().map(|n| n.addr)
    }

    /// What placement sees now: fresh local signals plus the latest gossip.
    pub fn view(&self) -> ClusterView {
        let state = self.state();
        let mut workers: Vec<WorkerView> = self
            .local
            .iter()
            .map(|l| WorkerView {
                node: self.node_id.clone(),
                worker: l.worker.id.clone(),
                local: true,
                state,
                device: l.device.clone(),
                max_waiting: l.worker.max_waiting as u32,
                signals: l.worker.handle.signals(),
                cached: l.cached.read().unwrap().clone(),
            })
            .collect();
        workers.extend(self.remote.read().unwrap().iter().cloned());
        ClusterView { workers }
    }

    /// Every node known, this one first.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut out = vec![NodeInfo {
            id: self.node_id.clone(),
            state: self.state(),
            http: self.http.lock().unwrap().clone(),
            quic: self.quic_addr(),
            generation: 0,
            local: true,
        }];
        out.extend(self.nodes.read().unwrap().iter().cloned());
        out
    }

    /// The QUIC address of a live peer.
    pub fn peer_addr(&self, node: &str) -> Option<SocketAddr> {
        self.nodes.read().unwrap().iter().find(|n| n.id == node && n.state != NodeState::Dead).and_then(|n| n.quic)
    }

    /// Leaves the cluster gracefully: gossips `draining`, then closes connections and stops tasks.
    pub async fn stop(&self) {
        self.set_state(NodeState::Draining);
        if let Some(net) = &self.net {
            net.chitchat.with_chitchat(|c| c.self_node_state().set("state", "draining")).await;
            // One more gossip round so peers hear it before the connections close.
            tokio::time::sleep(Duration::from_millis(self.config.cluster.gossip_interval_ms * 2)).await;
        }
        self.kill();
    }

    /// Stops at once, as a crash would look to peers: tasks end and connections close.
    pub fn kill(&self) {
        self.set_state(NodeState::Dead);
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
        if let Some(net) = &self.net {
            let _ = net.chitchat.initiate_shutdown();
            net.peers.close_all();
            net.relays.clear();
            net.endpoint.close(0u32.into(), b"node stopped");
        }
    }
}

/// Accepts peer connections (mutual TLS is enforced by the endpoint's config) and dispatches
/// their streams: uni = gossip, bi = a forwarded request.
async fn accept_loop(cluster: Arc<Cluster>) {
    let Some(net) = &cluster.net else { return };
    while let Some(incoming) = net.endpoint.accept().await {
        let c = cluster.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(%remote, error = %e, "refused a peer connection (TLS handshake failed)");
                    return;
                }
            };
            let relays = c.net.as_ref().map(|n| n.relays.clone()).expect("net");
            loop {
                tokio::select! {
                    uni = conn.accept_uni() => {
                        let Ok(mut s) = uni else { break };
                        let relays = relays.clone();
                        tokio::spawn(async move {
                            if let Ok(bytes) = s.read_to_end(MAX_GOSSIP_BYTES).await {
                                relays.deliver(remote, &bytes).await;
                            }
                        });
                    }
                    bi = conn.accept_bi() => {
                        let Ok((send, recv)) = bi else { break };
                        tokio::spawn(forward::serve(c.clone(), send, recv, remote));
                    }
                }
            }
        });
    }
}

/// Cached parse of one remote worker's digest: the shard versions it was built from.
struct DigestCache {
    versions: [u64; KV_SHARDS],
    set: Arc<HashSet<u64>>,
}

async fn publisher(cluster: std::sync::Weak<Cluster>, mut kv_rx: Vec<broadcast::Receiver<KvEvent>>) {
    let interval = match cluster.upgrade() {
        Some(c) => Duration::from_millis(c.config.cluster.publish_interval_ms),
        None => return,
    };
    let mut sets: Vec<HashSet<u64>> = vec![HashSet::new(); kv_rx.len()];
    let mut dirty: Vec<[bool; KV_SHARDS]> = vec![[true; KV_SHARDS]; kv_rx.len()];
    let mut described = false;
    let mut digests: HashMap<(String, String), DigestCache> = HashMap::new();
    // When each peer's heartbeat last advanced, as seen here.
    let mut heard: HashMap<ChitchatId, (chitchat::Heartbeat, std::time::Instant)> = HashMap::new();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(c) = cluster.upgrade() else { return };
        // 1. Local prefix sets from KV events.
        for (i, rx) in kv_rx.iter_mut().enumerate() {
            let mut changed = false;
            loop {
                match rx.try_recv() {
                    Ok(KvEvent::Stored { hashes }) => {
                        for h in hashes {
                            if sets[i].insert(h) {
                                dirty[i][shard_of(h)] = true;
                                changed = true;
                            }
                        }
                    }
                    Ok(KvEvent::Evicted { hashes }) => {
                        for h in hashes {
                            if sets[i].remove(&h) {
                                dirty[i][shard_of(h)] = true;
                                changed = true;
                            }
                        }
                    }
                    Err(broadcast::error::TryRecvError::Lagged(n)) => {
                        tracing::debug!(worker = %c.local[i].worker.id, missed = n, "KV events lagged; resyncing");
                        if let Ok(all) = c.local[i].worker.handle.cached_hashes().await {
                            sets[i] = all.into_iter().collect();
                            dirty[i] = [true; KV_SHARDS];
                            changed = true;
                        }
                    }
                    Err(_) => break,
                }
            }
            if changed {
                *c.local[i].cached.write().unwrap() = Arc::new(sets[i].clone());
            }
        }
        // 2. Gossip: publish, then read everyone else.
        let Some(net) = &c.net else { continue };
        let handle = net.chitchat.chitchat();
        let mut chitchat = handle.lock().await;
        let http = c.http.lock().unwrap().clone();
        {
            let me = chitchat.self_node_state();
            me.set("state", c.state().as_str());
            me.set("http", http);
            for (i, l) in c.local.iter().enumerate() {
                let id = &l.worker.id;
                if !described {
                    let d = WorkerDesc { device: l.device.clone(), max_waiting: l.worker.max_waiting as u32 };
                    me.set(format!("w:{id}"), serde_json::to_string(&d).unwrap_or_default());
                }
                me.set(format!("sig:{id}"), serde_json::to_string(&l.worker.handle.signals()).unwrap_or_default());
                for s in 0..KV_SHARDS {
                    if dirty[i][s] {
                        let mut hs: Vec<u64> = sets[i].iter().copied().filter(|h| shard_of(*h) == s).collect();
                        hs.sort_unstable();
                        let mut v = String::with_capacity(hs.len() * 16);
                        for h in hs {
                            v.push_str(&format!("{h:016x}"));
                        }
                        me.set(format!("kv:{id}:{s:x}"), v);
                        dirty[i][s] = false;
                    }
                }
            }
            described = true;
        }
        let dead: HashSet<ChitchatId> = chitchat.dead_nodes().cloned().collect();
        let live: HashSet<ChitchatId> = chitchat.live_nodes().cloned().collect();
        // The newest generation of each node id wins.
        let mut latest: BTreeMap<String, (&ChitchatId, &chitchat::NodeState)> = BTreeMap::new();
        for (id, ns) in chitchat.node_states() {
            if &*id.node_id == c.node_id.as_str() {
                continue;
            }
            let e = latest.entry(id.node_id.to_string()).or_insert((id, ns));
            if id.generation_id > e.0.generation_id {
                *e = (id, ns);
            }
        }
        let mut nodes = Vec::new();
        let mut remote = Vec::new();
        for (name, (id, ns)) in latest {
            let now = std::time::Instant::now();
            let hb = ns.heartbeat();
            let last = heard.entry((*id).clone()).or_insert((hb, now));
            if last.0 != hb {
                *last = (hb, now);
            }
            // chitchat's detector (silence > phi_threshold × mean heartbeat gap) can fire on a
            // short silence right after startup, when a few bursty samples make the mean tiny;
            // a node is dead only once it has also been silent for MIN_DEAD_SILENCE.
            let silent = now.duration_since(last.1) >= MIN_DEAD_SILENCE;
            let state = if dead.contains(id) && silent {
                NodeState::Dead
            } else if dead.contains(id) {
                ns.get("state").map(NodeState::parse).unwrap_or(NodeState::Joining)
            } else if !live.contains(id) {
                NodeState::Joining
            } else {
                ns.get("state").map(NodeState::parse).unwrap_or(NodeState::Joining)
            };
            nodes.push(NodeInfo {
                id: name.clone(),
                state,
                http: ns.get("http").unwrap_or_default().to_string(),
                quic: Some(id.gossip_advertise_addr),
                generation: id.generation_id,
                local: false,
            });
            for (k, v) in ns.key_values() {
                let Some(wid) = k.strip_prefix("w:") else { continue };
                let Ok(desc) = serde_json::from_str::<WorkerDesc>(v) else { continue };
                let signals: WorkerSignals = ns.get(&format!("sig:{wid}")).and_then(|s| serde_json::from_str(s).ok()).unwrap_or_default();
                let mut versions = [0u64; KV_SHARDS];
                for (s, ver) in versions.iter_mut().enumerate() {
                    *ver = ns.get_versioned(&format!("kv:{wid}:{s:x}")).map(|v| v.version).unwrap_or(0);
                }
                let key = (format!("{name}#{}", id.generation_id), wid.to_string());
                let cached = match digests.get(&key) {
                    Some(d) if d.versions == versions => d.set.clone(),
                    _ => {
                        let mut set = HashSet::new();
                        for s in 0..KV_SHARDS {
                            if let Some(v) = ns.get(&format!("kv:{wid}:{s:x}")) {
                                set.extend((0..v.len() / 16).filter_map(|j| u64::from_str_radix(&v[j * 16..j * 16 + 16], 16).ok()));
                            }
                        }
                        let set = Arc::new(set);
                        digests.insert(key, DigestCache { versions, set: set.clone() });
                        set
                    }
                };
                remote.push(WorkerView {
                    node: name.clone(),
                    worker: wid.to_string(),
                    local: false,
                    state,
                    device: desc.device,
                    max_waiting: desc.max_waiting,
                    signals,
                    cached,
                });
            }
        }
        drop(chitchat);
        *c.remote.write().unwrap() = Arc::new(remote);
        *c.nodes.write().unwrap() = Arc::new(nodes);
    }
}
