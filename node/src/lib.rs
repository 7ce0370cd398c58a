//! The zerolayer worker: everything that runs on one device of a node. (The crate lives in
//! `node/`, the directory name the design card fixes; "node" itself always means one zerolayer
//! process, and a node runs one worker per device.)
//!
//! - [`model`]: our Llama-family forward pass over a paged KV cache (GGUF and safetensors),
//!   whole or as one tensor-parallel shard.
//! - [`backend`]: what the engine runs the model on: the CPU, or a tensor-parallel group.
//! - [`ranks`]: tensor-parallel groups whose ranks run on other nodes: the leader's remote
//!   ranks, the hosted rank's shard and loop, and the star collective, over any transport that
//!   gives [`ranks::RankChannels`] (the coordinator's QUIC link, or in-process channels).
//! - [`tokenizer`], [`chat`]: text in and out (GGUF-embedded BPE, minijinja chat templates).
//! - [`block_pool`]: paged KV blocks with reference counts and automatic prefix caching;
//!   [`kv_disk`]: the worker's disk tier under it (evicted blocks kept on disk, read back on a
//!   hit, reloaded after a restart).
//! - [`scheduler`]: continuous batching with chunked prefill and preemption (sans-IO).
//! - [`sampler`], [`stop`]: sampling and stop sequences.
//! - [`synthetic`]: a small random-weight GGUF in every native format, for device checks.
//! - `device_check` (feature `gpu`): the GPU backend's checks that `gpu-check` runs.
//! - [`engine`]: one `step()` at a time over all of the above; [`migrate`]: what a sequence
//!   that leaves its worker takes with it, and how KV blocks enter another worker's cache.
//! - [`actor`]: the worker actor and its engine thread; [`WorkerHandle`] is the API.
//!
//! This crate speaks neither HTTP nor QUIC. A request reaches it as one
//! [`Job`](zerolayer_common::Job), and a worker reads its limits from its
//! [`WorkerConfig`](zerolayer_common::WorkerConfig).

pub mod actor;
pub mod backend;
pub mod block_pool;
pub mod chat;
#[cfg(feature = "gpu")]
pub mod device_check;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod kv_disk;
pub mod loader;
pub mod migrate;
pub mod model;
pub mod ranks;
pub mod sampler;
pub mod scheduler;
pub mod speculate;
pub mod step_time;
pub mod synthetic;
pub mod stop;
pub mod tokenizer;

pub use engine::{Engine, StepHook};
pub use error::{WorkerError, Result};
pub use actor::{SeqStream, WorkerHandle};
pub use zerolayer_common::Job;
/// The collective a tensor-parallel shard sums through (a group across nodes implements it
/// over the cluster link).
pub use zerolayer_kernels::collective;
