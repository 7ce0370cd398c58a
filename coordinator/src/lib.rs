//! The zerolayer coordinator: the HTTP API (Anthropic Messages and OpenAI Chat Completions),
//! placement onto workers anywhere in the cluster, the cluster link, metrics, and the
//! `zerolayer` binary. "Node" always means one zerolayer process (a `[[nodes]]` entry of the
//! config); "worker" means one device's engine inside it.
//!
//! Modules, lowest layer first (a module uses only those before it; `module_graph` tests it):
//! - [`error`], [`clock`], [`view`] (the cluster as placement reads it), [`tools`] (offered
//!   functions, calls, and finding calls in generated text), [`request`] (the neutral
//!   generation request), [`prompt`] (it through the chat template, and where the client's
//!   words land), [`caching`] (cache breakpoints in tokens, and the cache usage split),
//!   [`diagnostics`] (why a prompt missed the cache), [`metrics`], [`status`] (the CLI's table);
//! - [`placement`] (a pure function over a view), [`tracker`] (staleness correction), [`quota`]
//!   (per-key limits held cluster-wide), [`auth`] (keys and callers);
//! - [`cluster`]: QUIC with mutual TLS, chitchat membership and gossip, forwarding;
//! - [`dispatch`]: placement and submission (local or one QUIC hop); [`resume`]: a sequence
//!   followed across moves (exact replay after a loss or a drain);
//! - [`coordinator`]: prompt and admission; [`drain`]: the node's coordinator actor (drain,
//!   undrain, the moves);
//! - [`api`]: the axum router, one folder per API; [`fuzzing`]: the front end as one function;
//! - [`node`]: starting a node and serving it with graceful shutdown.
//!
//! This crate never touches tensors.

pub mod api;
pub mod auth;
pub mod caching;
pub mod clock;
pub mod constrain;
pub mod cluster;
pub mod coordinator;
pub mod diagnostics;
pub mod dispatch;
pub mod drain;
pub mod error;
pub mod fuzzing;
pub mod metrics;
pub mod node;
pub mod placement;
pub mod quota;
pub mod prompt;
pub mod request;
pub mod resume;
pub mod status;
pub mod tools;
pub mod tracker;
pub mod view;
