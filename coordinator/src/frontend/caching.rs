//! Anthropic prompt-caching semantics on the prefix cache: where a request's `cache_control`
//! breakpoints fall in its prompt's tokens, and the `usage` split the API defines.
//!
//! - `cache_read_input_tokens`: prompt tokens the worker's prefix cache held (a hit);
//! - `cache_creation_input_tokens`: the rest of the prompt up to the last breakpoint, which this
//!   request wrote to the cache, split by the breakpoints' TTLs (`cache_creation.ephemeral_5m` /
//!   `ephemeral_1h`);
//! - `input_tokens`: what follows the last breakpoint.
//!
//! Without breakpoints nothing counts as written, as in the official API. The prefix cache
//! itself caches every full block whatever the request asks; the breakpoints decide only how
//! usage reports it.

use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;

use crate::frontend::request::{CacheTtl, GenerationRequest};

/// Put at each breakpoint in a second rendering (private-use characters; a request that holds
/// them has no breakpoints counted).
const MARK_5M: char = '\u{F0002}';
const MARK_1H: char = '\u{F0003}';

/// Each breakpoint's position in the prompt's tokens, in prompt order, with its TTL: the tokens
/// of the rendered prompt up to the end of the block that carries it. Found by rendering again
/// with a mark at each breakpoint and tokenizing what comes before each mark. Empty when the
/// request has none, or when a client text holds a mark character.
pub fn breakpoint_tokens(req: &GenerationRequest, template: &ChatTemplate, tokenizer: &Tokenizer) -> Vec<(usize, CacheTtl)> {
    if req.breakpoints.is_empty() || req.texts().iter().any(|t| t.contains([MARK_5M, MARK_1H])) {
        return vec![];
    }
    let mut marked = req.clone();
    let mut bps = req.breakpoints.clone();
    // From the back, so that earlier offsets stay valid.
    bps.sort_by_key(|b| (b.turn.map_or(0, |t| t + 1), b.end));
    for b in bps.iter().rev() {
        let text = match b.turn {
            None => marked.system.as_mut(),
            Some(i) => marked.turns.get_mut(i).map(|t| &mut t.text),
        };
        if let Some(text) = text.filter(|t| b.end <= t.len() && t.is_char_boundary(b.end)) {
            text.insert(b.end, if b.ttl == CacheTtl::OneHour { MARK_1H } else { MARK_5M });
        }
    }
    let Ok(rendered) = marked.render(template) else { return vec![] };
    let mut out = vec![];
    let mut prefix = String::with_capacity(rendered.len());
    for c in rendered.chars() {
        match c {
            MARK_5M | MARK_1H => {
                let Ok(ids) = tokenizer.encode(&prefix) else { return vec![] };
                out.push((ids.len(), if c == MARK_1H { CacheTtl::OneHour } else { CacheTtl::FiveMinutes }));
            }
            c => prefix.push(c),
        }
    }
    out
}

/// A prompt's tokens as the Anthropic `usage` splits them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheUsage {
    pub input: u32,
    pub read: u32,
    pub creation_5m: u32,
    pub creation_1h: u32,
}

impl CacheUsage {
    pub fn creation(&self) -> u32 {
        self.creation_5m + self.creation_1h
    }
}

/// Splits `prompt` tokens of which the first `cached` were read from the cache, given the
/// breakpoints' token positions: each stretch up to a breakpoint that was not read was written,
/// under that breakpoint's TTL; the rest is input.
pub fn split(prompt: u32, cached: u32, points: &[(usize, CacheTtl)]) -> CacheUsage {
    let read = cached.min(prompt);
    let mut points = points.to_vec();
    points.sort_by_key(|p| p.0);
    let (mut c5, mut c1, mut from) = (0u32, 0u32, read);
    for (pos, ttl) in points {
        let pos = (pos as u64).min(prompt as u64) as u32;
        if pos > from {
            match ttl {
                CacheTtl::FiveMinutes => c5 += pos - from,
                CacheTtl::OneHour => c1 += pos - from,
            }
            from = pos;
        }
    }
    CacheUsage { input: prompt - read - c5 - c1, read, creation_5m: c5, creation_1h: c1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_splits_at_the_breakpoints() {
        let five = CacheTtl::FiveMinutes;
        let hour = CacheTtl::OneHour;
        // First call: nothing cached; everything up to the last breakpoint is written.
        assert_eq!(split(1000, 0, &[(600, five)]), CacheUsage { input: 400, read: 0, creation_5m: 600, creation_1h: 0 });
        // Repeat: the prefix is read, nothing written.
        assert_eq!(split(1000, 996, &[(600, five)]), CacheUsage { input: 4, read: 996, creation_5m: 0, creation_1h: 0 });
        // Two breakpoints with different TTLs; half of the first stretch was cached.
        assert_eq!(split(1000, 200, &[(900, five), (400, hour)]), CacheUsage { input: 100, read: 200, creation_5m: 500, creation_1h: 200 });
        // No breakpoint: nothing is written.
        assert_eq!(split(1000, 300, &[]), CacheUsage { input: 700, read: 300, creation_5m: 0, creation_1h: 0 });
        // Positions past the prompt are clamped.
        assert_eq!(split(10, 0, &[(50, five)]).creation(), 10);
    }
}
