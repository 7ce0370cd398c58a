//! A tokenizer from GGUF metadata, equal to llama.cpp's on the same file.
//!
//! - `gpt2` (byte-level BPE: SmolLM2, Qwen, Llama 3): the vocabulary and merges come from
//!   `tokenizer.ggml.tokens` / `tokenizer.ggml.merges`, and `tokenizer.ggml.pre` picks
//!   llama.cpp's splitting (SmolLM2's `smollm` splits every digit on its own before the GPT-2
//!   pattern; Qwen2's splits digits one by one inside the Llama 3 pattern).
//! - `llama` (SentencePiece: Gemma, Llama 2, Mistral): llama.cpp merges the adjacent pair whose
//!   joined text is the highest-scored token, then spells what is left over in byte tokens
//!   (`<0x41>`). That is BPE with one merge per way of splitting each token in two, ranked by the
//!   joined token's score, and byte fallback: what Hugging Face's SentencePiece conversion
//!   builds. Spaces are `▁`; `add_space_prefix` puts one before the text.
//!
//! Anything else (another tokenizer model, a pre-tokenizer llama.cpp splits some other way) is
//! refused, naming what was found and what is supported: a guess would encode prompts into
//! tokens the model never saw.

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior};

use super::{Tokenizer, END_TOKEN_NAMES};
use crate::error::{Result, WorkerError};

// llama.cpp's `llama-bpe` / Llama 3 pattern (also DBRX's and Smaug's).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

// llama.cpp's `qwen2` pattern: Llama 3's, with digits split one by one.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer models read here.
pub const TOKENIZER_MODELS: &[&str] = &["gpt2 (byte-level BPE)", "llama (SentencePiece)"];

/// The `tokenizer.ggml.pre` values of byte-level BPE vocabularies that split as llama.cpp does.
pub const PRE_TOKENIZERS: &[&str] =
    &["smollm", "llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "qwen2", "deepseek-r1-qwen", "gpt-2", "phi-2", "jina-v2-code"];

/// Token types in `tokenizer.ggml.token_type`: control (special; never shown in output text) and
/// user-defined (Qwen's `<tool_call>`, Gemma's runs of newlines: ordinary text, matched whole).
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata (`file` names the model in errors).
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let get = |k: &str| md.get(k).ok_or_else(|| WorkerError::Model(format!("GGUF metadata lacks {k}")));
        let model = get("tokenizer.ggml.model")?.to_string().map_err(WorkerError::candle)?.clone();
        let tokens: Vec<String> = get("tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(WorkerError::candle)?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<std::result::Result<_, _>>()
            .map_err(WorkerError::candle)?;
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v.to_vec().map_err(WorkerError::candle)?.iter().map(|t| t.to_i32().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let flag = |k: &str| md.get(k).and_then(|v| v.to_bool().ok());
        let (mut inner, add_bos_default) = match model.as_str() {
            "gpt2" => (byte_level_bpe(md, &tokens)?, false),
            "llama" => {
                let scores: Vec<f32> = get("tokenizer.ggml.scores")?.to_vec().map_err(WorkerError::candle)?.iter().map(|v| v.to_f32().unwrap_or(0.0)).collect();
                (sentencepiece_bpe(&tokens, &scores, &types, flag("tokenizer.ggml.add_space_prefix").unwrap_or(true))?, true)
            }
            other => {
                return Err(WorkerError::Model(format!(
                    "GGUF tokenizer model {other:?} is not supported (supported: {}); pass a tokenizer.json instead",
                    TOKENIZER_MODELS.join(", ")
                )))
            }
        };
        let added = |kind: i32| -> Vec<AddedToken> {
            tokens.iter().zip(&types).filter(|(_, &t)| t == kind).map(|(s, _)| AddedToken::from(s.clone(), kind == CONTROL).normalized(false)).collect()
        };
        inner.add_special_tokens(added(CONTROL)).map_err(|e| WorkerError::Model(format!("registering special tokens: {e}")))?;
        inner.add_tokens(added(USER_DEFINED)).map_err(|e| WorkerError::Model(format!("registering user-defined tokens: {e}")))?;

        let mut end_tokens = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            end_tokens.extend(md.get(key).and_then(|v| v.to_u32().ok()));
        }
        end_tokens.extend(END_TOKEN_NAMES.iter().filter_map(|name| tokens.iter().position(|t| t == name)).map(|id| id as u32));
        end_tokens.sort_unstable();
        end_tokens.dedup();
        let bos_token = md.get("tokenizer.ggml.bos_token_id").and_then(|v| v.to_u32().ok());
        let mut tok = Tokenizer::assemble(inner, end_tokens, bos_token, tokens.len());
        tok.add_bos = bos_token.is_some() && flag("tokenizer.ggml.add_bos_token").unwrap_or(add_bos_default);
        Ok(tok)
    }
}

