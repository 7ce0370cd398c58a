//! Constrained decoding: a sequence whose [`SamplingParams::grammar`] is set only ever samples
//! tokens its grammar allows, so a forced tool call always parses and validates against the
//! tool's schema, and so does structured output.
//!
//! The grammar engine is llguidance (Earley parsing over a token trie, as vLLM, SGLang and
//! llama.cpp use it): [`Grammars`] holds its per-vocabulary state, built once per tokenizer on
//! first use; [`Constraint`] is one sequence's parser. Each step computes the sequence's mask of
//! allowed tokens before sampling and advances the parser with the sampled token. A moved or
//! replayed sequence rebuilds its parser by feeding it the tokens already generated, so its
//! constraint continues exactly where it was.
//!
//! Grammar completion is the end of the turn: once the grammar accepts, the model's end tokens
//! are allowed (all of them, not only the one llguidance calls EOS), and once it can go no
//! further they are the only tokens allowed.
//!
//! [`SamplingParams::grammar`]: zerolayer_common::SamplingParams::grammar

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::error::{Result, WorkerError};

/// Most bytes of grammar text one request may carry (schemas included).
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// The vocabulary as llguidance sees it: each token's bytes, in a trie.
struct Vocab {
    trie: TokTrie,
    /// Encodes text with special-token strings read as plain text (what a grammar literal is).
    text: tokenizers::Tokenizer,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.text.encode_fast(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiled grammars kept for reuse (an agent sends the same tools on every turn).
pub const COMPILED_CACHE: usize = 64;

/// One vocabulary's grammar compiler: shared by every constrained sequence of a model.
pub struct Grammars {
    factory: ParserFactory,
    /// The model's end tokens (allowed wherever llguidance allows its EOS).
    end_tokens: Vec<u32>,
    /// Fresh parsers of recently compiled grammars, newest last (at most [`COMPILED_CACHE`]):
    /// the coordinator's check compiles a request's grammar, and the worker that runs it (or
    /// the next request with the same tools) starts from a copy instead of compiling again on
    /// the engine thread.
    compiled: std::sync::Mutex<std::collections::VecDeque<(Arc<str>, Matcher)>>,
}

impl Grammars {
    /// Builds the compiler from a Hugging Face `tokenizer.json` (as text) and the end tokens.
    pub fn new(tokenizer_json: &str, text: tokenizers::Tokenizer, end_tokens: &[u32]) -> Result<Self> {
        let bad = |e: String| WorkerError::Model(format!("constrained decoding is unavailable for this vocabulary: {e}"));
        let json: serde_json::Value = serde_json::from_str(tokenizer_json).map_err(|e| bad(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| bad(e.to_string()))?;
        let vocab = text.get_vocab_size(true).max(words.len());
        words.resize(vocab, Vec::new());
        let eos = *end_tokens.first().ok_or_else(|| bad("the model has no end token".into()))?;
        if eos as usize >= vocab {
            return Err(bad(format!("end token {eos} is outside the vocabulary")));
        }
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(Vocab { trie, text });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, end_tokens: end_tokens.to_vec(), compiled: Default::default() })
    }

    /// Compiles `lark` into a fresh parser, checking it: the coordinator calls this before a
    /// request is placed, so a grammar that does not compile is the client's 400, not a
    /// worker's failure.
    pub fn compile(&self, lark: &str) -> Result<Matcher> {
        if lark.len() > MAX_GRAMMAR_BYTES {
            return Err(WorkerError::Grammar(format!("the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES} are allowed", lark.len())));
        }
        let cached = |c: &mut std::collections::VecDeque<(Arc<str>, Matcher)>| {
            let i = c.iter().position(|(text, _)| &**text == lark)?;
            let hit = c.remove(i)?;
            let copy = hit.1.deep_clone();
            c.push_back(hit);
            Some(copy)
        };
        if let Some(m) = cached(&mut self.compiled.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(m);
        }
        let parser = self.factory.create_parser(TopLevelGrammar::from_lark(lark.to_string())).map_err(|e| WorkerError::Grammar(without_listing(&e.to_string())))?;
        let m = Matcher::new(Ok(parser));
        let mut c = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if c.len() >= COMPILED_CACHE {
            c.pop_front();
        }
        c.push_back((Arc::from(lark), m.deep_clone()));
        Ok(m)
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    grammars: Arc<Grammars>,
    mask: SimpleVob,
}

impl Constraint {
    /// A parser for `lark` that has already read `generated` (a resumed sequence's tokens; a
    /// trailing end token is not part of the grammar's text).
    pub fn new(grammars: Arc<Grammars>, lark: &str, generated: &[u32]) -> Result<Self> {
        let mut matcher = grammars.compile(lark)?;
        let body = match generated.last() {
            Some(t) if grammars.end_tokens.contains(t) => &generated[..generated.len() - 1],
            _ => generated,
        };
        matcher.consume_tokens(body).map_err(|e| WorkerError::Grammar(format!("replaying the generated tokens: {e}")))?;
        Ok(Constraint { matcher, grammars, mask: SimpleVob::new() })
    }

    /// The tokens allowed next, as a bitset (bit `t % 32` of word `t / 32`): what the grammar
    /// allows, plus every end token wherever it allows its EOS.
    pub fn allowed(&mut self) -> Result<&[u32]> {
        let mut mask = self.matcher.compute_mask_or_eos().map_err(|e| WorkerError::Grammar(e.to_string()))?;
        let eos = self.matcher.tok_env().map(|env| env.tok_trie().eos_token()).ok();
        if eos.is_some_and(|e| mask.is_allowed(e)) {
            for &t in &self.grammars.end_tokens {
                if (t as usize) < mask.len() {
                    mask.allow_token(t);
                }
            }
        }
        if mask.is_zero() {
            return Err(WorkerError::Grammar("the grammar allows no token here".into()));
        }
        self.mask = mask;
        Ok(self.mask.as_slice())
    }

    /// Advances the parser by the sampled token (end tokens end the sequence instead).
    pub fn commit(&mut self, tok: u32) -> Result<()> {
        if self.grammars.end_tokens.contains(&tok) {
            return Ok(());
        }
        self.matcher.consume_token(tok).map_err(|e| WorkerError::Grammar(e.to_string()))
    }
}

/// Whether `text` is a whole sentence of `lark`, read byte by byte (a vocabulary of one token
/// per byte, so no model is needed): for checking what a grammar admits. Errors: the grammar
/// does not compile.
pub fn accepts_text(lark: &str, text: &str) -> Result<bool> {
    let env = ApproximateTokEnv::single_byte_env();
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| WorkerError::Grammar(e.to_string()))?;
    factory.quiet();
    let parser = factory.create_parser(TopLevelGrammar::from_lark(lark.to_string())).map_err(|e| WorkerError::Grammar(without_listing(&e.to_string())))?;
    let mut m = Matcher::new(Ok(parser));
    let bytes: Vec<TokenId> = text.bytes().map(TokenId::from).collect();
    if m.consume_tokens(&bytes).is_err() {
        return Ok(false);
    }
    Ok(m.is_accepting().unwrap_or(false))
}

/// An error message without the grammar listing llguidance appends (numbered `  n | …` lines):
/// the grammar is ours, the schema in it the client's, which it has.
fn without_listing(msg: &str) -> String {
    let listing = |l: &str| l.trim_start().split_once(" | ").is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()));
    msg.lines().filter(|l| !listing(l) && !l.trim_start().starts_with('^')).collect::<Vec<_>>().join("\n")
}

