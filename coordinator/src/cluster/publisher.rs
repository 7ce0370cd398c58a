//! The publisher: one task per node, every `publish_interval_ms`. A thin I/O loop around the
//! pure core in [`super::gossip`]:
//! 1. the local workers' KV events into their exact prefix sets ([`LocalDigest`]), resyncing
//!    from a snapshot (a message to the worker actor) if the event stream lagged;
//! 2. local state, signals, per-key usage and changed digest shards into chitchat;
//! 3. every peer's keys into the remote part of the view, and its per-key usage into the quota: only the newest generation of a
//!    node whose certificate (from the CA, naming the node) and signatures check out
//!    ([`super::identity`]), only nodes the config admits, and every value through the
//!    validating decoders; refused values are logged and skipped, and the loop keeps going.
//!
//! It holds a weak reference: when the [`Cluster`] is dropped it ends; `Cluster::kill` aborts it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chitchat::{Chitchat, ChitchatId};
use tokio::sync::broadcast;
use zerolayer_common::KvEvent;

use super::gossip::{self, Detector, Liveness, LocalDigest, RemoteDigests, KEY_HTTP, KEY_MOVING, KEY_STATE, MAX_WORKERS_PER_NODE};
use super::identity::{Verifier, KEY_CERT};
use super::handle::{Cluster, LinkStats, NodeInfo};
use crate::quota::wire;
use crate::view::{NodeState, WorkerView};

/// Per-key usage values read from one node; more are ignored.
const MAX_TENANTS_PER_NODE: usize = 65_536;

pub async fn run(cluster: Weak<Cluster>, mut kv_rx: Vec<broadcast::Receiver<KvEvent>>) {
    let interval = match cluster.upgrade() {
        Some(c) => Duration::from_millis(c.config.cluster.publish_interval_ms),
        None => return,
    };
    let mut digests: Vec<LocalDigest> = kv_rx.iter().map(|_| LocalDigest::default()).collect();
    // A single node (no cluster) still keeps its workers' prefix sets, for placement among them.
    let mut remote = cluster.upgrade().and_then(|c| c.net.as_ref().map(|n| Remote::new(n.ca.clone())));
    let mut signed = Signed::default();
    let mut described = false;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(c) = cluster.upgrade() else { return };
        for (i, rx) in kv_rx.iter_mut().enumerate() {
            if drain_kv_events(&c, i, rx, &mut digests[i]).await {
                *c.local[i].cached.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(digests[i].set().clone());
            }
        }
        let (Some(net), Some(remote)) = (&c.net, remote.as_mut()) else { continue };
        let handle = net.chitchat.chitchat();
        let mut chitchat = handle.lock().await;
        publish(&c, &mut chitchat, &mut digests, &mut signed, !described);
        described = true;
        let (nodes, workers) = remote.read(&c, &chitchat, Instant::now());
        let gossip_node_states = chitchat.node_states().len();
        // Connections and relays only for peers chitchat still knows (it drops a dead node
        // `dead_node_grace_secs` after its death) and the seeds.
        let keep: HashSet<std::net::SocketAddr> = chitchat
            .node_states()
            .keys()
            .map(|id| id.gossip_advertise_addr)
            .chain(c.config.nodes.iter().filter_map(|n| n.quic.as_deref()?.parse().ok()))
            .collect();
        drop(chitchat);
        net.relays.retain(&keep);
        net.peers.retain(&keep);
        *c.stats.lock().unwrap_or_else(|e| e.into_inner()) = LinkStats {
            gossip_node_states,
            nodes: nodes.len(),
            remote_workers: workers.len(),
            digests: remote.digests.len(),
            certificates: remote.verifier.len(),
            relay_sockets: net.relays.len(),
            gossip_refused: net.relays.screen.refused(),
            connections: net.peers.len(),
        };
        *c.remote.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(workers);
        *c.nodes.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(nodes);
    }
}

/// Applies worker `i`'s pending KV events; returns whether its set changed. A reader that
/// lagged resyncs from a snapshot (a message to the worker actor).
async fn drain_kv_events(c: &Cluster, i: usize, rx: &mut broadcast::Receiver<KvEvent>, digest: &mut LocalDigest) -> bool {
    let (changed, lagged) = digest.drain(rx);
    if !lagged {
        return changed;
    }
    tracing::debug!(worker = %c.local[i].worker.id, "KV events lagged; resyncing");
    match c.local[i].worker.handle.cached_hashes().await {
        Ok(all) => {
            digest.resync(all);
            // Events sent while the snapshot was taken apply on top of it.
            digest.drain(rx);
            true
        }
        Err(_) => changed,
    }
}

