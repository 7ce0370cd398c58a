//! The models this node's front end serves ([`Served`]), and the one path a parsed request takes
//! to the engine's input, whichever API it came in on and for the fuzz target alike: the length
//! check that needs no tokenizer, the prompt's tokens, the grammar the reply is held to, and
//! where the cache breakpoints fall in the prompt.
//!
//! Pure over the served model (its tokenizer and chat template): the handlers run it on the
//! preparation pool ([`crate::frontend::service::Frontend::prepare`]), the fuzz target inline.

use std::sync::Arc;

use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;

use crate::error::ApiError;
use crate::frontend::caching;
use crate::frontend::request::{CacheTtl, GenerationRequest};

/// A model the cluster serves: its names and its context.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub id: String,
    pub aliases: Vec<String>,
    pub display_name: String,
    pub created_unix: i64,
    pub context_length: usize,
}

impl ModelInfo {
    pub fn matches(&self, name: &str) -> bool {
        self.id == name || self.aliases.iter().any(|a| a == name)
    }
}

/// A model as this node's front end serves it: what it is, and the tokenizer and chat template
/// that render and tokenize its prompts (this node renders prompts for every model in the
/// cluster, whichever worker runs them).
pub struct Served {
    pub info: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub special_tokens_in_content: bool,
}

/// What the prompt is prepared for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A generation: the grammar is compiled and the cache breakpoints are found.
    Generate,
    /// Counting the prompt's tokens (`count_tokens`): nothing is generated.
    Count,
}

/// A request ready for the engine.
pub struct Prepared {
    pub req: GenerationRequest,
    /// The prompt's tokens.
    pub ids: Vec<u32>,
    /// Where the request's cache breakpoints fall in `ids` (none when counting).
    pub breakpoints: Vec<(usize, CacheTtl)>,
}

impl Served {
    /// Runs `req` through the pipeline (module docs).
    pub fn prepare(&self, mut req: GenerationRequest, purpose: Purpose) -> Result<Prepared, ApiError> {
        self.check_length(&req)?;
        let ids = self.prompt_ids(&req)?;
        if tracing::enabled!(target: "zerolayer_coordinator::frontend::prompt", tracing::Level::DEBUG) {
            let last = match &req.raw {
                Some(crate::frontend::request::RawPrompt::Text(t)) => t.as_str(),
                Some(_) => "",
                None => req.turns.last().map_or("", |t| t.text.as_str()),
            };
            let mut from = last.len().saturating_sub(512);
            while !last.is_char_boundary(from) {
                from -= 1;
            }
            let tail = &last[from..];
            tracing::debug!(target: "zerolayer_coordinator::frontend::prompt", model = %self.info.id, prompt_tokens = ids.len(), last_turn = %tail, "prompt prepared");
        }
        let breakpoints = match purpose {
            Purpose::Generate => {
                self.constrain(&mut req)?;
                caching::breakpoint_tokens(&req, &self.template, &self.tokenizer)
            }
            Purpose::Count => vec![],
        };
        Ok(Prepared { req, ids, breakpoints })
    }

    /// The length check that needs no tokenizer: a prompt whose text alone must be more tokens
    /// than the context holds is refused before the template runs.
    pub fn check_length(&self, req: &GenerationRequest) -> Result<(), ApiError> {
        let at_least = self.tokenizer.min_tokens(req.text_bytes());
        if at_least >= self.info.context_length {
            return Err(ApiError::invalid(format!(
                "prompt is too long: at least {at_least} tokens > {} maximum",
                self.info.context_length.saturating_sub(1)
            )));
        }
        Ok(())
    }

    /// The prompt's token ids (`prompt::prompt_ids`: what the client wrote stays text).
    pub fn prompt_ids(&self, req: &GenerationRequest) -> Result<Vec<u32>, ApiError> {
        match &req.raw {
            Some(raw) => crate::frontend::prompt::raw_ids(raw, &self.tokenizer),
            None if !self.template.is_own() => Err(ApiError::invalid(format!(
                "model {} has no chat template (a base model): send its prompt to /v1/completions",
                self.info.id
            ))),
            None => crate::frontend::prompt::prompt_ids(req, &self.template, &self.tokenizer, self.special_tokens_in_content),
        }
    }

    /// Sets the grammar the reply is held to (`tool_choice`, the output format: see
    /// [`crate::frontend::constrain`]) and checks that it compiles, so that a schema the engine
    /// cannot enforce is the client's 400 before anything is placed.
    pub fn constrain(&self, req: &mut GenerationRequest) -> Result<(), ApiError> {
        req.params.grammar = req.grammar()?;
        if let Some(g) = &req.params.grammar {
            self.tokenizer.grammars()?.compile(g)?;
        }
        Ok(())
    }
}
