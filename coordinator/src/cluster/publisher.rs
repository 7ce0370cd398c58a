//! The publisher: one task per node, every `publish_interval_ms`. A thin I/O loop around the
//! pure core in [`super::gossip`]:
//! 1. the local workers' KV events into their exact prefix sets ([`LocalDigest`]), resyncing
//!    from a snapshot (a message to the worker actor) if the event stream lagged;
//! 2. local state, signals and changed digest shards into chitchat;
//! 3. every peer's keys into the remote part of the view, through the validating decoders;
//!    refused values are logged and skipped, and the loop keeps going.
//!
//! It holds a weak reference: when the [`Cluster`] is dropped it ends; `Cluster::kill` aborts it.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chitchat::{Chitchat, ChitchatId};
use tokio::sync::broadcast;
use zerolayer_common::KvEvent;

use super::gossip::{self, Detector, Liveness, LocalDigest, RemoteDigests, KEY_HTTP, KEY_MOVING, KEY_STATE, KV_SHARDS, MAX_WORKERS_PER_NODE};
use super::link::{Cluster, NodeInfo};
use crate::view::WorkerView;

pub async fn run(cluster: Weak<Cluster>, mut kv_rx: Vec<broadcast::Receiver<KvEvent>>) {
    let interval = match cluster.upgrade() {
        Some(c) => Duration::from_millis(c.config.cluster.publish_interval_ms),
        None => return,
    };
    let mut digests: Vec<LocalDigest> = kv_rx.iter().map(|_| LocalDigest::default()).collect();
    let mut remote = Remote::default();
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
        let Some(net) = &c.net else { continue };
        let handle = net.chitchat.chitchat();
        let mut chitchat = handle.lock().await;
        publish(&c, &mut chitchat, &mut digests, !described);
        described = true;
        let (nodes, workers) = remote.read(&c.node_id, &chitchat, Instant::now());
        drop(chitchat);
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

/// Writes this node's keys (worker descriptions only the first time).
fn publish(c: &Cluster, chitchat: &mut Chitchat, digests: &mut [LocalDigest], describe: bool) {
    let http = c.http.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let me = chitchat.self_node_state();
    me.set(KEY_STATE, c.state().as_str());
    me.set(KEY_HTTP, http);
    me.set(KEY_MOVING, c.moving.load(std::sync::atomic::Ordering::Acquire).to_string());
    for (l, digest) in c.local.iter().zip(digests) {
        let id = &l.worker.id;
        if describe {
            let d = gossip::WorkerDesc { device: l.worker.device.clone(), max_waiting: l.worker.max_waiting as u32 };
            me.set(gossip::worker_key(id), gossip::encode_desc(&d));
        }
        me.set(gossip::signals_key(id), gossip::encode_signals(&l.worker.handle.signals()));
        for (s, v) in digest.take_dirty() {
            me.set(gossip::digest_key(id, s), v);
        }
    }
}

/// What the publisher remembers about peers between rounds (bounded: both caches forget
/// whatever is no longer gossiped).
#[derive(Default)]
struct Remote {
    liveness: Liveness,
    digests: RemoteDigests,
}

impl Remote {
    /// Every peer (the newest generation of each node id) and its workers.
    fn read(&mut self, self_id: &str, chitchat: &Chitchat, now: Instant) -> (Vec<NodeInfo>, Vec<WorkerView>) {
        let dead: HashSet<&ChitchatId> = chitchat.dead_nodes().collect();
        let live: HashSet<&ChitchatId> = chitchat.live_nodes().collect();
        let mut latest: BTreeMap<&str, (&ChitchatId, &chitchat::NodeState)> = BTreeMap::new();
        for (id, ns) in chitchat.node_states() {
            if &*id.node_id == self_id {
                continue;
            }
            let e = latest.entry(&*id.node_id).or_insert((id, ns));
            if id.generation_id > e.0.generation_id {
                *e = (id, ns);
            }
        }
        let (mut nodes, mut workers) = (Vec::new(), Vec::new());
        let (mut seen_nodes, mut seen_workers) = (HashSet::new(), HashSet::new());
        for (name, (id, ns)) in latest {
            let silent = self.liveness.observe(name, id.generation_id, u64::from(ns.heartbeat()), now);
            seen_nodes.insert((name.to_string(), id.generation_id));
            let detector = if dead.contains(id) {
                Detector::Dead
            } else if live.contains(id) {
                Detector::Live
            } else {
                Detector::Unknown
            };
            let state = Liveness::state(detector, silent, ns.get(KEY_STATE));
            nodes.push(NodeInfo {
                id: name.to_string(),
                state,
                http: ns.get(KEY_HTTP).filter(|h| h.len() <= 256).unwrap_or_default().to_string(),
                quic: Some(id.gossip_advertise_addr),
                generation: id.generation_id,
                local: false,
                moving: ns.get(KEY_MOVING).and_then(|v| gossip::decode_count(v).ok()).unwrap_or(0),
            });
            for (k, v) in ns.key_values().filter(|(k, _)| k.starts_with("w:")).take(MAX_WORKERS_PER_NODE) {
                let Some(wid) = gossip::worker_of_key(k) else { continue };
                let desc = match gossip::decode_desc(v) {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(node = name, worker = wid, error = %e, "refused a gossiped worker description");
                        continue;
                    }
                };
                let signals = match ns.get(&gossip::signals_key(wid)).map(gossip::decode_signals) {
                    Some(Ok(s)) => s,
                    Some(Err(e)) => {
                        tracing::warn!(node = name, worker = wid, error = %e, "refused gossiped signals");
                        continue;
                    }
                    None => Default::default(),
                };
                let versions: [u64; KV_SHARDS] =
                    std::array::from_fn(|s| ns.get_versioned(&gossip::digest_key(wid, s)).map(|v| v.version).unwrap_or(0));
                let (cached, errors) =
                    self.digests.get(name, id.generation_id, wid, versions, |s| ns.get(&gossip::digest_key(wid, s)).map(str::to_string));
                for e in errors {
                    tracing::warn!(node = name, worker = wid, error = %e, "refused a gossiped prefix digest shard");
                }
                seen_workers.insert((name.to_string(), id.generation_id, wid.to_string()));
                workers.push(WorkerView {
                    node: name.to_string(),
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
        self.liveness.retain(&seen_nodes);
        self.digests.retain(&seen_workers);
        (nodes, workers)
    }
}
