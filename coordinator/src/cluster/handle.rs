//! The state of a node's cluster link: its local workers and their prefix sets, the latest
//! remote snapshot the publisher built, membership, and the network half. Read by placement
//! (through [`Cluster::view`]), forwarding and the admin API; written only by the publisher.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use chitchat::ChitchatHandle;
use serde::Serialize;
use tokio::task::JoinHandle;
use zerolayer_common::ClusterConfig;
use zerolayer_worker::WorkerHandle;

use super::identity::Signer;
use super::transport::{Peers, Relays};
use crate::quota::Quota;
use crate::view::{ClusterView, NodeState, WorkerView};

/// What answers a peer's lookup of a stored response on this node (see `super::lookup`):
/// whether it found the entry, and its body.
/// What the front end answers for peers, registered once with [`Cluster::serve_peers`]: the
/// cluster wing calls it and knows nothing of what is stored, drained or configured.
pub trait PeerCalls: Send + Sync {
    /// A stored response asked for by another node: whether it was there, and its body.
    fn lookup(&self, l: &zerolayer_common::wire::Lookup) -> (bool, Vec<u8>);
    /// An admin call another node passed on: the HTTP status and JSON body of its answer.
    fn admin(&self, call: zerolayer_common::wire::AdminCall) -> std::pin::Pin<Box<dyn std::future::Future<Output = (u16, Vec<u8>)> + Send>>;
    /// A forwarded job under this node's own config (its tenant's share, options and cache
    /// scope); `Err` refuses it.
    fn rederive(&self, job: zerolayer_common::Job) -> Result<zerolayer_common::Job, String>;
    /// Pulls into local worker `into` the prefix blocks of `job` that `from` holds, before the
    /// job runs there (the node's orchestrator does it and keeps its figures). Never fails: a
    /// fetch that does not work leaves the job to recompute.
    fn fetch(&self, into: &str, job: &zerolayer_common::Job, from: zerolayer_common::wire::FetchFrom) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
}

/// Fetches of its cached blocks a node serves at once; more are refused as overloaded (the
/// askers recompute).
pub const FETCHES_SERVED_AT_ONCE: usize = 2;

/// A worker on this node.
#[derive(Clone)]
pub struct LocalWorker {
    pub id: String,
    pub handle: WorkerHandle,
    pub max_waiting: usize,
    /// `cpu`, `cuda:0`, … (from the config).
    pub device: String,
    /// The id of the model it serves.
    pub model: String,
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
    /// Sequences a draining node still has to move (0 otherwise).
    pub moving: u32,
}

/// A local worker and the prefix set the publisher keeps for it.
pub(super) struct LocalState {
    pub(super) worker: LocalWorker,
    pub(super) cached: RwLock<Arc<HashSet<u64>>>,
}

/// The network half: present when the node has a `quic` address.
pub struct Net {
    /// This process's generation (its start time, ms): a restarted node has a new one.
    pub generation: u64,
    pub endpoint: quinn::Endpoint,
    pub peers: Arc<Peers>,
    pub addr: SocketAddr,
    pub(super) chitchat: ChitchatHandle,
    pub(super) relays: Arc<Relays>,
    /// Signs this node's gossip (see [`super::identity`]).
    pub(super) signer: Signer,
    /// The cluster CA, that other nodes' certificates must chain to.
    pub(super) ca: rustls::pki_types::CertificateDer<'static>,
}

