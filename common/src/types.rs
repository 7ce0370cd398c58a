//! Request-level types exchanged between the coordinator and the worker.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Identifies a node in the cluster (from `cluster.toml`).
pub type NodeId = String;

/// A worker's id within its node (from `cluster.toml`), e.g. `cpu0`.
pub type WorkerId = String;

/// Sampling and stopping parameters for one sequence.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means exact greedy decoding (argmax), never a small positive temperature.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (None or 0: no limit).
    pub top_k: Option<u32>,
    /// Nucleus sampling mass in (0, 1] (None: 1).
    pub top_p: Option<f32>,
    /// Seed for reproducible sampling; None draws one.
    pub seed: Option<u64>,
    /// The most tokens to generate. 0 only prefills (and caches) the prompt.
    pub max_tokens: u32,
    /// Generation stops before emitting any of these strings.
    pub stop_sequences: Vec<String>,
    /// Keep generating past the model's end tokens (benchmarks only).
    #[serde(default)]
    pub ignore_eos: bool,
    /// A grammar the output must match, in llguidance's Lark dialect (JSON schemas embedded as
    /// `%json {…}`): tokens it does not allow are never sampled. Built by the coordinator from
    /// `tool_choice` and the requested output format; None leaves the output free.
    #[serde(default)]
    pub grammar: Option<String>,
    /// Drop the tokens less likely than `min_p` times the most likely one (None or 0: off).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// OpenAI's penalties on the tokens generated so far: each loses `presence_penalty` once it
    /// has appeared, and `frequency_penalty` per time it appeared (0: off).
    #[serde(default)]
    pub presence_penalty: f32,
    #[serde(default)]
    pub frequency_penalty: f32,
    /// The CTRL penalty (Hugging Face's, vLLM's) on every token of the prompt and the output: a
    /// positive logit is divided by it, a negative one multiplied (None or 1: off).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Added to these tokens' logits before anything else (OpenAI's `logit_bias`).
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Return each generated token's log-probability and this many of the most likely
    /// alternatives (at most [`TokenLogprob::MAX_TOP`]); None: none.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// With `logprobs`: also report the prompt's tokens' (each after the first), computed anew
    /// rather than read from the prefix cache ([`SeqEvent::PromptLogprobs`]).
    #[serde(default)]
    pub prompt_logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: None,
            max_tokens: 256,
            stop_sequences: vec![],
            ignore_eos: false,
            grammar: None,
            min_p: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: None,
            logit_bias: vec![],
            logprobs: None,
            prompt_logprobs: false,
        }
    }
}

impl SamplingParams {
    /// Most stop sequences, and the longest one (bytes), on every API.
    pub const MAX_STOP_SEQUENCES: usize = 16;
    pub const MAX_STOP_SEQUENCE_BYTES: usize = 256;
    /// Most `logit_bias` entries.
    pub const MAX_LOGIT_BIAS: usize = 1024;

    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams { temperature: 0.0, max_tokens, ..Default::default() }
    }

    /// Whether every field is within what the APIs accept (their widest bounds: OpenAI's
    /// temperature up to 2, the penalties of [-2, 2], `repetition_penalty` in (0, 2], biases
    /// of [-100, 100], no NaN anywhere). The worker checks every job with it, so a job that a
    /// peer made up, not only a client's request, is held to the same bounds. Token ids are
    /// checked against the model's vocabulary by the worker.
    pub fn check(&self) -> Result<(), String> {
        let within = |v: f32, lo: f32, hi: f32| v.is_finite() && (lo..=hi).contains(&v);
        let fields = [
            ("temperature", within(self.temperature, 0.0, 2.0)),
            ("top_p", self.top_p.is_none_or(|p| within(p, 0.0, 1.0) && p > 0.0)),
            ("min_p", self.min_p.is_none_or(|m| within(m, 0.0, 1.0))),
            ("presence_penalty", within(self.presence_penalty, -2.0, 2.0)),
            ("frequency_penalty", within(self.frequency_penalty, -2.0, 2.0)),
            ("repetition_penalty", self.repetition_penalty.is_none_or(|r| within(r, 0.0, 2.0) && r > 0.0)),
            ("logit_bias", self.logit_bias.len() <= Self::MAX_LOGIT_BIAS && self.logit_bias.iter().all(|&(_, b)| within(b, -100.0, 100.0))),
            ("logprobs", self.logprobs.is_none_or(|k| k <= TokenLogprob::MAX_TOP)),
            (
                "stop_sequences",
                self.stop_sequences.len() <= Self::MAX_STOP_SEQUENCES
                    && self.stop_sequences.iter().all(|s| !s.is_empty() && s.len() <= Self::MAX_STOP_SEQUENCE_BYTES),
            ),
        ];
        match fields.iter().find(|(_, ok)| !ok) {
            Some((name, _)) => Err(format!("sampling parameter {name} is outside its bounds")),
            None => Ok(()),
        }
    }
}

