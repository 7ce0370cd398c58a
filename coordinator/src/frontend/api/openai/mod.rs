//! The OpenAI APIs: [`request`] parses and validates a Chat Completions body into the neutral
//! [`GenerationRequest`](crate::frontend::request::GenerationRequest); [`response`] holds its
//! handler, the completion JSON and the `chat.completion.chunk` stream (ending in
//! `data: [DONE]`); [`completions`] is the legacy Completions API (a raw prompt, for base
//! models); [`responses`] is the Responses API (what OpenAI's agents, Codex among them, speak);
//! [`logprobs`] is what a request asks of logprobs and their shape in each answer; [`choices`]
//! runs a request's `n` choices; [`chunks`] is what one stream's chunks share; [`fields`] is
//! what every route's parsing shares, the refusal of unknown fields among it.

pub mod choices;
pub mod chunks;
pub mod completions;
pub(crate) mod fields;
pub mod logprobs;
pub mod request;
pub mod response;
pub mod responses;

pub use request::{parse, ChatRequest};
