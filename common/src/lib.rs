//! Types shared by every zerolayer crate: the one request type ([`Job`]), ids, sampling parameters, worker signals and KV
//! events, block hashing, the cluster configuration, and the rkyv wire frames between nodes.
//!
//! Invariant: this crate depends on no async runtime, no tensor library and no GPU library, so
//! every other crate (and the wire format) can use it.

pub mod config;
pub mod hash;
pub mod job;
pub mod signals;
pub mod types;
pub mod wire;

pub use config::{ClusterConfig, Tenant, TenantLimits, ClusterSection, ConfigError, NodeConfig, PlacementConfig, PlacementPolicy, WorkerConfig};
pub use hash::{block_hashes, block_hashes_from, chain_hash, checksum, cluster_secret, disk_name, scope_root};
pub use job::{Job, TenantClaim};
pub use signals::{DiskSignals, KvEvent, WorkerSignals};
pub use types::*;
