//! The cluster link of one node: membership, signal and prefix-cache gossip, the
//! [`ClusterView`](crate::view::ClusterView) placement reads, and forwarding over QUIC.
//!
//! - **Transport.** One quinn endpoint per node, mutual TLS against the cluster CA
//!   ([`tls`]). It carries chitchat gossip (uni streams, [`transport`]) and forwarded requests
//!   (bi streams, [`forward`]); [`accept`] dispatches a peer's streams.
//! - **Membership.** chitchat (scuttlebutt + phi-accrual failure detection). What each node
//!   publishes, and how a value from a peer is parsed and validated, is [`gossip`], a pure core
//!   with no I/O: `state`, `http`, and per worker `w:<id>` (device, queue limit), `sig:<id>`
//!   (its signals) and `kv:<id>:<shard>` (its cached block hashes, 16 shards). A node the
//!   failure detector gives up on, and that has been silent long enough, is `dead`.
//! - **Publisher** ([`publisher`]). A thin loop, every `publish_interval_ms`: KV events into the
//!   local digests, local signals and changed shards into chitchat, and the remote part of the
//!   view rebuilt from gossip.
//! - **State** ([`handle`]). [`Cluster`] holds the local workers, the latest remote snapshot and
//!   the network half; [`Cluster::view`] joins fresh local signals with that snapshot. A single
//!   node (no `quic` address) runs the same code with no network: the view is local.
//!
//! - **KV transfer** ([`migrate`]). A draining node sends a sequence's blocks to the target
//!   worker's prefix cache on a bi-stream of their own (header, then raw bytes, a checksum per
//!   block). A node about to run a request pulls the prompt's prefix blocks that another
//!   worker caches ([`fetch`]) in the same framing, on the holder's answer to its ask.
//!
//! - **Tensor-parallel ranks on other nodes** ([`rank`]). A worker whose `rank_nodes` name
//!   other nodes leads a group whose ranks those nodes host, one bi-stream per rank: the step's
//!   batch out, the all-reduce's partials and sums both ways.
//!
//! - **Stored responses** ([`lookup`]). A node asks the node a response id names for it, on
//!   a tenant's behalf; the front end's store answers through a hook. Admin calls for another
//!   node ([`admin`]: drain, undrain, the drain report) are passed on the same way, with the
//!   caller's key, which the receiving node checks.
//!
//! - **The gossip screen** ([`screen`]). Every chitchat message from a peer is decoded by our
//!   own reader and checked (chitchat's panicking deltas, inflation, self-claims, growth)
//!   before chitchat applies it.
//!
//! - **Identity** ([`identity`]). A peer is the node its certificate names; every gossiped
//!   value is signed by its node and checked by every reader.
//!
//! Layering (no module here uses one above it): `gossip`, `tls` < `screen` < `transport`,
//! `frames`, `identity` <
//! `link` < `forward`, `lookup` < `admin`, `migrate`, `publisher`, `rank` < `fetch` < `accept` < `start`. Every task is owned by [`Cluster`] and stops
//! in [`Cluster::stop`] (graceful) or [`Cluster::kill`].

pub mod accept;
pub mod admin;
pub mod fetch;
pub mod forward;
pub mod frames;
pub mod gossip;
pub mod identity;
pub mod handle;
pub mod lookup;
pub mod migrate;
pub mod publisher;
pub mod rank;
pub mod screen;
mod start;
pub mod tls;
pub mod transport;

pub use handle::{Cluster, LinkStats, LocalWorker, NodeInfo};