/// This node's signed values, re-signed only when their payload changes (a signature is not
/// deterministic, and chitchat re-sends a key whose value changed).
#[derive(Default)]
struct Signed {
    last: HashMap<String, (String, String)>,
}

impl Signed {
    fn set(&mut self, signer: &super::identity::Signer, me: &mut chitchat::NodeState, key: String, payload: String) {
        if let Some((p, _)) = self.last.get(&key) {
            if *p == payload {
                return;
            }
        }
        let v = signer.sign(&key, &payload);
        me.set(key.clone(), v.clone());
        self.last.insert(key, (payload, v));
    }
}

/// Writes this node's keys (its certificate and worker descriptions only the first time).
fn publish(c: &Cluster, chitchat: &mut Chitchat, digests: &mut [LocalDigest], signed: &mut Signed, describe: bool) {
    let Some(net) = &c.net else { return };
    let signer = &net.signer;
    let http = c.http.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let me = chitchat.self_node_state();
    if describe {
        me.set(KEY_CERT, signer.cert());
    }
    signed.set(signer, me, KEY_STATE.into(), c.state().as_str().into());
    signed.set(signer, me, KEY_HTTP.into(), http);
    signed.set(signer, me, KEY_MOVING.into(), c.moving.load(std::sync::atomic::Ordering::Acquire).to_string());
    for (k, v) in c.quota.publish() {
        signed.set(signer, me, k, v);
    }
    for (l, digest) in c.local.iter().zip(digests) {
        let id = &l.worker.id;
        if describe {
            let d = gossip::WorkerDesc { device: l.worker.device.clone(), model: l.worker.model.clone(), max_waiting: l.worker.max_waiting as u32 };
            signed.set(signer, me, gossip::worker_key(id), gossip::encode_desc(&d));
        }
        signed.set(signer, me, gossip::signals_key(id), gossip::encode_signals(&l.worker.handle.signals()));
        let dirty = digest.take_dirty();
        signed.set(signer, me, gossip::shard_bits_key(id), digest.bits().to_string());
        for (s, v) in dirty {
            signed.set(signer, me, gossip::digest_key(id, s), v);
        }
    }
}

/// What the publisher remembers about peers between rounds (bounded: every cache forgets
/// whatever is no longer gossiped).
struct Remote {
    liveness: Liveness,
    digests: RemoteDigests,
    verifier: Verifier,
}

impl Remote {
    fn new(ca: rustls::pki_types::CertificateDer<'static>) -> Self {
        Remote { liveness: Liveness::default(), digests: RemoteDigests::default(), verifier: Verifier::new(ca) }
    }