/// A prompt prefix the worker keeps cached (Anthropic's `cache_control` TTLs): the prompt's
/// first `tokens` tokens stay pinned in its prefix cache for `ttl_secs` after the last request
/// that names them, inside the worker's pinned share of the KV cache.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachePin {
    pub tokens: u32,
    pub ttl_secs: u32,
}

impl CachePin {
    /// Most pins one request carries (Anthropic's limit on breakpoints).
    pub const MAX_PER_REQUEST: usize = 4;
    /// The longest TTL (Anthropic's `1h`).
    pub const MAX_TTL_SECS: u32 = 3600;

    /// Whether pins a peer sent are within the limits, for a prompt of `prompt_len` tokens.
    pub fn all_valid(pins: &[CachePin], prompt_len: usize) -> bool {
        pins.len() <= Self::MAX_PER_REQUEST && pins.iter().all(|p| p.tokens as usize <= prompt_len && (1..=Self::MAX_TTL_SECS).contains(&p.ttl_secs))
    }
}

/// Whose a sequence is, for a worker's fair sharing of running slots and KV between API keys:
/// the tenant (a fixed hash of its name, the same on every node) and its weight.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Share {
    pub tenant: u64,
    /// In (0, 1000]; a tenant's fair share is its weight over the sum of the weights present.
    pub weight: f32,
}

impl Default for Share {
    fn default() -> Self {
        Share { tenant: 0, weight: 1.0 }
    }
}

impl Share {
    /// The share of the tenant named `name` (FNV-1a of the name).
    pub fn of(name: &str, weight: f64) -> Share {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        Share { tenant: h, weight: weight as f32 }
    }

    /// Whether a peer's share is usable (a finite weight in (0, 1000]).
    pub fn is_valid(&self) -> bool {
        self.weight.is_finite() && self.weight > 0.0 && self.weight <= 1000.0
    }
}

/// Why a sequence stopped.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The model produced one of its end tokens.
    EndTurn,
    /// `max_tokens` were generated.
    MaxTokens,
    /// A stop sequence matched; it names which one. Its text was not emitted.
    StopSequence(String),
    /// The request was cancelled (client gone, or explicit cancel).
    Cancelled,
    /// The worker failed the sequence.
    Error(String),
    /// The worker (or the link to it) went away before the sequence ended: the coordinator that
    /// holds the client continues it elsewhere by exact replay. Never reaches a client.
    Lost(String),
    /// The sequence left this worker (its node drains) and continues on `node`/`worker`, whose
    /// prefix cache now holds the first `kv_tokens` tokens of its KV (0: the move carried no KV,
    /// and the continuation recomputes). Never reaches a client.
    Moved { node: String, worker: String, kv_tokens: u32 },
    /// An output policy rule matched: the answer stops before the matching text, and an audit
    /// record names the match. Set by the coordinator that holds the client, never by a worker.
    Refused { rule: String, audit_id: String },
}

impl StopReason {
    /// Whether the sequence did not end but left its worker (the coordinator continues it).
    pub fn continues_elsewhere(&self) -> bool {
        matches!(self, StopReason::Lost(_) | StopReason::Moved { .. })
    }

    /// The Anthropic `stop_reason` string.
    pub fn as_anthropic(&self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence(_) => "stop_sequence",
            StopReason::Refused { .. } => "refusal",
            StopReason::Cancelled | StopReason::Error(_) | StopReason::Lost(_) | StopReason::Moved { .. } => "end_turn",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::EndTurn => write!(f, "end_turn"),
            StopReason::MaxTokens => write!(f, "max_tokens"),
            StopReason::StopSequence(s) => write!(f, "stop_sequence({s:?})"),
            StopReason::Cancelled => write!(f, "cancelled"),
            StopReason::Error(e) => write!(f, "error: {e}"),
            StopReason::Lost(e) => write!(f, "lost: {e}"),
            StopReason::Moved { node, worker, kv_tokens } => write!(f, "moved to {node}/{worker} with {kv_tokens} tokens of KV"),
            StopReason::Refused { rule, audit_id } => write!(f, "refused by policy rule {rule} (audit id {audit_id})"),
        }
    }
}

