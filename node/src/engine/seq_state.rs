//! A sequence's state on the engine beside its scheduling: its sampler, detokenizer, stop
//! matcher, grammar, pins, draft length and prompt-logprob progress; `advance` takes each new
//! token through them.

use zerolayer_common::{CachePin, SamplingParams, StopReason};

use crate::error::Result;
use crate::grammar::Constraint;
use crate::sampler::Sampler;
use crate::speculate::Drafter;
use crate::stop::StopChecker;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

pub(super) struct SeqState {
    pub(super) params: SamplingParams,
    pub(super) sampler: Sampler,
    pub(super) decoder: IncrementalDecoder,
    pub(super) stop: StopChecker,
    /// The grammar the output must match, if the request set one.
    pub(super) constraint: Option<Constraint>,
    /// Prompt prefixes to pin once they are computed (`cache_control` TTLs).
    pub(super) pins: Vec<CachePin>,
    /// How long its next speculative draft may be.
    pub(super) drafter: Drafter,
    /// The next prompt token whose logprobs are to be reported (the prompt's length when
    /// none are: not asked, or reported before it moved here).
    pub(super) prompt_next: usize,
}

impl SeqState {
    pub(super) fn new(params: SamplingParams, sampled: u64, max_draft: usize) -> Self {
        SeqState {
            sampler: Sampler::new(&params, sampled),
            decoder: IncrementalDecoder::default(),
            stop: StopChecker::new(&params.stop_sequences),
            params,
            constraint: None,
            pins: Vec::new(),
            drafter: Drafter::new(max_draft),
            prompt_next: usize::MAX,
        }
    }

    /// The text the newest token of `generated` completes (the token is `generated`'s last),
    /// and whether the sequence ends with it: the end token, a stop sequence, `max_tokens`.
    pub(super) fn advance(&mut self, tok: &Tokenizer, generated: &[u32]) -> Result<(String, Option<StopReason>)> {
        let last = *generated.last().expect("a new token");
        let end = tok.is_end_token(last) && (!self.params.ignore_eos || self.params.grammar.is_some());
        let at_limit = !end && generated.len() >= self.params.max_tokens as usize;
        // An end token adds no text of its own: only what the decoder still holds back.
        let gen = &generated[..generated.len() - usize::from(end)];
        let mut text = if end { String::new() } else { self.decoder.step(tok, gen)? };
        if end || at_limit {
            text.push_str(&self.decoder.flush(tok, gen)?);
        }
        let step = self.stop.push(&text);
        let mut emit = step.emit;
        let reason = match step.matched {
            Some(m) => Some(StopReason::StopSequence(m)),
            None if end => Some(StopReason::EndTurn),
            None if at_limit => Some(StopReason::MaxTokens),
            None => None,
        };
        if matches!(reason, Some(StopReason::EndTurn | StopReason::MaxTokens)) {
            // Text held back as a possible stop-sequence start is final now.
            emit.push_str(&self.stop.flush());
        }
        Ok((emit, reason))
    }
}
