//! The Anthropic Messages API: [`request`] parses and validates a body into the neutral
//! [`GenerationRequest`](crate::frontend::request::GenerationRequest); [`response`] holds the handlers,
//! the response JSON and the SSE event sequence.

pub mod request;
pub mod response;

pub use request::{parse, parse_bytes, Endpoint, MessagesRequest};
