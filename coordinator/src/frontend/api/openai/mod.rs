//! The OpenAI Chat Completions API: [`request`] parses and validates a body into the neutral
//! [`GenerationRequest`](crate::frontend::request::GenerationRequest); [`response`] holds the handler,
//! the completion JSON and the `chat.completion.chunk` stream (ending in `data: [DONE]`).

pub mod request;
pub mod response;

pub use request::{parse, ChatRequest};