    /// Every peer the config admits (the newest generation of each node id whose certificate
    /// checks out) and its workers.
    fn read(&mut self, c: &Cluster, chitchat: &Chitchat, now: Instant) -> (Vec<NodeInfo>, Vec<WorkerView>) {
        let dead: HashSet<&ChitchatId> = chitchat.dead_nodes().collect();
        let live: HashSet<&ChitchatId> = chitchat.live_nodes().collect();
        let mut by_name: BTreeMap<&str, Vec<(&ChitchatId, &chitchat::NodeState)>> = BTreeMap::new();
        let mut quota_peers = HashSet::new();
        for (id, ns) in chitchat.node_states() {
            if *id.node_id == *c.node_id {
                continue;
            }
            if !c.admits(&id.node_id) {
                tracing::debug!(node = %id.node_id, "ignored gossip about a node the config does not admit");
                continue;
            }
            by_name.entry(&*id.node_id).or_default().push((id, ns));
        }
        let (mut nodes, mut workers) = (Vec::new(), Vec::new());
        let (mut seen_nodes, mut seen_workers, mut seen_certs) = (HashSet::new(), HashSet::new(), HashSet::new());
        for (name, mut gens) in by_name {
            gens.sort_by_key(|(id, _)| std::cmp::Reverse(id.generation_id));
            for (id, _) in &gens {
                seen_certs.insert((name.to_string(), id.generation_id));
            }
            // The newest generation that proves it is this node: a certificate that names it,
            // and a state signed for that generation and address (a replayed certificate under
            // a newer generation, or the node's values under another address, prove nothing).
            let proven = |v: &mut Verifier, id: &ChitchatId, ns: &chitchat::NodeState| {
                v.accept_cert(name, id.generation_id, ns.get(KEY_CERT).unwrap_or(""))
                    && ns.get(KEY_STATE).is_some_and(|s| v.open(name, id.generation_id, id.gossip_advertise_addr, KEY_STATE, s).is_some())
            };
            let Some(&(id, ns)) = gens.iter().find(|(id, ns)| proven(&mut self.verifier, id, ns)) else {
                tracing::warn!(node = name, generations = gens.len(), "gossip about a node with no valid certificate for it: ignored");
                metrics::counter!("zerolayer_gossip_refused_total", "node" => c.node_id.clone(), "reason" => "certificate").increment(1);
                continue;
            };
            let generation = id.generation_id;
            let verifier = &self.verifier;
            let get = |key: &str| -> Option<&str> {
                let v = ns.get(key)?;
                let opened = verifier.open(name, generation, id.gossip_advertise_addr, key, v);
                if opened.is_none() {
                    tracing::warn!(node = name, key, "a gossiped value without a valid signature: refused");
                    metrics::counter!("zerolayer_gossip_refused_total", "node" => c.node_id.clone(), "reason" => "signature").increment(1);
                }
                opened
            };
            let silent = self.liveness.observe(name, generation, u64::from(ns.heartbeat()), now);
            seen_nodes.insert((name.to_string(), generation));
            let detector = if dead.contains(id) {
                Detector::Dead
            } else if live.contains(id) {
                Detector::Live
            } else {
                Detector::Unknown
            };
            let state = Liveness::state(detector, silent, get(KEY_STATE));
            if state != NodeState::Dead {
                // Its per-key usage: charged to this node's buckets (see `crate::quota`).
                let peer = (name.to_string(), generation);
                for (k, _) in ns.key_values().filter(|(k, _)| k.starts_with(wire::KEY_PREFIX)).take(MAX_TENANTS_PER_NODE) {
                    let (Some(tenant), Some(v)) = (wire::tenant_of_key(k), get(k)) else { continue };
                    if let Err(e) = c.quota.observe(&peer, tenant, v) {
                        tracing::warn!(node = name, tenant, error = %e, "refused gossiped key usage");
                    }
                }
                quota_peers.insert(peer);
            }
            nodes.push(NodeInfo {
                id: name.to_string(),
                state,
                http: get(KEY_HTTP).filter(|h| h.len() <= 256).unwrap_or_default().to_string(),
                quic: Some(id.gossip_advertise_addr),
                generation,
                local: false,
                moving: get(KEY_MOVING).and_then(|v| gossip::decode_count(v).ok()).unwrap_or(0),
            });
            for (k, _) in ns.key_values().filter(|(k, _)| k.starts_with("w:")).take(MAX_WORKERS_PER_NODE) {
                let Some(wid) = gossip::worker_of_key(k) else { continue };
                let Some(desc) = get(k).map(gossip::decode_desc) else { continue };
                let desc = match desc {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(node = name, worker = wid, error = %e, "refused a gossiped worker description");
                        continue;
                    }
                };
                let signals = match get(&gossip::signals_key(wid)).map(gossip::decode_signals) {
                    Some(Ok(s)) => s,
                    Some(Err(e)) => {
                        tracing::warn!(node = name, worker = wid, error = %e, "refused gossiped signals");
                        continue;
                    }
                    None => Default::default(),
                };
                let bits = get(&gossip::shard_bits_key(wid)).and_then(|v| gossip::decode_shard_bits(v).ok()).unwrap_or(gossip::MIN_SHARD_BITS);
                let versions: Vec<u64> = (0..1usize << bits).map(|s| ns.get_versioned(&gossip::digest_key(wid, s)).map(|v| v.version).unwrap_or(0)).collect();
                let (cached, errors) = self.digests.get(name, generation, wid, bits, &versions, |s| get(&gossip::digest_key(wid, s)).map(str::to_string));
                for e in errors {
                    tracing::warn!(node = name, worker = wid, error = %e, "refused a gossiped prefix digest shard");
                }
                seen_workers.insert((name.to_string(), generation, wid.to_string()));
                workers.push(WorkerView {
                    node: name.to_string(),
                    worker: wid.to_string(),
                    local: false,
                    state,
                    device: desc.device,
                    model: desc.model,
                    max_waiting: desc.max_waiting,
                    signals,
                    cached,
                });
            }
        }
        self.liveness.retain(&seen_nodes);
        self.digests.retain(&seen_workers);
        self.verifier.retain(&seen_certs);
        c.quota.retain(&quota_peers);
        (nodes, workers)
    }
}