/// A byte-level BPE vocabulary (`gpt2`), split by the pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_bpe(md: &HashMap<String, gguf_file::Value>, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    let merges: Vec<(String, String)> = md
        .get("tokenizer.ggml.merges")
        .ok_or_else(|| WorkerError::Model("GGUF metadata lacks tokenizer.ggml.merges".into()))?
        .to_vec()
        .map_err(WorkerError::candle)?
        .iter()
        .map(|v| {
            let s = v.to_string().map_err(WorkerError::candle)?;
            s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| WorkerError::Model(format!("bad merge {s:?}")))
        })
        .collect::<Result<_>>()?;
    let pre = md.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).cloned().unwrap_or_else(|| "default".into());
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| WorkerError::Model(format!("building BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| WorkerError::Model(format!("pre-tokenizer regex: {e}")))?;
        Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into())
    };
    let pre_tok: PreTokenizerWrapper = match pre.as_str() {
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        "llama-bpe" | "llama3" | "llama-v3" | "dbrx" | "smaug-bpe" => split(LLAMA3_PATTERN)?,
        "qwen2" | "deepseek-r1-qwen" => split(QWEN2_PATTERN)?,
        "gpt-2" | "phi-2" | "jina-v2-code" => byte_level.into(),
        other => {
            return Err(WorkerError::Model(format!(
                "GGUF pre-tokenizer {other:?} is not supported: llama.cpp splits text for it in a way this server does not \
                 reproduce (supported: {}); pass a tokenizer.json instead",
                PRE_TOKENIZERS.join(", ")
            )))
        }
    };
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// A SentencePiece vocabulary (`llama`) as BPE: every way to split a token into two tokens is a
/// merge, ranked by the joined token's score (highest first; llama.cpp's order), with byte
/// fallback for what no token spells.
fn sentencepiece_bpe(tokens: &[String], scores: &[f32], types: &[i32], add_space_prefix: bool) -> Result<tokenizers::Tokenizer> {
    if scores.len() != tokens.len() {
        return Err(WorkerError::Model(format!("{} token scores for {} tokens", scores.len(), tokens.len())));
    }
    // Only normal tokens take part in merges (control, user-defined and byte tokens are
    // matched whole or spelled by the fallback, as in llama.cpp).
    let normal = |i: usize| types.get(i).is_none_or(|&t| t == 1);
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().filter(|&(i, _)| normal(i)).map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate().filter(|&(i, _)| normal(i)) {
        for (at, _) in t.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&t[..at]), ids.get(&t[at..])) {
                merges.push((scores[i], i, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = merges.into_iter().map(|(_, _, l, r)| (tokens[l].clone(), tokens[r].clone())).collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let unk = tokens.iter().position(|t| t == "<unk>").map(|i| tokens[i].clone());
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(u);
    }
    let bpe = builder.build().map_err(|e| WorkerError::Model(format!("building the SentencePiece vocabulary: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space = Replace::new(" ", "▁").map_err(|e| WorkerError::Model(format!("normalizer: {e}")))?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        tokenizers::normalizers::Sequence::new(vec![Prepend::new("▁".into()).into(), space.into()]).into()
    } else {
        space.into()
    };
    inner.with_normalizer(Some(normalizer)).map_err(|e| WorkerError::Model(format!("normalizer: {e}")))?;
    let mut decoders = vec![Replace::new("▁", " ").map_err(|e| WorkerError::Model(format!("decoder: {e}")))?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;

    fn md(model: &str, pre: Option<&str>) -> HashMap<String, Value> {
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String(model.into()));
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(["a", "b", "ab"].iter().map(|t| Value::String(t.to_string())).collect()));
        md.insert("tokenizer.ggml.merges".into(), Value::Array(vec![Value::String("a b".into())]));
        md.insert("tokenizer.ggml.scores".into(), Value::Array(vec![Value::F32(0.0), Value::F32(-1.0), Value::F32(-2.0)]));
        if let Some(p) = pre {
            md.insert("tokenizer.ggml.pre".into(), Value::String(p.into()));
        }
        md
    }

    fn err(md: &HashMap<String, Value>) -> String {
        match Tokenizer::from_gguf(md) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    }

    /// An unknown tokenizer model or pre-tokenizer is refused, naming what was found and what
    /// is supported; no vocabulary is guessed.
    #[test]
    fn unknown_tokenizers_are_refused_with_what_is_supported() {
        let e = err(&md("bert", None));
        assert!(e.contains("\"bert\"") && e.contains("gpt2") && e.contains("llama (SentencePiece)"), "{e}");
        for pre in [Some("starcoder"), Some("default"), None] {
            let e = err(&md("gpt2", pre));
            assert!(e.contains(&format!("{:?}", pre.unwrap_or("default"))) && e.contains("smollm") && e.contains("qwen2"), "{e}");
        }
        assert!(Tokenizer::from_gguf(&md("gpt2", Some("llama-bpe"))).is_ok());
        // SentencePiece: "ab" is one piece, merged from "a" and "b".
        let t = Tokenizer::from_gguf(&md("llama", None)).unwrap();
        assert_eq!(t.encode("ab").unwrap(), vec![2]);
    }
}
