//! The request front end as one function, for the fuzz target (`fuzz/`) and for the test
//! suite's deterministic pass over the fuzz corpus: bytes → JSON → validation → chat template
//! → tokenization. It must return (an error or a prompt) for every input, never panic.

use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;

use crate::frontend::api::anthropic::{self, Endpoint};
use crate::error::ApiError;

/// Runs one input through the whole front end. Returns the prompt's token count.
pub fn exercise(data: &[u8], tokenizer: &Tokenizer, template: &ChatTemplate) -> Result<usize, ApiError> {
    let endpoint = if data.first().is_some_and(|b| b % 2 == 1) { Endpoint::CountTokens } else { Endpoint::Messages };
    let req = match anthropic::parse_bytes(data, endpoint) {
        Ok(r) => r,
        Err(e) => {
            // Errors are always well-formed API errors.
            assert!(e.status().is_client_error(), "validation produced {e:?}");
            return Err(e);
        }
    };
    let prompt = req.generation.render(template)?;
    let ids = crate::frontend::prompt::prompt_ids(&req.generation, template, tokenizer, false)?;
    // The rendered prompt round-trips through the tokenizer whenever the vocabulary has a token
    // for each of its bytes (bytes without one are dropped, as llama.cpp does).
    if tokenizer.covers(&prompt) {
        let back = tokenizer.decode_with_special(&ids).map_err(|e| ApiError::Internal(e.to_string()))?;
        assert_eq!(back, prompt, "tokenizer round trip");
    }
    Ok(ids.len())
}
