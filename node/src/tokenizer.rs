//! The tokenizer: built from GGUF metadata, or loaded from a `tokenizer.json`.
//!
//! GGUF vocabularies are built in `gguf`: byte-level BPE (`gpt2`: SmolLM2, Qwen, Llama 3) and
//! SentencePiece (`llama`: Gemma, Llama 2, Mistral), each equal to llama.cpp's tokenizer on the
//! same file. Control and user-defined tokens are registered as added tokens, so `<|im_start|>`
//! in a rendered chat template encodes to one id.

use std::path::Path;

use crate::error::{WorkerError, Result};

/// A tokenizer plus the ids that end a turn.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens read as plain text: for what users wrote.
    text_only: tokenizers::Tokenizer,
    /// The special (control) tokens' strings and ids, longest first.
    specials: Vec<(String, u32)>,
    /// Token ids that end generation (the model's EOS and the chat end-of-turn tokens).
    pub end_tokens: Vec<u32>,
    pub bos_token: Option<u32>,
    /// Whether a raw prompt (not a chat template's, which writes its own) starts with
    /// `bos_token`: the GGUF's `tokenizer.ggml.add_bos_token`, as llama.cpp reads it.
    pub add_bos: bool,
    vocab_size: usize,
    /// Which raw bytes have a byte-level token. Some vocabularies lack a few (SmolLM2 has no
    /// token for 0xF1, for example); like llama.cpp, encoding then drops those bytes, so such
    /// text does not round-trip.
    byte_covered: [bool; 256],
    /// The most text bytes one token can stand for (the longest token's UTF-8 length, which is
    /// at least the bytes it covers in both byte-level and SentencePiece vocabularies).
    max_token_bytes: usize,
    /// The constrained-decoding compiler for this vocabulary, built on first use (it indexes
    /// every token's bytes once).
    grammars: std::sync::OnceLock<std::result::Result<std::sync::Arc<crate::grammar::Grammars>, String>>,
}

