//! An accepted sequence as the coordinator holding its client follows it, wherever it runs.
//!
//! When its worker hands it over (`Moved`: a drain put its KV blocks in another worker's prefix
//! cache) or is lost (`Lost`: the worker stopped, its node died or was cut off, a transfer
//! failed), the sequence continues elsewhere by **exact replay**: the prompt plus every token the
//! client already has is submitted again, with the same seed and the sampler at the same step
//! (a [`Job`] with its `resume` tokens). After a move the whole prefix is a cache hit; after a loss it is
//! recomputed. Greedy decoding is batch-invariant and sampling is a function of (seed, step), so
//! the continuation produces exactly the tokens the original would have: the client's stream
//! goes on with no gap, no repeat and no missing token, and its `usage` is the original's.
//!
//! A request continues elsewhere at most `cluster.migration_limit` times; then it gets the
//! error it would have had without the moves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use zerolayer_common::{Job, SeqEvent, StopReason, TokenLogprob, Usage};

use crate::routing::dispatch::{Dispatcher, Placed};

/// An accepted sequence's events, continued across moves.
pub struct LiveSequence {
    dispatch: Arc<Dispatcher>,
    /// The request; its `resume` is every token delivered to the client so far, on any worker
    /// (what a continuation resumes after).
    job: Job,
    at: Placed,
    /// The first `Started`: the prompt's cached/uncached split the client was told.
    started: Option<(u32, u32)>,
    moves: u32,
    /// Nodes this sequence was lost on (not tried again).
    lost_on: Vec<String>,
    finished: bool,
    /// When it last left a worker, until its continuation's next token.
    left_at: Option<Instant>,
    /// Time spent between leaving a worker and the continuation's next token, all moves.
    migrating: Duration,
    /// The next prompt token whose logprobs the client gets (a replay computes the prompt's
    /// again: those it already has are not passed on twice).
    prompt_next: u32,
}

impl LiveSequence {
    pub fn new(dispatch: Arc<Dispatcher>, job: Job, at: Placed) -> Self {
        LiveSequence { dispatch, job, at, started: None, moves: 0, lost_on: Vec::new(), finished: false, left_at: None, migrating: Duration::ZERO, prompt_next: 1 }
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.job.prompt
    }

    /// `NODE/WORKER` serving the sequence now.
    pub fn served_by(&self) -> String {
        self.at.served_by()
    }

    /// The node and worker serving the sequence now.
    pub fn at(&self) -> (&str, &str) {
        (&self.at.node, &self.at.worker)
    }

    /// The request as it was submitted (its `resume` empty: what a new sequence of the same
    /// request starts from).
    pub fn request(&self) -> Job {
        Job { resume: Vec::new(), ..self.job.clone() }
    }

    /// How many times the sequence continued elsewhere.
    pub fn moves(&self) -> u32 {
        self.moves
    }

