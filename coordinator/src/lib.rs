//! The zerolayer coordinator: the HTTP API (Anthropic Messages and OpenAI Chat Completions),
//! placement onto workers, metrics, and the `zerolayer` binary.
//!
//! - [`anthropic`], [`openai`]: request parsing and validation.
//! - [`coordinator`]: prompt rendering, admission; places and hands sequences to workers.
//! - [`placement`]: the sans-IO placement function over a cluster view.
//! - [`cluster`]: QUIC with mutual TLS, chitchat membership and gossip, forwarding.
//! - [`http`]: the axum router and the response/SSE shapes.
//! - [`error`]: the one place errors become HTTP responses.
//! - [`node`]: starting a node and serving it with graceful shutdown.
//!
//! This crate never touches tensors.

pub mod anthropic;
pub mod auth;
pub mod cluster;
pub mod coordinator;
pub mod error;
pub mod fuzzing;
pub mod http;
pub mod metrics;
pub mod node;
pub mod openai;
pub mod placement;
pub mod status;
