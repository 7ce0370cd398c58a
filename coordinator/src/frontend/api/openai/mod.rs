//! The OpenAI APIs: [`request`] parses and validates a Chat Completions body into the neutral
//! [`GenerationRequest`](crate::frontend::request::GenerationRequest); [`response`] holds its
//! handler, the completion JSON and the `chat.completion.chunk` stream (ending in
//! `data: [DONE]`); [`completions`] is the legacy Completions API (a raw prompt, for base
//! models); [`responses`] is the Responses API (what OpenAI's agents, Codex among them, speak);
//! [`logprobs`] is what a request asks of logprobs and their shape in each answer.

pub mod completions;
mod fields;
pub mod logprobs;
pub mod request;
pub mod response;
pub mod responses;

pub use request::{parse, ChatRequest};
