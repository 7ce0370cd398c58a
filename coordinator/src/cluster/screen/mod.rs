//! The gossip screen: every chitchat message from a peer is read by our own decoder
//! ([`wire`]) and checked here before chitchat sees it; a message that fails any check is
//! dropped whole (gossip repairs loss on the next round, and a peer that keeps sending such
//! messages is left talking to itself).
//!
//! What it refuses, and why:
//! - bytes chitchat would decode differently or not at all, and streams that inflate past
//!   [`wire::MAX_STREAM_BYTES`] (chitchat inflates without a bound);
//! - **a node delta whose `max_version` is below one of its own keys' versions**: chitchat
//!   0.13 asserts the opposite while applying it (`state.rs:237`), which kills the gossip task
//!   of the node for good;
//! - any other delta chitchat's builder would refuse (a key before its node, a node twice,
//!   versions not strictly increasing), so the two readers agree;
//! - node ids that are not valid names;
//! - growth past [`MAX_NODE_STATES`] node states, [`MAX_KEYS_PER_NODE`] keys in one node's
//!   state, keys over [`MAX_KEY_BYTES`] or values over [`MAX_VALUE_BYTES`].
//!
//! Cut out of a message, the rest going on to chitchat: a delta about this node's own current
//! (or a later) generation, a digest entry for a later generation of it (only this node
//! speaks for itself), and, when `allow_join` is off, what it says of nodes the config does
//! not name.
//!
//! [`check`] is pure (what chitchat already holds comes in through [`Known`]); [`Screen`] is
//! the shell the relays call.

pub mod wire;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use chitchat::{Chitchat, ChitchatId};

use super::gossip::valid_name;
use wire::{Id, Message, Op, WireError};

/// Node states (every generation of every node) chitchat may hold; a message that would add
/// more is refused.
pub const MAX_NODE_STATES: usize = 256;
/// Keys (deleted ones included) one node state may hold: eight workers at the largest prefix
/// digest (4,096 shards each), with room to spare.
pub const MAX_KEYS_PER_NODE: usize = 40_000;
pub const MAX_KEY_BYTES: usize = 256;
/// The largest value a node writes is a full digest shard (32 KiB) and its signature.
pub const MAX_VALUE_BYTES: usize = super::gossip::MAX_HASHES_PER_SHARD * 16 + 16 * 1024;

/// Whose messages this node takes.
#[derive(Clone, Debug)]
pub struct Policy {
    /// This node's id and generation.
    pub me: String,
    pub generation: u64,
    /// The config's node ids, and whether others may join.
    pub configured: Vec<String>,
    pub allow_join: bool,
}

/// What chitchat holds now.
pub trait Known {
    fn node_states(&self) -> usize;
    fn knows(&self, id: &Id) -> bool;
    /// Keys (deleted ones included) in the node's state.
    fn keys(&self, id: &Id) -> usize;
    fn has_key(&self, id: &Id, key: &str) -> bool;
}

/// Why a message was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("node id {0:?}: not a valid name, or not a node of the config")]
    Node(String),
    #[error("would hold more than {MAX_NODE_STATES} node states")]
    TooManyNodes,
    #[error("a delta chitchat would refuse: {0}")]
    Delta(&'static str),
    #[error("node {node:?}: max_version {max} is below key version {key}")]
    MaxBelowKey { node: String, max: u64, key: u64 },
    #[error("node {0:?}: a key or value over its size limit")]
    TooLarge(String),
    #[error("node {0:?}: would hold more than {MAX_KEYS_PER_NODE} keys")]
    TooManyKeys(String),
}

impl Refusal {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Wire(_) => "wire",
            Refusal::Node(_) => "node",
            Refusal::TooManyNodes => "nodes",
            Refusal::Delta(_) | Refusal::MaxBelowKey { .. } => "delta",
            Refusal::TooLarge(_) | Refusal::TooManyKeys(_) => "size",
        }
    }
}

