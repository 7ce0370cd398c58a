//! The routing wing: where a sequence runs, and how it keeps running.
//! - [`placement`]: a pure function from a [`crate::view::ClusterView`] and a request summary
//!   to a worker; [`tracker`]: corrects the gossiped view for what this node placed since;
//! - [`dispatch`]: placement, then submission (an in-process message or one QUIC hop);
//!   [`resume`]: a sequence followed across moves (exact replay after a loss or a drain);
//! - [`fetching`]: a prefix fetch as the orchestrator runs it, and its measured cost;
//! - [`orchestrator`]: the node's orchestration actor (drain, undrain, the moves, fetches).
//!
//! Uses the cluster wing; never the front end.

pub mod dispatch;
pub mod fetching;
pub mod orchestrator;
pub mod placement;
pub mod resume;
pub mod tracker;
