//! The request front end as one function, for the fuzz target (`fuzz/`) and for the test
//! suite's deterministic pass over the fuzz corpus: bytes → JSON → validation → the pipeline
//! every handler runs ([`crate::frontend::pipeline`]: length, chat template, tokenization,
//! grammar, cache breakpoints). It must return (an error or a prompt) for every input, never
//! panic.

use std::sync::Arc;

use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;

use crate::error::ApiError;
use crate::frontend::api::anthropic::{self, Endpoint};
use crate::frontend::pipeline::{ModelInfo, Purpose, Served};

/// The model as the fuzz target serves it: a file's tokenizer, template and context length.
pub fn served(tokenizer: Arc<Tokenizer>, template: Arc<ChatTemplate>, context_length: usize) -> Served {
    let info = ModelInfo { id: "fuzz".into(), aliases: vec![], display_name: "fuzz".into(), created_unix: 0, context_length };
    Served { info, tokenizer, template, special_tokens_in_content: false }
}

/// Runs one input through the whole front end. Returns the prompt's token count.
pub fn exercise(data: &[u8], served: &Served) -> Result<usize, ApiError> {
    let (endpoint, purpose) = match data.first().is_some_and(|b| b % 2 == 1) {
        true => (Endpoint::CountTokens, Purpose::Count),
        false => (Endpoint::Messages, Purpose::Generate),
    };
    let req = match anthropic::parse_bytes(data, endpoint) {
        Ok(r) => r,
        Err(e) => {
            // Errors are always well-formed API errors.
            assert!(e.status().is_client_error(), "validation produced {e:?}");
            return Err(e);
        }
    };
    let prepared = served.prepare(req.generation, purpose)?;
    // The rendered prompt round-trips through the tokenizer whenever the vocabulary has a token
    // for each of its bytes (bytes without one are dropped, as llama.cpp does).
    let prompt = prepared.req.render(&served.template)?;
    if served.tokenizer.covers(&prompt) {
        let back = served.tokenizer.decode_with_special(&prepared.ids).map_err(|e| ApiError::Internal(e.to_string()))?;
        assert_eq!(back, prompt, "tokenizer round trip");
    }
    for &(at, _) in &prepared.breakpoints {
        assert!(at <= prepared.ids.len(), "a breakpoint inside the prompt");
    }
    Ok(prepared.ids.len())
}