fn ids(m: &Message) -> (Vec<&Id>, Vec<&Id>) {
    let digest: Vec<&Id> = match m {
        Message::Syn { digest, .. } | Message::SynAck { digest, .. } => digest.iter().map(|(i, _)| i).collect(),
        _ => vec![],
    };
    let delta = delta(m).iter().filter_map(|op| if let Op::Node { id, .. } = op { Some(id) } else { None }).collect();
    (digest, delta)
}

fn delta(m: &Message) -> &[Op] {
    match m {
        Message::SynAck { delta, .. } | Message::Ack { delta } => delta,
        _ => &[],
    }
}

/// Removes what the message says of nodes the config does not admit (when `allow_join` is
/// off), and what it says for this node itself: a digest entry for a later generation of it,
/// a delta about its current or a later one. Returns how many entries and ops went.
/// Such nodes cannot connect, and the publisher ignores them; only this node speaks for
/// itself. Cutting rather than dropping the whole message matters: a peer relaying a forged
/// generation of this node (or a config that differs by one line) would otherwise cut this
/// node off from every message that peer sends.
fn strip(m: &mut Message, p: &Policy) -> usize {
    let admitted = |id: &Id| p.allow_join || p.configured.iter().any(|n| *n == id.node);
    let mine = |id: &Id, from: u64| id.node == p.me && id.generation >= from;
    let mut removed = 0;
    if let Message::Syn { digest, .. } | Message::SynAck { digest, .. } = m {
        let before = digest.len();
        digest.retain(|(id, _)| admitted(id) && !mine(id, p.generation + 1));
        removed += before - digest.len();
    }
    if let Message::SynAck { delta, .. } | Message::Ack { delta } = m {
        let (before, mut keep) = (delta.len(), true);
        delta.retain(|op| {
            if let Op::Node { id, .. } = op {
                keep = admitted(id) && !mine(id, p.generation);
            }
            keep
        });
        removed += before - delta.len();
    }
    removed
}

/// Checks the node ids a message names: not too many new ones.
fn check_ids(m: &Message, known: &impl Known) -> Result<(), Refusal> {
    let (in_digest, in_delta) = ids(m);
    let new: HashSet<&Id> = in_digest.iter().chain(&in_delta).copied().filter(|id| !known.knows(id)).collect();
    if known.node_states() + new.len() > MAX_NODE_STATES {
        return Err(Refusal::TooManyNodes);
    }
    Ok(())
}

/// One node's part of a delta: chitchat's builder rules, the max-version rule and the sizes.
fn check_node(id: &Id, ops: &[Op], known: &impl Known) -> Result<(), Refusal> {
    let (mut max, mut last_key) = (0u64, 0u64);
    let mut fresh = HashSet::new();
    for op in ops {
        match op {
            Op::Kv(kv) => {
                if kv.version <= max {
                    return Err(Refusal::Delta("key versions must increase"));
                }
                (max, last_key) = (kv.version, kv.version);
                if kv.key.is_empty() || kv.key.len() > MAX_KEY_BYTES || kv.value.len() > MAX_VALUE_BYTES {
                    return Err(Refusal::TooLarge(id.node.clone()));
                }
                if !known.has_key(id, &kv.key) {
                    fresh.insert(kv.key.as_str());
                }
            }
            Op::SetMaxVersion(v) => max = *v,
            Op::Node { .. } => {} // `check` splits the ops at node ops
        }
    }
    if max < last_key {
        return Err(Refusal::MaxBelowKey { node: id.node.clone(), max, key: last_key });
    }
    // Counting the node's keys walks its state: only when the delta brings new ones.
    if !fresh.is_empty() && known.keys(id) + fresh.len() > MAX_KEYS_PER_NODE {
        return Err(Refusal::TooManyKeys(id.node.clone()));
    }
    Ok(())
}

/// A message that passed: what chitchat gets, and whether it had to be rewritten.
#[derive(Debug, PartialEq, Eq)]
pub struct Screened {
    pub message: Message,
    /// The message's bytes without the parts [`strip`] cuts, when it had any (chitchat then
    /// gets these instead of the original bytes).
    pub rewritten: Option<Vec<u8>>,
}