pub struct Cluster {
    pub node_id: String,
    pub(super) config: ClusterConfig,
    pub(super) local: Vec<LocalState>,
    pub(super) remote: RwLock<Arc<Vec<WorkerView>>>,
    pub(super) nodes: RwLock<Arc<Vec<NodeInfo>>>,
    state: AtomicU8,
    pub(super) http: Mutex<String>,
    pub net: Option<Net>,
    /// Forwarded sequences this node is running for other coordinators.
    pub serving_remote: AtomicUsize,
    /// Sequences this node's drain still has to move (gossiped for `zerolayer status`).
    pub moving: AtomicU32,
    pub(super) tasks: Mutex<Vec<JoinHandle<()>>>,
    /// What the link holds about peers, as of the last publisher round.
    pub(super) stats: Mutex<LinkStats>,
    /// Per-key usage: published for peers, and peers' taken in (see [`crate::quota`]).
    pub(super) quota: Arc<Quota>,
    /// The tensor-parallel ranks this node hosts for other nodes' workers, by
    /// `leader/worker/rank` (at most the slots the config gives this node; see [`super::rank`]),
    /// each with the flag that ends it when a new join replaces it.
    pub(super) hosted_ranks: Mutex<std::collections::HashMap<String, Arc<std::sync::atomic::AtomicBool>>>,
    /// KV bytes each peer has in transfers to this node now (see `migrate::serve`); an entry
    /// goes when its transfers end, so there are at most as many as transfers running.
    pub(super) imports_in_flight: Mutex<std::collections::HashMap<String, u64>>,
    /// Each peer's budget of opening frames being read (see `accept::serve_bi`).
    pub(super) openings: super::frames::OpeningBudgets,
    /// Fetches of this node's cached blocks being served now (see `fetch::serve`).
    pub(super) fetches_served: tokio::sync::Semaphore,
    /// What answers peers' calls (set once by the front end; until then they are refused).
    pub(super) peer_calls: std::sync::OnceLock<Arc<dyn PeerCalls>>,
}

/// How much a node's link holds about its peers (all bounded; see `publisher`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LinkStats {
    /// Node states chitchat holds (every generation of every node, until garbage-collected).
    pub gossip_node_states: usize,
    /// Nodes in the view (the newest valid generation of each).
    pub nodes: usize,
    pub remote_workers: usize,
    /// Parsed prefix digests kept.
    pub digests: usize,
    /// Certificates accepted (one per node generation still gossiped).
    pub certificates: usize,
    pub relay_sockets: usize,
    pub connections: usize,
    /// Gossip messages the screen dropped since the node started.
    pub gossip_refused: u64,
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

impl Cluster {
    /// The secret every node of the cluster derives from the cluster CA's certificate (which
    /// clients never see): the key of the prefix cache's scope roots
    /// ([`zerolayer_common::scope_root`]). None without a cluster link: a lone node draws its own.
    pub fn cache_secret(&self) -> Option<[u8; 32]> {
        self.net.as_ref().map(|n| zerolayer_common::cluster_secret(&n.ca))
    }

    /// The link's state before any task runs (see `start`).
    pub(super) fn new(node_id: &str, config: &ClusterConfig, workers: &[LocalWorker], http: String, net: Option<Net>, quota: Arc<Quota>) -> Cluster {
        Cluster {
            node_id: node_id.to_string(),
            config: config.clone(),
            local: workers.iter().map(|w| LocalState { worker: w.clone(), cached: RwLock::new(Arc::new(HashSet::new())) }).collect(),
            remote: RwLock::new(Arc::new(Vec::new())),
            nodes: RwLock::new(Arc::new(Vec::new())),
            state: AtomicU8::new(state_code(NodeState::Joining)),
            http: Mutex::new(http),
            net,
            serving_remote: AtomicUsize::new(0),
            moving: AtomicU32::new(0),
            tasks: Mutex::new(Vec::new()),
            stats: Mutex::new(LinkStats::default()),
            quota,
            hosted_ranks: Mutex::new(std::collections::HashMap::new()),
            imports_in_flight: Mutex::new(std::collections::HashMap::new()),
            openings: Default::default(),
            fetches_served: tokio::sync::Semaphore::new(FETCHES_SERVED_AT_ONCE),
            peer_calls: std::sync::OnceLock::new(),
        }
    }

