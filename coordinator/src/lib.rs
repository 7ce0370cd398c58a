//! The zerolayer coordinator: the HTTP API (Anthropic Messages and OpenAI Chat Completions),
//! placement onto workers, metrics, and the `zerolayer` binary.
//!
//! - [`anthropic`], [`openai`]: request parsing and validation.
//! - [`coordinator`]: prompt rendering, admission and placement; hands sequences to workers.
//! - [`http`]: the axum router and the response/SSE shapes.
//! - [`error`]: the one place errors become HTTP responses.
//! - [`node`]: starting a node and serving it with graceful shutdown.
//!
//! This crate never touches tensors.

pub mod anthropic;
pub mod auth;
pub mod coordinator;
pub mod error;
pub mod fuzzing;
pub mod http;
pub mod metrics;
pub mod node;
pub mod openai;
