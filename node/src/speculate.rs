//! Speculative decoding's drafts (pure): prompt lookup over a sequence's own tokens, then over
//! its scope's recent outputs on the worker, and how long a draft each sequence gets from its
//! record of acceptance.
//!
//! A draft is only a guess. The engine computes a drafted sequence's last token and its k
//! draft tokens as one chunk of k + 1 rows, each computed exactly as a decode would compute it
//! (batch invariance), and its sampler draws row after row with the `(seed, step)` plain decoding
//! would use; the draft's tokens are kept while they equal the draws. So a draft changes how
//! many tokens a step yields, never which: the output is plain decoding's, bit for bit.

/// The longest n-gram looked up, and the shortest: a single token matches too often to be
/// worth a draft's rows.
const MAX_NGRAM: usize = 4;
const MIN_NGRAM: usize = 2;
/// How far back a lookup searches (tokens): the cost of a lookup stays small next to a step's
/// even in a 100k-token context.
const LOOKBACK: usize = 32_768;
/// The longest a sequence waits between drafts after misses (steps).
const MAX_COOLDOWN: u32 = 32;
/// Output tokens a worker keeps of its finished sequences for drafts ([`RecentOutputs`]).
pub const RECENT_TOKENS: usize = 16_384;

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest
/// n-gram (`MAX_NGRAM` down to `MIN_NGRAM` tokens) that ends `tokens`, at most `max` of them,
/// into `out` (cleared first; left empty when nothing matches).
pub fn ngram_draft(tokens: &[u32], max: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = tokens.len();
    if max == 0 {
        return;
    }
    let from = len.saturating_sub(LOOKBACK);
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        // Occurrences that start at `i` and end before the tail itself starts repeating it.
        if let Some(next) = continuation(&tokens[from..], &tokens[len - n..]) {
            let next = from + next;
            out.extend_from_slice(&tokens[next..(next + max).min(len)]);
            return;
        }
    }
}

/// Where the tokens after the last occurrence of `tail` in `hay` start, leaving out one at
/// `hay`'s very end (so something follows it).
fn continuation(hay: &[u32], tail: &[u32]) -> Option<usize> {
    let n = tail.len();
    let found = (0..hay.len().saturating_sub(n)).rev().find(|&i| &hay[i..i + n] == tail);
    found.map(|i| i + n)
}

/// The outputs of a worker's recently finished sequences, each under its cache scope (the
/// chain root of its tenant and `cache_salt`), newest last, at most [`RECENT_TOKENS`] tokens
/// in all: an agent's next turn often repeats what its last one wrote. A sequence drafts only
/// from its own scope's outputs, so how fast a draft makes it says nothing of another tenant's.
#[derive(Default)]
pub struct RecentOutputs {
    outputs: std::collections::VecDeque<(u64, Vec<u32>)>,
    tokens: usize,
}

impl RecentOutputs {
    /// Keeps `output` (its last [`RECENT_TOKENS`] tokens) under `scope`, forgetting the oldest
    /// outputs past the bound.
    pub fn push(&mut self, scope: u64, output: &[u32]) {
        if output.len() <= MIN_NGRAM {
            return;
        }
        let output = &output[output.len().saturating_sub(RECENT_TOKENS)..];
        self.tokens += output.len();
        self.outputs.push_back((scope, output.to_vec()));
        while self.tokens > RECENT_TOKENS {
            let (_, gone) = self.outputs.pop_front().expect("tokens are counted in outputs");
            self.tokens -= gone.len();
        }
    }

    /// Like [`ngram_draft`], looking for the n-gram ending `tokens` in the outputs kept under
    /// `scope`, newest first.
    pub fn draft(&self, scope: u64, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        let len = tokens.len();
        if max == 0 {
            return;
        }
        for n in (MIN_NGRAM..=MAX_NGRAM.min(len)).rev() {
            let tail = &tokens[len - n..];
            for (_, o) in self.outputs.iter().rev().filter(|(s, _)| *s == scope) {
                if let Some(next) = continuation(o, tail) {
                    out.extend_from_slice(&o[next..(next + max).min(o.len())]);
                    return;
                }
            }
        }
    }
}

/// The drafts of one step (buffers reused across steps).
#[derive(Default)]
pub struct Drafts {
    /// Per plan item: its draft's length (0: none).
    pub len: Vec<usize>,
    /// Per plan item: where its chunk (the decode's token, then its draft) starts in `tokens`.
    pub at: Vec<usize>,
    pub tokens: Vec<u32>,
    /// The lookup's draft before blocks are found for it.
    pub scratch: Vec<u32>,
}

impl Drafts {
    /// Item `i`'s draft (empty when it has none).
    pub fn of(&self, i: usize) -> &[u32] {
        &self.tokens[self.at[i] + 1..self.at[i] + 1 + self.len[i]]
    }

    /// Item `i`'s chunk: its decode token and its draft.
    pub fn chunk(&self, i: usize) -> &[u32] {
        &self.tokens[self.at[i]..self.at[i] + 1 + self.len[i]]
    }

    pub fn clear(&mut self) {
        self.len.clear();
        self.at.clear();
        self.tokens.clear();
        self.scratch.clear();
    }