    /// Time spent continuing elsewhere: from leaving a worker to the continuation's next token.
    pub fn migrate_time(&self) -> Duration {
        self.migrating + self.left_at.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The next event for the client, or `None` once the sequence is over. Continuations are
    /// invisible: their `Started` is dropped and a `Moved`/`Lost` end becomes a replay.
    pub async fn recv(&mut self) -> Option<SeqEvent> {
        if self.finished {
            return None;
        }
        loop {
            let ev = self.at.stream.recv().await.unwrap_or_else(|| lost("the worker ended the stream without a result"));
            match ev {
                SeqEvent::Started { prompt_tokens, cached_tokens, .. } => {
                    if self.started.is_some() {
                        continue;
                    }
                    self.started = Some((prompt_tokens, cached_tokens));
                    return Some(ev);
                }
                SeqEvent::PromptLogprobs { from, logprobs } => {
                    if let Some(ev) = self.new_prompt_logprobs(from, logprobs) {
                        return Some(ev);
                    }
                }
                SeqEvent::Delta { tokens, text, mut logprobs } => {
                    if let Some(t) = self.left_at.take() {
                        self.migrating += t.elapsed();
                    }
                    if !names_each(&logprobs, &tokens) {
                        logprobs.clear();
                    }
                    self.job.resume.extend_from_slice(&tokens);
                    return Some(SeqEvent::Delta { tokens, text, logprobs });
                }
                SeqEvent::Finished { reason, usage } if reason.continues_elsewhere() => {
                    self.left_at.get_or_insert_with(Instant::now);
                    if let Err(e) = self.continue_elsewhere(reason).await {
                        self.finished = true;
                        return Some(SeqEvent::Finished { reason: StopReason::Error(e), usage: self.usage(usage) });
                    }
                }
                SeqEvent::Finished { reason, usage } => {
                    self.finished = true;
                    if let Some(t) = self.left_at.take() {
                        self.migrating += t.elapsed();
                    }
                    if self.moves > 0 {
                        tracing::info!(request_id = %self.job.request_id, moves = self.moves, served_by = %self.served_by(), "request finished after moving");
                        metrics::histogram!("zerolayer_request_moves", "node" => self.dispatch.node_id.clone()).record(self.moves as f64);
                    }
                    return Some(SeqEvent::Finished { reason, usage: self.usage(usage) });
                }
            }
        }
    }

    /// The prompt logprobs of `logprobs` (tokens `from`, …) that the client does not have yet,
    /// in order, within the prompt (a worker's report is checked like a client's input).
    fn new_prompt_logprobs(&mut self, from: u32, mut logprobs: Vec<TokenLogprob>) -> Option<SeqEvent> {
        let prompt_len = self.job.prompt.len() as u64;
        let end = from as u64 + logprobs.len() as u64;
        if from == 0 || from > self.prompt_next || end <= self.prompt_next as u64 || end > prompt_len {
            return None;
        }
        if !names_each(&logprobs, &self.job.prompt[from as usize..end as usize]) {
            return None;
        }
        logprobs.drain(..(self.prompt_next - from) as usize);
        let ev = SeqEvent::PromptLogprobs { from: self.prompt_next, logprobs };
        self.prompt_next = end as u32;
        Some(ev)
    }

    /// The usage of what the client has had so far (a sequence the coordinator ends early).
    pub fn usage_so_far(&self) -> Usage {
        let (prompt, cached) = self.started.unwrap_or_default();
        Usage { prompt_tokens_uncached: prompt - cached.min(prompt), prompt_tokens_cached: cached.min(prompt), output_tokens: self.job.resume.len() as u32 }
    }

    /// The client's usage: the prompt as first admitted, every token generated on any worker.
    fn usage(&self, last: Usage) -> Usage {
        if self.moves == 0 {
            return last;
        }
        let (prompt, cached) = self.started.unwrap_or((last.prompt_tokens(), last.prompt_tokens_cached));
        Usage { prompt_tokens_uncached: prompt - cached.min(prompt), prompt_tokens_cached: cached.min(prompt), output_tokens: last.output_tokens.max(self.job.resume.len() as u32) }
    }

    async fn continue_elsewhere(&mut self, reason: StopReason) -> Result<(), String> {
        let limit = self.dispatch.migration_limit();
        let from = self.at.served_by();
        if self.moves >= limit {
            tracing::warn!(request_id = %self.job.request_id, moves = self.moves, %from, %reason, "request failed: its migrations ran out");
            metrics::counter!("zerolayer_migrations_total", "node" => self.dispatch.node_id.clone(), "kind" => "exhausted").increment(1);
            return Err(format!("the sequence could not continue: {reason} (it already moved {} times; migration_limit is {limit})", self.moves));
        }
        self.moves += 1;
        let (kind, prefer) = match &reason {
            StopReason::Moved { node, worker, kv_tokens } if *kv_tokens > 0 => ("kv", Some((node.clone(), worker.clone()))),
            StopReason::Moved { node, worker, .. } => ("replay", Some((node.clone(), worker.clone()))),
            _ => {
                self.lost_on.push(self.at.node.clone());
                ("replay", None)
            }
        };
        // Never back onto the node it just left, nor onto one it was lost on.
        let mut exclude = self.lost_on.clone();
        exclude.push(self.at.node.clone());
        let prefer = prefer.as_ref().map(|(n, w)| (n.as_str(), w.as_str()));
        let placed = self.dispatch.submit(&self.job, &exclude, prefer).await.map_err(|e| format!("{reason}, and it could not continue elsewhere: {e}"))?;
        tracing::info!(
            request_id = %self.job.request_id, %from, to = %placed.served_by(), kind, %reason,
            tokens = self.job.resume.len(), moves = self.moves, "sequence continues elsewhere"
        );
        metrics::counter!("zerolayer_migrations_total", "node" => self.dispatch.node_id.clone(), "kind" => kind).increment(1);
        self.at = placed;
        Ok(())
    }
}

/// Whether a worker's logprobs are one per token of `tokens`, each for that token (a peer's
/// report is checked like a client's input): otherwise the client gets none rather than
/// another token's.
fn names_each(logprobs: &[TokenLogprob], tokens: &[u32]) -> bool {
    logprobs.is_empty() || (logprobs.len() == tokens.len() && logprobs.iter().zip(tokens).all(|(l, &t)| l.token == t))
}

fn lost(why: &str) -> SeqEvent {
    SeqEvent::Finished { reason: StopReason::Lost(why.into()), usage: Usage::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker's logprobs pass only as one per token, each naming its token.
    #[test]
    fn logprobs_must_name_the_tokens_they_come_with() {
        let lp = |token| TokenLogprob { token, logprob: -0.5, top: vec![] };
        assert!(names_each(&[], &[1, 2]), "none asked");
        assert!(names_each(&[lp(1), lp(2)], &[1, 2]));
        assert!(!names_each(&[lp(1), lp(3)], &[1, 2]), "another token's");
        assert!(!names_each(&[lp(1)], &[1, 2]), "one missing");
        assert!(!names_each(&[lp(1), lp(2), lp(3)], &[1, 2]), "one too many");
    }
}