    /// Registers what answers peers' lookups, admin calls and forwarded jobs (the first
    /// registration holds).
    pub fn serve_peers(&self, calls: Arc<dyn PeerCalls>) {
        let _ = self.peer_calls.set(calls);
    }

    /// Pulls `job`'s prefix blocks that `from` holds into local worker `into` first, through
    /// the front end's hook (nothing happens before it is set).
    pub async fn fetch_first(&self, into: &str, job: &zerolayer_common::Job, from: zerolayer_common::wire::FetchFrom) {
        if let Some(calls) = self.peer_calls.get() {
            calls.fetch(into, job, from).await;
        }
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
                device: l.worker.device.clone(),
                model: l.worker.model.clone(),
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
            generation: self.net.as_ref().map_or(0, |n| n.generation),
            local: true,
            moving: self.moving.load(Ordering::Acquire),
        }];
        out.extend(self.nodes.read().unwrap().iter().cloned());
        out
    }

    /// Gossips `key` = `payload` as this node, signed like the publisher's own values (tests:
    /// a node that lies about its workers, or a forger holding another node's certificate).
    #[doc(hidden)]
    pub async fn publish_for_tests(&self, key: &str, payload: &str) {
        if let Some(net) = &self.net {
            let v = net.signer.sign(key, payload);
            net.chitchat.with_chitchat(|c| c.self_node_state().set(key.to_string(), v.clone())).await;
        }
    }

    /// Gossips `key` = `value` as this node, exactly as given (tests: a forger replaying another
    /// node's certificate and signed values).
    #[doc(hidden)]
    pub async fn gossip_raw_for_tests(&self, key: &str, value: &str) {
        if let Some(net) = &self.net {
            net.chitchat.with_chitchat(|c| c.self_node_state().set(key.to_string(), value.to_string())).await;
        }
    }

    /// What this node gossips for `key` now, signature included (tests: what a forger replays).
    #[doc(hidden)]
    pub async fn own_gossip_for_tests(&self, key: &str) -> Option<String> {
        let net = self.net.as_ref()?;
        net.chitchat.with_chitchat(|c| c.self_node_state().get(key).map(str::to_string)).await
    }

    /// Bytes of peers' opening frames this node holds being read now (at most
    /// [`super::frames::OPENING_BYTES_PER_PEER`] per peer).
    pub fn opening_bytes_held(&self) -> usize {
        self.openings.held()
    }

    /// What the link holds about peers now.
    pub fn link_stats(&self) -> LinkStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `node` may be part of this cluster: in the config, or any id if joining is on.
    pub fn admits(&self, node: &str) -> bool {
        self.joining_allowed() || self.config.nodes.iter().any(|n| n.id == node)
    }

    /// Whether nodes not in the config may join (`cluster.allow_join`).
    pub fn joining_allowed(&self) -> bool {
        self.config.cluster.allow_join
    }

    /// The configured node ids.
    pub fn configured_nodes(&self) -> impl Iterator<Item = &str> {
        self.config.nodes.iter().map(|n| n.id.as_str())
    }

    /// How many tensor-parallel ranks this node hosts for other nodes now.
    pub fn hosted_ranks(&self) -> usize {
        self.hosted_ranks.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The QUIC address of a live peer.
    pub fn peer_addr(&self, node: &str) -> Option<SocketAddr> {
        self.nodes.read().unwrap().iter().find(|n| n.id == node && n.state != NodeState::Dead).and_then(|n| n.quic)
    }

    /// Leaves the cluster gracefully: gossips `draining`, then closes connections and stops tasks.
    pub async fn stop(&self) {
        self.set_state(NodeState::Draining);
        if let Some(net) = &self.net {
            let v = net.signer.sign(super::gossip::KEY_STATE, NodeState::Draining.as_str());
            net.chitchat.with_chitchat(|c| c.self_node_state().set(super::gossip::KEY_STATE, v.clone())).await;
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