/// Whether token `t` is set in the bitset `mask` (tokens past its end are not).
pub fn allows(mask: &[u32], t: u32) -> bool {
    mask.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grammar_admits_its_sentences_and_nothing_else() {
        let g = "start: \"a\" (\"b\" | \"c\")* \"!\"\n";
        for (text, ok) in [("a!", true), ("abcb!", true), ("a", false), ("ab", false), ("b!", false), ("a!!", false)] {
            assert_eq!(accepts_text(g, text).unwrap(), ok, "{text:?}");
        }
        assert!(accepts_text("start: nope\n", "x").is_err(), "an undefined rule does not compile");
    }

    #[test]
    fn embedded_json_is_held_to_its_schema() {
        let g = r#"start: %json {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}"#;
        assert!(accepts_text(g, r#"{"n": 3}"#).unwrap());
        assert!(!accepts_text(g, r#"{"n": "3"}"#).unwrap());
        assert!(!accepts_text(g, r#"{"m": 3}"#).unwrap());
    }

    #[test]
    fn listings_are_cut_from_errors() {
        assert_eq!(without_listing("bad rule\n  1 | start: x\n    ^ here\nmore"), "bad rule\nmore");
    }

    #[test]
    fn allows_reads_the_bitset() {
        let mask = [0b1010u32, 1];
        assert!(allows(&mask, 1) && allows(&mask, 3) && allows(&mask, 32));
        assert!(!allows(&mask, 0) && !allows(&mask, 2) && !allows(&mask, 33) && !allows(&mask, 64));
    }
}
