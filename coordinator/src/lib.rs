//! The zerolayer coordinator: the HTTP API (Anthropic Messages and OpenAI Chat Completions),
//! placement onto workers anywhere in the cluster, the cluster link, metrics, and the
//! `zerolayer` binary. "Node" always means one zerolayer process (a `[[nodes]]` entry of the
//! config); "worker" means one device's engine inside it.
//!
//! Three wings, each a folder, over a shared vocabulary; a module uses only those before it
//! (`module_graph` tests it, on the modules and on these top-level wings):
//! - the vocabulary: [`error`], [`clock`], [`logs`] (log lines, redacted), [`view`] (the cluster as placement reads it: what
//!   [`cluster`] publishes and [`routing`] reads), [`metrics`], [`status`] (the CLI's table);
//!   [`quota`] (per-key limits held cluster-wide) and [`auth`] (keys and callers);
//! - [`cluster`]: QUIC with mutual TLS, chitchat membership and gossip, forwarding, migration,
//!   and the tensor-parallel rank links;
//! - [`routing`]: placement (a pure function over a view), the tracker (staleness correction),
//!   dispatch (local or one QUIC hop), resume (a sequence followed across moves) and the node's
//!   orchestrator actor (drain, undrain, the moves);
//! - [`frontend`]: the APIs (parsing, validation, rendering), the prompt, cache breakpoints,
//!   tools and their grammars, cache-miss diagnostics, and the [`frontend::service::Frontend`]
//!   that every handler calls (admission, preparation, then routing);
//! - the process: [`node`] starts a node and serves it with graceful shutdown; `main` is the
//!   binary and its admin CLI.
//!
//! This crate never touches tensors.

pub mod auth;
pub mod clock;
pub mod cluster;
pub mod error;
pub mod frontend;
pub mod logs;
pub mod metrics;
pub mod node;
pub mod quota;
pub mod routing;
pub mod status;
pub mod view;