/// Decodes and checks one message from a peer.
pub fn check(bytes: &[u8], p: &Policy, known: &impl Known) -> Result<Screened, Refusal> {
    let mut m = wire::decode(bytes)?;
    let (in_digest, in_delta) = ids(&m);
    if let Some(bad) = in_digest.iter().chain(&in_delta).find(|id| !valid_name(&id.node)) {
        return Err(Refusal::Node(bad.node.chars().take(64).collect()));
    }
    let rewritten = (strip(&mut m, p) > 0).then(|| wire::write::encode(&m));
    check_ids(&m, known)?;
    let ops = delta(&m);
    if matches!(ops.first(), Some(Op::Kv(_) | Op::SetMaxVersion(_))) {
        return Err(Refusal::Delta("a key before any node"));
    }
    let mut seen = HashSet::new();
    let starts: Vec<usize> = ops.iter().enumerate().filter(|(_, op)| matches!(op, Op::Node { .. })).map(|(i, _)| i).collect();
    for (k, &s) in starts.iter().enumerate() {
        let Op::Node { id, .. } = &ops[s] else { continue };
        if !seen.insert(id) {
            return Err(Refusal::Delta("a node twice"));
        }
        let end = starts.get(k + 1).copied().unwrap_or(ops.len());
        check_node(id, &ops[s + 1..end], known)?;
    }
    Ok(Screened { message: m, rewritten })
}

impl Known for Chitchat {
    fn node_states(&self) -> usize {
        Chitchat::node_states(self).len()
    }
    fn knows(&self, id: &Id) -> bool {
        self.node_state(&chitchat_id(id)).is_some()
    }
    fn keys(&self, id: &Id) -> usize {
        self.node_state(&chitchat_id(id)).map_or(0, |s| s.key_values_including_deleted().count())
    }
    fn has_key(&self, id: &Id, key: &str) -> bool {
        self.node_state(&chitchat_id(id)).is_some_and(|s| s.get_versioned(key).is_some())
    }
}

fn chitchat_id(id: &Id) -> ChitchatId {
    ChitchatId::new(id.node.clone(), id.generation, id.addr)
}

/// The shell: the policy, chitchat's state (attached once chitchat runs) and a count of
/// refusals.
pub struct Screen {
    policy: Policy,
    chitchat: OnceLock<Arc<tokio::sync::Mutex<Chitchat>>>,
    refused: AtomicU64,
}

impl Screen {
    pub fn new(policy: Policy) -> Self {
        Screen { policy, chitchat: OnceLock::new(), refused: AtomicU64::new(0) }
    }

    pub fn attach(&self, chitchat: Arc<tokio::sync::Mutex<Chitchat>>) {
        let _ = self.chitchat.set(chitchat);
    }

    /// What chitchat may have of the message (the bytes, or their rewrite without nodes the
    /// config does not admit), or nothing; counts and logs a refusal.
    pub async fn admit<'b>(&self, bytes: &'b [u8], peer: std::net::SocketAddr) -> Option<std::borrow::Cow<'b, [u8]>> {
        // Nothing reaches chitchat before its state can be consulted.
        let chitchat = self.chitchat.get()?;
        let verdict = check(bytes, &self.policy, &*chitchat.lock().await);
        let why = match verdict {
            Ok(Screened { rewritten: Some(b), .. }) => return Some(b.into()),
            Ok(_) => return Some(bytes.into()),
            Err(why) => why,
        };
        let n = self.refused.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("zerolayer_gossip_refused_total", "node" => self.policy.me.clone(), "reason" => why.reason()).increment(1);
        if n.is_power_of_two() || n == 0 {
            tracing::warn!(%peer, refused = n + 1, error = %why, "dropped a gossip message that failed the screen");
        }
        None
    }

    /// Messages refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;
