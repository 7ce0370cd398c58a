//! The cluster as placement reads it: every worker's state, signals and cached prefix set, and
//! each node's membership state. Plain data: [`crate::cluster`] publishes a snapshot, placement
//! ([`crate::routing::placement`]) reads it, and neither knows the other.

use std::collections::HashSet;
use std::sync::Arc;

use serde::Serialize;
use zerolayer_common::WorkerSignals;

/// A node's membership state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Joining,
    Ready,
    Draining,
    Dead,
}

impl NodeState {
    pub fn as_str(&self) -> &'static str {
        match self {
            NodeState::Joining => "joining",
            NodeState::Ready => "ready",
            NodeState::Draining => "draining",
            NodeState::Dead => "dead",
        }
    }

    /// The state a gossiped string names; `None` for anything else.
    pub fn parse(s: &str) -> Option<NodeState> {
        match s {
            "joining" => Some(NodeState::Joining),
            "ready" => Some(NodeState::Ready),
            "draining" => Some(NodeState::Draining),
            "dead" => Some(NodeState::Dead),
            _ => None,
        }
    }
}

/// One worker as this coordinator sees it.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub node: String,
    pub worker: String,
    /// On this coordinator's node (no QUIC hop).
    pub local: bool,
    pub state: NodeState,
    pub device: String,
    /// The id of the model it serves.
    pub model: String,
    pub max_waiting: u32,
    pub signals: WorkerSignals,
    /// Block hashes the worker caches (exact, from its KV events).
    pub cached: Arc<HashSet<u64>>,
}

/// Every worker of the cluster, local and remote.
#[derive(Clone, Debug, Default)]
pub struct ClusterView {
    pub workers: Vec<WorkerView>,
}

/// A ready `cpu0` worker of `node` with these signals and nothing cached (unit tests).
#[cfg(test)]
pub(crate) fn test_worker(node: &str, local: bool, signals: WorkerSignals) -> WorkerView {
    WorkerView {
        node: node.into(),
        worker: "cpu0".into(),
        local,
        state: NodeState::Ready,
        device: "cpu".into(),
        model: "m".into(),
        max_waiting: 8,
        signals,
        cached: Arc::new(HashSet::new()),
    }
}
