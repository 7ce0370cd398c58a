//! The front-end wing: everything between a client's bytes and a routed sequence.
//! - [`request`]: the neutral generation request every API parses into; [`tools`]: offered
//!   functions, calls, and finding calls in generated text; [`constrain`]: the grammar a reply
//!   is held to;
//! - [`prompt`]: the request through the chat template, and where the client's words land;
//!   [`caching`]: cache breakpoints in tokens, and the cache usage split; [`diagnostics`]: why a
//!   prompt missed the cache;
//! - [`pipeline`]: the served models, and the one path from a parsed request to the engine's
//!   input (length, prompt tokens, grammar, cache breakpoints) that every API and the fuzz target
//!   run;
//! - [`service`]: the [`service::Frontend`] every handler calls (admission, preparation off the
//!   runtime, then [`crate::routing`]); [`stored`]: the responses this node keeps for the
//!   Responses API's `previous_response_id`; [`timing`]: where a request's time went
//!   (`server-timing`); [`policy`]: input and output rules (pure); [`audit`]: the records of
//!   their matches;
//! - [`api`]: the axum router, one folder per API; [`fuzzing`]: the front end as one function,
//!   for the fuzz targets.
//!
//! Uses the routing and cluster wings; neither of them uses this one.

pub mod api;
pub mod audit;
pub mod caching;
pub mod constrain;
pub mod diagnostics;
pub mod fuzzing;
pub mod pipeline;
pub mod policy;
pub mod prompt;
pub mod request;
pub mod service;
pub mod stored;
pub mod timing;
pub mod tools;