    pub fn total(&self) -> usize {
        self.len.iter().sum()
    }
}

/// One sequence's drafting record: how long its next draft may be, and how long it waits
/// after drafts that were rejected outright.
#[derive(Clone, Debug)]
pub struct Drafter {
    /// Most draft tokens, from the worker's `max_draft`.
    max: usize,
    /// The next draft's length.
    len: usize,
    /// Drafts rejected at their first token in a row, and the steps still to wait.
    misses: u32,
    wait: u32,
}

impl Drafter {
    pub fn new(max: usize) -> Self {
        Drafter { max, len: max.min(4), misses: 0, wait: 0 }
    }

    /// The most draft tokens this step (0: none, cooling down after misses), counting the step.
    pub fn budget(&mut self) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            return 0;
        }
        self.len
    }

    /// Learns from a verified draft of `drafted` tokens of which `accepted` were kept: a draft
    /// kept whole grows the next (up to `max`), one cut short shrinks it to what was kept plus
    /// one, and drafts rejected outright back off for 1, 2, 4 … (at most `MAX_COOLDOWN`) steps.
    pub fn learn(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.misses += 1;
            self.wait = (1u32 << self.misses.min(5)).min(MAX_COOLDOWN) - 1;
            self.len = 2.min(self.max);
            return;
        }
        self.misses = 0;
        self.len = if accepted == drafted { (self.len * 2).min(self.max) } else { (accepted + 1).min(self.max) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_continues_the_most_recent_longest_match() {
        let mut out = Vec::new();
        // "a b c d e ... a b c" → the 3-gram "a b c" occurred at 0: draft "d e".
        ngram_draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2, &mut out);
        assert_eq!(out, [4, 5]);
        // The most recent occurrence wins, and the draft stops at the sequence's end.
        ngram_draft(&[1, 2, 7, 1, 2, 8, 1, 2], 8, &mut out);
        assert_eq!(out, [8, 1, 2]);
        // A longer n-gram is preferred to a more recent shorter one.
        ngram_draft(&[5, 1, 2, 6, 0, 1, 2, 7, 5, 1, 2], 1, &mut out);
        assert_eq!(out, [6]);
        // A single repeated token is not enough, nor is nothing.
        ngram_draft(&[1, 2, 3, 4, 3], 4, &mut out);
        assert!(out.is_empty());
        ngram_draft(&[], 4, &mut out);
        assert!(out.is_empty());
        ngram_draft(&[1, 2, 1, 2], 0, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn recent_outputs_draft_within_their_scope_newest_first_and_bounded() {
        let mut r = RecentOutputs::default();
        let mut out = Vec::new();
        r.push(1, &[10, 11, 12, 13, 14]);
        r.push(2, &[10, 11, 99, 98]);
        r.push(1, &[7]);
        // Scope 1's output continues "10 11" with "12 13"; scope 2's newer one is not scope 1's.
        r.draft(1, &[5, 10, 11], 2, &mut out);
        assert_eq!(out, [12, 13]);
        r.draft(2, &[5, 10, 11], 8, &mut out);
        assert_eq!(out, [99, 98]);
        r.draft(3, &[5, 10, 11], 8, &mut out);
        assert!(out.is_empty(), "no output of scope 3");
        // Newest first within a scope.
        r.push(1, &[10, 11, 50]);
        r.draft(1, &[10, 11], 8, &mut out);
        assert_eq!(out, [50]);
        // Bounded: a flood of new outputs pushes the old ones out.
        for _ in 0..RECENT_TOKENS / 8 + 1 {
            r.push(4, &[0; 8]);
        }
        assert!(r.tokens <= RECENT_TOKENS);
        r.draft(1, &[10, 11], 8, &mut out);
        assert!(out.is_empty(), "scope 1's outputs are gone");
        r.push(5, &vec![3; RECENT_TOKENS * 2]);
        assert_eq!((r.tokens, r.outputs.len()), (RECENT_TOKENS, 1));
    }

    #[test]
    fn drafts_grow_when_kept_shrink_when_cut_and_back_off_when_rejected() {
        let mut d = Drafter::new(8);
        assert_eq!(d.budget(), 4);
        d.learn(4, 4);
        assert_eq!(d.budget(), 8);
        d.learn(8, 8);
        assert_eq!(d.budget(), 8, "never past max");
        d.learn(8, 3);
        assert_eq!(d.budget(), 4);
        d.learn(4, 0);
        assert_eq!(d.budget(), 0, "one step of cooling down after a miss");
        assert_eq!(d.budget(), 2);
        d.learn(2, 0);
        assert_eq!((d.budget(), d.budget(), d.budget()), (0, 0, 0));
        assert_eq!(d.budget(), 2);
        for _ in 0..10 {
            d.learn(2, 0);
        }
        let waited = std::iter::from_fn(|| Some(d.budget())).take_while(|&b| b == 0).count();
        assert_eq!(waited as u32, MAX_COOLDOWN - 1);
        d.learn(0, 0);
        assert_eq!(Drafter::new(0).budget(), 0);
    }
}
