//! The zerolayer worker: everything that runs on one device.
//!
//! - [`model`]: our Llama-family forward pass over a paged KV cache (GGUF and safetensors).
//! - [`tokenizer`], [`chat`]: text in and out (GGUF-embedded BPE, minijinja chat templates).
//! - [`block_pool`]: paged KV blocks with reference counts and automatic prefix caching.
//! - [`scheduler`]: continuous batching with chunked prefill and preemption (sans-IO).
//! - [`sampler`], [`stop`]: sampling and stop sequences.
//! - [`engine`]: one `step()` at a time over all of the above.
//! - [`worker`]: the ractor actor and the engine thread; [`WorkerHandle`] is the API.
//!
//! This crate speaks neither HTTP nor QUIC.

pub mod block_pool;
pub mod chat;
pub mod engine;
pub mod error;
pub mod loader;
pub mod model;
pub mod sampler;
pub mod scheduler;
pub mod stop;
pub mod tokenizer;
pub mod worker;

pub use engine::{Engine, EngineConfig};
pub use error::{NodeError, Result};
pub use worker::{SeqStream, SubmitRequest, WorkerHandle};