/// GPT-2's byte-to-unicode table: the character that stands for each raw byte.
fn byte_char(b: u8) -> char {
    let printable = |c: u32| (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || (0xae..=0xff).contains(&c);
    if printable(b as u32) {
        return char::from_u32(b as u32).unwrap();
    }
    let n = (0..b as u32).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// Which raw bytes have a token: a byte-level one (GPT-2's character for it) or a
/// SentencePiece byte-fallback one (`<0x41>`).
fn coverage(has: impl Fn(&str) -> bool) -> [bool; 256] {
    let mut out = [false; 256];
    for (b, o) in out.iter_mut().enumerate() {
        *o = has(&byte_char(b as u8).to_string()) || has(&format!("<0x{b:02X}>"));
    }
    out
}

const END_TOKEN_NAMES: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<end_of_turn>"];

mod gguf;

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`; end tokens come from the vocabulary's well-known names
    /// plus `extra_end_tokens` (e.g. from `config.json`'s `eos_token_id`).
    pub fn from_file(path: &Path, extra_end_tokens: &[u32]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| WorkerError::Model(format!("loading {}: {e}", path.display())))?;
        let mut end_tokens: Vec<u32> = END_TOKEN_NAMES.iter().filter_map(|n| inner.token_to_id(n)).collect();
        end_tokens.extend_from_slice(extra_end_tokens);
        end_tokens.sort_unstable();
        end_tokens.dedup();
        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer::assemble(inner, end_tokens, None, vocab_size))
    }

    fn assemble(inner: tokenizers::Tokenizer, end_tokens: Vec<u32>, bos_token: Option<u32>, vocab_size: usize) -> Self {
        let byte_covered = coverage(|s| inner.token_to_id(s).is_some());
        let mut text_only = inner.clone();
        text_only.set_encode_special_tokens(true);
        let mut specials: Vec<(String, u32)> =
            inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (t.content, id)).collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let max_token_bytes = inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        Tokenizer { inner, text_only, specials, end_tokens, bos_token, add_bos: false, vocab_size, byte_covered, max_token_bytes, grammars: Default::default() }
    }

    /// Encodes text with special-token strings read as plain text.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.text_only.encode_fast(text, false).map_err(|e| WorkerError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The first special-token string written in `text`, if any.
    pub fn special_in<'a>(&'a self, text: &str) -> Option<&'a str> {
        self.specials.iter().map(|(s, _)| s.as_str()).find(|s| text.contains(s))
    }

    /// Encodes a rendered prompt in which `user` (sorted, disjoint byte ranges) is text that
    /// users wrote: special-token strings there are plain text, and only the rest (the chat
    /// template's scaffolding) yields control tokens. Where no user range holds a special-token
    /// string, this is exactly [`Tokenizer::encode`]. Elsewhere the prompt is split at the
    /// scaffolding's special tokens, as `encode` splits it, and the pieces between are encoded
    /// with special tokens read as text.
    pub fn encode_prompt(&self, text: &str, user: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        if !user.iter().any(|r| self.special_in(&text[r.clone()]).is_some()) {
            return self.encode(text);
        }
        let mut ids = Vec::new();
        let piece = |ids: &mut Vec<u32>, s: &str| -> Result<()> {
            if !s.is_empty() {
                ids.extend(self.encode_text(s)?);
            }
            Ok(())
        };
        let (mut at, mut from, mut next_user) = (0, 0, 0);
        while at < text.len() {
            while next_user < user.len() && user[next_user].end <= at {
                next_user += 1;
            }
            if let Some(r) = user.get(next_user).filter(|r| r.start <= at) {
                at = r.end;
                continue;
            }
            let limit = user.get(next_user).map_or(text.len(), |r| r.start);
            let rest = &text[at..];
            match self.specials.iter().find(|(s, _)| rest.starts_with(s.as_str()) && at + s.len() <= limit) {
                Some((s, id)) => {
                    piece(&mut ids, &text[from..at])?;
                    ids.push(*id);
                    at += s.len();
                    from = at;
                }
                None => at += rest.chars().next().map_or(1, char::len_utf8),
            }
        }
        piece(&mut ids, &text[from..])?;
        Ok(ids)
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| WorkerError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| WorkerError::Tokenizer(e.to_string()))
    }

    /// Decodes ids to text, keeping special tokens.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| WorkerError::Tokenizer(e.to_string()))
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(|e| WorkerError::Tokenizer(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The fewest tokens `bytes` bytes of text can encode to (without running the tokenizer).
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes)
    }

    /// Whether every byte of `text` has a token, so that `decode(encode(text)) == text`.
    pub fn covers(&self, text: &str) -> bool {
        text.bytes().all(|b| self.byte_covered[b as usize])
    }

    /// This vocabulary's grammar compiler (built on the first call; later calls share it).
    pub fn grammars(&self) -> Result<std::sync::Arc<crate::grammar::Grammars>> {
        self.grammars
            .get_or_init(|| {
                let json = self.inner.to_string(false).map_err(|e| e.to_string())?;
                crate::grammar::Grammars::new(&json, self.text_only.clone(), &self.end_tokens).map(std::sync::Arc::new).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(WorkerError::Grammar)
    }

    pub fn is_end_token(&self, id: u32) -> bool {
        self.end_tokens.contains(&id)
    }
}

/// Incremental detokenization: turns a growing list of ids into text deltas without ever
/// emitting a broken UTF-8 character (the approach of vLLM and TGI: decode a short window
/// and emit only what became final).
#[derive(Default, Clone, Debug)]
pub struct IncrementalDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Given all generated ids so far (the new one last), returns newly completed text.
    pub fn step(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is left when the sequence ends (a trailing partial character decodes lossily).
    pub fn flush(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&ids[self.prefix_offset..])?;
        self.prefix_offset = ids.len();
        self.read_offset = ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            Ok(full[prefix.len()..].trim_end_matches('\u{FFFD}').to_string())
        } else {
            Ok(String::new())
        }
    }
}