/// Prompt and output token counts for a finished sequence.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens that were computed (not served from the prefix cache).
    pub prompt_tokens_uncached: u32,
    /// Prompt tokens served from cached KV blocks.
    pub prompt_tokens_cached: u32,
    /// Tokens generated.
    pub output_tokens: u32,
}

impl Usage {
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens_uncached + self.prompt_tokens_cached
    }
}

/// A generated token's log-probability under the model (the log-softmax of its raw logits,
/// before bias, penalties, temperature or truncation, as llama.cpp and vLLM report them), and
/// the most likely tokens of the same position with theirs, most likely first.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// The most alternatives a request may ask for (OpenAI's `top_logprobs` limit).
    pub const MAX_TOP: u32 = 20;
}

/// What a worker streams back for one sequence.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum SeqEvent {
    /// The prompt is admitted; `cached` prompt tokens came from the prefix cache.
    /// `since_admitted_us`: microseconds from the start of the step that admitted it until this
    /// event left the worker (its first step's compute), so that a follower can tell the
    /// time it waited from the time it computed.
    Started { prompt_tokens: u32, cached_tokens: u32, since_admitted_us: u32 },
    /// New tokens and the text they completed (text may be empty while a multi-byte character
    /// or a possible stop sequence is held back).
    /// `logprobs`: one per token when the request asked for them (else empty).
    Delta { tokens: Vec<u32>, text: String, logprobs: Vec<TokenLogprob> },
    /// The log-probabilities of prompt tokens `from`, `from + 1`, … (the request asked for
    /// prompt logprobs): in order, before any `Delta`. A sequence computed again (replayed
    /// after a loss) may repeat some; the coordinator passes each index on once.
    PromptLogprobs { from: u32, logprobs: Vec<TokenLogprob> },
    /// The sequence is over. No event follows.
    Finished { reason: StopReason, usage: Usage },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_outside_the_apis_bounds_are_named() {
        let ok = SamplingParams { temperature: 2.0, top_p: Some(1.0), min_p: Some(0.0), presence_penalty: -2.0, frequency_penalty: 2.0, repetition_penalty: Some(2.0), ..Default::default() };
        assert_eq!(ok.check(), Ok(()));
        assert_eq!(SamplingParams::greedy(1).check(), Ok(()));
        let base = SamplingParams::default;
        for (p, name) in [
            (SamplingParams { temperature: f32::NAN, ..base() }, "temperature"),
            (SamplingParams { temperature: 2.5, ..base() }, "temperature"),
            (SamplingParams { temperature: -0.5, ..base() }, "temperature"),
            (SamplingParams { top_p: Some(0.0), ..base() }, "top_p"),
            (SamplingParams { top_p: Some(f32::INFINITY), ..base() }, "top_p"),
            (SamplingParams { min_p: Some(f32::NAN), ..base() }, "min_p"),
            (SamplingParams { presence_penalty: 3.0, ..base() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::NEG_INFINITY, ..base() }, "frequency_penalty"),
            (SamplingParams { repetition_penalty: Some(0.0), ..base() }, "repetition_penalty"),
            (SamplingParams { logit_bias: vec![(1, 101.0)], ..base() }, "logit_bias"),
            (SamplingParams { logit_bias: vec![(1, 0.0); SamplingParams::MAX_LOGIT_BIAS + 1], ..base() }, "logit_bias"),
            (SamplingParams { logprobs: Some(TokenLogprob::MAX_TOP + 1), ..base() }, "logprobs"),
            (SamplingParams { stop_sequences: vec![String::new()], ..base() }, "stop_sequences"),
            (SamplingParams { stop_sequences: vec!["x".repeat(257)], ..base() }, "stop_sequences"),
            (SamplingParams { stop_sequences: vec!["x".into(); 17], ..base() }, "stop_sequences"),
        ] {
            let e = p.check().unwrap_err();
            assert!(e.contains(name), "{name}: {e}");
        }
    }
}
