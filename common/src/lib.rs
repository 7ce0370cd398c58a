//! Types shared by every zerolayer crate: ids, sampling parameters, worker signals and KV
//! events, block hashing, and the cluster configuration.
//!
//! Invariant: this crate depends on no async runtime, no tensor library and no GPU library, so
//! every other crate (and the wire format) can use it.

pub mod config;
pub mod hash;
pub mod signals;
pub mod types;

pub use config::{ClusterConfig, ConfigError, NodeConfig, WorkerConfig};
pub use hash::{block_hashes, chain_hash};
pub use signals::{KvEvent, WorkerSignals};
pub use types::*;
